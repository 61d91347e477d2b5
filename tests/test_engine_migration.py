"""Request migration between engines: KV export/import with reservations, live
multi-stage, blocking and token migration (CPU).

The key property (issue item 5): a request migrated mid-generation, in any
mode, yields exactly the tokens of an unmigrated run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fleetserve.runtime.engine.engine import Engine, EngineRequest  # noqa: E402
from fleetserve.runtime.engine.kvpool import PoolFull  # noqa: E402
from fleetserve.runtime.engine.migration import (  # noqa: E402
    MigrationStats,
    migrate_blocking,
    migrate_live,
    migrate_tokens,
)
from fleetserve.runtime.engine.sampling import SamplingParams  # noqa: E402
from fleetserve.runtime.engine.weights import WeightSource, load_weight_source  # noqa: E402

A, B = "tiny-llama-a", "tiny-llama-b"
MiB = 1 << 20
BS = 4
PROMPTS = ["Hello world", "The quick brown fox jumps", "a", "Paged attention shares one arena"]
BACKGROUND = ["Some other request", "xyz"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
MODES: dict[str, Callable[[Engine, Engine, int], MigrationStats]] = {
    "blocking": migrate_blocking,
    "live": migrate_live,
    "tokens": migrate_tokens,
}


class _Cached(WeightSource):
    """A built-in model's random weights, generated once per test session."""

    def __init__(self, name: str) -> None:
        self.inner = load_weight_source(name)
        self.cfg = self.inner.cfg
        self._t: dict[str, torch.Tensor] = {}

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._t:
            self._t[name] = self.inner.tensor(name)
        return self._t[name]


@cache
def source(name: str) -> _Cached:
    return _Cached(name)


@cache
def weights_bytes(*models: str) -> int:
    e = Engine([source(m) for m in models], 64 * MiB, block_size=BS)
    return e.pool.weight_pages() * e.pool.page_bytes


def engine(*models: str, kv_bytes: int = 2 * MiB, engine_id: int = 0) -> Engine:
    return Engine(
        [source(m) for m in models],
        weights_bytes(*models) + kv_bytes,
        block_size=BS,
        engine_id=engine_id,
    )


@cache
def reference(model: str, prompt: str, params: SamplingParams = GREEDY) -> tuple[int, ...]:
    """The unmigrated run of one request, alone on one engine."""
    e = engine(model)
    return tuple(e.generate(model, [prompt], params)[0])


def run_all(*engines: Engine) -> None:
    while any(e.has_work() for e in engines):
        for e in engines:
            e.step()
            e.check_integrity()


def final(e1: Engine, e2: Engine, rid: int, stats: MigrationStats | None) -> EngineRequest:
    """The request's final state, wherever it ended."""
    if stats is None or stats.aborted:
        return e1.requests[rid]
    assert e1.requests[rid].finish_reason == "migrated"
    assert stats.new_rid is not None
    return e2.requests[stats.new_rid]


# ------------------------------------------------------------- token equality
@pytest.mark.parametrize("mode", list(MODES))
def test_migrated_requests_yield_the_unmigrated_tokens(mode: str) -> None:
    migrate = MODES[mode]
    e1, e2 = engine(A), engine(A, engine_id=1)
    finished: dict[int, list[int]] = {1: [], 2: []}
    rids = [
        e1.add_request(A, p, GREEDY, on_finish=lambda r: finished[1].append(r.id)) for p in PROMPTS
    ]
    bg = [e2.add_request(A, p, GREEDY) for p in BACKGROUND]
    free1, free2 = e1.pool.num_free, e2.pool.num_free
    stats: dict[int, MigrationStats] = {}
    for step in range(30):
        if step in (3, 9):  # two requests move, at different points of their run
            rid = rids[1] if step == 3 else rids[3]
            stats[rid] = migrate(e1, e2, rid)
            assert not stats[rid].aborted
            new = stats[rid].new_rid
            assert new is not None
            e2.requests[new].on_finish = lambda r: finished[2].append(r.id)
            e1.check_integrity()
            e2.check_integrity()
        for e in (e1, e2):
            e.step()
            e.check_integrity()
    run_all(e1, e2)
    for rid, p in zip(rids, PROMPTS, strict=True):
        req = final(e1, e2, rid, stats.get(rid))
        assert req.finish_reason == "length"
        assert tuple(req.output_ids) == reference(A, p), (mode, p)
    for rid, p in zip(bg, BACKGROUND, strict=True):
        assert tuple(e2.requests[rid].output_ids) == reference(A, p)
    # on_finish: once, on the engine where the request really ended
    assert sorted(finished[1]) == [rids[0], rids[2]]
    assert sorted(finished[2]) == sorted(s.new_rid for s in stats.values())
    if mode != "tokens":
        assert all(s.stages >= 1 and s.bytes > 0 for s in stats.values())
    assert e1.pool.num_free == free1 and e2.pool.num_free == free2
    assert e1.pool.usage()["reserved"] == e2.pool.usage()["reserved"] == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_sampled_request_continues_its_generator(mode: str) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    prompt = PROMPTS[1]
    want = reference(A, prompt, params)
    e1, e2 = engine(A), engine(A, engine_id=1)
    rid = e1.add_request(A, prompt, params)
    e1.add_request(A, PROMPTS[0], params)  # a neighbour with the same seed
    e2.add_request(A, PROMPTS[2], GREEDY)
    for _ in range(6):
        e1.step()
        e2.step()
    st = MODES[mode](e1, e2, rid)
    run_all(e1, e2)
    assert tuple(final(e1, e2, rid, st).output_ids) == want


def test_live_migration_copies_in_stages_and_stalls_only_for_the_tail() -> None:
    e1, e2 = engine(A), engine(A, engine_id=1)
    long_prompt = "Live migration copies the KV while the request keeps decoding. " * 3
    rid = e1.add_request(A, long_prompt, GREEDY)
    other = e1.add_request(A, PROMPTS[0], GREEDY)
    e1.step()
    e1.step()
    per_block = e1.export_kv(rid, 0, 1).nbytes
    # default: stage 1 copies the full blocks, one source step, then the tail
    st = migrate_live(e1, e2, rid)
    assert not st.aborted and st.stages >= 2
    assert st.stall_bytes <= 2 * per_block < st.bytes
    assert st.stall_s <= st.total_s
    assert st.new_rid is not None
    moved = e2.requests[st.new_rid]
    assert st.bytes == -(-moved.n_cached // BS) * per_block  # every block copied once
    # several source steps per stage: more stages, up to max_stages + the final one
    e3 = engine(A, engine_id=2)
    steps = []

    def run() -> None:
        for _ in range(5):
            steps.append(e2.step())

    st2 = migrate_live(e2, e3, st.new_rid, run_source_step=run, max_stages=3)
    assert st2.stages == 4 and len(steps) == 15
    run_all(e1, e2, e3)
    assert st2.new_rid is not None
    assert tuple(e3.requests[st2.new_rid].output_ids) == reference(A, long_prompt)
    assert tuple(e1.requests[other].output_ids) == reference(A, PROMPTS[0])


# ---------------------------------------------------------------- abort paths
@pytest.mark.parametrize("mode", ["blocking", "live"])
def test_destination_too_small_aborts_and_the_request_stays(mode: str) -> None:
    e1 = engine(A)
    per_tb = e1.pool.pages_per_token_block(A) * e1.pool.page_bytes
    e2 = engine(A, kv_bytes=3 * per_tb, engine_id=1)  # 3 token-blocks of room
    prompt = PROMPTS[3]  # 33 tokens: 9 blocks
    rid = e1.add_request(A, prompt, GREEDY)
    e1.step()
    free2 = e2.pool.num_free
    assert not e2.can_import(A, e1.requests[rid].n_cached)
    with pytest.raises(PoolFull):
        e2.begin_import(A, e1.requests[rid].n_cached)
    st = MODES[mode](e1, e2, rid)
    assert st.aborted and st.reason == "destination full" and st.new_rid is None
    for e in (e1, e2):
        e.check_integrity()
    assert e2.pool.num_free == free2 and e2.pool.usage()["reserved"] == 0
    assert e1.requests[rid].status == "running"
    run_all(e1, e2)
    req = e1.requests[rid]
    assert req.finish_reason == "length" and tuple(req.output_ids) == reference(A, prompt)


def test_live_migration_aborts_when_the_destination_fills_up_meanwhile() -> None:
    e1 = engine(A)
    per_tb = e1.pool.pages_per_token_block(A) * e1.pool.page_bytes
    prompt = PROMPTS[1]  # 26 tokens: 7 blocks
    e2 = engine(A, kv_bytes=8 * per_tb, engine_id=1)
    rid = e1.add_request(A, prompt, GREEDY)
    e1.step()

    def run() -> None:
        for _ in range(2 * BS):  # the request outgrows the destination
            e1.step()

    st = migrate_live(e1, e2, rid, run_source_step=run)
    assert st.aborted and st.reason == "destination full" and st.stages >= 1
    e1.check_integrity()
    e2.check_integrity()
    assert e2.pool.usage()["reserved"] == 0 and e2.pool.kv_pages == 0
    run_all(e1, e2)
    assert tuple(e1.requests[rid].output_ids) == reference(A, prompt)


def test_live_migration_aborts_when_the_request_finishes_on_the_source() -> None:
    e1, e2 = engine(A), engine(A, engine_id=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    done: list[int] = []
    rid = e1.add_request(A, PROMPTS[3], params, on_finish=lambda r: done.append(r.id))
    e1.step()

    def run() -> None:
        for _ in range(10):
            e1.step()

    st = migrate_live(e1, e2, rid, run_source_step=run)
    assert st.aborted and st.reason == "finished on the source"
    assert done == [rid] and e1.requests[rid].finish_reason == "length"
    e1.check_integrity()
    e2.check_integrity()
    assert e2.pool.usage()["reserved"] == 0


# ------------------------------------------------------- primitives, streaming
def test_export_import_primitives() -> None:
    e1, e2 = engine(A), engine(A, engine_id=1)
    rid = e1.add_request(A, PROMPTS[3], GREEDY)
    e1.step()
    e1.step()
    req = e1.requests[rid]
    n = req.n_cached  # 34: 9 blocks, the last one partial
    chunk = e1.export_kv(rid)
    spec = e1.models[A].cfg.spec
    assert chunk.data.shape == (9, spec.num_layers, spec.num_kv_heads, 2, BS, spec.head_dim)
    assert chunk.first_tb == 0 and chunk.n_tokens == n and chunk.layers == (0, 1, 2, 3)
    assert chunk.nbytes == chunk.data.numel() * 4
    # it is a copy, equal to the pages it came from
    kv = e1.pool.kv(A)
    assert torch.equal(chunk.data, kv[e1.pool.table(rid)])
    chunk.data.zero_()
    assert not torch.equal(chunk.data, kv[e1.pool.table(rid)])
    part = e1.export_kv(rid, 2, 3, layers=[1, 3])
    assert part.data.shape[:2] == (3, 2) and part.n_tokens == 3 * BS and part.start_token == 8
    with pytest.raises(ValueError, match="outside"):
        e1.export_kv(rid, 5, 10)
    # import in two stages; commit needs all of it written
    free2 = e2.pool.num_free
    h = e2.begin_import(A, 5 * BS)
    e2.write_import(h, e1.export_kv(rid, 0, 5))
    state = e1.export_state(rid)
    with pytest.raises(ValueError, match="grow_import"):
        e2.write_import(h, e1.export_kv(rid, 5))
    e2.grow_import(h, n)
    with pytest.raises(ValueError, match="cached"):
        e2.commit_import(h, state)
    with pytest.raises(ValueError, match="does not match"):
        e2.write_import(h, part)
    e2.write_import(h, e1.export_kv(rid, 5))
    with pytest.raises(ValueError, match="belong"):
        e1.write_import(h, chunk)
    new = e2.commit_import(h, state)
    assert e2.requests[new].n_cached == n and e2.requests[new].status == "running"

    def per_token(e: Engine, r: int) -> torch.Tensor:  # [tokens, layers, heads, 2, d]
        g = e.pool.kv(A)[e.pool.table(r)].permute(0, 4, 1, 2, 3, 5)
        return g.reshape(-1, *g.shape[2:])

    assert torch.equal(per_token(e2, new)[:n], per_token(e1, rid)[:n])  # bit for bit
    with pytest.raises(ValueError, match="committed"):
        e2.abort_import(h)
    e1.release_migrated(rid)
    assert e1.requests[rid].finish_reason == "migrated" and not e1.pool.has(rid)
    # an aborted import leaves nothing behind
    h2 = e2.begin_import(A, 100)
    e2.write_import(h2, e2.export_kv(new))
    e2.abort_import(h2)
    e2.check_integrity()
    e2.abort(new)
    assert e2.pool.num_free == free2
    e1.check_integrity()


def test_pause_keeps_the_kv_out_of_batches_and_resume_continues() -> None:
    e = engine(A, kv_bytes=MiB)
    rids = [e.add_request(A, p, GREEDY) for p in PROMPTS[:3]]
    e.step()
    e.pause(rids[0])
    before = list(e.requests[rids[0]].tokens)
    pages = e.pool.table(rids[0]).clone()
    for _ in range(5):
        out = e.step()
        assert rids[0] not in out.decoded and rids[0] not in out.preempted
        e.check_integrity()
    assert e.requests[rids[0]].tokens == before and e.requests[rids[0]].migrating
    assert torch.equal(e.pool.table(rids[0]), pages)
    with pytest.raises(ValueError, match="only a running"):
        e.pause(rids[0])
    e.resume(rids[0])
    with pytest.raises(ValueError, match="only a paused"):
        e.resume(rids[0])
    run_all(e)
    for rid, p in zip(rids, PROMPTS, strict=False):
        assert tuple(e.requests[rid].output_ids) == reference(A, p)


@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_text_is_the_final_text_with_every_token_once(mode: str) -> None:
    # a stop string that never matches but whose prefix holds text back
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=("m" * 30,))
    prompt = PROMPTS[0]
    ref = engine(A)
    ref_rid = ref.add_request(A, prompt, params)
    run_all(ref)
    want = ref.requests[ref_rid]
    streamed: list[tuple[int, str]] = []
    e1, e2 = engine(A), engine(A, engine_id=1)
    rid = e1.add_request(A, prompt, params, on_token=lambda r, t, s: streamed.append((t, s)))
    e1.add_request(A, PROMPTS[1], GREEDY)
    e2.add_request(A, PROMPTS[2], GREEDY)
    for _ in range(30):  # in the middle of a run of 'm's: text is held back
        e1.step()
        e2.step()
    assert e1.requests[rid].held
    st = MODES[mode](e1, e2, rid)
    run_all(e1, e2)
    req = final(e1, e2, rid, st)
    assert req.output_ids == want.output_ids
    assert req.text == want.text and "".join(s for _, s in streamed) == req.text
    assert [t for t, _ in streamed] == req.output_ids


def test_two_models_in_one_arena_migrate_one_of_each() -> None:
    e1, e2 = engine(A, B, kv_bytes=4 * MiB), engine(A, B, kv_bytes=4 * MiB, engine_id=1)
    free1, free2 = e1.pool.num_free, e2.pool.num_free
    reqs = [(m, p) for m in (A, B) for p in PROMPTS[:3]]
    rids = [e1.add_request(m, p, GREEDY) for m, p in reqs]
    bg = [(e2.add_request(m, BACKGROUND[0], GREEDY), m) for m in (A, B)]
    stats: dict[int, MigrationStats] = {}
    for step in range(12):
        if step == 4:
            stats[rids[1]] = migrate_live(e1, e2, rids[1])  # a request of A
            stats[rids[4]] = migrate_blocking(e1, e2, rids[4])  # one of B
        if step == 6:
            stats[rids[5]] = migrate_tokens(e1, e2, rids[5])  # another of B
        for e in (e1, e2):
            e.step()
            e.check_integrity()
    run_all(e1, e2)
    for rid, (m, p) in zip(rids, reqs, strict=True):
        assert tuple(final(e1, e2, rid, stats.get(rid)).output_ids) == reference(m, p), (m, p)
    for rid, m in bg:
        assert tuple(e2.requests[rid].output_ids) == reference(m, BACKGROUND[0])
    assert e1.pool.num_free == free1 and e2.pool.num_free == free2


@pytest.mark.parametrize("mode", ["blocking", "live"])
def test_torch_index_copy_path(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gather/scatter path used off the CPU (torch index_select / index_copy_)."""
    from fleetserve.runtime.engine import migration

    monkeypatch.setattr(migration, "_np_view", lambda t: None)
    monkeypatch.setattr(migration, "_NP_KV", migration.weakref.WeakKeyDictionary())
    e1, e2 = engine(A), engine(A, engine_id=1)
    rid = e1.add_request(A, PROMPTS[3], GREEDY)
    e1.add_request(A, PROMPTS[0], GREEDY)
    for _ in range(4):
        e1.step()
    chunk = e1.export_kv(rid)
    assert torch.equal(chunk.data, e1.pool.kv(A)[e1.pool.table(rid)])
    st = MODES[mode](e1, e2, rid)
    run_all(e1, e2)
    assert tuple(final(e1, e2, rid, st).output_ids) == reference(A, PROMPTS[3])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_migration_matches_the_unmigrated_run(mode: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def cuda_engine(engine_id: int) -> Engine:
        return Engine([A], 64 * MiB, block_size=BS, device="cuda", engine_id=engine_id)

    ref = cuda_engine(0)
    want = ref.generate(A, PROMPTS, GREEDY)
    e1, e2 = cuda_engine(0), cuda_engine(1)
    rids = [e1.add_request(A, p, GREEDY) for p in PROMPTS]
    for _ in range(5):
        e1.step()
    st = MODES[mode](e1, e2, rids[1])
    assert not st.aborted
    run_all(e1, e2)
    got = [final(e1, e2, r, st if r == rids[1] else None).output_ids for r in rids]
    assert got == want


def test_precommit_sets_the_request_up_paused_and_abort_undoes_it() -> None:
    """The destination side of live migration's pre-commit, step by step."""
    a, b = engine(A, engine_id=0), engine(A, engine_id=1)
    free_b = b.pool.num_free
    rid = a.add_request(A, "The quick brown fox jumps over", GREEDY)
    for _ in range(3):
        a.step()
    req = a.requests[rid]
    handle = b.begin_import(A, req.n_cached)
    b.write_import(handle, a.export_kv(rid))
    early = a.export_state(rid)
    pre = b.precommit_import(handle, early)
    assert b.requests[pre].status == "paused" and b.requests[pre] not in b.running
    b.step()  # a paused request is neither scheduled nor preempted
    b.check_integrity()
    a.step()  # the source goes on: the pre-committed state now lags
    late = a.export_state(rid)
    with pytest.raises(ValueError, match="does not continue"):
        b.finish_import(pre, dataclasses.replace(late, prompt_len=late.prompt_len - 1))
    with pytest.raises(ValueError, match="not a paused running request"):
        b.finish_import(pre, dataclasses.replace(late, n_cached=1))
    b.abort_paused(pre)
    assert pre not in b.requests and b.pool.num_free == free_b
    b.check_integrity()
    # and a full pre-commit round continues with the unmigrated tokens
    handle = b.begin_import(A, req.n_cached)
    b.write_import(handle, a.export_kv(rid))
    pre = b.precommit_import(handle, a.export_state(rid))
    a.step()
    b.grow_paused(pre, req.n_cached)
    a.pause(rid)
    b.write_paused(pre, a.export_kv(rid))
    b.finish_import(pre, a.export_state(rid))
    a.release_migrated(rid)
    run_all(a, b)
    assert tuple(b.requests[pre].output_ids) == reference(A, "The quick brown fox jumps over")


@pytest.mark.parametrize("fragmented", [False, True])
def test_copy_pages_moves_a_request_kv_arena_to_arena(fragmented: bool) -> None:
    from fleetserve.runtime.engine.migration import copy_pages

    a, b = engine(A, engine_id=0), engine(A, engine_id=1)
    rid = a.add_request(A, "The quick brown fox jumps over the lazy dog", GREEDY)
    a.step()
    req = a.requests[rid]
    h = b.begin_import(A, req.n_cached)
    src = a.pool.table(rid).numpy()
    dst = h.pages()[: src.size].reshape(src.shape)
    if fragmented:  # every page to a shuffled destination: the gather/scatter path
        dst = np.random.default_rng(0).permutation(dst.reshape(-1)).reshape(src.shape)
    n = copy_pages(a.pool, b.pool, A, src, dst)
    assert n == src.size * a.pool.page_bytes
    kv_a, kv_b = a.pool.kv(A), b.pool.kv(A)
    assert torch.equal(kv_b[torch.from_numpy(dst)], kv_a[torch.from_numpy(src)])
    b.abort_import(h)
    b.check_integrity()


def test_export_without_copy_is_a_view_of_one_page_run_else_a_copy() -> None:
    a = engine(A)
    rid = a.add_request(A, "The quick brown fox jumps over the lazy dog", GREEDY)
    a.step()
    copied = a.export_kv(rid)
    view = a.export_kv(rid, copy=False)
    assert torch.equal(view.data, copied.data)
    flat = a.pool.table(rid).reshape(-1)
    assert bool((flat.diff() == 1).all())  # a fresh engine: one run
    assert view.data.data_ptr() == a.pool.kv(A)[int(flat[0])].data_ptr()  # no copy
    # one layer only: the pages are no longer one run, so it is a copy
    part = a.export_kv(rid, layers=[1], copy=False)
    arena = a.pool.arena.untyped_storage().data_ptr()
    assert part.data.untyped_storage().data_ptr() != arena
    assert view.data.untyped_storage().data_ptr() == arena
    assert torch.equal(part.data, copied.data[:, 1:2])


@pytest.mark.parametrize("fragmented", [False, True])
def test_planned_page_copy_copies_the_data_at_run_time(fragmented: bool) -> None:
    """A live migration plans its stop-and-copy before the pause: the plan holds
    page ids and views, so running it copies what the pages hold *then*."""
    from fleetserve.runtime.engine.migration import plan_page_copy

    a, b = engine(A, engine_id=0), engine(A, engine_id=1)
    rid = a.add_request(A, "The quick brown fox jumps over the lazy dog", GREEDY)
    a.step()
    h = b.begin_import(A, a.requests[rid].n_cached)
    src = a.pool.table(rid).numpy()
    dst = h.pages()[: src.size].reshape(src.shape)
    if fragmented:
        dst = np.random.default_rng(1).permutation(dst.reshape(-1)).reshape(src.shape)
    plan = plan_page_copy(a.pool, b.pool, A, src, dst)
    assert (plan.gather is not None) == fragmented
    kv_a, kv_b = a.pool.kv(A), b.pool.kv(A)
    s_idx, d_idx = torch.from_numpy(src), torch.from_numpy(dst)
    kv_a[s_idx] = kv_a[s_idx] + 1.0  # the source changes after the plan
    assert plan.run() == src.size * a.pool.page_bytes
    assert torch.equal(kv_b[d_idx], kv_a[s_idx])
    b.abort_import(h)
    b.check_integrity()
