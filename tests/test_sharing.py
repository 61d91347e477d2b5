"""Multi-LLM sharing groups: schedulers (FCFS, RR, MLFQ, DB, ADBS), the group
simulator and its invariants (every request ends exactly once, memory and
quotas never over-committed, every layout returns all blocks)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.policy.sharing import (
    BATCHING,
    DECODE,
    PREFILL,
    Adbs,
    DoublingBudget,
    ServiceStats,
    SkipJoinMlfq,
)
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.spec import get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

SCHEDULERS = ["fcfs", "rr", "mlfq", "db", "adbs"]
LAYOUTS = ["headwise", "merged", "partitioned"]


def services(*pairs: tuple[str, str, float]) -> dict[str, Service]:
    return {n: Service(n, get_model(m), rate, 256, 128) for n, m, rate in pairs}


def workload(
    rates: dict[str, float], seconds: float, seed: int, lens: dict[str, tuple[int, int]]
) -> list[Request]:
    rng = np.random.default_rng(seed)
    out: list[tuple[float, str, int, int]] = []
    for name, rate in rates.items():
        t = 0.0
        while True:
            t += rng.exponential(1 / rate)
            if t >= seconds:
                break
            p, o = lens[name]
            out.append((t, name, int(rng.integers(p // 2, p + 1)), int(rng.integers(1, o + 1))))
    out.sort()
    return [Request(i, m, a, p, o) for i, (a, m, p, o) in enumerate(out)]


def one_group(names: list[str], gpus: int = 1, tp: int = 1) -> PlacementPlan:
    return PlacementPlan((GroupPlacement(tuple(range(gpus)), tp, tuple(names)),), gpus)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_every_request_ends_once_and_memory_is_never_overcommitted(sched: str, layout: str) -> None:
    svc = services(("a", "llama-2-7b", 4.0), ("b", "llama-2-13b", 1.0))
    reqs = workload({"a": 4.0, "b": 1.0}, 20.0, 1, {"a": (512, 256), "b": (1024, 64)})
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=1,
        scheduler=sched,
        layout=layout,
        check_integrity=True,
        max_num_seqs=32,
    )
    sim = MultiSimulator(cfg, svc, one_group(["a", "b"]), reqs)
    res = sim.run()
    assert all(r.status == "finished" for r in res.records)
    assert all(r.generated == r.output_tokens for r in res.records)
    for g in sim.groups:  # every layout gives all memory back
        assert g.layout.used_bytes() == 0
        assert g.idle
        g.layout.check_integrity()
    for r in res.records:
        assert r.first_token_s is not None and r.finish_s is not None
        assert r.arrival_s <= r.first_token_s <= r.finish_s


def test_memory_pressure_preempts_and_still_finishes_everything() -> None:
    svc = services(("a", "llama-2-13b", 20.0), ("b", "llama-2-13b", 20.0))
    reqs = workload({"a": 20.0, "b": 20.0}, 4.0, 2, {"a": (2048, 512), "b": (2048, 512)})
    for sched in SCHEDULERS:
        cfg = MultiConfig(n_gpus=1, scheduler=sched, check_integrity=True, mem_util=0.8)
        sim = MultiSimulator(cfg, svc, one_group(["a", "b"]), reqs)
        res = sim.run()
        assert all(r.status == "finished" for r in res.records), sched
        assert sum(g.preemptions for g in sim.groups) > 0, sched


def test_adbs_runs_prefill_and_decodes_of_other_services_at_once() -> None:
    svc = services(("a", "llama-2-7b", 5.0), ("b", "llama-2-7b", 5.0))
    reqs = workload({"a": 5.0, "b": 5.0}, 10.0, 3, {"a": (512, 128), "b": (512, 128)})
    sim = MultiSimulator(
        MultiConfig(n_gpus=1, scheduler="adbs", check_integrity=True),
        svc,
        one_group(["a", "b"]),
        reqs,
    )
    seen = []
    g0 = None

    orig = sim._on_job_end

    def spy(g, token, now):  # type: ignore[no-untyped-def]
        nonlocal g0
        g0 = g
        seen.append({(j.model, j.phase) for j, _, _, _ in g.jobs.values()})
        orig(g, token, now)

    sim._on_job_end = spy  # type: ignore[method-assign]
    sim.run()
    assert any(len(s) >= 2 for s in seen)  # spatial: jobs overlap
    assert any(("a", PREFILL) in s and ("b", DECODE) in s for s in seen) or any(
        ("b", PREFILL) in s and ("a", DECODE) in s for s in seen
    )


def test_adbs_quotas_are_never_exceeded_and_adapt_to_use() -> None:
    # a is popular and fills its quota, b is rare: b's unused quota moves to a
    svc = services(("a", "llama-2-7b", 20.0), ("b", "llama-2-7b", 0.2))
    reqs = workload({"a": 20.0, "b": 0.2}, 30.0, 4, {"a": (2048, 512), "b": (64, 16)})
    sim = MultiSimulator(  # check_integrity checks used <= quota after every event
        MultiConfig(n_gpus=1, scheduler="adbs", check_integrity=True, mem_util=0.45),
        svc,
        one_group(["a", "b"]),
        reqs,
    )
    sched = sim.groups[0].scheduler
    assert isinstance(sched, Adbs)
    q0 = dict(sched.quota)
    history: list[dict[str, float]] = []
    adapt = sched.adapt

    def record(state):  # type: ignore[no-untyped-def]
        adapt(state)
        history.append(dict(sched.quota))
        for m in ("a", "b"):  # never below use, never below the floor
            assert sched.quota[m] >= state.kv_used(m)
            assert sched.quota[m] >= sched.floor * q0[m] - 1e-6

    sched.adapt = record  # type: ignore[method-assign]
    res = sim.run()
    assert all(r.status == "finished" for r in res.records)
    assert len(history) >= 5
    assert max(h["a"] for h in history) > q0["a"]  # a got b's unused quota
    assert min(h["b"] for h in history) < q0["b"]
    for h in history:
        assert sum(h.values()) == pytest.approx(sum(q0.values()))


def test_db_serves_the_short_service_first_and_doubles_budgets() -> None:
    stats = {
        "short": ServiceStats(1.0, 1.0, 0.0, 1),
        "long": ServiceStats(1.0, 10.0, 0.0, 1),
    }
    db = DoublingBudget()
    db.setup(stats, 1 << 30)

    class S:
        def __init__(self, i: int, model: str, t: float) -> None:
            self.id, self.model, self.arrival_s = i, model, t
            self.prompt_tokens, self.generated = 10, 0

    long_, short = S(0, "long", 0.0), S(1, "short", 1.0)
    db.on_arrival(long_, 0.0)
    db.on_arrival(short, 1.0)
    assert db.priority(short) == 1.0 * 1.0 and db.priority(long_) == 10.0 * 10.0
    assert db.priority(short) < db.priority(long_)  # the later, shorter one goes first
    # running 1.5 s uses up short's budget of 1.0: doubled to 2 * (1 + 0)
    db.on_job_end(None, [short], 1.5, 2.5)  # type: ignore[arg-type]
    assert db.priority(short) == 2.0 * 1.0


def test_mlfq_skip_joins_long_prompts_lower_and_demotes_after_quantum() -> None:
    stats = {"m": ServiceStats(1.0, 1.0, 0.0, 1, prefill_s_per_token=1e-3)}
    q = SkipJoinMlfq(q0_s=0.05)
    q.setup(stats, 1 << 30)

    class S:
        def __init__(self, i: int, p: int) -> None:
            self.id, self.model, self.arrival_s, self.prompt_tokens, self.generated = (
                i,
                "m",
                0.0,
                p,
                0,
            )

    short, long_ = S(0, 10), S(1, 1000)  # prefill 0.01 s vs 1 s
    q.on_arrival(short, 0.0)
    q.on_arrival(long_, 0.0)
    assert q._level[0] == 0 and q._level[1] == 5  # 0.05 * 2**5 = 1.6 >= 1.0
    q.on_job_end(None, [short], 0.06, 0.1)  # type: ignore[arg-type]
    assert q._level[0] == 1


def test_fcfs_with_one_service_serves_in_arrival_order() -> None:
    svc = services(("a", "llama-2-7b", 2.0))
    reqs = [Request(i, "a", 0.01 * i, 128, 16) for i in range(20)]
    res = MultiSimulator(
        MultiConfig(n_gpus=1, scheduler="fcfs", check_integrity=True), svc, one_group(["a"]), reqs
    ).run()
    firsts = [r.first_token_s for r in res.records]
    assert firsts == sorted(firsts)  # type: ignore[type-var]


def test_replicas_split_a_service_and_unknown_names_are_clear_errors() -> None:
    svc = services(("a", "llama-2-7b", 8.0))
    plan = PlacementPlan((GroupPlacement((0, 1), 1, ("a",)),), 2)
    reqs = workload({"a": 8.0}, 5.0, 5, {"a": (256, 64)})
    sim = MultiSimulator(MultiConfig(n_gpus=2, check_integrity=True), svc, plan, reqs)
    res = sim.run()
    assert len(sim.groups) == 2
    used = {r.instance for r in res.records}
    assert used == {0, 1}
    with pytest.raises(Exception, match="batching policy"):
        MultiSimulator(MultiConfig(n_gpus=2, scheduler="nope"), svc, plan, reqs)
    assert set(SCHEDULERS) <= set(BATCHING.names())


def test_weights_that_leave_no_kv_room_are_a_config_error() -> None:
    svc = services(("a", "llama-2-70b", 1.0), ("b", "llama-2-13b", 1.0))
    with pytest.raises(Exception, match="leave no KV memory"):
        MultiSimulator(MultiConfig(n_gpus=2), svc, one_group(["a", "b"], gpus=2, tp=2), [])


@pytest.mark.parametrize("heavy", [False, True])
@pytest.mark.parametrize("sched", ["fcfs", "rr", "mlfq", "db"])
def test_macro_steps_give_the_same_results_as_step_by_step(sched: str, heavy: bool) -> None:
    """A lone decode batch advanced many iterations at once (truncated by
    arrivals) gives the records of an iteration-by-iteration run."""
    if heavy:  # three services, queues, DB budgets running out and starvation
        svc = services(("a", "llama-2-7b", 3), ("b", "llama-2-13b", 1), ("c", "opt-6.7b", 1))
        rates = {"a": 3.0, "b": 1.0, "c": 1.0}
        lens = {"a": (1024, 400), "b": (2048, 300), "c": (256, 600)}
        reqs = workload(rates, 20.0, 9, lens)
    else:
        svc = services(("a", "llama-2-7b", 1.5), ("b", "llama-2-13b", 0.5))
        reqs = workload({"a": 1.5, "b": 0.5}, 30.0, 7, {"a": (512, 400), "b": (256, 300)})
    runs = []
    for macro in (False, True):
        cfg = MultiConfig(
            n_gpus=1, scheduler=sched, macro_steps=macro, check_integrity=True, mem_util=0.75
        )
        sim = MultiSimulator(cfg, svc, one_group(sorted(svc)), reqs)
        res = sim.run()
        runs.append((res, sim.n_events))
    (slow, n_slow), (fast, n_fast) = runs
    assert n_fast <= n_slow
    for a, b in zip(slow.records, fast.records, strict=True):
        assert (a.status, a.generated, a.preemptions) == (b.status, b.generated, b.preemptions)
        assert a.first_token_s == pytest.approx(b.first_token_s, rel=1e-12, abs=1e-12)
        assert a.finish_s == pytest.approx(b.finish_s, rel=1e-12, abs=1e-12)
    # the samples are taken as of their time (a macro job's KV allocated ahead
    # not counted): the same with and without macro steps
    for col in ("kv_used_bytes", "kv_demand_bytes", "queued", "running"):
        assert getattr(slow.timeseries, col) == getattr(fast.timeseries, col), col
    assert slow.extra["kv_layout"] == fast.extra["kv_layout"]


def test_macro_steps_skip_most_iterations_of_a_lone_batch() -> None:
    svc = services(("a", "llama-2-7b", 0.5))
    reqs = workload({"a": 0.5}, 30.0, 8, {"a": (256, 500)})
    n = []
    for macro in (False, True):
        sim = MultiSimulator(MultiConfig(n_gpus=1, macro_steps=macro), svc, one_group(["a"]), reqs)
        sim.run()
        n.append(sim.n_events)
    assert n[1] < n[0] / 5


# --- DB: the fast scans and deferred job ends equal the plain loops ----------


class _PlainDb:
    """DB as the request-by-request loops of SeaLLM's Algorithm 2 compute it
    (what :class:`DoublingBudget` must equal exactly, floats included)."""

    def __init__(self, stats: dict[str, ServiceStats], scale: float = 5.0) -> None:
        self.stats = stats
        self.limit = {m: scale * st.exec_mean_s for m, st in stats.items()}
        self.budget: dict[int, float] = {}
        self.renewals: dict[int, int] = {}
        self.served: dict[int, float] = {}

    def on_arrival(self, s: _Seq, now: float) -> None:
        st = self.stats[s.model]
        self.budget[s.id] = st.exec_mean_s + st.exec_std_s
        self.renewals[s.id] = 0
        self.served[s.id] = now

    def key(self, s: _Seq) -> tuple[float, float, int]:
        st = self.stats[s.model]
        q = self.budget.get(s.id, st.exec_mean_s + st.exec_std_s)
        return (q * st.exec_mean_s, s.arrival_s, s.id)

    def on_job_end(self, seqs: list[_Seq], d: float, now: float) -> None:
        for s in seqs:
            st = self.stats[s.model]
            left = self.budget.get(s.id, 0.0) - d
            if left <= 0.0:
                k = self.renewals.get(s.id, 0) + 1
                self.renewals[s.id] = k
                left = (2**k) * (st.exec_mean_s + st.exec_std_s)
            self.budget[s.id] = left
            self.served[s.id] = now

    def on_finish(self, s: _Seq) -> None:
        for d in (self.budget, self.renewals, self.served):
            d.pop(s.id, None)

    def schedule(self, state: _State, fits: set[int], now: float) -> tuple[object, ...]:
        best = worst = None
        for m in state.models:
            for phase, seqs in ((PREFILL, state.waiting(m)), (DECODE, state.ready(m))):
                for s in seqs:
                    k = self.key(s)
                    if best is None or k < best[0]:
                        best = (k, m, phase)
                    over = now - self.served.get(s.id, s.arrival_s) - self.limit[m]
                    if over > 0 and (worst is None or over > worst[0]):
                        worst = (over, m, phase)
        if best is None:
            return ()
        m, phase = (worst[1], worst[2]) if worst is not None else (best[1], best[2])
        if phase == PREFILL:
            got = []
            for s in sorted(state.waiting(m), key=self.key):
                if s.id not in fits:
                    break
                got.append(s.id)
            if got:
                return (m, PREFILL, tuple(got))
            cands = [(self.key(s), mm) for mm in state.models for s in state.ready(mm)]
            if not cands:
                return ()
            _, m = min(cands)
        return (m, DECODE, tuple(s.id for s in sorted(state.ready(m), key=self.key)))

    def stable(self, state: _State, batch: list[_Seq], ends: list[float], now: float) -> int:
        from bisect import bisect_left, bisect_right

        n = len(ends)
        if n <= 1:
            return n
        inside = {s.id for s in batch}
        every = [s for m in state.models for q in (state.waiting(m), state.ready(m)) for s in q]
        best = min((self.key(s) for s in every), default=None)
        if best is None or best[2] not in inside:
            return 1
        cum = [t - now for t in ends]
        k = n
        for s in batch:
            if s.id not in self.budget:
                return 1
            k = min(k, bisect_left(cum, self.budget[s.id]) + 1)
        t_starve = min(
            (
                self.served.get(s.id, s.arrival_s) + self.limit[s.model]
                for s in every
                if s.id not in inside
            ),
            default=math.inf,
        )
        if t_starve < math.inf:
            k = min(k, max(1, bisect_right([now, *ends[:-1]], t_starve)))
        return max(1, min(k, n))


class _Seq:
    def __init__(self, i: int, model: str, t: float) -> None:
        self.id, self.model, self.arrival_s = i, model, t
        self.prompt_tokens, self.generated = 100, 0


class _State:
    def __init__(self, models: list[str]) -> None:
        self.models = models
        self.queued: dict[str, list[_Seq]] = {m: [] for m in models}
        self.running: dict[str, list[_Seq]] = {m: [] for m in models}

    def waiting(self, m: str) -> list[_Seq]:
        return self.queued[m]

    def ready(self, m: str) -> list[_Seq]:
        return list(self.running[m])


class _Budget:
    def __init__(self, fits: set[int]) -> None:
        self.ok = fits
        self.taken: list[int] = []

    def fits(self, s: _Seq) -> bool:
        return s.id in self.ok

    def take(self, s: _Seq) -> None:
        self.taken.append(s.id)


@pytest.mark.parametrize("seed", range(12))
def test_db_fast_paths_equal_the_plain_loops(seed: int) -> None:
    """Random arrivals, prefills, decode steps (one at a time and as macro
    runs), finishes and preemptions on a fake group: DB's jobs, stable
    iterations, victims and priorities equal the plain per-request loops'."""
    rng = np.random.default_rng(seed)
    models = ["a", "b", "c"][: 1 + seed % 3]
    stats = {
        m: ServiceStats(1.0, float(rng.uniform(0.2, 3.0)), float(rng.uniform(0, 1)), 1)
        for m in models
    }
    db, ref = DoublingBudget(), _PlainDb(stats)
    db.setup(stats, 1 << 30)
    state = _State(models)
    now, nid = 0.0, 0
    tick = (0.3, 0.03, 0.003, 0.05)[seed % 4]  # from starving to never starving
    for _ in range(400):
        now += float(rng.exponential(tick))
        op = rng.random()
        if op < 0.25:  # arrival
            s = _Seq(nid, models[int(rng.integers(len(models)))], now)
            nid += 1
            state.queued[s.model].append(s)
            db.on_arrival(s, now)
            ref.on_arrival(s, now)
        elif op < 0.35:  # a prefill of some queued requests
            m = models[int(rng.integers(len(models)))]
            q = state.queued[m]
            took = [s for s in q if rng.random() < 0.5]
            for s in took:
                q.remove(s)
                state.running[m].append(s)
            d = float(rng.exponential(0.5))
            db.on_job_end(None, took, d, now)  # type: ignore[arg-type]
            ref.on_job_end(took, d, now)
        elif op < 0.75:  # decode steps of one service's running requests
            m = models[int(rng.integers(len(models)))]
            batch = list(state.running[m])
            steps = [float(x) for x in rng.exponential(tick, int(rng.integers(1, 40)))]
            if rng.random() < 0.5:
                for d in steps:
                    now += d
                    db.on_job_end(None, batch, d, now)  # type: ignore[arg-type]
                    ref.on_job_end(batch, d, now)
            else:  # the batch form: ends of consecutive iterations
                ends = list(np.cumsum([now, *steps])[1:])
                db.on_job_ends(None, batch, ends, now)  # type: ignore[arg-type]
                prev = now
                for t in ends:
                    ref.on_job_end(batch, float(t) - prev, float(t))
                    prev = float(t)
                now = float(ends[-1])
        elif op < 0.85:  # a finish
            m = models[int(rng.integers(len(models)))]
            if state.running[m]:
                s = state.running[m].pop(int(rng.integers(len(state.running[m]))))
                db.on_finish(s)
                ref.on_finish(s)
        else:  # a preemption: DB names the victim, it goes back to the queue head
            m = models[int(rng.integers(len(models)))]
            if state.running[m]:
                v = db.victim(state, m, state.running[m])  # type: ignore[arg-type]
                assert v is max(state.running[m], key=ref.key)
                state.running[m].remove(v)  # type: ignore[arg-type]
                state.queued[m].insert(0, v)  # type: ignore[arg-type]
        fits = {s.id for q in state.queued.values() for s in q if rng.random() < 0.6}
        budget = _Budget(fits)
        jobs = db.schedule(state, budget, now)  # type: ignore[arg-type]
        want = ref.schedule(state, fits, now)
        got = (jobs[0].model, jobs[0].phase, jobs[0].seqs) if jobs else ()
        assert got == want
        if want and want[1] == PREFILL:
            assert tuple(budget.taken) == want[2]
        if want and want[1] == DECODE:
            m = str(want[0])
            batch = list(state.running[m])
            ends = list(np.cumsum([now, *rng.exponential(tick / 5, int(rng.integers(1, 60)))])[1:])
            assert db.stable_iterations(state, m, batch, ends, now) == ref.stable(  # type: ignore[arg-type]
                state, batch, ends, now
            )
        for q in (*state.queued.values(), *state.running.values()):
            for s in q:
                assert db.priority(s) == ref.key(s)[0]  # type: ignore[arg-type]
