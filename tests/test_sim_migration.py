"""Migrations in the simulator: KV (live, staged) and token mechanisms, aborts,
Defer and ActivateGpu refs, exactness of macro-steps, invariants under hypothesis.

Test-only policies are registered under names starting with ``_test``. A
scripted migration policy gets its plan from a callable the test installs on
``Simulator.migration`` before running.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.cluster.state import ClusterState, InstanceView, SeqView
from fleetserve.config import SimConfig, config_from_dict
from fleetserve.costmodel import DEFAULT_PARAMS, CostModel
from fleetserve.costmodel.transfer import intra_node_link, transfer_time
from fleetserve.errors import FleetserveError
from fleetserve.metrics import summarize
from fleetserve.metrics.records import RunResult
from fleetserve.policy import (
    DISPATCH,
    MIGRATION,
    ActivateGpu,
    Defer,
    Dispatch,
    Migrate,
    ReleaseGpu,
)
from fleetserve.policy.actions import DispatchAction
from fleetserve.policy.base import DispatchPolicy, MigrationPolicy
from fleetserve.policy.catalog import resolve_policies
from fleetserve.sim.simulator import Simulator
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload.request import Request

MODEL = "llama-2-7b"
Plan = Callable[[ClusterState, float, np.random.Generator], list[Any]]


# ------------------------------------------------------------ test policies


@MIGRATION.register("_test_script")
class Scripted(MigrationPolicy):
    """Plans whatever ``script(state, now, rng)`` returns; records ``bind`` calls."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.script: Plan = lambda state, now, rng: []
        self.bound: list[tuple[int, int]] = []
        self.finished: list[tuple[int, int]] = []
        self.released: list[int] = []
        self.dispatcher: DispatchPolicy | None = None

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        p = cls()
        p.interval_s = config.migration.epoch_s
        return p

    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        return self.script(state, now, rng)

    def attach(self, dispatcher: DispatchPolicy) -> None:
        self.dispatcher = dispatcher

    def bind(self, ref: int, instance_id: int) -> None:
        self.bound.append((ref, instance_id))

    def on_finish(self, request_id: int, instance_id: int, now: float) -> None:
        self.finished.append((request_id, instance_id))

    def on_release(self, instance_id: int, now: float) -> None:
        self.released.append(instance_id)


@MIGRATION.register("_test_balance")
class Balance(MigrationPolicy):
    """Every epoch, per model: the request with the most KV on the fullest
    instance moves to the emptiest one (if that is a different instance and
    no move of that request is under way)."""

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        p = cls()
        p.interval_s = config.migration.epoch_s
        return p

    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        out: list[Any] = []
        for model in sorted(state.by_model):
            views = state.instances_of(model)
            if len(views) < 2:
                continue
            full = max(views, key=lambda v: (v.used_blocks, -v.id))
            empty = min(views, key=lambda v: (v.used_blocks, v.id))
            cands = [s for s in full.seqs() if s.kv_tokens > 0 and not s.migrating]
            if full.id != empty.id and cands:
                seq = max(cands, key=lambda s: (s.kv_tokens, -s.id))
                out.append(Migrate(seq.id, empty.id))
        return out


@DISPATCH.register("_test_maybe_defer")
class MaybeDefer(DispatchPolicy):
    """Defers odd request ids, round-robins the rest (activating an instance
    when there is none); the held ids are kept for the migration policy."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.deferred: list[int] = []
        self._n = 0

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        views = state.instances_of(req.model)
        if not views and req.id % 2 == 0 and state.can_activate(1):
            return ActivateGpu(req.model, 1, req.id)
        if req.id % 2 == 1 or not views:
            self.deferred.append(req.id)
            return Defer(req.id)
        self._n += 1
        return Dispatch(req.id, views[self._n % len(views)].id)


@MIGRATION.register("_test_random")
class RandomMoves(MigrationPolicy):
    """Random plans: dispatch held requests (sometimes onto a new instance
    named by a ref), random moves of random requests (modes kv, token or the
    mechanism's choice), occasionally a move to a freshly activated instance."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.dispatcher: DispatchPolicy | None = None
        self.bound: dict[int, int] = {}

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        p = cls()
        p.interval_s = config.migration.epoch_s
        return p

    def attach(self, dispatcher: DispatchPolicy) -> None:
        self.dispatcher = dispatcher

    def bind(self, ref: int, instance_id: int) -> None:
        self.bound[ref] = instance_id

    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        out: list[Any] = []
        views = state.instances_of(MODEL)
        ids = [v.id for v in views]
        ref = -1
        room = state.gpus_limit - state.gpus_active if state.elastic else 0
        if isinstance(self.dispatcher, MaybeDefer):
            held, self.dispatcher.deferred = self.dispatcher.deferred, []
            for rid in held:
                if room > 0 and (not ids or rng.random() < 0.2):
                    out.append(ActivateGpu(MODEL, 1, ref=ref))
                    ids.append(ref)
                    ref -= 1
                    room -= 1
                out.append(Dispatch(rid, ids[int(rng.integers(len(ids)))]))
        seqs = [s for v in views for s in v.seqs()]
        for _ in range(int(rng.integers(0, 4))):
            if not seqs or not ids:
                break
            seq = seqs[int(rng.integers(len(seqs)))]
            if room > 0 and rng.random() < 0.1:
                out.append(ActivateGpu(MODEL, 1, ref=ref))
                ids.append(ref)
                ref -= 1
                room -= 1
            mode = [None, "kv", "token"][int(rng.integers(3))]
            # half the moves go to the newest instance (on a second node, if any)
            dst = ids[-1] if rng.random() < 0.5 else ids[int(rng.integers(len(ids)))]
            out.append(Migrate(seq.id, dst, mode))
        return out


# ------------------------------------------------------------------ helpers


def cfg(**over: Any) -> SimConfig:
    # long requests (20,000 tokens) exercise multi-stage copies: serve a long
    # context window (LLaMA-2-7B's own, 4,096, would reject them)
    data: dict[str, Any] = {
        "model": MODEL,
        "check_integrity": True,
        "engine": {"max_model_len": 131072},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            data[k] = v
    return config_from_dict(data)


def fixed(n: int, **over: Any) -> SimConfig:
    """A fixed pool of ``n`` A100-40GB, the scripted migration policy."""
    base: dict[str, Any] = {
        "cluster": {"elastic": False, "gpus": n},
        "policy": {"stack": "vllm", "migration": "_test_script"},
        "migration": {"epoch_s": 0.05},
    }
    for k, v in over.items():
        if isinstance(v, dict):
            base.setdefault(k, {}).update(v)
        else:
            base[k] = v
    return cfg(**base)


def run_script(
    c: SimConfig, reqs: list[Request], script: Plan, cost: CostModel | None = None
) -> tuple[RunResult, Scripted]:
    sim = Simulator(c, reqs, cost=cost)
    assert isinstance(sim.migration, Scripted)
    sim.migration.script = script
    return sim.run(), sim.migration


def find(state: ClusterState, rid: int) -> tuple[InstanceView, SeqView] | None:
    for v in state.instances.values():
        for s in v.seqs():
            if s.id == rid:
                return v, s
    return None


def when(cond: Callable[[ClusterState, float], bool], actions: Sequence[Any]) -> Plan:
    """A plan that returns ``actions`` once, at the first epoch where ``cond`` holds."""
    fired: list[bool] = []

    def plan(state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        if not fired and cond(state, now):
            fired.append(True)
            return list(actions)
        return []

    return plan


def decoding(rid: int, generated: int = 1) -> Callable[[ClusterState, float], bool]:
    def cond(state: ClusterState, now: float) -> bool:
        got = find(state, rid)
        return got is not None and got[1].kv_tokens > 0 and got[1].generated >= generated

    return cond


def cost7b(gpu: str = "a100-40gb") -> Any:
    return CostModel().bind(get_model(MODEL), get_gpu(gpu))


def assert_all_finished(res: RunResult) -> None:
    for r in res.records:
        assert r.status == "finished", r
        assert r.generated == r.output_tokens


# ---------------------------------------------------------------- mechanisms


def test_kv_migration_end_to_end() -> None:
    """A running request's KV moves to the other instance; it finishes there
    with all its tokens, bytes = its KV at the detach, a short stall."""
    req = Request(0, MODEL, 0.0, 2000, 300)
    res, pol = run_script(fixed(2), [req], when(decoding(0, 20), [Migrate(0, 1, "kv")]))
    rec = res.records[0]
    assert_all_finished(res)
    assert rec.instance == 1 and rec.migrations == 1 and rec.aborted_migrations == 0
    (m,) = res.migrations
    assert (m.request_id, m.src, m.dst, m.mode) == (0, 0, 1, "kv")
    kvpt = get_model(MODEL).kv_bytes_per_token
    assert m.bytes > 0 and m.bytes % kvpt == 0
    assert 2000 + 20 - 1 <= m.bytes // kvpt < 2000 + 300
    assert m.stages >= 1
    assert rec.migration_stall_s > 0
    # the stall is the final copy (a few tokens) and the wait for a boundary of
    # the idle destination: far less than copying the whole KV at once
    assert rec.migration_stall_s < cost7b().kv_transfer_time(
        2000, intra_node_link(get_gpu("a100-40gb"))
    )
    assert pol.finished == [(0, 1)]
    assert summarize(res)["migrations"]["by_mode"]["kv"]["count"] == 1


def test_token_migration_end_to_end() -> None:
    """Token ids move; the destination re-prefills prompt + generated tokens
    (its prefill time is in the stall) and the request finishes there."""
    req = Request(0, MODEL, 0.0, 2000, 300)
    res, _ = run_script(fixed(2), [req], when(decoding(0, 20), [Migrate(0, 1, "token")]))
    rec = res.records[0]
    assert_all_finished(res)
    assert rec.instance == 1 and rec.migrations == 1
    (m,) = res.migrations
    assert m.mode == "token" and m.stages == 0
    tokens = m.bytes // 4  # prompt + generated at the detach
    assert m.bytes == 4 * tokens and 2000 + 20 <= tokens < 2000 + 300
    link = intra_node_link(get_gpu("a100-40gb"))
    expect = transfer_time(m.bytes, link) + cost7b().prefill_time([tokens])
    assert rec.migration_stall_s == pytest.approx(expect, rel=1e-9)
    assert rec.preemptions == 0


def test_mechanism_from_config_decides_the_mode() -> None:
    req = Request(0, MODEL, 0.0, 1000, 100)
    for mech in ("kv", "token"):
        c = fixed(2, migration={"mechanism": mech})
        res, _ = run_script(c, [req], when(decoding(0, 5), [Migrate(0, 1)]))
        assert [m.mode for m in res.migrations] == [mech]
        assert res.config["migration"]["mechanism"] == mech
        config_from_dict(res.config)  # the resolved config is still valid
    assert resolve_policies(cfg())["mechanism"] == "kv"  # the stacks' default


def test_waiting_request_moves_without_kv() -> None:
    """A queued request (batch limit 1) moves by token ids to the other
    instance's queue: no stall, no re-prefill beyond its own prefill."""
    reqs = [Request(0, MODEL, 0.0, 500, 200), Request(1, MODEL, 0.001, 400, 50)]
    c = fixed(2, policy={"stack": "bf"}, engine={"max_num_seqs": 1})

    def queued(state: ClusterState, now: float) -> bool:
        got = find(state, 1)
        return got is not None and got[0].id == 0 and got[1].kv_tokens == 0

    res, _ = run_script(c, reqs, when(queued, [Migrate(1, 1, "kv")]))
    assert_all_finished(res)
    rec = res.records[1]
    assert rec.instance == 1 and rec.migrations == 1 and rec.migration_stall_s == 0.0
    (m,) = res.migrations
    assert m.mode == "token" and m.bytes == 4 * 400  # no KV: token ids whatever was asked
    # it started long before request 0 (200 tokens) would have freed the batch
    assert rec.first_token_s is not None and res.records[0].finish_s is not None
    assert rec.first_token_s < res.records[0].finish_s


def test_preempted_request_moves_to_the_head_of_the_queue() -> None:
    """A preempted request (generated tokens, no KV) moves by token ids and
    goes to the head of the destination's queue."""
    small = {"cluster": {"mem_util": 0.33}}  # ~80 blocks: preemption
    reqs = [
        Request(0, MODEL, 0.0, 600, 400),
        Request(1, MODEL, 0.01, 600, 400),
        Request(2, MODEL, 0.02, 200, 300),
    ]
    c = fixed(2, policy={"stack": "bf"}, **small)

    def preempted(state: ClusterState, now: float) -> bool:
        got = find(state, 1)
        return got is not None and got[1].kv_tokens == 0 and got[1].generated > 0

    res, _ = run_script(c, reqs, when(preempted, [Migrate(1, 1)]))
    assert_all_finished(res)
    rec = res.records[1]
    assert rec.preemptions >= 1 and rec.migrations == 1 and rec.instance == 1
    assert res.migrations[0].mode == "token"
    assert res.migrations[0].bytes > 4 * 600  # prompt and generated token ids


def test_long_request_on_a_fast_source_needs_several_stages() -> None:
    """20,000 tokens of KV over the network (instance 8 is on the second node)
    take longer than 16 decode steps, so the stop-and-copy waits for a second
    live stage; the stall is only the final copy."""
    req = Request(0, MODEL, 0.0, 20000, 500)
    res, _ = run_script(fixed(9), [req], when(decoding(0, 10), [Migrate(0, 8, "kv")]))
    assert_all_finished(res)
    (m,) = res.migrations
    assert m.stages >= 2 and m.dst == 8
    net = get_gpu("a100-40gb").network_bw
    assert res.records[0].migration_stall_s < 0.05 * m.bytes / net


def test_max_stages_forces_the_stop_and_copy() -> None:
    req = Request(0, MODEL, 0.0, 20000, 500)
    c = fixed(9, migration={"max_stages": 1})
    res, _ = run_script(c, [req], when(decoding(0, 10), [Migrate(0, 8, "kv")]))
    assert_all_finished(res)
    assert res.migrations[0].stages == 1
    # the final copy now carries the KV of the whole first stage's duration
    stalled = res.records[0].migration_stall_s
    c2 = fixed(9)
    res2, _ = run_script(c2, [req], when(decoding(0, 10), [Migrate(0, 8, "kv")]))
    assert stalled > res2.records[0].migration_stall_s


# -------------------------------------------------------------------- aborts


def test_abort_when_the_request_finishes_during_a_stage() -> None:
    """Five tokens left, a copy over the network of 10,000 tokens: the request
    finishes on its source first; the destination's reservation is freed."""
    req = Request(0, MODEL, 0.0, 10000, 40)
    res, pol = run_script(fixed(9), [req], when(decoding(0, 35), [Migrate(0, 8, "kv")]))
    rec = res.records[0]
    assert_all_finished(res)
    assert rec.instance == 0 and rec.migrations == 0 and rec.aborted_migrations == 1
    assert res.migrations == [] and res.aborted_migrations == 1
    assert any("aborted" in n for n in res.notes)
    assert pol.finished == [(0, 0)]


def test_abort_when_the_request_finishes_before_its_token_detach() -> None:
    """A token move is requested while the request's last iteration is in flight."""
    req = Request(0, MODEL, 0.0, 500, 30)
    c = fixed(2, migration={"epoch_s": 0.001})
    res, _ = run_script(c, [req], when(decoding(0, 29), [Migrate(0, 1, "token")]))
    assert_all_finished(res)
    assert res.records[0].aborted_migrations == 1 and res.migrations == []


def test_abort_when_the_source_preempts_the_request() -> None:
    """Two long requests fill instance 0; the later one (the preemption victim)
    starts a slow cross-node copy just before memory runs out: it is preempted
    during the stage, the move aborts, and it recomputes on its source. (The
    timing is set on the legacy cost model: on the calibrated one the copy
    completes before memory runs out.)"""
    reqs = [Request(0, MODEL, 0.0, 23000, 2000), Request(1, MODEL, 0.01, 23000, 2000)]
    c = fixed(9, policy={"stack": "bf"})

    def nearly_full(state: ClusterState, now: float) -> bool:
        v = state.instances[0]
        got = find(state, 1)
        return got is not None and got[1].kv_tokens > 0 and v.free_blocks <= 1

    res, _ = run_script(
        c, reqs, when(nearly_full, [Migrate(1, 8, "kv")]), CostModel(DEFAULT_PARAMS)
    )
    assert_all_finished(res)
    rec = res.records[1]
    assert rec.preemptions >= 1 and rec.aborted_migrations == 1 and rec.migrations == 0
    assert rec.instance == 0 and res.migrations == []


def test_abort_when_the_destination_has_no_room() -> None:
    """The destination holds a large request: the copy cannot reserve blocks."""
    reqs = [Request(0, MODEL, 0.0, 30000, 300), Request(1, MODEL, 0.0, 30000, 300)]
    # round robin: request 0 on instance 0, request 1 on instance 1
    res, _ = run_script(fixed(2), reqs, when(decoding(0, 2), [Migrate(0, 1, "kv")]))
    assert_all_finished(res)
    assert res.records[0].aborted_migrations == 1 and res.records[0].instance == 0
    assert res.migrations == []


def test_a_move_waits_for_room_when_asked() -> None:
    """``migration.wait_for_room_s``: the destination holds a request that
    finishes soon. Without waiting the move aborts at once; with a long
    enough wait it starts as soon as that request has left (at the
    destination's boundary, not at a later epoch) and completes; with a wait
    too short it aborts once the wait is over."""
    reqs = [Request(0, MODEL, 0.0, 30000, 300), Request(1, MODEL, 0.0, 30000, 20)]
    out = {}
    for wait in (0.0, 0.05, 30.0):
        script = when(decoding(0, 2), [Migrate(0, 1, "kv")])
        res, _ = run_script(fixed(2, migration={"wait_for_room_s": wait}), reqs, script)
        assert_all_finished(res)
        out[wait] = res
    assert out[0.0].records[0].aborted_migrations == 1 and out[0.0].migrations == []
    assert out[0.05].records[0].aborted_migrations == 1 and out[0.05].migrations == []
    done = out[30.0]
    assert done.records[0].aborted_migrations == 0
    assert [(m.request_id, m.src, m.dst) for m in done.migrations] == [(0, 0, 1)]
    assert done.records[0].instance == 1
    # it started once request 1 had left: it completed after that, well within the wait
    finish_1 = done.records[1].finish_s
    assert finish_1 is not None and finish_1 < done.migrations[0].time_s < finish_1 + 5.0
    with pytest.raises(FleetserveError, match="wait_for_room_s"):
        fixed(2, migration={"wait_for_room_s": -1.0})


def test_abort_when_the_destination_fills_up_between_stages() -> None:
    """The move starts when the first stage barely fits on the destination,
    whose own request keeps growing during the slow cross-node stage: the
    next reservation finds no room, the move aborts and frees what it held."""
    reqs = [Request(0, MODEL, 0.0, 20000, 3000), Request(1, MODEL, 0.0, 27000, 3000)]
    c = fixed(9, policy={"dispatch": "_test_defer_all"})
    started: list[float] = []

    def plan(state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        if now == 0.0:
            return [Dispatch(0, 0), Dispatch(1, 8)]
        got = find(state, 0)
        if started or got is None or got[1].generated < 1:
            return []
        dst = state.instances[8]
        room = dst.free_blocks - int(0.01 * dst.total_blocks)
        if room - -(-got[1].kv_tokens // 16) <= 1:
            started.append(now)
            return [Migrate(0, 8, "kv")]
        return []

    res, _ = run_script(c, reqs, plan)
    assert_all_finished(res)
    assert started and res.migrations == []
    assert res.records[0].aborted_migrations == 1 and res.records[0].instance == 0


def test_release_of_a_migrating_instance_is_refused() -> None:
    """Instances touched by a migration are not idle, so releasing them fails."""
    req = Request(0, MODEL, 0.0, 20000, 500)
    seen: list[tuple[bool, bool]] = []
    fired: list[int] = []

    def plan(state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        got = find(state, 0)
        if not fired and got is not None and got[1].generated >= 5:
            fired.append(1)
            return [Migrate(0, 8, "kv")]
        if fired and got is not None and got[1].migrating:
            seen.append((state.instances[0].idle, state.instances[8].idle))
            return [ReleaseGpu(8)]
        return []

    with pytest.raises(RuntimeError, match="released busy instance 8"):
        run_script(fixed(9), [req], plan)
    assert seen == [(False, False)]


def test_move_to_an_instance_released_before_it_starts_is_dropped() -> None:
    req = Request(0, MODEL, 0.0, 1000, 100)
    res, pol = run_script(
        fixed(2, cluster={"elastic": True, "gpus": None}, policy={"memory": "planned"}),
        [req],
        when(decoding(0, 3), [ActivateGpu(MODEL, 1, ref=-1), Migrate(0, -1), ReleaseGpu(-1)]),
    )
    assert_all_finished(res)
    assert res.records[0].aborted_migrations == 1 and res.migrations == []
    ((ref, iid),) = pol.bound
    assert ref == -1 and pol.released == [iid]


# --------------------------------------------------------- Defer, refs, bind


@DISPATCH.register("_test_defer_all")
class DeferAll(DispatchPolicy):
    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> DispatchAction:
        return Defer(req.id)


def test_deferred_requests_are_dispatched_by_a_later_plan() -> None:
    reqs = [Request(i, MODEL, 0.01 * i, 300, 20) for i in range(4)]
    c = fixed(2, policy={"dispatch": "_test_defer_all"}, migration={"epoch_s": 0.5})

    def plan(state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        return [Dispatch(i, i % 2) for i in range(4)] if now == 0.5 else []

    res, _ = run_script(c, reqs, plan)
    assert_all_finished(res)
    for r in res.records:
        assert r.first_token_s is not None and r.first_token_s > 0.5
        assert r.instance == r.id % 2
    assert summarize(res)["requests"]["finished"] == 4


def test_activate_with_ref_binds_and_takes_the_plan_actions() -> None:
    """An elastic pool: the plan activates an instance by ref, dispatches a
    held request and migrates a running one to it; ``bind`` gets the real id."""
    reqs = [Request(0, MODEL, 0.0, 800, 200), Request(1, MODEL, 0.2, 300, 50)]
    c = fixed(
        1,
        cluster={"elastic": True, "gpus": None},
        policy={"stack": "bf", "dispatch": "_test_maybe_defer", "memory": "elastic"},
        migration={"epoch_s": 0.25},
    )

    def plan(state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        if now == 0.25:
            return [
                ActivateGpu(MODEL, 1, ref=-7),
                Dispatch(1, -7),
                ActivateGpu(MODEL, 1, ref=-8),
                Migrate(0, -8, "kv"),
            ]
        return []

    res, pol = run_script(c, reqs, plan)
    assert_all_finished(res)
    refs = dict(pol.bound)
    assert set(refs) == {-7, -8}
    assert res.records[1].instance == refs[-7]
    assert res.records[0].instance == refs[-8] and res.records[0].migrations == 1
    # the source became idle when its only request left: the elastic policy released it
    assert 0 in [iv.gpu for iv in res.gpu_intervals if iv.end_s < res.end_s]


def test_bad_plans_are_errors() -> None:
    req = Request(0, MODEL, 0.0, 300, 50)
    for bad, msg in (
        ([Dispatch(0, 1)], "not held"),
        ([Migrate(0, 5)], "unknown instance"),
        ([Migrate(3, 1)], "not in flight"),
        ([Migrate(0, 1, "teleport")], "mode"),
    ):
        with pytest.raises(RuntimeError, match=msg):
            run_script(fixed(2), [req], when(decoding(0, 1), bad))


def test_defer_needs_a_planning_migration_policy() -> None:
    c = cfg(policy={"stack": "bf", "dispatch": "_test_defer_all"})
    with pytest.raises(RuntimeError, match="never plans"):
        Simulator(c, [Request(0, MODEL, 0.0, 10, 10)]).run()


def test_views_are_as_of_now_and_equal_without_macro_steps() -> None:
    """What a policy reads between iteration ends (decode steps, KV tokens,
    generated tokens, demand, used blocks) is the same with and without
    macro-steps, and consistent: a running request's KV is prompt +
    generated tokens (the in-flight iteration's token counted)."""
    reqs = workload(40, 4.0, seed=21, pmax=900, omax=300)

    def snapshots(macro: bool) -> list[tuple[Any, ...]]:
        got: list[tuple[Any, ...]] = []

        def plan(state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
            for v in state.instances.values():
                got.append((now, v.id, v.decode_steps, v.used_blocks, v.idle))
                for sq in v.seqs():
                    got.append((sq.id, sq.kv_tokens, sq.generated, sq.demand_tokens))
                    assert sq.demand_tokens >= sq.kv_tokens
                    if sq.kv_tokens and not sq.migrating and sq.generated:
                        assert sq.kv_tokens in (
                            sq.prompt_tokens + sq.generated,
                            sq.prompt_tokens + sq.generated - 1,
                        )
            return []

        c = fixed(2, cluster={"mem_util": 0.33}, migration={"epoch_s": 0.037}, macro_steps=macro)
        run_script(c, reqs, plan)
        return got

    fast = snapshots(True)
    assert fast == snapshots(False) and len(fast) > 1000


def test_no_epoch_timer_without_a_migration_policy() -> None:
    reqs = [Request(i, MODEL, 0.1 * i, 200, 30) for i in range(5)]
    sim = Simulator(cfg(policy={"stack": "bf"}), reqs)
    assert sim.migration.interval_s is None

    def fail(*a: Any) -> Any:
        raise AssertionError("epoch timer must not exist")

    sim._on_epoch = fail  # type: ignore[method-assign,assignment]
    assert_all_finished(sim.run())


# ---------------------------------------------------------------- exactness


def outcome(res: RunResult) -> list[tuple[Any, ...]]:
    return [
        (
            r.status,
            r.first_token_s,
            r.finish_s,
            r.generated,
            r.preemptions,
            r.instance,
            r.migrations,
            r.migration_stall_s,
            r.aborted_migrations,
        )
        for r in res.records
    ]


def workload(n: int, rate: float, seed: int, pmax: int, omax: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    p = rng.integers(1, pmax, n)
    o = rng.integers(1, omax, n)
    return [Request(i, MODEL, float(t[i]), int(p[i]), int(o[i])) for i in range(n)]


@pytest.mark.parametrize(("mechanism", "chunked"), [("kv", False), ("token", False), ("kv", True)])
def test_macro_steps_exact_with_migrations(mechanism: str, chunked: bool) -> None:
    """With migrations, iteration-by-iteration and macro-stepped runs give the
    same records, time series and migration records, bit for bit."""
    reqs = workload(150, 6.0, seed=11, pmax=1000, omax=250)
    over: dict[str, Any] = {
        "cluster": {"elastic": False, "gpus": 3, "mem_util": 0.33},
        "policy": {"stack": "vllm", "migration": "_test_balance"},
        "migration": {"mechanism": mechanism, "epoch_s": 0.3},
        "engine": {"chunked_prefill": chunked, "max_batched_tokens": 1024},
        "check_integrity": False,
    }
    fast = Simulator(cfg(**over), reqs).run()
    slow = Simulator(cfg(macro_steps=False, **over), reqs).run()
    assert outcome(fast) == outcome(slow)
    assert fast.timeseries == slow.timeseries
    assert fast.migrations == slow.migrations
    assert fast.aborted_migrations == slow.aborted_migrations
    assert len(fast.migrations) > 20
    assert sum(r.preemptions for r in fast.records) > 0
    assert fast.sim_events is not None and slow.sim_events is not None
    assert fast.sim_events < slow.sim_events
    assert all(r.status == "finished" or r.reason for r in fast.records)


def test_balanced_run_keeps_every_invariant() -> None:
    reqs = workload(80, 6.0, seed=12, pmax=900, omax=300)
    c = cfg(
        cluster={"elastic": False, "gpus": 3, "mem_util": 0.33},
        policy={"stack": "vllm", "migration": "_test_balance"},
        migration={"epoch_s": 0.3},
    )
    res = Simulator(c, reqs).run()
    assert_all_finished(res)
    assert len(res.migrations) > 5
    assert all(m.bytes > 0 for m in res.migrations)


@pytest.mark.parametrize("mechanism", ["kv", "token"])
@pytest.mark.parametrize("pool", ["fixed", "elastic"])
def test_random_moves_on_a_busy_pool(mechanism: str, pool: str) -> None:
    """Hundreds of random moves among requests that preempt each other, with
    every invariant checked after every event."""
    reqs = workload(200, 8.0, seed=13, pmax=900, omax=300)
    cluster: dict[str, Any] = {"mem_util": 0.33}
    cluster.update({"elastic": False, "gpus": 3} if pool == "fixed" else {"max_gpus": 5})
    c = cfg(
        cluster=cluster,
        policy={"stack": "bf", "migration": "_test_random", "dispatch": "_test_maybe_defer"},
        migration={"mechanism": mechanism, "epoch_s": 0.1},
    )
    res = Simulator(c, reqs).run()
    assert_all_finished(res)
    assert len(res.migrations) > 200 and res.aborted_migrations > 0
    assert sum(r.preemptions for r in res.records) > 0


# ---------------------------------------------------------------- hypothesis

request_lists = st.lists(
    st.tuples(
        st.floats(0.0, 0.5, allow_nan=False),  # inter-arrival gap
        st.integers(1, 900),  # prompt
        st.integers(1, 300),  # output
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=request_lists,
    mechanism=st.sampled_from(["kv", "token"]),
    pool=st.sampled_from(["fixed", "elastic", "two-nodes"]),
    defer=st.booleans(),
    chunked=st.booleans(),
    seed=st.integers(0, 2**16),
    wait=st.sampled_from([0.0, 0.3]),
)
def test_random_migrations_keep_invariants(
    items: list[tuple[float, int, int]],
    mechanism: str,
    pool: str,
    defer: bool,
    chunked: bool,
    seed: int,
    wait: float,
) -> None:
    """Random workloads, random moves each epoch (random requests, random
    destinations, random modes, new instances by ref, deferred dispatch):
    every invariant holds after every event (memory never over-committed on
    either end of a move, every request in exactly one place) and every
    request finishes with all its tokens. ``two-nodes``: nine full-memory
    instances, the ninth on a second node, with prompts x20, so KV moves over
    the network take several live stages."""
    scale = 20 if pool == "two-nodes" else 1
    t = 0.0
    reqs = []
    for i, (gap, p, o) in enumerate(items):
        t += gap
        reqs.append(Request(i, MODEL, t, p * scale, o))
    cluster: dict[str, Any] = {"mem_util": 0.33}
    if pool == "elastic":
        cluster.update(elastic=True, max_gpus=6)
    elif pool == "fixed":
        cluster.update(elastic=False, gpus=3)
    else:
        cluster.update(elastic=False, gpus=9, mem_util=0.9)
    policy: dict[str, Any] = {"stack": "bf", "migration": "_test_random"}
    if defer:
        policy["dispatch"] = "_test_maybe_defer"
    if pool == "elastic":
        policy["memory"] = "elastic"
    c = cfg(
        cluster=cluster,
        policy=policy,
        migration={
            "mechanism": mechanism,
            "epoch_s": 0.2,
            "max_stages": 3,
            "wait_for_room_s": wait,
        },
        engine={"chunked_prefill": chunked, "max_batched_tokens": 512 * scale},
        seed=seed,
    )
    res = Simulator(c, reqs).run()
    assert_all_finished(res)
    s = summarize(res)
    assert s["requests"]["finished"] == len(reqs)
    assert s["migrations"]["count"] == len(res.migrations) == sum(r.migrations for r in res.records)
    assert res.aborted_migrations == sum(r.aborted_migrations for r in res.records)
    for m in res.migrations:
        assert m.bytes > 0 and m.src != m.dst


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=request_lists,
    mechanism=st.sampled_from(["kv", "token"]),
    pool=st.sampled_from(["fixed", "elastic", "two-nodes"]),
    chunked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_migrations_exact_with_macro_steps(
    items: list[tuple[float, int, int]], mechanism: str, pool: str, chunked: bool, seed: int
) -> None:
    """Random moves, deferred dispatch and refs: macro-stepped and
    iteration-by-iteration runs give identical records, migrations, series."""
    scale = 20 if pool == "two-nodes" else 1
    t = 0.0
    reqs = []
    for i, (gap, p, o) in enumerate(items):
        t += gap
        reqs.append(Request(i, MODEL, t, p * scale, o))
    cluster: dict[str, Any] = {
        "fixed": {"mem_util": 0.33, "elastic": False, "gpus": 3},
        "elastic": {"mem_util": 0.33, "max_gpus": 6},
        "two-nodes": {"mem_util": 0.9, "elastic": False, "gpus": 9},
    }[pool]
    over: dict[str, Any] = {
        "cluster": cluster,
        "policy": {"stack": "bf", "migration": "_test_random", "dispatch": "_test_maybe_defer"},
        "migration": {"mechanism": mechanism, "epoch_s": 0.2, "max_stages": 3},
        "engine": {"chunked_prefill": chunked, "max_batched_tokens": 512 * scale},
        "seed": seed,
        "check_integrity": False,
    }
    fast = Simulator(cfg(**over), reqs).run()
    slow = Simulator(cfg(macro_steps=False, **over), reqs).run()
    assert outcome(fast) == outcome(slow)
    assert fast.migrations == slow.migrations
    assert fast.timeseries == slow.timeseries
    assert fast.gpu_intervals == slow.gpu_intervals


# ------------------------------------------------------- copies beside decoding


def test_a_kv_copy_slows_a_memory_bound_decode_beside_it() -> None:
    """A long request's KV moves from instance 0 to 1 (a live stage and the
    final copy) while another request decodes on each end. With copy
    contention (the default) an iteration planned during a copy shares the
    HBM with it: the source's batch (the 20,000-token request and its
    neighbour: a decode using more than ``1 - c`` of the bandwidth) runs
    slower, and its neighbour ends later; the destination's lone 3,000-token
    decode asks for less than ``1 - c`` and is unchanged (max-min: both fit).
    Without it (``migration.copy_contention: false``) the copy is free for
    both. The copy itself is link-bound: the move ends at the same time."""
    reqs = [
        Request(0, MODEL, 0.0, 20000, 400),
        Request(1, MODEL, 0.0, 3000, 600),
        Request(2, MODEL, 0.0, 3000, 600),
    ]

    def run(contention: bool) -> RunResult:
        c = fixed(2, migration={"copy_contention": contention})
        res, _ = run_script(c, list(reqs), when(decoding(0, 5), [Migrate(0, 1, "kv")]))
        assert_all_finished(res)
        return res

    on, off = run(True), run(False)
    (m_on,), (m_off,) = on.migrations, off.migrations
    assert m_on.stages >= 1 and m_off.stages >= 1
    src_side, dst_side = on.records[2], on.records[1]
    assert (src_side.instance, dst_side.instance) == (0, 1)
    gpu = get_gpu("a100-40gb")
    link = intra_node_link(gpu)
    c = link.bandwidth_Bps / gpu.hbm_bw
    copy_s = cost7b().kv_transfer_time(20400, link)
    late = src_side.finish_s - off.records[2].finish_s  # type: ignore[operator]
    # slower, by at most a 1 / (1 - c) stretch of the copy's duration
    assert 0 < late <= copy_s * (1 / (1 - c) - 1) * 1.01
    assert dst_side.finish_s == off.records[1].finish_s
    # the limiting case: without any migration nothing changes
    plain = [Request(0, MODEL, 0.0, 3000, 600)]
    a, _ = run_script(fixed(2, migration={"copy_contention": True}), plain, lambda *_: [])
    b, _ = run_script(fixed(2, migration={"copy_contention": False}), plain, lambda *_: [])
    assert [r.finish_s for r in a.records] == [r.finish_s for r in b.records]


def test_beside_copies_limiting_cases() -> None:
    from fleetserve.sim.contention import beside_copies

    t = np.array([0.02, 0.02, 0.02, 0.02])
    mem = np.array([0.02, 0.019, 0.01, 0.001])  # u = 1, 0.95, 0.5, 0.05
    assert np.array_equal(beside_copies(t, mem, 0.0), t)  # no copy: the cost model's time
    got = beside_copies(t, mem, 0.2)
    assert got[0] == pytest.approx(0.02 / 0.8)  # memory-bound: 1 / (1 - c)
    assert got[1] == pytest.approx(0.02 * 0.95 / 0.8)
    assert got[2] == got[3] == 0.02  # u + c <= 1: unchanged
    # elementwise: each element as a scalar
    for i in range(4):
        assert float(beside_copies(float(t[i]), float(mem[i]), 0.2)) == pytest.approx(got[i])
    # copies asking for more than half: the iteration still gets its max-min share
    assert float(beside_copies(1.0, 1.0, 0.9)) == pytest.approx(2.0)


def test_link_overrides_price_the_copies_and_other_worlds_refuse_them() -> None:
    """``cluster.intra_node_bw`` / ``network_bw`` replace the catalog's links
    (Mell's testbed: PCIe 4.0 and 10 Gbps): the same move takes longer on the
    slower link; the multi-LLM and KunServe worlds and the runtime refuse them
    rather than ignore them."""
    from fleetserve.config import config_from_dict
    from fleetserve.errors import ConfigError
    from fleetserve.policy.catalog import check_world

    reqs = [Request(0, MODEL, 0.0, 2000, 300)]
    stalls = []
    for bw in (None, 32e9):
        over: dict[str, Any] = {} if bw is None else {"intra_node_bw": bw}
        c = fixed(2, cluster=over)
        assert (c.cluster.gpu_spec().intra_node_bw == bw) or bw is None
        res, _ = run_script(c, list(reqs), when(decoding(0, 20), [Migrate(0, 1, "kv")]))
        assert_all_finished(res)
        stalls.append(res.records[0].migration_stall_s)
    assert stalls[1] > stalls[0]  # the final copy crosses a ~9x slower link
    with pytest.raises(ConfigError, match="intra_node_bw must be positive"):
        fixed(2, cluster={"intra_node_bw": 0})
    for world in (
        {
            "policy": {"stack": "muxserve"},
            "multi": {"generator": "muxserve"},
            "cluster": {"elastic": False, "gpus": 8},
        },
        {"policy": {"stack": "kunserve"}, "cluster": {"elastic": False, "gpus": 2}},
    ):
        data: dict[str, Any] = {"model": MODEL, **world}
        data.setdefault("cluster", {})["network_bw"] = 1.25e9
        with pytest.raises(ConfigError, match="only the single-model simulator"):
            check_world(config_from_dict(data))


# ---------------------------------------------------------- link contention


def _migrations(link_contention: bool = True, gpus_per_node: int = 8) -> Any:
    from fleetserve.config import MigrationConfig
    from fleetserve.policy.mechanism import KvTransfer
    from fleetserve.sim.migration import Migrations

    mc = MigrationConfig(link_contention=link_contention)
    return Migrations(mc, get_gpu("a100-40gb"), gpus_per_node, KvTransfer(), 16)


def _task(src: tuple[int, ...], dst: tuple[int, ...]) -> Any:
    from types import SimpleNamespace

    from fleetserve.sim.migration import MigrationTask

    gpu = get_gpu("a100-40gb")
    link = intra_node_link(gpu)
    return MigrationTask(
        None,  # type: ignore[arg-type]
        SimpleNamespace(gpus=src),  # type: ignore[arg-type]
        SimpleNamespace(gpus=dst),  # type: ignore[arg-type]
        "kv",
        link,
    )


@settings(max_examples=50, deadline=None)
@given(
    k=st.integers(1, 6),
    dur=st.floats(1e-4, 2.0),
    now=st.floats(0.0, 100.0),
)
def test_transfers_on_one_port_queue_and_others_do_not_wait(k: int, dur: float, now: float) -> None:
    """Limiting cases of link contention (issue 22 item 2): one transfer
    alone takes its own time; ``k`` equal transfers out of one GPU at once
    end one after another, the last after ``k`` times as long; a transfer on
    other ports (another pair, or the same GPU receiving: full duplex) does
    not wait; without ``link_contention`` nobody waits."""
    m = _migrations()
    ends = [m._occupy(_task((0,), (1 + i,)), dur, now, shards=True) for i in range(k)]
    assert ends == pytest.approx([now + (i + 1) * dur for i in range(k)])
    # GPU 0 receiving (its "in" port) while it sends: no wait, whatever k is
    assert m._occupy(_task((7,), (0,)), dur, now, shards=True) == now + dur
    # a pair of other GPUs: no wait
    assert m._occupy(_task((8,), (9,)), dur, now, shards=True) == now + dur
    off = _migrations(link_contention=False)
    assert [off._occupy(_task((0,), (1 + i,)), dur, now, shards=True) for i in range(k)] == [
        now + dur
    ] * k


def test_sharded_transfers_hold_every_pair_and_token_ids_the_first() -> None:
    """A tensor-parallel move sends each shard over its own GPU pair: it
    occupies every pair's ports (a later move out of the second GPU waits),
    while token ids cross the first pair only; a pair within one GPU is a
    local copy and occupies nothing; nodes decide intra or network ports."""
    m = _migrations(gpus_per_node=4)
    assert m._occupy(_task((0, 1), (2, 3)), 1.0, 0.0, shards=True) == 1.0
    assert m._occupy(_task((1,), (5,)), 1.0, 0.0, shards=True) == 1.0  # network port: free
    assert m._occupy(_task((1,), (2,)), 1.0, 0.0, shards=True) == 2.0  # GPU 1's intra out: busy
    t = _migrations(gpus_per_node=4)
    assert t._occupy(_task((0, 1), (2, 3)), 1.0, 0.0, shards=False) == 1.0
    assert t._occupy(_task((1,), (3,)), 1.0, 0.0, shards=True) == 1.0  # token ids left 1 and 3 free
    assert t._occupy(_task((4,), (4,)), 1.0, 0.0, shards=True) == 1.0  # local: no port
    assert t._ports(_task((4,), (4,)), shards=True) == []


def test_two_moves_out_of_one_gpu_share_its_link() -> None:
    """End to end: one KV move alone is the same with and without link
    contention; two long requests moved out of instance 0 at the same epoch
    (to instances 1 and 2) finish their moves later with it, by no more than
    the whole of one move's copying, and every request still finishes."""
    reqs = [Request(0, MODEL, 0.0, 20000, 300), Request(1, MODEL, 0.0, 20000, 300)]
    both = [Migrate(0, 1, "kv"), Migrate(1, 2, "kv")]

    def run(on: bool, rs: list[Request], acts: list[Migrate]) -> RunResult:
        c = fixed(3, migration={"link_contention": on}, policy={"dispatch": "best_fit"})
        res, _ = run_script(c, rs, when(decoding(0, 5), acts))
        assert_all_finished(res)
        return res

    one_on, one_off = run(True, reqs[:1], both[:1]), run(False, reqs[:1], both[:1])
    assert [m.time_s for m in one_on.migrations] == [m.time_s for m in one_off.migrations]
    on, off = run(True, reqs, both), run(False, reqs, both)
    assert len(on.migrations) == len(off.migrations) == 2
    assert {m.src for m in on.migrations} == {0}
    last_on, last_off = max(m.time_s for m in on.migrations), max(m.time_s for m in off.migrations)
    copy_s = cost7b().kv_transfer_time(20300, intra_node_link(get_gpu("a100-40gb")))
    assert last_off < last_on <= last_off + copy_s * 1.01
