"""The engine runs every catalog group scheduler (FCFS, RR, MLFQ, DB, ADBS) as a
sharing group of several models: each step runs the jobs the scheduler names,
with the requests it admitted and the victims it chose, and reports each job's
measured duration; greedy outputs equal the default engine's (CPU)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from fleetserve.errors import ConfigError  # noqa: E402
from fleetserve.policy.sharing import (  # noqa: E402
    BATCHING,
    DECODE,
    PREFILL,
    GroupScheduler,
    Job,
    ServiceStats,
)
from fleetserve.runtime.engine.engine import Engine  # noqa: E402
from fleetserve.runtime.engine.model import layer_numel  # noqa: E402
from fleetserve.runtime.engine.sampling import SamplingParams  # noqa: E402
from fleetserve.runtime.engine.weights import load_weight_source  # noqa: E402

A, B = "tiny-llama-a", "tiny-llama-b"
MiB = 1 << 20
SCHEDULERS = BATCHING.names()


def stats() -> dict[str, ServiceStats]:
    out = {}
    for m in (A, B):
        spec = load_weight_source(m).cfg.spec
        out[m] = ServiceStats(
            rate=1.0,
            exec_mean_s=0.04,
            exec_std_s=0.01,
            kv_bytes_per_token=spec.kv_bytes_per_token,
            prefill_s_per_token=2e-4,
        )
    return out


class Clock:
    """A deterministic clock: every reading is 1 ms after the last."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def weights_bytes(*models: str) -> int:
    e = Engine([A], 64 * MiB)
    per = [
        e.pool.region_pages(layer_numel(load_weight_source(m).cfg))
        * load_weight_source(m).cfg.spec.num_layers
        for m in models
    ]
    return sum(per) * e.pool.page_bytes


def fits_arena(eng: Engine, model: str, prompt: str) -> bool:
    """Whether the engine takes ``prompt`` (its tokens, BOS included, plus the
    next one fit the arena's KV pages; a longer one is refused at once)."""
    n = len(eng.tokenizer(model).encode(prompt))
    need = eng.pool.pages_per_token_block(model) * -(-(n + 1) // eng.pool.block_size)
    return need <= eng.pool.num_pages - eng.pool.weight_pages()


def spy(name: str) -> GroupScheduler:
    """The catalog's scheduler ``name``, recording what the engine tells it."""
    base = type(BATCHING.get(name)())

    class Spy(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.jobs: list[Job] = []
            self.ends: list[tuple[Job, tuple[int, ...], float, float]] = []
            self.arrived: list[int] = []
            self.left: list[int] = []

        def schedule(self, state: Any, budget: Any, now: float) -> list[Job]:
            got = super().schedule(state, budget, now)
            self.jobs += got
            return got

        def on_arrival(self, seq: Any, now: float) -> None:
            self.arrived.append(seq.id)
            super().on_arrival(seq, now)

        def on_job_end(self, job: Job, seqs: Any, duration_s: float, now: float) -> None:
            self.ends.append((job, tuple(s.id for s in seqs), duration_s, now))
            super().on_job_end(job, seqs, duration_s, now)

        def on_finish(self, seq: Any) -> None:
            self.left.append(seq.id)
            super().on_finish(seq)

    return Spy()


WORK = [(A, "Hello world", 12), (B, "The quick brown fox", 9), (A, "a", 15), (B, "xyz " * 6, 7)]
WORK += [(B, "Paged attention", 11), (A, "one arena, two models", 6)]


def run(eng: Engine, work: list[tuple[str, str, int]], stagger: bool = True) -> dict[int, Any]:
    """Run ``work`` (one request added per step when staggered) to the end,
    checking the engine's invariants after every step; the finished requests."""
    rids, pending, done = [], list(work), {}
    for _ in range(5000):
        while pending and (not stagger or not rids or len(rids) <= eng.steps):
            m, p, n = pending.pop(0)
            rids.append(eng.add_request(m, p, SamplingParams(max_tokens=n, ignore_eos=True)))
            if stagger:
                break
        if not pending and not eng.has_work():
            break
        eng.step()
        eng.check_integrity()
        if eng.group is not None:  # quotas hold, but for one request alone past one
            for m in eng.models:
                used, holders = eng.kv_use(m)
                assert used <= eng.group.kv_limit(m) or holders == 1, "a KV quota was exceeded"
    for r in rids:
        done[r] = eng.pop_finished(r)
    return done


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy outputs of the default engine (FCFS over both models, ample memory)."""
    eng = Engine([A, B], weights_bytes(A, B) + 8 * MiB)
    done = run(eng, WORK)
    return [done[r].output_ids for r in sorted(done)]


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("kv_mib", [8.0, 0.25])
def test_every_scheduler_runs_its_jobs_and_outputs_are_exact(
    name: str, kv_mib: float, reference: list[list[int]]
) -> None:
    sched = spy(name)
    clock = Clock()
    eng = Engine(
        [A, B],
        weights_bytes(A, B) + int(kv_mib * MiB),
        batching=sched,
        services=stats(),
        clock=clock,
    )
    forwards: list[Any] = []

    # step by step: each step's forwards are exactly the non-empty jobs named
    orig_step = eng.step

    def step() -> Any:
        n_jobs = len(sched.jobs)
        out = orig_step()
        named = sched.jobs[n_jobs:]
        forwards.append((named, out.forwards, out.preempted))
        return out

    eng.step = step  # type: ignore[method-assign]
    done = run(eng, WORK)
    assert [done[r].output_ids for r in sorted(done)] == reference
    assert all(done[r].finish_reason == "length" for r in done)
    for named, fwd, preempted in forwards:
        # one forward per job, in order, but for a decode job that lost every
        # request to victims
        it = iter(fwd)
        for job in named:
            if job.phase == PREFILL:
                f = next(it)
                assert (f.model, len(f.chunks), f.decode_batch) == (job.model, len(job.seqs), 0)
            else:
                left = [r for r in job.seqs if r not in preempted]
                if left:
                    f = next(it)
                    assert (f.model, f.chunks, f.decode_batch) == (job.model, (), len(left))
        assert next(it, None) is None
        if not sched.spatial:
            assert len(named) <= 1  # temporal sharing: one job at a time
    # every request arrived once and left once; every job end was reported
    # with the clock's duration (the engine reads it before and after a job)
    assert sorted(sched.arrived) == sorted(done) == sorted(sched.left)
    assert sched.ends and all(abs(d - 0.001) < 1e-12 for _, _, d, _ in sched.ends)
    PREEMPTED[(name, kv_mib)] = sum(len(p) for _, _, p in forwards)


PREEMPTED: dict[tuple[str, float], int] = {}


def test_the_small_arena_made_the_schedulers_preempt() -> None:
    """The runs above exercised victims: some scheduler preempted on the
    small arena (none on the large one)."""
    if len(PREEMPTED) < 2 * len(SCHEDULERS):
        pytest.skip("needs the whole parametrized test above in this session")
    print(PREEMPTED)
    assert sum(n for (_, kv), n in PREEMPTED.items() if kv < 1) > 0
    assert sum(n for (_, kv), n in PREEMPTED.items() if kv >= 1) == 0


def test_a_scheduler_that_reads_statistics_needs_them() -> None:
    for name in ("mlfq", "db", "adbs"):
        with pytest.raises(ConfigError, match="statistics"):
            Engine([A, B], weights_bytes(A, B) + MiB, batching=BATCHING.get(name)())
    Engine([A, B], weights_bytes(A, B) + MiB, batching=BATCHING.get("rr")())  # reads none


def test_db_serves_the_service_with_the_shorter_requests_first() -> None:
    """SeaLLM's DB: at equal budgets, the service with the smaller L̂_s has the
    smaller priority O_r = Q_r · L̂_s, so its queue is served first; FCFS
    serves arrival order."""
    st_ = stats()
    st_[A] = ServiceStats(1.0, 0.01, 0.0, st_[A].kv_bytes_per_token, 2e-4)
    st_[B] = ServiceStats(1.0, 1.00, 0.0, st_[B].kv_bytes_per_token, 2e-4)
    first = {}
    for name in ("fcfs", "db"):
        sched = spy(name)
        eng = Engine(
            [A, B],
            weights_bytes(A, B) + 8 * MiB,
            batching=sched,
            services=st_,
            clock=Clock(),
        )
        run(eng, [(B, "first in", 3), (A, "second in", 3)], stagger=False)
        first[name] = sched.jobs[0].model
    assert first == {"fcfs": B, "db": A}


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# found in session 28: round-robin tried B's head (which no longer fit the
# arena) first, and the job budget then took it as the job's model, so A's
# head, which fit, was never admitted: the engine stepped without a job for ever
@example(
    name="rr",
    kv_kib=256,
    work=[(A, 1, 1), (A, 1, 1), (A, 31, 2), (B, 21, 12), (A, 15, 2)],
    stagger=False,
)
@given(
    name=st.sampled_from(SCHEDULERS),
    kv_kib=st.integers(96, 2048),
    work=st.lists(
        st.tuples(st.sampled_from([A, B]), st.integers(1, 40), st.integers(1, 12)),
        min_size=1,
        max_size=8,
    ),
    stagger=st.booleans(),
)
def test_any_mix_ends_every_request_once_within_memory_and_quotas(
    name: str, kv_kib: int, work: list[tuple[str, int, int]], stagger: bool
) -> None:
    """Random requests of both models under a random scheduler and arena:
    the engine's invariants and the quotas hold after every step, every
    request ends exactly once (``length`` or ``capacity``), and the scheduler
    hears of each arrival and departure once."""
    sched = spy(name)
    eng = Engine(
        [A, B],
        weights_bytes(A, B) + kv_kib * 1024,
        batching=sched,
        services=stats(),
        clock=Clock(),
    )
    # requests whose prompt fits the arena (longer ones are refused at once)
    items = [(m, "x" * n, k) for m, n, k in work if fits_arena(eng, m, "x" * n)]
    if not items:
        return
    done = run(eng, items, stagger)
    assert len(done) == len(items)
    assert all(r.finish_reason in ("length", "capacity") for r in done.values())
    assert sorted(sched.arrived) == sorted(done) == sorted(sched.left)
    assert eng.pool.kv_pages == 0 and not eng.has_work()
    assert all(j.phase in (PREFILL, DECODE) for j in sched.jobs)


# ------------------------------------------------------------ chunked prefill


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(4, 40),
    work=st.lists(
        st.tuples(st.sampled_from([A, B]), st.integers(1, 90), st.integers(1, 8)),
        min_size=1,
        max_size=6,
    ),
    kv_mib=st.sampled_from([0.3, 4.0]),
    batching=st.sampled_from([None, "fcfs", "rr"]),
)
def test_chunked_prefill_gives_the_same_tokens_within_the_token_budget(
    budget: int, work: list[tuple[str, int, int]], kv_mib: float, batching: str | None
) -> None:
    """Chunked prefill (one model or two, prompts longer than the step's token
    budget, a small arena that preempts; the engine's own step or a group
    scheduler's mixed jobs, FCFS or RR): every step stays within
    ``max_batch_tokens``, partly prefilled prompts sample nothing, and every
    request's tokens equal the unchunked engine's."""
    eng = Engine(
        [A, B],
        weights_bytes(A, B) + int(kv_mib * MiB),
        max_batch_tokens=budget,
        chunked_prefill=True,
        batching=BATCHING.get(batching)() if batching else None,
    )
    texts = [(m, "".join(chr(97 + (i * 7 + n) % 26) for i in range(n)), k) for m, n, k in work]
    items = [(m, p, k) for m, p, k in texts if fits_arena(eng, m, p)]
    ref = run(Engine([A, B], weights_bytes(A, B) + 8 * MiB), items)
    seen_chunks: list[tuple[int, int]] = []
    orig = eng.step

    def step() -> Any:
        out = orig()
        for f in out.forwards:
            assert sum(n for n, _ in f.chunks) + f.decode_batch <= budget
            seen_chunks.extend(f.chunks)
        for rid in out.tokens:  # a request sampled: its prompt is cached in full
            r = eng.requests[rid]
            assert r.n_cached == len(r.tokens) - 1
        return out

    eng.step = step  # type: ignore[method-assign]
    got = run(eng, items)
    finished = [r for r in ref.values() if r.finish_reason == "length"]
    assert len(finished) == len(ref)  # the reference had room for every request
    for rid, r in got.items():  # a request the small arena could not hold ends "capacity"
        assert r.finish_reason in ("length", "capacity")
        n = len(r.output_ids)
        assert r.output_ids == ref[rid].output_ids[:n] and (n == len(ref[rid].output_ids)) == (
            r.finish_reason == "length"
        )
    if any(len(p) > budget for _, p, _ in items):
        assert any(c > 0 for _, c in seen_chunks)  # a long prompt ran in chunks


@pytest.mark.parametrize("name", ["mlfq", "db", "adbs"])
def test_group_schedulers_with_whole_prefill_jobs_refuse_chunked_prefill(name: str) -> None:
    with pytest.raises(ConfigError, match="chunked_prefill"):
        Engine(
            [A, B],
            weights_bytes(A, B) + MiB,
            batching=BATCHING.get(name)(),
            services=stats(),
            chunked_prefill=True,
        )


def test_a_prompt_longer_than_the_token_budget_needs_chunked_prefill() -> None:
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        Engine([A], 64 * MiB, max_batch_tokens=8).add_request(A, [1] * 9)
    eng = Engine([A], 64 * MiB, max_batch_tokens=8, chunked_prefill=True)
    rid = eng.add_request(A, [1] * 30, SamplingParams(max_tokens=3, ignore_eos=True))
    steps = []
    while eng.has_work():
        steps.append(eng.step().forwards[0].chunks)
        eng.check_integrity()
    assert steps[:4] == [((8, 0),), ((8, 8),), ((8, 16),), ((6, 24),)]
    assert len(eng.pop_finished(rid).output_ids) == 3


# ---------------------------------------------------------------- sleep / wake


def test_an_idle_engine_sleeps_without_weights_or_arena_and_wakes_exact() -> None:
    """An inactive worker of an elastic pool holds no memory: sleep gives back
    the arena and every weight; wake loads them again (timed) and the engine
    serves the same tokens as before."""
    eng = Engine([A, B], weights_bytes(A, B) + 2 * MiB)
    before = run(eng, WORK[:3])
    with pytest.raises(ValueError, match="allocated"):
        eng.pool.acquire_arena()
    arena = eng.pool.arena.numel() * eng.pool.arena.element_size()
    freed = eng.sleep()
    assert eng.asleep and freed > arena and eng.pool.released
    assert eng.pool.arena.numel() == 0 and eng.pool.weight_pages() == 0
    assert all(m.embed.numel() == 0 and not m.layers for m in eng.models.values())
    with pytest.raises(ConfigError, match="asleep"):
        eng.add_request(A, "x")
    assert eng.sleep() == 0  # already asleep
    took = eng.wake()
    assert took > 0 and not eng.asleep and eng.wake() == 0.0
    eng.check_integrity()
    after = run(eng, WORK[:3])
    assert [r.output_ids for r in after.values()] == [r.output_ids for r in before.values()]
    eng.add_request(A, "busy")
    with pytest.raises(ValueError, match="idle"):
        eng.sleep()


# ------------------------------------------------------------- prefix caching

DOC = "The paged arena holds the weights and KV of every hosted model. " * 3


def test_a_shared_prefix_is_read_from_cached_blocks_with_the_same_tokens() -> None:
    """A prompt that starts with another's blocks reuses their KV (not
    recomputed: the forward starts past them) and its tokens equal an
    engine's without caching; blocks outlive their requests, shared while
    both run, and are counted by reference (integrity after every step)."""
    work = [(A, DOC + "first question", 6), (A, DOC + "second one", 6), (B, DOC + "x", 4)]
    ref = run(Engine([A, B], weights_bytes(A, B) + 4 * MiB), work, stagger=False)
    eng = Engine([A, B], weights_bytes(A, B) + 4 * MiB, prefix_caching=True)
    first = run(eng, work[:1])
    cached = eng.pool.cached_blocks
    n_tok = len(eng.tokenizer(A).encode(DOC + "first question"))  # BOS included
    assert cached == n_tok // 16 and eng.prefix_hits == 0
    assert eng.pool.evictable_pages == eng.pool.num_pages - eng.pool.num_free - (
        eng.pool.weight_pages()
    )  # nothing references them now: all evictable
    forwards: list[Any] = []
    orig = eng.step

    def step() -> Any:
        out = orig()
        forwards.extend(out.forwards)
        return out

    eng.step = step  # type: ignore[method-assign]
    rest = run(eng, work[1:], stagger=False)
    got = [first[0].output_ids] + [rest[r].output_ids for r in sorted(rest)]
    assert got == [ref[r].output_ids for r in sorted(ref)]
    enc = eng.tokenizer(A).encode
    shared = len(enc(DOC)) // 16  # full blocks of the common text
    assert eng.prefix_hits == shared * 16  # model B's blocks are its own: no hit
    a_pre = next(f for f in forwards if f.model == A and f.chunks)
    assert a_pre.chunks == ((len(enc(DOC + "second one")) - shared * 16, shared * 16),)


def test_prefix_caching_keeps_the_invariants_and_tokens_under_eviction() -> None:
    """A small arena: cached blocks are evicted when pages are needed,
    requests are preempted and re-admitted through the cache, and every
    request still gets the tokens of an engine without caching."""
    texts = [DOC, DOC[::-1], DOC.upper()]
    work = [(A, texts[i % 3][: 40 + 11 * i] + str(i), 8) for i in range(9)]
    ref = run(Engine([A], weights_bytes(A) + 4 * MiB), work)
    eng = Engine([A], weights_bytes(A) + int(0.7 * MiB), prefix_caching=True, max_running=4)
    got = run(eng, work)
    assert [got[r].output_ids for r in sorted(got)] == [ref[r].output_ids for r in sorted(ref)]
    assert eng.prefix_hits > 0 and eng.pool.evictions > 0
    eng.check_integrity()
    assert eng.pool.num_available == eng.pool.num_pages - eng.pool.weight_pages()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    work=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 70), st.integers(1, 6)),
        min_size=1,
        max_size=7,
    ),
    kv_mib=st.sampled_from([0.35, 4.0]),
    chunked=st.booleans(),
)
def test_prefix_caching_gives_the_same_tokens_on_any_mix(
    work: list[tuple[int, int, int]], kv_mib: float, chunked: bool
) -> None:
    """Prompts cut from four shared texts at random lengths, a roomy or a
    small arena, chunked prefill or not: the pool's invariants hold after
    every step and each request's tokens equal the uncached engine's."""
    texts = [DOC, DOC[::-1], DOC.upper(), "zz" + DOC]
    eng = Engine(
        [A], weights_bytes(A) + int(kv_mib * MiB), prefix_caching=True, chunked_prefill=chunked
    )
    kv_pages = eng.pool.num_pages - eng.pool.weight_pages()
    per = eng.pool.pages_per_token_block(A)
    items = [(A, texts[t][:n], k) for t, n, k in work if per * -(-(n + k + 1) // 16) <= kv_pages]
    ref = run(Engine([A], weights_bytes(A) + 4 * MiB), items)
    got = run(eng, items)
    for rid, r in got.items():
        assert r.finish_reason == "length" and r.output_ids == ref[rid].output_ids


def test_a_live_engine_loads_and_unloads_models_for_a_re_placement(
    reference: list[list[int]],
) -> None:
    """SeaLLM's re-placement on a live engine: a model is loaded beside the
    one served (its weights take arena pages, the group scheduler gets both
    services), serves exactly as if it had been there from the start, and a
    model without requests is unloaded (its pages join the KV pool, its
    cached prefix blocks are given back)."""
    eng = Engine(
        [A],
        weights_bytes(A, B) + 8 * MiB,
        batching=BATCHING.get("db")(),
        services=stats(),
        clock=Clock(),
        prefix_caching=True,
    )
    free_a = eng.pool.num_pages - eng.pool.weight_pages()
    rid = eng.add_request(A, "Hello world", SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()
    took = eng.load_model(B, stats())
    assert took > 0 and set(eng.models) == {A, B}
    assert set(eng.group.services) == {A, B}  # type: ignore[union-attr]
    assert eng.pool.num_pages - eng.pool.weight_pages() < free_a
    with pytest.raises(ConfigError, match="loaded twice"):
        eng.load_model(B, stats())
    done = run(eng, WORK)
    first = eng.pop_finished(rid)
    assert first.output_ids == reference[0]
    assert [d.output_ids for d in done.values()] == reference
    assert eng.pool.cached_blocks > 0  # both models published blocks
    busy = eng.add_request(A, "still running", SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="still has requests"):
        eng.unload_model(A, stats())
    while eng.has_work():
        eng.step()
    eng.pop_finished(busy)
    freed = eng.unload_model(A, stats())
    assert freed > 0 and set(eng.models) == {B}
    assert set(eng.group.services) == {B}  # type: ignore[union-attr]
    assert all(k[0] == B for k in eng.pool._cache)  # A's cached blocks are gone
    eng.check_integrity()
    with pytest.raises(ConfigError, match="unknown model"):
        eng.add_request(A, "gone", SamplingParams(max_tokens=2))
    one = Engine([A], 64 * MiB)  # one-model batching hosts one model
    with pytest.raises(ConfigError, match="one-model batching"):
        one.load_model(B)


@pytest.mark.parametrize("batching", [None, "fcfs"])
def test_the_admission_watermark_keeps_pages_free(batching: str | None) -> None:
    """``watermark`` (``engine.watermark``, which ``serve`` passes): a prompt is
    admitted only while that share of the arena's KV pages stays free after
    it; a prompt that could never be admitted so is refused at once; the
    tokens are those of an engine without a watermark."""
    kv = 4 * MiB
    eng = Engine(
        [A, B],
        weights_bytes(A, B) + kv,
        watermark=0.3,
        batching=BATCHING.get(batching)() if batching else None,
    )
    total = eng.pool.num_pages - eng.pool.weight_pages()
    wm = eng.watermark_pages()
    assert wm == int(0.3 * total) > 0
    seen: list[int] = []
    orig = eng.step

    def step() -> Any:
        before = {r.id for r in eng.waiting}
        out = orig()
        if before - {r.id for r in eng.waiting}:  # it admitted: the watermark is still free
            seen.append(eng.pool.num_available)
        return out

    eng.step = step  # type: ignore[method-assign]
    work = [
        (m, "".join(chr(97 + (i * 5 + k) % 26) for i in range(300)), 6)
        for k, m in enumerate([A, B, A, B, A, B])
    ]
    got = run(eng, work)
    ref = run(Engine([A, B], weights_bytes(A, B) + kv), work)
    assert [r.output_ids for r in got.values()] == [r.output_ids for r in ref.values()]
    assert seen and all(free >= wm for free in seen)
    with pytest.raises(ConfigError, match="watermark"):  # fits the arena, not above the mark
        n_ok = (total - wm) // eng.pool.pages_per_token_block(A) * eng.pool.block_size
        eng.add_request(A, [1] * (n_ok + eng.pool.block_size), SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="watermark"):
        Engine([A], 64 * MiB, watermark=1.0)
