"""Dispatch indexes and kept sample totals: the same decisions and numbers as a scan.

``ClusterState.index_of`` (cluster/index.py) answers Best-Fit, Worst-Fit,
round-robin and least-loaded from bounds on each instance's available blocks;
``UsageTotals`` (sim/usage.py) keeps the time series' sums per change. Both
must agree with a scan of every instance exactly, ties included: checked here
on random states against the scans of policy/dispatch.py, and on whole
simulations against runs that scan.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fleetserve.cluster.index as index_mod
import fleetserve.cluster.state as state_mod
import fleetserve.sim.usage as usage_mod
from fleetserve.cluster.state import ClusterState
from fleetserve.config import config_from_dict
from fleetserve.costmodel import CostModel, InstanceCost
from fleetserve.metrics.records import RunResult
from fleetserve.policy import DISPATCH
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import GpuSpec, ModelSpec
from fleetserve.workload.request import Request

MODEL = "llama-2-7b"
POLICIES = ["best_fit", "worst_fit", "round_robin", "least_loaded"]


@contextmanager
def small_thresholds(index_from: int = 4, totals_from: int = 4, block: int = 2) -> Iterator[None]:
    """Index from a few instances on, in tiny blocks (so splits and merges happen)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_mod, "INDEX_FROM", index_from)
        mp.setattr(usage_mod, "TOTALS_FROM", totals_from)
        mp.setattr(index_mod, "BLOCK", block)
        yield


@contextmanager
def never_indexed() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state_mod, "INDEX_FROM", 1 << 40)
        mp.setattr(usage_mod, "TOTALS_FROM", 1 << 40)
        yield


# ------------------------------------------------------------ random states


class Tracked:
    """An instance view that reports changes (``TrackedView``). Between reports its
    available blocks may drift down to ``lo`` unreported, as a decode segment's do."""

    def __init__(self, iid: int, avail: int, width: int, running: int, waiting: int) -> None:
        self.id = iid
        self.model = MODEL
        self.gpus = (iid,)
        self.tp = 1
        self.block_size = 16
        self.total_blocks = 1000
        self.used_blocks = self.free_blocks = self.reserved_blocks = 0
        self.available_blocks = avail
        self.lo = avail - width
        self.num_running = running
        self.num_waiting = waiting
        self.logs: list[dict[int, Any]] = []

    def avail_bounds(self) -> tuple[int, int]:
        return self.lo, self.available_blocks

    def track(self, log: dict[int, Any]) -> None:
        self.logs.append(log)

    def untrack(self, log: dict[int, Any]) -> None:
        self.logs = [g for g in self.logs if g is not log]

    def change(self, avail: int, width: int, running: int, waiting: int) -> None:
        self.available_blocks = avail
        self.lo = avail - width
        self.num_running = running
        self.num_waiting = waiting
        for log in self.logs:
            log[self.id] = self

    def drift(self, by: int) -> None:
        self.available_blocks = max(self.lo, self.available_blocks - by)


class Plain:
    """The same instance without change reports: a state holding it scans."""

    def __init__(self, v: Tracked) -> None:
        self._v = v
        self.id, self.model, self.gpus, self.tp = v.id, v.model, v.gpus, v.tp
        self.block_size, self.total_blocks = v.block_size, v.total_blocks

    @property
    def available_blocks(self) -> int:
        return self._v.available_blocks

    @property
    def num_running(self) -> int:
        return self._v.num_running

    @property
    def num_waiting(self) -> int:
        return self._v.num_waiting


value = st.integers(-4, 24)  # a narrow range: many ties
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), value, st.integers(0, 8), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
        st.tuples(
            st.just("change"),
            st.integers(0, 1000),
            value,
            st.integers(0, 8),
            st.integers(0, 3),
            st.integers(0, 3),
        ),
        st.tuples(st.just("drift"), st.integers(0, 1000), st.integers(1, 6)),
        st.tuples(st.just("query"), st.sampled_from(POLICIES), st.integers(1, 26), st.booleans()),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_indexed_dispatch_equals_the_scan(ops: list[tuple[Any, ...]]) -> None:
    """Every policy picks the same instance (ties, fallbacks and round-robin
    cursors included) from an indexed state as from a scanned one, while
    instances come, go, change and drift unreported within their bounds."""
    with small_thresholds():
        idx = ClusterState(gpus_limit=10_000, model_tp={MODEL: 1})
        plain = ClusterState(gpus_limit=10_000, model_tp={MODEL: 1})
        pol_i = {n: DISPATCH.get(n)() for n in POLICIES}
        pol_p = {n: DISPATCH.get(n)() for n in POLICIES}
        views: list[Tracked] = []
        next_id = 0
        rng = np.random.default_rng(0)
        for op in ops:
            kind = op[0]
            if kind == "add":
                v = Tracked(next_id, *op[1:])
                next_id += 1
                views.append(v)
                idx.add(v)  # type: ignore[arg-type]
                plain.add(Plain(v))  # type: ignore[arg-type]
            elif kind == "remove" and views:
                v = views.pop(op[1] % len(views))
                idx.remove(v.id)
                plain.remove(v.id)
            elif kind == "change" and views:
                views[op[1] % len(views)].change(*op[2:])
            elif kind == "drift" and views:
                views[op[1] % len(views)].drift(op[2])
            elif kind == "query":
                _, name, need, elastic = op
                idx.elastic = plain.elastic = elastic
                req = Request(0, MODEL, 0.0, 16 * need, 1)
                got = pol_i[name].dispatch(idx, req, 0.0, rng)
                want = pol_p[name].dispatch(plain, req, 0.0, rng)
                assert got == want, (name, need, elastic)
            assert (idx.index_of(MODEL) is not None) == (
                len(views) >= state_mod.INDEX_FROM or MODEL in idx._index
            )
            idx.check_index()


@settings(max_examples=200, deadline=None)
@given(
    vals=st.lists(st.tuples(value, st.integers(0, 8), st.integers(0, 3)), min_size=1, max_size=60),
    need=st.integers(1, 26),
    start=st.integers(0, 10_000),
)
def test_index_queries_equal_brute_force(
    vals: list[tuple[int, int, int]], need: int, start: int
) -> None:
    """Each query of a ModelIndex against its definition, computed by brute force."""
    with small_thresholds():
        views = [Tracked(i, a, w, r, 0) for i, (a, w, r) in enumerate(vals)]
        for v in views[::3]:
            v.drift(3)
        mi = index_mod.ModelIndex(views)  # type: ignore[arg-type]
        fits = [v for v in views if v.available_blocks >= need]
        bf = min(fits, key=lambda v: (v.available_blocks, v.id), default=None)
        assert mi.best_fit(need) is bf
        assert mi.most_available() is min(views, key=lambda v: (-v.available_blocks, v.id))
        ll = min(fits, key=lambda v: (v.num_running, v.id), default=None)
        assert mi.least_loaded(need) is ll
        assert mi.least_loaded_any() is min(views, key=lambda v: (v.num_running, v.id))
        s = start % len(views)
        cyc = [views[(s + k) % len(views)] for k in range(len(views))]
        rr = next(((v, views.index(v)) for v in cyc if v.available_blocks >= need), None)
        got = mi.first_fit(need, s)
        assert (got[0], got[1]) == rr if got is not None else rr is None
        assert mi.nth(s) is views[s]
        mi.check()


# ---------------------------------------------------------------- simulations


def reqs_of(n: int, rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = rng.integers(1, 1200, n)
    o = rng.integers(1, 400, n)
    return [Request(i, MODEL, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]


def config(stack: str, **over: Any) -> Any:
    data: dict[str, Any] = {
        "model": MODEL,
        "policy": {"stack": stack},
        "cluster": {"mem_util": 0.33},  # ~80 blocks an instance: many instances
        "sample_interval_s": 0.05,  # samples inside decode segments
    }
    for k, v in over.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return config_from_dict(data)


def fingerprint(res: RunResult) -> tuple[Any, ...]:
    ts = res.timeseries
    return (
        [
            (
                r.status,
                r.reason,
                r.first_token_s,
                r.finish_s,
                r.generated,
                r.preemptions,
                r.instance,
            )
            for r in res.records
        ],
        (ts.t, ts.active_gpus, ts.kv_used_bytes, ts.kv_capacity_bytes),
        (ts.kv_demand_bytes, ts.queued, ts.running),
        res.gpu_intervals,
        res.sim_events,
    )


def run_checked(c: Any, reqs: list[Request]) -> RunResult:
    """Run with the indexes in use from a few instances on, checking them
    (and every simulator invariant) after every event."""
    orig = Simulator.check_integrity
    seen = {"index": False, "totals": False}

    def checked(self: Simulator, arrived: int) -> None:
        orig(self, arrived)
        self.state.check_index()
        seen["index"] |= bool(self.state._index)
        usage = getattr(self, "_usage", None)
        seen["totals"] |= usage is not None and usage.active

    with small_thresholds(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Simulator, "check_integrity", checked)
        res = Simulator(c, reqs).run()
    assert seen == {"index": True, "totals": True}, "the test should exercise both"
    return res


def run_scanning(c: Any, reqs: list[Request], cost: CostModel | None = None) -> RunResult:
    """The reference: the same run with scans, without ``check_integrity``.

    The run compared with this one checks the simulator's invariants after
    every event; equal fingerprints (every request's instance, preemptions and
    times, every sample, the event count) mean this run went through the same
    states, so checking them here again (most of its time) adds nothing."""
    with never_indexed():
        return Simulator(replace(c, check_integrity=False), reqs, cost=cost).run()


CASES: dict[str, dict[str, Any]] = {
    "bf": {},
    "wf": {},
    "vllm": {},
    "ll": {},
    "bf-chunked": {"engine": {"chunked_prefill": True, "max_batched_tokens": 512}},
    "vllm-fixed": {"cluster": {"elastic": False, "gpus": 24}},
    "ll-fixed-small-batch": {
        "cluster": {"elastic": False, "gpus": 16},
        "engine": {"max_num_seqs": 3},
    },
    "wf-capped": {"cluster": {"max_gpus": 12}},
    "bf-horizon": {"max_time_s": 7.3},
    "llumnix": {},
}


@pytest.mark.parametrize("case", list(CASES))
def test_indexed_simulation_equals_scanning_simulation(case: str) -> None:
    """Whole runs: same records, time series (every sample), GPU intervals and
    event count with the indexes and kept totals as with scans."""
    stack = case.split("-")[0]
    c = config(stack, check_integrity=True, **CASES[case])
    reqs = reqs_of(300, 40.0, seed=len(case))
    assert fingerprint(run_checked(c, reqs)) == fingerprint(run_scanning(c, reqs))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    stack=st.sampled_from(["bf", "wf", "vllm", "ll"]),
    rate=st.sampled_from([5.0, 30.0, 120.0]),
    interval=st.sampled_from([0.01, 0.1, 0.7]),
    chunked=st.booleans(),
)
def test_random_runs_equal_scanning_runs(
    seed: int, stack: str, rate: float, interval: float, chunked: bool
) -> None:
    c = config(
        stack,
        check_integrity=True,
        sample_interval_s=interval,
        engine={"chunked_prefill": chunked, "max_batched_tokens": 700},
    )
    reqs = reqs_of(120, rate, seed)
    with small_thresholds():
        a = Simulator(c, reqs).run()
    assert fingerprint(a) == fingerprint(run_scanning(c, reqs))


class _DyadicCost(InstanceCost):
    """Iteration times that are multiples of 1/64 s: iteration ends fall exactly on
    sample times (and on each other), the ties the "as of now" views must count."""

    def prefill_time(self, prompt_lens: Any, share: float = 1.0) -> float:
        return (1 + int(sum(prompt_lens)) // 2048) / 64

    def decode_time(self, batch: int, ctx_total: Any) -> Any:
        return np.full(np.shape(ctx_total), (1 + batch // 8) / 64)

    def mixed_time(
        self, chunks: Any, decode_batch: int, decode_ctx_total: int, share: float = 1.0
    ) -> float:
        return 2 / 64


class DyadicCostModel(CostModel):
    def bind(self, model: ModelSpec, gpu: GpuSpec, tp: int = 1) -> InstanceCost:
        return _DyadicCost(model, gpu, tp, self.params_for(model, gpu, tp))


@pytest.mark.parametrize("stack", ["bf", "wf", "vllm", "ll", "llumnix"])
@pytest.mark.parametrize("chunked", [False, True])
def test_samples_on_iteration_ends_equal_scanning(stack: str, chunked: bool) -> None:
    """Samples every 1/16 s, arrivals and iteration ends on multiples of 1/64 s:
    a sample at the instant an iteration ends sees it complete, as the lazy
    views do, and dispatch at such instants decides as the scan does."""
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.integers(0, 3, 250)) / 64
    reqs = [
        Request(i, MODEL, float(t[i]), int(rng.integers(1, 1200)), int(rng.integers(1, 300)))
        for i in range(250)
    ]
    c = config(
        stack,
        check_integrity=True,
        sample_interval_s=1 / 16,
        engine={"chunked_prefill": chunked, "max_batched_tokens": 700},
    )
    orig = Simulator.check_integrity

    def checked(self: Simulator, arrived: int) -> None:
        orig(self, arrived)
        self.state.check_index()

    with small_thresholds(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(Simulator, "check_integrity", checked)
        a = Simulator(c, reqs, cost=DyadicCostModel()).run()
    b = run_scanning(c, reqs, cost=DyadicCostModel())
    assert fingerprint(a) == fingerprint(b)
