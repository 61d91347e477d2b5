"""A request longer than its model's context window is rejected with a reason
by every simulator (issue 21 item 9), and the run says so in its notes."""

from __future__ import annotations

import pytest

from fleetserve.config import config_from_dict
from fleetserve.metrics.summary import summarize
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.admission import CONTEXT_REASON, context_note, context_reason
from fleetserve.sim.kun import KunSimulator
from fleetserve.sim.multi_run import MultiRunSettings, run_multi_stack
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

MODEL = "opt-6.7b"  # max_context 2048


def _reqs() -> list[Request]:
    # 2048 exactly fits; 2049 does not; a small one after them
    return [
        Request(0, MODEL, 0.0, 1500, 548),
        Request(1, MODEL, 0.1, 1500, 549),
        Request(2, MODEL, 0.2, 100, 20),
    ]


def _check(records: list, notes: list[str]) -> None:
    assert [r.status for r in records] == ["finished", "rejected", "finished"]
    reason = records[1].reason or ""
    assert CONTEXT_REASON in reason and "2048" in reason and MODEL in reason
    assert any("context window" in n for n in notes)


def test_context_reason_boundaries() -> None:
    spec = get_model(MODEL)
    assert context_reason(Request(0, MODEL, 0.0, 2000, 48), spec) is None
    assert context_reason(Request(0, MODEL, 0.0, 2000, 49), spec) is not None
    assert context_note([]) is None


def test_single_model_simulator_rejects_over_context() -> None:
    cfg = config_from_dict(
        {"model": MODEL, "cluster": {"gpu": "a100-80gb", "gpus": 1}, "check_integrity": True}
    )
    res = Simulator(cfg, _reqs()).run()
    _check(res.records, res.notes)
    s = summarize(res)
    assert s["requests"]["rejected"] == 1


def test_multi_llm_simulator_rejects_over_context() -> None:
    services = {MODEL: Service(MODEL, get_model(MODEL), 1.0, 700, 150)}
    settings = MultiRunSettings(gpu="a100-80gb", n_gpus=1, processes=1, check_integrity=True)
    res = run_multi_stack("vllm", services, _reqs(), _reqs(), settings)
    _check(res.records, res.notes)


@pytest.mark.parametrize("pressure", ["queue", "kunserve"])
def test_kunserve_simulator_rejects_over_context(pressure: str) -> None:
    sim = KunSimulator(
        _reqs(),
        model=MODEL,
        gpu="a100-80gb",
        instances=2,
        settings=KunSettings(pressure=pressure),
        stack=pressure,
        kv_tokens=8000,
        network_gbps=200,
        gpus_per_node=1,
        check_integrity=True,
    )
    res = sim.run()
    _check(res.records, res.notes)


def test_max_model_len_extends_or_shrinks_the_served_window() -> None:
    def run(max_len: int) -> list[str]:
        cfg = config_from_dict(
            {
                "model": MODEL,
                "cluster": {"gpu": "a100-80gb", "gpus": 1},
                "engine": {"max_model_len": max_len},
                "check_integrity": True,
            }
        )
        return [r.status for r in Simulator(cfg, _reqs()).run().records]

    assert run(4096) == ["finished", "finished", "finished"]  # a long-context variant
    assert run(1000) == ["rejected", "rejected", "finished"]


def test_max_model_len_must_be_positive() -> None:
    from fleetserve.errors import ConfigError

    with pytest.raises(ConfigError, match="max_model_len"):
        config_from_dict({"model": MODEL, "engine": {"max_model_len": 0}})
