"""One batching registry for every world: a one-model instance runs the
catalog's group schedulers whose one-model case needs no statistics (FCFS, RR)
through policy/batching.OneModel, and that case is what schedule() decides."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.policy.batching import OneModel, instance_batching, one_model_batching
from fleetserve.policy.catalog import resolve_policies
from fleetserve.policy.sharing import BATCHING, DECODE, PREFILL, GroupSeq, admit_in_order


@dataclass
class _Seq:
    id: int
    arrival_s: float
    prompt_tokens: int
    model: str = "m"
    generated: int = 0


class _Budget:
    def __init__(self, tokens: int, seqs: int) -> None:
        self.tokens, self.seqs = tokens, seqs

    def fits(self, s: GroupSeq) -> bool:
        return self.seqs > 0 and s.prompt_tokens <= self.tokens

    def take(self, s: GroupSeq) -> None:
        self.tokens -= s.prompt_tokens
        self.seqs -= 1


class _State:
    """A sharing group hosting one model."""

    def __init__(self, waiting: list[_Seq], running: list[_Seq]) -> None:
        self._w, self._r = waiting, running

    models = ("m",)
    free_share = 1.0
    jobs_in_flight = 0

    def waiting(self, model: str) -> list[_Seq]:
        return self._w

    def ready(self, model: str) -> list[_Seq]:
        return self._r

    def busy(self, model: str, phase: str) -> bool:
        return False

    def kv_used(self, model: str) -> int:
        return 0

    def prefill_in_flight(self) -> bool:
        return False


def test_the_one_model_policies_are_fcfs_and_rr() -> None:
    assert one_model_batching() == ["fcfs", "rr"]
    assert set(BATCHING.names()) == {"fcfs", "rr", "mlfq", "db", "adbs"}
    assert instance_batching("fcfs").macro_step_safe
    assert not instance_batching("rr").macro_step_safe


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(one_model_batching()),  # every policy with a one-model case
    prompts=st.lists(st.integers(1, 60), max_size=12),
    running=st.lists(st.floats(0, 10, allow_nan=False), max_size=6),
    tokens=st.integers(0, 200),
    slots=st.integers(0, 8),
)
def test_schedule_decides_what_the_one_model_instance_does(
    name: str, prompts: list[int], running: list[float], tokens: int, slots: int
) -> None:
    """A policy's one-model case, as one-model instances and one-service
    sharing groups run it (``SharingGroup.schedule_one``): the queue in
    order while prompts fit, else a decode of every running request."""
    waiting = [_Seq(100 + i, 10.0 + i, p) for i, p in enumerate(prompts)]
    run = [_Seq(i, t, 1) for i, t in enumerate(running)]
    jobs = BATCHING.get(name)().schedule(_State(waiting, run), _Budget(tokens, slots), 0.0)
    admitted = admit_in_order(waiting, _Budget(tokens, slots))
    if admitted:
        assert [(j.phase, j.seqs) for j in jobs] == [(PREFILL, tuple(s.id for s in admitted))]
    elif run:
        assert [(j.phase, set(j.seqs)) for j in jobs] == [(DECODE, {s.id for s in run})]
    else:
        assert jobs == []
    if run:
        inst = _Seq(-1, 0.0, 0)  # only its model is read
        victim = instance_batching(name).victim(inst, run)  # type: ignore[arg-type]
        assert victim is max(run, key=lambda s: (s.arrival_s, s.id))


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(BATCHING.names())),
    prompts=st.lists(st.integers(1, 60), max_size=6),
    running=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=6),
    n=st.integers(1, 30),
)
def test_a_lone_batch_kept_whole_is_what_stable_iterations_says(
    name: str, prompts: list[int], running: list[float], n: int
) -> None:
    """``keeps_lone_batch`` (a one-service group then skips the call) holds
    only where :meth:`stable_iterations` keeps every iteration offered to a
    one-service group, whatever is queued or running (FCFS, RR)."""
    sched = BATCHING.get(name)()
    assert sched.keeps_lone_batch == (name in ("fcfs", "rr"))
    if not sched.keeps_lone_batch:
        return
    waiting = [_Seq(100 + i, 10.0 + i, p) for i, p in enumerate(prompts)]
    run = [_Seq(i, t, 1) for i, t in enumerate(running)]
    ends = [float(i + 1) for i in range(n)]
    assert sched.stable_iterations(_State(waiting, run), "m", run, ends, 0.0) == n


@pytest.mark.parametrize("name", ["mlfq", "db", "adbs"])
def test_policies_that_need_service_statistics_are_refused_on_one_model(name: str) -> None:
    with pytest.raises(ConfigError, match="statistics"):
        instance_batching(name)
    with pytest.raises(ValueError, match="one-model"):
        OneModel(BATCHING.get(name)())
    cfg = config_from_dict({"policy": {"stack": "vllm", "batching": name}})
    with pytest.raises(ConfigError, match="statistics"):
        resolve_policies(cfg)
    # the single-model simulator runs the temporal ones on one-model sharing groups
    if name == "adbs":
        with pytest.raises(ConfigError, match=r"at once \(spatial sharing"):
            resolve_policies(cfg, groups=True)
    else:
        assert resolve_policies(cfg, groups=True)["batching"] == name


def test_unknown_batching_suggests_names() -> None:
    with pytest.raises(UnknownNameError, match="fcfs"):
        instance_batching("fcsf")
