"""`vllm` means one thing in both worlds: a model served alone on one GPU gives
the same request records in the single-model world (an ``Instance``) and in
the multi-LLM world (a one-model ``SharingGroup``, partitioned layout; FCFS
and RR, the two batching policies with a one-model case),
under memory pressure included (preemptions, the admission watermark,
requests too large to ever fit).

This is the check behind issue 21's "one instance model": the group's
one-model case must be the single-model instance, event for event. Two
defects it found (session 25): the instance re-admitted a request it had just
preempted before the others decoded (a thrash: 8,187 preemptions where vLLM's
order gives 153), and the multi-LLM world had no admission watermark.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError
from fleetserve.policy.catalog import check_world
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.kun_run import run_kun
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.sim.multi_run import MultiRunSettings, run_multi_stack
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

MODEL = "llama-2-7b"


def _load(seed: int, n: int, rate: float, max_prompt: int, max_out: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    ts = np.cumsum(rng.exponential(1 / rate, size=n))
    return [
        Request(i, MODEL, float(t), int(rng.integers(1, max_prompt)), int(rng.integers(1, max_out)))
        for i, t in enumerate(ts)
    ]


def _both(
    reqs: list[Request],
    *,
    mem_util: float,
    watermark: float,
    seqs: int,
    tokens: int,
    batching: str = "fcfs",
    chunked: bool = False,
) -> tuple[list, list]:  # type: ignore[type-arg]
    cfg = config_from_dict(
        {
            "model": MODEL,
            "cluster": {"gpu": "a100-80gb", "gpus": 1, "elastic": False, "mem_util": mem_util},
            "policy": {"stack": "vllm", "batching": batching},
            "engine": {
                "watermark": watermark,
                "max_num_seqs": seqs,
                "max_batched_tokens": tokens,
                "chunked_prefill": chunked,
            },
            "check_integrity": True,
        }
    )
    one = Simulator(cfg, reqs).run()
    svc = {MODEL: Service(MODEL, get_model(MODEL), 1.0, 500, 200)}
    plan = PlacementPlan((GroupPlacement((0,), 1, (MODEL,)),), 1)
    mcfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=1,
        scheduler=batching,
        layout="partitioned",
        mem_util=mem_util,
        watermark=watermark,
        max_num_seqs=seqs,
        max_batched_tokens=tokens,
        chunked_prefill=chunked,
        check_integrity=True,
    )
    multi = MultiSimulator(mcfg, svc, plan, reqs).run()
    return list(one.records), list(multi.records)


def _key(r) -> tuple:  # type: ignore[no-untyped-def,type-arg]
    return (r.id, r.status, r.first_token_s, r.finish_s, r.generated, r.preemptions)


@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([2.0, 10.0, 40.0]),
    mem_util=st.sampled_from([0.2, 0.25, 0.9]),
    watermark=st.sampled_from([0.0, 0.01, 0.05]),
    seqs=st.sampled_from([4, 256]),
    tokens=st.sampled_from([512, 2048, 8192]),
    batching=st.sampled_from(["fcfs", "rr"]),
    chunked=st.booleans(),
)
def test_a_model_alone_is_served_alike_in_both_worlds(
    seed: int,
    rate: float,
    mem_util: float,
    watermark: float,
    seqs: int,
    tokens: int,
    batching: str,
    chunked: bool,
) -> None:
    reqs = _load(seed, 120, rate, 2500, 600)
    one, multi = _both(
        reqs,
        mem_util=mem_util,
        watermark=watermark,
        seqs=seqs,
        tokens=tokens,
        batching=batching,
        chunked=chunked,
    )
    assert [_key(r) for r in one] == [_key(r) for r in multi]


@pytest.mark.parametrize("chunked", [False, True])
def test_an_overloaded_model_does_not_thrash(chunked: bool) -> None:
    """The case that found the re-admission thrash: 30 req/s on one A100.
    Both worlds agree, and preemptions stay a fraction of the requests."""
    reqs = _load(1, 400, 30.0, 1500, 400)
    one, multi = _both(reqs, mem_util=0.9, watermark=0.0, seqs=256, tokens=2048, chunked=chunked)
    assert [_key(r) for r in one] == [_key(r) for r in multi]
    preemptions = sum(r.preemptions for r in one)
    assert 0 < preemptions < len(reqs)


def test_chunked_prefill_is_refused_where_it_is_not_modelled() -> None:
    """The KunServe world and the group schedulers without a one-model case
    (MLFQ, DB, ADBS: whole prefill jobs), and KunServe's pipelined groups,
    refuse ``engine.chunked_prefill`` rather than ignore it."""
    kun = {"policy": {"stack": "kunserve"}, "cluster": {"elastic": False, "gpus": 2}}
    with pytest.raises(ConfigError, match="chunked_prefill"):
        check_world(config_from_dict({"model": MODEL, "engine": {"chunked_prefill": True}, **kun}))
    check_world(config_from_dict({"model": MODEL, **kun}))
    check_world(config_from_dict({"model": MODEL, "engine": {"chunked_prefill": True}}))
    for name in ("mlfq", "db", "adbs"):
        with pytest.raises(ConfigError, match=f"batching {name!r}"):
            MultiConfig(scheduler=name, chunked_prefill=True)
    MultiConfig(scheduler="rr", chunked_prefill=True)
    with pytest.raises(ConfigError, match="lanes"):
        MultiConfig(chunked_prefill=True, burst=KunSettings(pressure="kunserve"))


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([1.0, 4.0, 8.0]),
    gpus=st.sampled_from([1, 2]),
    batching=st.sampled_from(["fcfs", "rr"]),
)
def test_a_kunserve_world_replica_is_the_instance_when_it_does_not_alternate(
    seed: int, rate: float, gpus: int, batching: str
) -> None:
    """The KunServe world's ``vllm`` replicas (no burst reaction acting) with
    ``kunserve.alternate: false`` give the single-model world's records while
    memory is not short (the two count KV in tokens and in 16-token blocks:
    under pressure they differ by that granularity, which is not compared)."""
    reqs = _load(seed, 100, rate, 1200, 300)
    data = {
        "model": MODEL,
        "cluster": {"gpu": "a100-80gb", "gpus": gpus, "elastic": False},
        "policy": {"stack": "vllm", "batching": batching},
        "check_integrity": True,
    }
    one = Simulator(config_from_dict(data), reqs).run()
    kun = run_kun(config_from_dict({**data, "kunserve": {"alternate": False}}), reqs)
    assert sum(r.preemptions for r in one.records) == 0  # the regime compared
    assert [_key(r) for r in one.records] == [_key(r) for r in kun.records]


def test_the_kunserve_worlds_alternation_is_the_difference() -> None:
    """With its default alternation, the same KunServe-world run differs:
    a prompt arriving during a prefill waits for one decode iteration."""
    reqs = _load(1, 100, 8.0, 1200, 300)
    data = {
        "model": MODEL,
        "cluster": {"gpu": "a100-80gb", "gpus": 1, "elastic": False},
        "policy": {"stack": "vllm"},
    }
    one = Simulator(config_from_dict(data), reqs).run()
    alt = run_kun(config_from_dict(data), reqs)
    off = run_kun(config_from_dict({**data, "kunserve": {"alternate": False}}), reqs)
    assert [_key(r) for r in off.records] == [_key(r) for r in one.records]
    assert [_key(r) for r in alt.records] != [_key(r) for r in one.records]


def test_the_multi_llm_world_refuses_cluster_tp() -> None:
    """Its placement sizes each group's tensor parallelism: ``cluster.tp`` would
    be ignored, so it is refused with the key that does restrict it."""
    data = {
        "services": [{"name": "a", "model": MODEL}],
        "cluster": {"gpus": 4, "elastic": False, "tp": 2},
        "policy": {"stack": "muxserve"},
    }
    with pytest.raises(ConfigError, match=r"multi\.tp_sizes"):
        check_world(config_from_dict(data))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("migration", "max_stages", 3),
        ("migration", "link_contention", False),
        ("migration", "wait_for_room_s", 1.0),
        ("mell", "batching", False),
        ("mell", "w_free", 2.0),
    ],
)
def test_single_model_only_keys_are_refused_elsewhere(section: str, key: str, value: Any) -> None:
    """Live-migration stages, transfer contention and Mell's scheduler settings
    are read by the single-model simulator only; the other worlds refuse them
    rather than ignore them."""
    multi = {
        "services": [{"name": "a", "model": MODEL}],
        "cluster": {"gpus": 2, "elastic": False},
        "policy": {"stack": "seallm-mell"},
    }
    kun = {"policy": {"stack": "kunserve"}, "cluster": {"elastic": False, "gpus": 2}}
    for data in (multi, kun):
        with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
            check_world(config_from_dict({"model": MODEL, section: {key: value}, **data}))
    check_world(config_from_dict({"model": MODEL, section: {key: value}}))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"kunserve": {"kv_tokens": 5000}}, "kunserve.kv_tokens"),
        ({"kunserve": {"alternate": False}}, "kunserve.alternate"),
        ({"multi": {"history_s": 30.0}}, "multi.history_s"),
        ({"fleet": {"zipf": 2.0}}, "fleet.zipf"),
    ],
)
def test_a_world_refuses_the_sections_it_does_not_read(extra: dict[str, Any], key: str) -> None:
    """The single-model world reads no ``multi``, ``fleet`` or ``kunserve``
    field; the multi-LLM world only the ``kunserve`` overrides of a stack with
    KunServe's drop; the KunServe world no ``multi`` or ``fleet`` field."""
    with pytest.raises(ConfigError, match=re.escape(key)):
        check_world(config_from_dict({"model": MODEL, **extra}))
    multi = {
        "services": [{"name": "a", "model": MODEL}],
        "cluster": {"gpus": 2, "elastic": False},
        "policy": {"stack": "fleet"},
    }
    if key.startswith("kunserve."):
        with pytest.raises(ConfigError, match=re.escape(key)):
            check_world(config_from_dict({"model": MODEL, **multi, **extra}))
    kun = {"policy": {"stack": "kunserve"}, "cluster": {"elastic": False, "gpus": 2}}
    if not key.startswith("kunserve."):
        with pytest.raises(ConfigError, match=re.escape(key)):
            check_world(config_from_dict({"model": MODEL, **kun, **extra}))
    # what each world does read passes
    check_world(config_from_dict({"model": MODEL, **multi, "kunserve": {"restore_min_s": 3.0}}))
    check_world(config_from_dict({"model": MODEL, **kun, "kunserve": {"kv_tokens": 5000}}))


@settings(max_examples=8, deadline=None)
@example(seed=0, rate=40.0, gpus=6, mem_util=0.42, chunked=False)  # differed before
@given(
    seed=st.integers(0, 10_000),
    rate=st.sampled_from([5.0, 20.0, 40.0]),
    gpus=st.sampled_from([3, 4, 6]),
    mem_util=st.sampled_from([0.42, 0.9]),
    chunked=st.booleans(),
)
def test_vllm_is_one_system_in_both_worlds(
    seed: int, rate: float, gpus: int, mem_util: float, chunked: bool
) -> None:
    """Several models on dedicated GPUs (`vllm`: dedicated placement by rate,
    round-robin dispatch that skips instances without room, FCFS; chunked
    prefill on or off): the
    single-model world (one ``Instance`` per GPU) and the multi-LLM world (one
    one-model group per GPU) give the same records, under memory pressure
    included. Session 25 made it so: one placement rule, and the groups' dispatch
    views count the queued prompts, the watermark and a macro job's blocks
    ahead as an instance does."""
    models = ["llama-2-7b", "llama-2-13b", "opt-6.7b"]
    rng = np.random.default_rng(seed)
    n = 200
    ts = np.cumsum(rng.exponential(1 / rate, size=n))
    pick = rng.choice(3, size=n, p=[0.5, 0.3, 0.2])
    reqs = [
        Request(
            i, models[pick[i]], float(t), int(rng.integers(16, 1500)), int(rng.integers(1, 400))
        )
        for i, t in enumerate(ts)
    ]
    cfg = config_from_dict(
        {
            "model": models[0],
            "cluster": {"gpu": "a100-80gb", "gpus": gpus, "elastic": False, "mem_util": mem_util},
            "policy": {"stack": "vllm"},
            "engine": {"chunked_prefill": chunked, "max_batched_tokens": 1024},
            "check_integrity": True,
        }
    )
    one = Simulator(cfg, reqs).run()
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    svc = {
        m: Service(m, get_model(m), sum(r.model == m for r in reqs) / span, 700, 200)
        for m in models
    }
    settings_ = MultiRunSettings(
        gpu="a100-80gb",
        n_gpus=gpus,
        mem_util=mem_util,
        check_integrity=True,
        chunked_prefill=chunked,
        max_batched_tokens=1024,
    )
    multi = run_multi_stack("vllm", svc, reqs, reqs, settings_)
    assert [_key(r) for r in one.records] == [_key(r) for r in multi.records]
