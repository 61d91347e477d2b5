"""Layer ranges (KunServe): pipelines across engines, remote attention, drop / restore.

Every generation check compares token ids with the single-engine run
(``Engine.generate``) of the same built-in model, prompts and parameters.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from fleetserve.errors import ConfigError, FleetserveError  # noqa: E402
from fleetserve.runtime.engine.config import builtin_config  # noqa: E402
from fleetserve.runtime.engine.engine import Batch, Engine  # noqa: E402
from fleetserve.runtime.engine.kvpool import FREE, WEIGHT, PoolFull  # noqa: E402
from fleetserve.runtime.engine.model import layer_numel  # noqa: E402
from fleetserve.runtime.engine.pipeline import (  # noqa: E402
    PipelineGroup,
    RemoteKV,
    check_stage_ranges,
)
from fleetserve.runtime.engine.sampling import SamplingParams  # noqa: E402

A, B = "tiny-llama-a", "tiny-llama-b"
BS = 16
PAGE = 2 * BS * 64 * 4  # both tiny models: head_dim 64, fp32
# different lengths; the longest spans several KV blocks
PROMPTS = [
    "hello world",
    "a",
    "the quick brown fox jumps over the lazy dog, twice over",
    "pipelines!",
]
GREEDY = SamplingParams(max_tokens=20)
SAMPLED = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these tiny matmuls gain nothing from more, and on a
    loaded machine OpenMP spinning makes them tens of times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def layer_pages(model: str) -> int:
    return -(-layer_numel(builtin_config(model)) // (PAGE // 4))


def arena(model: str, n_layers: int, kv_pages: int = 512) -> int:
    """Bytes for ``n_layers`` layers of ``model`` plus ``kv_pages`` KV pages."""
    return (n_layers * layer_pages(model) + kv_pages) * PAGE


@functools.cache
def reference(model: str, params: SamplingParams, prompts: tuple[str, ...]) -> list[list[int]]:
    """Tokens of the single-engine run (a fresh engine holding every layer)."""
    n = builtin_config(model).spec.num_layers
    return Engine([model], arena(model, n)).generate(model, list(prompts), params)


def blocks(model: str, prompts: list[str]) -> int:
    """KV token-blocks the prompts need on their first step."""
    tok = Engine([(model, [])], PAGE * 8).tokenizer(model)
    return sum(-(-len(tok.encode(p)) // BS) for p in prompts)


def stage_engines(model: str, ranges: list[range]) -> list[tuple[Engine, range]]:
    return [
        (Engine([(model, r)], arena(model, len(r)), engine_id=i), r) for i, r in enumerate(ranges)
    ]


# ----------------------------------------------------------------- pipelines
@pytest.mark.parametrize(
    ("model", "bounds"),
    [
        (A, [0, 2, 4]),
        (A, [0, 1, 2, 3, 4]),
        (B, [0, 1, 4, 6]),
        (B, [0, 3, 6]),
    ],
    ids=["a-2stage", "a-4stage", "b-uneven-3stage", "b-2stage"],
)
def test_pipeline_matches_single_engine(model: str, bounds: list[int]) -> None:
    ranges = [range(a, b) for a, b in itertools.pairwise(bounds)]
    stages = stage_engines(model, ranges)
    for e, r in stages:
        assert e.held_layers(model) == list(r)
    group = PipelineGroup(stages, model)
    kv_heads = builtin_config(model).spec.num_kv_heads
    rids = [group.add_request(p, GREEDY) for p in PROMPTS]
    group.step()  # every prompt prefills together
    nb = blocks(model, PROMPTS)
    for e, r in stages:  # each stage keeps the KV of its own layers only
        assert e.pool.kv_pages == nb * len(r) * kv_heads
        e.check_integrity()
    while group.has_work():
        group.step()
    out = [group.pop_finished(r).output_ids for r in rids]
    assert out == reference(model, GREEDY, tuple(PROMPTS))
    for e, _ in stages:  # finished requests leave: every stage's pages are free
        assert e.pool.kv_pages == 0
        e.check_integrity()


def test_pipeline_sampling_matches_single_engine() -> None:
    stages = stage_engines(A, [range(0, 2), range(2, 4)])
    out = PipelineGroup(stages, A).generate(PROMPTS, SAMPLED)
    assert out == reference(A, SAMPLED, tuple(PROMPTS))
    assert out != reference(A, GREEDY, tuple(PROMPTS))


def test_pipeline_stage_out_of_pages_is_a_clear_error() -> None:
    # stage 1 has KV room for 2 token-blocks of its 2 layers x 2 heads
    s0 = Engine([(A, range(0, 2))], arena(A, 2), engine_id=0)
    s1 = Engine([(A, range(2, 4))], arena(A, 2, kv_pages=8), engine_id=1)
    group = PipelineGroup([(s0, range(0, 2)), (s1, range(2, 4))], A)
    with pytest.raises(PoolFull, match="engine 1 needs"):
        group.generate(PROMPTS, GREEDY)
    for e in (s0, s1):  # the failed run is aborted: nothing left behind
        assert e.pool.kv_pages == 0
        e.check_integrity()


def test_stage_ranges_are_checked() -> None:
    check_stage_ranges([range(0, 1), range(1, 4), range(4, 6)], 6)
    with pytest.raises(ConfigError, match="stage 1 starts at layer 3, expected 2"):
        check_stage_ranges([range(0, 2), range(3, 4)], 4)  # gap
    with pytest.raises(ConfigError, match="stage 1 starts at layer 1, expected 2"):
        check_stage_ranges([range(0, 2), range(1, 4)], 4)  # overlap
    with pytest.raises(ConfigError, match="stage 0 starts at layer 1, expected 0"):
        check_stage_ranges([range(1, 4)], 4)
    with pytest.raises(ConfigError, match="last stage ends at 3, expected 4"):
        check_stage_ranges([range(0, 3)], 4)
    with pytest.raises(ConfigError, match="stage 1 must be a non-empty range"):
        check_stage_ranges([range(0, 2), range(2, 2), range(2, 4)], 4)
    with pytest.raises(ConfigError, match="at least one stage"):
        check_stage_ranges([], 4)
    e0, e1 = Engine([(A, range(0, 2))], arena(A, 2)), Engine([(A, range(2, 3))], arena(A, 1))
    with pytest.raises(ConfigError, match=r"stage 1 .* does not hold the weights of \[3\]"):
        PipelineGroup([(e0, range(0, 2)), (e1, range(2, 4))], A)
    with pytest.raises(ConfigError, match="expected 4"):
        PipelineGroup([(e0, range(0, 2))], A)
    kv = Engine([(A, [])], arena(A, 0))
    full = Engine([A], arena(A, 4))
    with pytest.raises(ConfigError, match="KV of layer 1 is given to two remote holders"):
        PipelineGroup([(full, range(4))], A, remote=[RemoteKV(kv, A, [1]), RemoteKV(kv, A, [1, 2])])
    with pytest.raises(ConfigError, match="does not host"):
        RemoteKV(kv, B, [0])


# ---------------------------------------------------------- remote attention
def test_remote_attention_matches_single_engine() -> None:
    full = Engine([A], arena(A, 4), engine_id=0)  # every weight
    holder = Engine([(A, [])], arena(A, 0), engine_id=1)  # KV of layers 1 and 3 only
    group = PipelineGroup([(full, range(4))], A, remote=[RemoteKV(holder, A, [1, 3])])
    assert [(e.engine_id, lay) for e, lay in group.kv_layers()] == [(0, (0, 2)), (1, (1, 3))]
    rids = [group.add_request(p, GREEDY) for p in PROMPTS]
    group.step()
    nb = blocks(A, PROMPTS)
    assert full.pool.kv_pages == nb * 2 * 2  # layers 0, 2 x 2 KV heads
    assert holder.pool.kv_pages == nb * 2 * 2  # layers 1, 3
    while group.has_work():
        group.step()
    out = [group.pop_finished(r).output_ids for r in rids]
    assert out == reference(A, GREEDY, tuple(PROMPTS))
    for e in (full, holder):
        assert e.pool.kv_pages == 0
        e.check_integrity()


def test_pipeline_with_remote_kv_on_the_next_stage() -> None:
    # stage 0 runs layers 0-1 but the KV of layer 0 lives on stage 1's engine
    stages = stage_engines(A, [range(0, 2), range(2, 4)])
    group = PipelineGroup(stages, A, remote=[RemoteKV(stages[1][0], A, [0])])
    assert [lay for _, lay in group.kv_layers()] == [(1,), (0, 2, 3)]
    assert group.generate(PROMPTS, SAMPLED) == reference(A, SAMPLED, tuple(PROMPTS))
    for e, _ in stages:
        assert e.pool.kv_pages == 0
        e.check_integrity()


def test_remote_kv_standalone_logits_are_exact() -> None:
    ids = Engine([(A, [])], PAGE * 8).tokenizer(A).encode(PROMPTS[2])
    n = len(ids)
    ref = Engine([A], arena(A, 4))
    ref.pool.open(0, A)
    ref.pool.grow(0, n)
    want = ref.forward(A, [0], [0], [n], ids)

    local = Engine([A], arena(A, 4))
    rk = RemoteKV(Engine([(A, [])], arena(A, 0)), A, [0, 2])
    local.pool.open(7, A, (1, 3))
    local.pool.grow(7, n)
    rk.open(7)
    rk.grow(7, n)
    batch = Batch.build(A, [7], [0], [n], local.device)
    h = local.run_layers(batch, local.embed(A, ids), range(4), remote=rk.functions())
    assert torch.equal(local.head(batch, h), want)
    assert rk.free(7) == -(-n // BS) * 2 * 2
    with pytest.raises(ConfigError, match="layer 1, whose KV is not kept there"):
        rk.attention(1, batch, h, h, h)


# -------------------------------------------------------------- layer ranges
def test_run_layers_refuses_layers_not_held() -> None:
    e = Engine([(A, range(1, 3))], arena(A, 2))
    assert e.held_layers(A) == [1, 2]
    ids = e.tokenizer(A).encode("hi")
    e.pool.open(0, A, range(0, 4))
    e.pool.grow(0, len(ids))
    batch = Batch.build(A, [0], [0], [len(ids)], e.device)
    h = e.embed(A, ids)
    assert e.run_layers(batch, h, range(1, 3)).shape == h.shape
    with pytest.raises(FleetserveError, match="layer 0 of tiny-llama-a not held"):
        e.run_layers(batch, h, range(0, 2))
    with pytest.raises(FleetserveError, match="layer 3 of tiny-llama-a not held"):
        e.run_layers(batch, h, range(2, 4))


def test_drop_layer_gives_its_pages_to_kv_and_restore_takes_them_back() -> None:
    e = Engine([A], arena(A, 4, kv_pages=64))
    pool = e.pool
    ptr, numel = pool.arena.data_ptr(), pool.arena.numel()
    free0 = pool.num_free
    lp = e.layer_bytes(A) // pool.page_bytes
    assert lp == layer_pages(A)
    # a request one token-block (8 pages) too big for the free pages
    big = 10**6
    pool.open(big, A)
    n_tok = (free0 // 8 + 1) * BS
    assert not pool.can_grow(big, n_tok)
    with pytest.raises(PoolFull):
        pool.grow(big, n_tok)
    assert e.drop_layer(A, 3) == e.layer_bytes(A)
    assert pool.num_free == free0 + lp
    assert e.held_layers(A) == [0, 1, 2]
    e.check_integrity()
    assert pool.can_grow(big, n_tok)  # fits now
    pool.grow(big, n_tok)
    e.check_integrity()
    assert not e.can_restore_layer(A)
    pool.free(big)
    e.restore_layer(A, 3)  # from the weight source (the host copy)
    assert pool.num_free == free0
    assert e.held_layers(A) == [0, 1, 2, 3]
    e.check_integrity()
    assert (pool.arena.data_ptr(), pool.arena.numel()) == (ptr, numel)
    assert e.generate(A, PROMPTS, GREEDY) == reference(A, GREEDY, tuple(PROMPTS))


def test_restore_without_room_raises_and_changes_nothing() -> None:
    e = Engine([A], arena(A, 4, kv_pages=64))
    pool = e.pool
    ptr = pool.arena.data_ptr()
    lp = layer_pages(A)
    e.drop_layer(A, 2)
    res = pool.reserve(pool.num_free - (lp - 1))  # one page short of a layer
    owner, usage, data = pool.owner.copy(), pool.usage(), pool.arena.clone()
    assert not e.can_restore_layer(A)
    with pytest.raises(PoolFull):
        e.restore_layer(A, 2)
    assert np.array_equal(pool.owner, owner) and pool.usage() == usage
    assert torch.equal(pool.arena, data)
    assert e.held_layers(A) == [0, 1, 3]
    e.check_integrity()
    pool.release(res)
    e.restore_layer(A, 2)
    e.check_integrity()
    assert pool.arena.data_ptr() == ptr
    assert e.generate(A, PROMPTS, GREEDY) == reference(A, GREEDY, tuple(PROMPTS))


def test_restore_relocates_kv_of_running_requests() -> None:
    """Drop a layer of model B, let model A's running requests' KV grow into its
    pages, restore it: that KV must move (data and tables) and A's generation
    continue with the tokens of an undisturbed run; B's restored layer (from
    the host copy) must give B's tokens of before the drop."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts_a, prompts_b = PROMPTS[:3], ["restore me", "layer five"]
    e = Engine([A, B], (4 * layer_pages(A) + 6 * layer_pages(B) + 160) * PAGE)
    pool = e.pool
    ptr, numel = pool.arena.data_ptr(), pool.arena.numel()
    b_before = e.generate(B, prompts_b, GREEDY)
    rids = [e.add_request(A, p, params) for p in prompts_a]
    e.step()
    e.step()
    # drop B's layer 5: its window of pages becomes free
    owner0, free0 = pool.owner.copy(), pool.num_free
    assert e.drop_layer(B, 5) == e.layer_bytes(B)
    window = np.flatnonzero((owner0 == WEIGHT) & (pool.owner == FREE))
    assert len(window) == layer_pages(B) and window[-1] - window[0] == len(window) - 1
    assert pool.num_free == free0 + len(window)
    e.check_integrity()
    # fill every free page below the window so that the requests grow into it
    res = pool.reserve(int((pool.owner[: window[0]] == FREE).sum()))
    assert max(res.pages) < window[0]
    for _ in range(BS + 2):  # every request crosses a block boundary
        e.step()
        e.check_integrity()
    assert (pool.owner[window] >= 0).sum() > 0  # KV of running requests in the window
    pool.release(res)
    e.check_integrity()
    kv, free1 = pool.kv_pages, pool.num_free
    e.restore_layer(B, 5)
    assert (pool.owner[window] >= 0).sum() == 0  # that KV moved out
    assert pool.kv_pages == kv and pool.num_free == free1 - len(window)
    assert (pool.arena.data_ptr(), pool.arena.numel()) == (ptr, numel)
    e.check_integrity()
    while e.has_work():
        e.step()
    out = [e.pop_finished(r).output_ids for r in rids]
    assert out == reference(A, params, tuple(prompts_a))
    assert pool.kv_pages == 0
    e.check_integrity()
    assert e.generate(B, prompts_b, GREEDY) == b_before


# ---------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_and_remote_kv_across_devices() -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    single = Engine([A], arena(A, 4), device="cuda").generate(A, PROMPTS, params)
    # all on the GPU: 2 stages, the KV of layer 1 on a third engine
    s0 = Engine([(A, range(0, 2))], arena(A, 2), device="cuda", engine_id=0)
    s1 = Engine([(A, range(2, 4))], arena(A, 2), device="cuda", engine_id=1)
    kv = Engine([(A, [])], arena(A, 0), device="cuda", engine_id=2)
    group = PipelineGroup([(s0, range(0, 2)), (s1, range(2, 4))], A, remote=[RemoteKV(kv, A, [1])])
    assert group.generate(PROMPTS, params) == single
    # mixed: stage 0 on the CPU, stage 1 and the remote KV of layer 0 on the GPU
    c0 = Engine([(A, range(0, 2))], arena(A, 2), engine_id=3)
    mixed = PipelineGroup([(c0, range(0, 2)), (s1, range(2, 4))], A, remote=[RemoteKV(kv, A, [0])])
    out = mixed.generate(PROMPTS, params)
    assert [len(o) for o in out] == [12] * len(PROMPTS)
    for e in (s0, s1, kv, c0):
        assert e.pool.kv_pages == 0
        e.check_integrity()


def test_pipeline_stop_strings_and_text_match_single_engine() -> None:
    """The group applies the engine's stop-string rule (shared code)."""
    n = builtin_config(A).spec.num_layers
    full = reference(A, GREEDY, (PROMPTS[0],))[0]
    text = Engine([(A, [])], PAGE * 8).tokenizer(A).decode(full)
    stop = next(
        text[i : i + 2]
        for i in range(3, len(text) - 1)
        if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    params = SamplingParams(max_tokens=GREEDY.max_tokens, stop=(stop,), ignore_eos=True)
    eng = Engine([A], arena(A, n))
    rid = eng.add_request(A, PROMPTS[0], params)
    while eng.has_work():
        eng.step()
    single = eng.pop_finished(rid)
    group = PipelineGroup(stage_engines(A, [range(0, 2), range(2, 4)]), A)
    gid = group.add_request(PROMPTS[0], params)
    while group.has_work():
        group.step()
    piped = group.pop_finished(gid)
    assert single.finish_reason == piped.finish_reason == "stop"
    assert piped.text == single.text == text[: text.index(stop)]
    assert piped.output_ids == single.output_ids
