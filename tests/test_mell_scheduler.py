"""Mell's scheduler (stack ``mell``) in the simulator: Algorithm 1 per epoch,
request-operation batching, growth between epochs, releases, the pool cap,
and the configuration errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.metrics import summarize
from fleetserve.metrics.records import RunResult
from fleetserve.policy.mell.packer import Move
from fleetserve.policy.mell.scheduler import MellScheduler, net_moves
from fleetserve.sim.simulator import Simulator
from fleetserve.workload.request import Request

MODEL = "llama-2-7b"
BS = 16
# mem_util 0.33 leaves C = 83 blocks (1,328 tokens) per A100-40GB for LLaMA-2-7B:
# requests of a few hundred tokens span every Mell class.
CAP = 83


def config(**over: Any) -> Any:
    data: dict[str, Any] = {
        "model": MODEL,
        "check_integrity": True,
        "cluster": {"elastic": True, "mem_util": 0.33},
        "policy": {"stack": "mell"},
        "migration": {"epoch_s": 0.5},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return config_from_dict(data)


def workload(n: int, rate: float, seed: int, pmax: int, omax: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = rng.integers(1, pmax, n)
    o = rng.integers(1, omax, n)
    return [Request(i, MODEL, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]


class Watch:
    """Wraps the scheduler's plan: after every epoch, constraint (2) holds in
    every packer and every packer's bookkeeping is consistent."""

    def __init__(self, sched: MellScheduler) -> None:
        self.sched = sched
        self.epochs = 0
        self.plan = sched.plan
        sched.plan = self  # type: ignore[method-assign]

    def __call__(self, state: Any, now: float, rng: np.random.Generator) -> list[Any]:
        actions = self.plan(state, now, rng)
        self.epochs += 1
        for ms in self.sched.models.values():
            ms.packer.check()
            assert all(b.used <= ms.packer.C for b in ms.packer.bins.values())
        return actions


def run(cfg: Any, reqs: list[Request]) -> tuple[RunResult, MellScheduler, Simulator]:
    sim = Simulator(cfg, reqs)
    sched = sim.migration
    assert isinstance(sched, MellScheduler)
    watch = Watch(sched)
    res = sim.run()
    assert watch.epochs > 0
    return res, sched, sim


def assert_all_finished(res: RunResult) -> None:
    for r in res.records:
        assert r.status == "finished", r
        assert r.generated == r.output_tokens


def test_mell_run_keeps_every_invariant_and_migrates() -> None:
    """A busy elastic run: every simulator invariant after every event
    (memory never over-committed, each request in one place, one terminal
    state), the packer consistent after every epoch, and Mell migrates."""
    reqs = workload(200, 8.0, seed=3, pmax=900, omax=300)
    res, sched, _ = run(config(), reqs)
    assert_all_finished(res)
    assert sched.models[MODEL].packer.C == CAP
    assert sched.stats.allocates == len(reqs)
    assert sched.stats.updates > 0 and sched.stats.departs > 0
    assert 0 < sched.stats.item_moves_max <= 10  # Theorem 3, in a real run
    assert len(res.migrations) > 10
    modes = {m.mode for m in res.migrations}
    assert modes <= {"kv", "token"} and modes
    # The adaptive mechanism is the stack's.
    assert res.config["migration"]["mechanism"] == "adaptive"


def test_idle_gpus_are_released() -> None:
    """Two bursts far apart: the GPUs of the first are released before the second."""
    first = workload(40, 50.0, seed=4, pmax=600, omax=40)
    second = [
        Request(40 + r.id, MODEL, r.arrival_s + 60.0, r.prompt_tokens, r.output_tokens)
        for r in workload(5, 50.0, seed=5, pmax=100, omax=20)
    ]
    res, _, _ = run(config(sample_interval_s=1.0), first + second)
    assert_all_finished(res)
    ts = res.timeseries
    gap = [g for t, g in zip(ts.t, ts.active_gpus, strict=True) if 40.0 <= t <= 59.0]
    assert max(ts.active_gpus) >= 4
    assert gap and max(gap) == 0, gap


def test_growth_between_epochs_preempts_instead_of_overcommitting() -> None:
    """With long epochs the packer's sizes go stale: GPUs it filled to C run
    out of KV while requests grow. The instance preempts (vLLM-style), memory
    is never over-committed (checked after every event), the next epoch's
    Updates see the preempted requests' full demand, and everything finishes."""
    reqs = workload(120, 20.0, seed=6, pmax=300, omax=600)
    res, sched, _ = run(config(migration={"epoch_s": 8.0}), reqs)
    assert_all_finished(res)
    assert sum(r.preemptions for r in res.records) > 0
    assert sched.stats.updates > 0


def test_batching_nets_moves_and_the_switch_turns_it_off() -> None:
    reqs = workload(200, 8.0, seed=3, pmax=900, omax=300)
    res_b, on, _ = run(config(), reqs)
    res_r, off, _ = run(config(mell={"batching": False}), reqs)
    assert_all_finished(res_b)
    assert_all_finished(res_r)
    # Unbatched: every move an operation produced is issued, except those of
    # requests un-allocated again in the epoch, plus re-issues of aborted moves.
    off_s = off.stats
    assert off_s.issued_moves == off_s.raw_moves - off_s.dropped_moves + off_s.reissued_moves
    # Batched: some requests moved twice (or back) within an epoch; fewer actions.
    on_s = on.stats
    assert on_s.issued_moves < on_s.raw_moves - on_s.dropped_moves + on_s.reissued_moves
    assert len(res_r.migrations) + res_r.aborted_migrations > 0


MOVES = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 5)), min_size=0, max_size=30
)  # (request, destination bin)


@settings(max_examples=200, deadline=None)
@given(MOVES, st.sets(st.integers(0, 4)))
def test_net_moves_ends_where_the_raw_moves_end(
    steps: list[tuple[int, int]], new: set[int]
) -> None:
    """Netting keeps each request's final GPU, moves it at most once, never to
    where it already is; a new request is placed once, at its last GPU."""
    where: dict[int, int | None] = {r: (None if r in new else r % 3) for r in range(5)}
    start = dict(where)
    raw: list[Move] = []
    for rid, dst in steps:
        if where[rid] == dst:
            continue
        raw.append(Move(rid, where[rid], dst))
        where[rid] = dst
    net = net_moves(raw)
    seen = [rid for rid, _, _ in net]
    assert len(seen) == len(set(seen))
    after = dict(start)
    for rid, src, dst in net:
        assert src == start[rid] and src != dst
        after[rid] = dst
    assert after == where


def test_net_moves_examples() -> None:
    assert net_moves([Move(1, 0, 1), Move(1, 1, 2)]) == [(1, 0, 2)]
    assert net_moves([Move(1, 0, 1), Move(1, 1, 0)]) == []
    assert net_moves([Move(1, None, 1), Move(1, 1, 2)]) == [(1, None, 2)]
    assert net_moves([Move(2, 3, 4), Move(1, None, 0)]) == [(2, 3, 4), (1, None, 0)]


def test_pool_cap_holds_arrivals_until_gpus_free_up() -> None:
    """At the pool's cap an arrival is not allocated (its Allocate is undone)
    and waits at the controller until requests finish. Sizes here never
    change class (prompt 310 tokens = 20 blocks, 4 per GPU; at most 5 output
    tokens stay in the 20th block), so only arrivals need GPUs."""
    reqs = [Request(i, MODEL, 0.01 * i, 310, 1 + i % 5) for i in range(40)]
    res, _, _ = run(config(cluster={"max_gpus": 2}), reqs)
    assert_all_finished(res)
    assert summarize(res)["gpus"]["peak"] == 2
    assert max(r.ttft_s or 0.0 for r in res.records) > 1.0  # some waited for room


def test_mell_needs_its_own_dispatch_and_an_elastic_pool() -> None:
    reqs = workload(3, 1.0, seed=1, pmax=50, omax=5)
    with pytest.raises(ConfigError, match="needs dispatch 'mell'"):
        Simulator(config(policy={"stack": "mell", "dispatch": "worst_fit"}), reqs)
    with pytest.raises(ConfigError, match="elastic"):
        Simulator(config(cluster={"elastic": False, "gpus": 2}), reqs)
    sim = Simulator(config(policy={"stack": "wf", "dispatch": "mell"}), reqs)
    with pytest.raises(ConfigError, match="needs migration 'mell'"):
        sim.run()


def test_moves_are_traced_to_their_cause_and_strict_update_skips_non_l_overflows() -> None:
    """Every packer move has a cause (summary.json's ``mell`` section); with
    ``mell.strict_update`` a T/S/M request overflowing its GPU within its class
    runs no operation (Fig. 10 / Algorithm 1), the GPU preempts instead, and
    every simulator invariant still holds after every event."""
    reqs = workload(200, 8.0, seed=3, pmax=900, omax=300)
    res, sched, _ = run(config(), reqs)
    causes = sched.stats.moves_by_cause
    assert sum(causes.values()) == sched.stats.raw_moves > 0
    assert set(causes) <= {
        "allocate",
        "depart",
        "pool cap",
        "update: class change",
        "update: L growth overflow",
        "update: growth overflow, not L",
    }
    assert causes.get("update: growth overflow, not L", 0) > 0
    assert summarize(res)["mell"]["moves_by_cause"] == dict(sorted(causes.items()))
    assert sched.stats.strict_overflows == 0

    sim = Simulator(config(mell={"strict_update": True}), reqs)
    strict = sim.migration
    assert isinstance(strict, MellScheduler) and strict.strict_update
    res2 = sim.run()  # check_integrity: memory never over-committed, every request once
    assert_all_finished(res2)
    assert "update: growth overflow, not L" not in strict.stats.moves_by_cause
    assert strict.stats.strict_overflows > 0
    strict.models[MODEL].packer.check()


def test_an_update_beyond_a_fixed_pool_is_held_not_fatal() -> None:
    """In the simulator an Update that opens a GPU beyond ``cluster.max_gpus``
    is a configuration error (raise the cap). On a fixed pool
    (``ClusterState.pool_fixed``: the runtime's workers) the Update is undone
    instead and the request grows in place: the run finishes with every
    invariant held and the holds counted."""
    reqs = workload(60, 6.0, seed=1, pmax=300, omax=900)
    with pytest.raises(FleetserveError, match="an Update needs more GPUs"):
        run(config(cluster={"max_gpus": 3}), reqs)

    sim = Simulator(config(cluster={"max_gpus": 3}), reqs)
    sched = sim.migration
    assert isinstance(sched, MellScheduler)
    plan = sched.plan

    def fixed(state: Any, now: float, rng: np.random.Generator) -> list[Any]:
        state.pool_fixed = True
        before = sched.stats.cap_holds
        actions = plan(state, now, rng)
        for ms in sched.models.values():
            ms.packer.check()
        if sched.stats.cap_holds > before:  # nothing activated past the pool
            kinds = [type(a).__name__ for a in actions]  # releases come first
            up = kinds.count("ActivateGpu") - kinds.count("ReleaseGpu")
            assert state.gpus_active + up <= state.gpus_limit
        return actions

    sched.plan = fixed  # type: ignore[method-assign]
    res = sim.run()  # check_integrity: memory never over-committed, every request once
    assert_all_finished(res)
    assert sched.stats.cap_holds > 0
    assert summarize(res)["mell"]["cap_holds"] == sched.stats.cap_holds
    assert summarize(res)["gpus"]["peak"] <= 3


def _headroom_run(h: int, reqs: list[Request]) -> dict[str, Any]:
    """A run with ``mell.headroom_blocks = h`` whose packer sizes are checked
    after every epoch: each request's blocks plus h, capped at C."""
    sim = Simulator(config(migration={"epoch_s": 2.0}, mell={"headroom_blocks": h}), reqs)
    sched = sim.migration
    assert isinstance(sched, MellScheduler) and sched.headroom == h
    checked = []
    plan = sched.plan

    def watch(state: Any, now: float, rng: np.random.Generator) -> list[Any]:
        actions = plan(state, now, rng)
        for view in state.instances.values():
            p = sched.models[MODEL].packer
            for seq in view.seqs():
                blocks = max(1, -(-seq.demand_tokens // BS))
                assert p.size[seq.id] == min(CAP, blocks + h), (seq.id, blocks, h)
                checked.append(seq.id)
        return actions

    sched.plan = watch  # type: ignore[method-assign]
    res = sim.run()
    assert_all_finished(res)
    assert checked
    return summarize(res)


def test_headroom_packs_every_request_larger_and_keeps_the_invariants() -> None:
    """``mell.headroom_blocks`` = h: after every epoch each request's size in
    the packer is its blocks plus h (capped at C), so a bin packed to C holds
    h blocks per request less than C; every simulator invariant holds and
    everything finishes. On a growth-heavy run (long epochs) the headroom
    leaves GPUs room: fewer preemptions than without it, on more GPUs."""
    reqs = workload(120, 20.0, seed=6, pmax=300, omax=600)
    plain, roomy = _headroom_run(0, reqs), _headroom_run(4, reqs)
    assert roomy["requests"]["preemptions"] < plain["requests"]["preemptions"]
    assert roomy["gpus"]["gpu_hours"] > plain["gpus"]["gpu_hours"]
    with pytest.raises(ConfigError, match="headroom_blocks"):
        config(mell={"headroom_blocks": -1})
