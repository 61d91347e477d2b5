"""KunServe's drop/restore in the multi-LLM world (the ``fleet`` stack's
pressure family, :mod:`fleetserve.sim.multi_burst`): buddy groups merge into a
pipeline under a burst, the pipeline holds the dropped weights as KV, and it
restores when the load falls; nothing is lost and memory is never
over-committed (integrity checks after every event)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import RunResult
from fleetserve.metrics.summary import summarize
from fleetserve.policy.catalog import MULTI, get_stack
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.pressure import KunSettings
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.sim.multi_build import multi_settings
from fleetserve.sim.multi_run import burst_settings
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

A = get_model("llama-2-7b")
SERVICES = {
    "a": Service("a", A, 2.0, 1500, 100),
    "b": Service("b", get_model("opt-6.7b"), 0.5, 300, 50),
}
# two replicas of "a" (buddies), one group of "b"
PLAN = PlacementPlan(
    (GroupPlacement((0, 1), 1, ("a",)), GroupPlacement((2,), 1, ("b",))),
    3,
)
KUN = KunSettings(pressure="kunserve", exchange="blocking", restore_min_s=2.0)


def _burst() -> list[Request]:
    """A burst of long prompts on "a" (far more KV than two replicas hold at
    mem_util 0.2), a trickle on "b", and a late request so the run goes on
    after the burst drains."""
    out = [(0.05 * i, "a", 1500, 100) for i in range(60)]
    out += [(1.0 * i, "b", 300, 50) for i in range(10)]
    out += [(60.0, "a", 100, 10)]
    out.sort()
    return [Request(i, m, t, p, o) for i, (t, m, p, o) in enumerate(out)]


def _run(burst: KunSettings | None, reqs: list[Request], **kw: Any) -> RunResult:
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=3,
        scheduler="fcfs",
        layout="merged",
        mem_util=kw.pop("mem_util", 0.2),
        burst=burst,
        check_integrity=kw.pop("check_integrity", True),
        **kw,
    )
    return MultiSimulator(cfg, SERVICES, PLAN, reqs).run()


def _all_finish(res: RunResult, n: int) -> None:
    s = summarize(res)["requests"]
    assert s["finished"] == s["total"] == n


def test_a_burst_merges_buddies_into_a_pipeline_and_low_load_restores_them() -> None:
    reqs = _burst()
    res = _run(KUN, reqs)
    _all_finish(res, len(reqs))
    k = res.extra["kunserve"]
    assert k["drops"] >= 1 and k["restores"] >= 1
    first = k["pipelines"][0]
    assert first["services"] == ["a"] and first["stages"] == [[0, 16], [16, 32]]
    # the pipeline's KV = both replicas' KV + the layer weights one of them dropped
    # (each member drops half of its 32 layers: one replica's worth in all)
    dropped = A.num_layers * A.weight_bytes_per_layer
    assert first["kv_bytes"] - first["kv_bytes_as_replicas"] == dropped
    assert first["ended_by"] == "restore" and first["end_s"] > first["start_s"]
    assert first["exchange_bytes"] > 0 and first["exchange_s"] > 0
    # the group of "b" has no buddy: never merged
    assert all(p["services"] == ["a"] for p in k["pipelines"])
    # requests served by the pipeline are recorded on it
    pipes = {p["id"] for p in k["pipelines"]}
    assert any(r.instance in pipes for r in res.records)
    # busy fractions are of each group's own life (the pipeline lived 0.2-10.6 s,
    # busy almost all of it: a fraction of the whole run would say ~1/6)
    groups = {g["id"]: g for g in res.extra["groups"]}
    fractions = [g["busy_fraction"] for g in groups.values()]
    assert all(f is None or f <= 1 + 1e-9 for f in fractions)
    assert groups[first["id"]]["busy_fraction"] > 0.5


def test_a_live_exchange_serves_at_once_and_moves_the_kv_beside_the_rounds() -> None:
    """``exchange: live`` (KunServe's): the pipelined group serves from the
    merge on, its victims' KV crossing the links victim by victim in the gaps
    between activations, so the exchange itself takes longer than at full
    bandwidth (the blocking one, during which the group serves nothing); while
    KV is on its way, decode rounds pay the remote attention. Everything
    finishes, the invariants hold after every event."""
    reqs = _burst()
    sims = {}
    for ex in ("blocking", "live"):
        cfg = MultiConfig(
            gpu="a100-80gb",
            n_gpus=3,
            scheduler="fcfs",
            layout="merged",
            mem_util=0.2,
            burst=replace(KUN, exchange=ex),
            check_integrity=True,
        )
        sim = MultiSimulator(cfg, SERVICES, PLAN, reqs)
        res = sim.run()
        _all_finish(res, len(reqs))
        sims[ex] = (sim, res.extra["kunserve"])
    (sb, kb), (sl, kl) = sims["blocking"], sims["live"]
    assert kb["exchange"] == "blocking" and kl["exchange"] == "live"
    pb, pl = kb["pipelines"][0], kl["pipelines"][0]
    assert pb["start_s"] == pl["start_s"] and pb["exchange_bytes"] == pl["exchange_bytes"] > 0
    # blocking: ready once the exchange is in; live: at once
    assert sb._ready_at[pb["id"]] == pytest.approx(pb["start_s"] + pb["exchange_s"])
    assert sl._ready_at[pl["id"]] == pl["start_s"]
    # the live exchange shares the links with activations: slower than alone;
    # the victims decoded meanwhile, paying the remote attention
    assert pl["exchange_s"] > pb["exchange_s"] > 0
    assert pl["remote_rounds"] >= 1 and "remote_rounds" not in pb
    assert sl.burst is not None and not sl.burst.live  # every exchange ended


def test_a_live_exchange_moves_the_remote_reads_to_the_sending_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a member still sends a victim's KV, the victim's attention for
    those layers reads that KV on the member's stage, not on the stage that
    owns the layers now (the KunServe world's rule): each round's per-stage
    moved KV adds to a sending stage what it takes from owning ones (the sum
    is 0), and the round's busiest stage is the cost model's with it."""
    from fleetserve.sim import multi_burst

    seen: list[tuple[list[float], float, float]] = []
    orig = multi_burst.BurstControl._moved_kv

    def spy(self: Any, ex: Any, m: str, stages: int) -> list[float] | None:
        got = orig(self, ex, m, stages)
        if got is not None:
            kv = sum(s.kv_tokens for s in ex.victims.values() if s.model == m)
            seen.append((got, sum(got), float(kv)))
        return got

    monkeypatch.setattr(multi_burst.BurstControl, "_moved_kv", spy)
    reqs = _burst()
    res = _run(replace(KUN, exchange="live"), reqs)
    _all_finish(res, len(reqs))
    assert seen  # rounds ran while KV was on its way
    for per_stage, total, kv in seen:
        assert len(per_stage) >= 2
        assert total == pytest.approx(0.0, abs=1e-9 * max(kv, 1.0))
        assert max(per_stage) > 0 > min(per_stage)
        assert max(per_stage) <= kv  # no stage reads more than the victims' whole KV


def test_a_victim_leaving_during_a_slow_live_exchange_voids_its_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a slow link the live exchange outlasts some victims: one that
    finishes (or is preempted) before its KV is sent frees that KV, so its
    copy is void (not sent, as in the KunServe world) and no later round pays
    its remote attention. The exchange still ends, everything finishes, the
    invariants hold after every event."""
    from fleetserve.costmodel.transfer import Link
    from fleetserve.sim import multi_burst

    monkeypatch.setattr(multi_burst, "intra_node_link", lambda gpu: Link(2e8, 1e-5))
    reqs = _burst()
    live = replace(KUN, exchange="live")
    res = _run(live, reqs)
    _all_finish(res, len(reqs))
    first = res.extra["kunserve"]["pipelines"][0]
    assert first["copies_void"] >= 1
    # the same run with every copy sent (departed victims kept): a longer exchange
    monkeypatch.setattr(multi_burst.BurstControl, "_void_departed", lambda self, ex, now: None)
    kept = _run(live, reqs, check_integrity=False)  # (the reference: every copy sent)
    _all_finish(kept, len(reqs))
    other = kept.extra["kunserve"]["pipelines"][0]
    assert other["copies_void"] == 0 and other["start_s"] == first["start_s"]
    assert first["exchange_s"] < other["exchange_s"]


def test_without_pressure_the_control_changes_nothing() -> None:
    """Ample memory: KunServe observes but never acts, and every request's
    timeline equals the run without it."""
    reqs = _burst()
    # the reference without the invariant checks: the run compared with it checks
    # them after every event, and every request's timeline is asserted to be equal
    base = _run(None, reqs, mem_util=0.9, check_integrity=False)
    kun = _run(KUN, reqs, mem_util=0.9)
    assert kun.extra["kunserve"]["drops"] == 0
    assert [(r.first_token_s, r.finish_s, r.instance) for r in base.records] == [
        (r.first_token_s, r.finish_s, r.instance) for r in kun.records
    ]
    assert base.end_s == kun.end_s


def test_a_spare_asleep_replica_is_woken_on_an_elastic_pool() -> None:
    """One live replica of "a" cannot drop (no buddy awake) but an asleep one
    can be woken: the policy's ActivateSpare."""
    reqs = [Request(0, "a", 0.0, 100, 5)] + [
        Request(i, "a", 20.0 + 0.05 * (i - 1), 1500, 100) for i in range(1, 50)
    ]
    res = _run(KUN, reqs, memory="elastic", keepalive_s=5.0)
    _all_finish(res, len(reqs))
    k = res.extra["kunserve"]
    assert k["spares_woken"] + k["drops"] >= 1
    assert res.extra["elastic"]["wakes"] >= 1


streams = st.lists(
    st.tuples(
        st.floats(0.0, 0.5, allow_nan=False),
        st.integers(1, 3000),
        st.integers(1, 150),
        st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=streams, elastic=st.booleans(), exchange=st.sampled_from(["blocking", "live"]))
def test_drop_and_restore_keep_every_invariant(
    items: list[tuple[float, int, int, bool]], elastic: bool, exchange: str
) -> None:
    t, reqs = 0.0, []
    for i, (gap, p, o, b) in enumerate(items):
        t += gap
        reqs.append(Request(i, "b" if b else "a", t, p, o))
    kw: dict[str, Any] = {"memory": "elastic", "keepalive_s": 0.5} if elastic else {}
    res = _run(replace(KUN, restore_min_s=0.5, exchange=exchange), reqs, **kw)
    s = summarize(res)["requests"]
    assert s["finished"] + s["rejected"] == s["total"] == len(reqs)
    for r in res.records:
        assert r.status in ("finished", "rejected")
        assert (r.status == "finished") == (r.generated == r.output_tokens)


def test_the_fleet_stack_and_bad_settings() -> None:
    st_ = get_stack("fleet")
    assert st_.worlds == (MULTI,)
    assert (st_.placement, st_.batching, st_.memory, st_.mechanism) == (
        "seallm",
        "db",
        "elastic",
        "adaptive",
    )
    assert st_.pressure == "kunserve" and st_.replacement
    # what the multi-LLM world does not model is refused, not substituted
    for bad, words in (
        (KunSettings(pressure="kv-swap"), "kunserve world only"),
        (KunSettings(pressure="queue", static_stages=2), "static pipeline"),
        (
            KunSettings(pressure="kunserve", exchange="blocking", live_restore=False),
            "live_restore",
        ),
    ):
        with pytest.raises(ConfigError, match=words):
            MultiConfig(burst=bad)
    # kunserve.* overrides reach the fleet stack; on a stack without KunServe they are an error
    cfg = config_from_dict(
        {
            "cluster": {"gpu": "a100-80gb", "gpus": 4},
            "fleet": {"generator": "fleet", "duration_s": 60, "bursts": 0},
            "policy": {"stack": "fleet"},
            "kunserve": {"restore_min_s": 7.0},
        }
    )
    got = burst_settings(st_, multi_settings(cfg).burst_overrides)
    assert got is not None and got.restore_min_s == 7.0
    with pytest.raises(ConfigError, match=r"kunserve\.restore_min_s"):
        burst_settings(get_stack("seallm"), {"restore_min_s": 7.0})


# ----------------------------------------------------- prefill lanes (pipelines)


def _pipelined_group(
    lanes: bool, scheduler: str = "fcfs", services: tuple[str, ...] = ("a",), cap: int = 40 * 2**30
) -> Any:
    """A 2-stage pipelined group on A100-80GB hosting ``services`` (of
    :data:`SERVICES`) under ``scheduler``, as a drop makes it (StagedCost job
    times; KV pool of ``cap`` bytes); ``lanes`` False gives the model before
    session 23 (a prefill is a round of its own)."""
    from fleetserve.costmodel import CostModel
    from fleetserve.costmodel.pipeline import PipelineCost, StagedCost
    from fleetserve.costmodel.transfer import Link
    from fleetserve.policy.sharing import BATCHING, ServiceStats
    from fleetserve.sim.group import SharingGroup
    from fleetserve.sim.kvlayout import make_layout
    from fleetserve.spec import get_gpu

    gpu = get_gpu("a100-80gb")
    specs = {m: SERVICES[m].spec for m in services}
    costs: dict[str, Any] = {}
    stats = {}
    for m, spec in specs.items():
        base = CostModel().bind(spec, gpu, 1)
        half = spec.num_layers // 2
        costs[m] = StagedCost(PipelineCost(base, [half, spec.num_layers - half], Link(25e9, 30e-6)))
        stats[m] = ServiceStats(1.0, 1.0, 0.1, spec.kv_bytes_per_token, 1e-4)
    sched = BATCHING.get(scheduler)()
    sched.setup(stats, cap)
    g = SharingGroup(0, (0, 1), 1, costs, make_layout("merged", cap, specs), sched)
    assert g.lanes and g.stages == 2
    if not lanes:
        g.lanes, g._bw = False, None
    return g


def _drive(g: Any, reqs: list[Request]) -> dict[int, list[float]]:
    """Run ``reqs`` through group ``g`` alone (its own little event loop, the
    group's integrity checked after every event); each request's token times."""
    import heapq

    from fleetserve.metrics.records import RequestRecord
    from fleetserve.sim.seq import Seq

    heap: list[tuple[float, int, int, Any]] = []  # (time, order, kind, payload)
    n = 0
    for r in reqs:
        heap.append(
            (
                r.arrival_s,
                n,
                0,
                Seq(r, RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens)),
            )
        )
        n += 1
    heapq.heapify(heap)
    tokens: dict[int, list[float]] = {r.id: [] for r in reqs}
    while heap:
        now, _, kind, x = heapq.heappop(heap)
        if kind == 0:
            started = g.enqueue(x, now)
        else:
            if g.stale(x):
                continue
            _, seqs, _, _ = g.jobs[x]
            for s in seqs:
                tokens[s.id].append(now)
            g.complete(x, now)
            started = g.schedule(now)
        for end, tok in started:
            heapq.heappush(heap, (end, n, 1, tok))
            n += 1
        g.check_integrity()
    assert g.idle
    return tokens


def test_a_pipelined_group_keeps_decoding_while_prompts_prefill() -> None:
    """Eight requests decode when four long prompts arrive: with prefill lanes
    the decode rounds go on beside the prompts' micro-batches (one per stage
    at most), so the decoders' longest gap between tokens is far shorter than
    when a prefill is a round of its own, the prompts still get their first
    token no later than about a round's share, and everything finishes."""
    decoders = [Request(i, "a", 0.001 * i, 200, 400) for i in range(8)]
    prompts = [Request(8 + i, "a", 1.0 + 0.0001 * i, 6000, 5) for i in range(4)]
    gaps, ttft = {}, {}
    for lanes in (False, True):
        toks = _drive(_pipelined_group(lanes), decoders + prompts)
        assert all(len(toks[r.id]) == r.output_tokens for r in decoders + prompts)
        gaps[lanes] = max(
            b - a for r in decoders for a, b in itertools.pairwise(toks[r.id]) if a > 1.0
        )
        ttft[lanes] = max(toks[r.id][0] - r.arrival_s for r in prompts)
    assert gaps[True] < 0.5 * gaps[False]
    assert ttft[True] < 1.5 * ttft[False]


@pytest.mark.parametrize("scheduler", ["fcfs", "rr", "mlfq", "db"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(
            st.floats(0, 3, allow_nan=False),
            st.sampled_from(["a", "b"]),
            st.integers(1, 3000),
            st.integers(1, 60),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_prefill_lanes_keep_every_invariant_under_every_temporal_scheduler(
    scheduler: str, reqs: list[tuple[float, str, int, int]]
) -> None:
    """Random requests of two services on a pipelined group with a small KV
    pool (preemptions happen): under each temporal scheduler, lanes and decode
    rounds keep the group's integrity after every event (every request in one
    place, the layout never over-committed, at most one lane per stage) and
    every request finishes with all its tokens."""
    rs = sorted(reqs)
    requests = [Request(i, m, t, p, o) for i, (t, m, p, o) in enumerate(rs)]
    g = _pipelined_group(True, scheduler, ("a", "b"), cap=3 * 2**30)
    toks = _drive(g, requests)
    assert all(len(toks[r.id]) == r.output_tokens for r in requests)
