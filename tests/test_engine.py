"""The engine's executor: paged KV shared by two models, continuous batching,
preemption by recompute, sampling and stop conditions (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fleetserve.errors import ConfigError  # noqa: E402
from fleetserve.runtime.engine.engine import Engine, EngineRequest, Forward  # noqa: E402
from fleetserve.runtime.engine.model import dense_forward, layer_numel  # noqa: E402
from fleetserve.runtime.engine.sampling import SamplingParams  # noqa: E402
from fleetserve.runtime.engine.tokenizer import ByteTokenizer  # noqa: E402
from fleetserve.runtime.engine.weights import load_weight_source, model_weights  # noqa: E402

A, B = "tiny-llama-a", "tiny-llama-b"
MiB = 1 << 20
PROMPTS = ["Hello world", "The quick brown fox jumps", "a", "Paged attention shares one arena"]


def weights_bytes(*models: str) -> int:
    """Arena bytes the models' layers take (whole pages)."""
    e = Engine([A], 64 * MiB)
    return (
        sum(
            e.pool.region_pages(layer_numel(load_weight_source(m).cfg))
            for m in models
            for _ in range(load_weight_source(m).cfg.spec.num_layers)
        )
        * e.pool.page_bytes
    )


@pytest.fixture(scope="module")
def reference() -> dict[tuple[str, str], list[int]]:
    """Greedy continuations from the dense (cache-free) reference forward."""
    tok = ByteTokenizer()
    out: dict[tuple[str, str], list[int]] = {}
    for m in (A, B):
        src = load_weight_source(m)
        w = model_weights(src)
        for p in PROMPTS:
            ids = tok.encode(p)
            gen: list[int] = []
            for _ in range(10):
                gen.append(int(dense_forward(src.cfg, w, ids + gen)[-1].argmax()))
            out[(m, p)] = gen
    return out


def test_two_models_share_one_arena_and_match_the_dense_forward(
    reference: dict[tuple[str, str], list[int]],
) -> None:
    eng = Engine([A, B], weights_bytes(A, B) + 4 * MiB)
    arena_ptr, arena_numel = eng.pool.arena.data_ptr(), eng.pool.arena.numel()
    free0 = eng.pool.num_free
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    rids: dict[int, tuple[str, str]] = {}
    # staggered arrivals: prefills and decodes of both models share steps
    pending = [(m, p) for p in PROMPTS for m in (A, B)]
    while pending or eng.has_work():
        if pending:
            m, p = pending.pop(0)
            rids[eng.add_request(m, p, greedy)] = (m, p)
        eng.step()
        eng.check_integrity()
        assert eng.pool.arena.data_ptr() == arena_ptr
        assert eng.pool.arena.numel() == arena_numel
        if eng.running:
            assert eng.pool.kv_pages > 0
    for rid, key in rids.items():
        req = eng.pop_finished(rid)
        assert req.finish_reason == "length"
        assert req.output_ids == reference[key], key
    # every block returned to free when the requests ended
    assert eng.pool.num_free == free0 and eng.pool.kv_pages == 0


def test_preemption_by_recompute_keeps_the_tokens(
    reference: dict[tuple[str, str], list[int]],
) -> None:
    # room for only a few token-blocks: four requests cannot all run at once
    cfg = load_weight_source(A).cfg
    per_block = cfg.spec.num_layers * cfg.spec.num_kv_heads
    page_bytes = 2 * 16 * cfg.spec.head_dim * 4
    eng = Engine([A], weights_bytes(A) + 5 * per_block * page_bytes)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    rids = {eng.add_request(A, p, greedy): p for p in PROMPTS}
    preempted = 0
    while eng.has_work():
        out = eng.step()
        preempted += len(out.preempted)
        eng.check_integrity()
    assert preempted > 0
    for rid, p in rids.items():
        assert eng.pop_finished(rid).output_ids == reference[(A, p)]


def test_step_output_describes_each_forward_as_the_cost_model_sees_it() -> None:
    eng = Engine([A, B], 64 * MiB)
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    a = eng.add_request(A, "abcd", p)
    n_a = len(eng.requests[a].tokens)
    out = eng.step()
    assert out.forwards == [Forward(A, ((n_a, 0),), 0, 0)]
    b = eng.add_request(B, "xy", p)
    n_b = len(eng.requests[b].tokens)
    out = eng.step()  # B's prompt; A decodes its second token, reading n_a + 1 KV tokens
    assert sorted(out.forwards, key=lambda f: f.model) == [
        Forward(A, (), 1, n_a + 1),
        Forward(B, ((n_b, 0),), 0, 0),
    ]
    out = eng.step()  # both decode; A's third token ends it
    assert sorted(out.forwards, key=lambda f: f.model) == [
        Forward(A, (), 1, n_a + 2),
        Forward(B, (), 1, n_b + 1),
    ]


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    alone = Engine([A], 64 * MiB).generate(A, ["Once upon a time"], p)[0]
    eng = Engine([A], 64 * MiB)
    rid = eng.add_request(A, "Once upon a time", p)
    eng.add_request(A, "noise " * 10, SamplingParams(max_tokens=20, temperature=1.0, seed=1))
    while eng.has_work():
        eng.step()
    assert eng.pop_finished(rid).output_ids == alone
    other = Engine([A], 64 * MiB).generate(
        A, ["Once upon a time"], SamplingParams(max_tokens=12, temperature=0.9, seed=8)
    )[0]
    assert other != alone  # a different seed gives a different continuation
    top1 = SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3)
    greedy = SamplingParams(max_tokens=8)
    e = Engine([A], 64 * MiB)
    assert e.generate(A, ["abc"], top1) == e.generate(A, ["abc"], greedy)


def test_streaming_stop_strings_eos_and_length() -> None:
    eng = Engine([A], 64 * MiB)
    full = eng.generate(A, ["Hello world"], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    text = eng.tokenizer(A).decode(full)
    # a 2-character stop string that first occurs after a few characters
    at = next(
        i
        for i in range(2, len(text) - 1)
        if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    stop = text[at : at + 2]
    pieces: list[str] = []
    finished: list[EngineRequest] = []
    rid = eng.add_request(
        A,
        "Hello world",
        SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)),
        on_token=lambda r, t, s: pieces.append(s),
        on_finish=finished.append,
    )
    while eng.has_work():
        eng.step()
    req = eng.pop_finished(rid)
    assert req.finish_reason == "stop"
    assert req.text == text[: text.index(stop)]
    assert "".join(pieces) == req.text
    assert finished == [req]
    # EOS: make the model's first greedy token the EOS id
    eos_cfg = eng.models[A].cfg
    first = full[0]
    object.__setattr__(eos_cfg, "eos_token_ids", (first,))
    try:
        r = eng.add_request(A, "Hello world", SamplingParams(max_tokens=16))
        while eng.has_work():
            eng.step()
        got = eng.pop_finished(r)
        assert got.finish_reason == "stop" and got.output_ids == [first]
    finally:
        object.__setattr__(eos_cfg, "eos_token_ids", (257,))
    r = eng.add_request(A, "Hello world", SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_work():
        eng.step()
    got = eng.pop_finished(r)
    assert got.finish_reason == "length" and len(got.output_ids) == 3


def test_abort_frees_at_once_and_clear_errors() -> None:
    eng = Engine([A], 64 * MiB)
    free0 = eng.pool.num_free
    rid = eng.add_request(A, "Hello", SamplingParams(max_tokens=50))
    eng.step()
    assert eng.pool.num_free < free0
    eng.abort(rid)
    assert eng.pool.num_free == free0 and eng.requests[rid].finish_reason == "abort"
    eng.check_integrity()
    with pytest.raises(ConfigError, match="unknown model"):
        eng.add_request("nope", "x")
    with pytest.raises(ConfigError, match="context window"):
        eng.add_request(A, [1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="neither a built-in model nor a checkpoint"):
        Engine(["tiny-llama-z"], 64 * MiB)


@pytest.mark.gpu
def test_cuda_engine_matches_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    cpu = Engine([A], 64 * MiB).generate(A, PROMPTS, p)
    gpu = Engine([A], 64 * MiB, device="cuda").generate(A, PROMPTS, p)
    assert gpu == cpu


def test_arena_too_small_for_the_weights_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="arena_bytes too small"):
        Engine([A], 1 * MiB)


def test_a_request_that_outgrows_the_arena_ends_with_capacity_not_a_hang() -> None:
    cfg = load_weight_source(A).cfg
    per_block = cfg.spec.num_layers * cfg.spec.num_kv_heads
    page_bytes = 2 * 16 * cfg.spec.head_dim * 4
    eng = Engine([A], weights_bytes(A) + 2 * per_block * page_bytes)  # 32 tokens of KV
    rid = eng.add_request(A, "Hello", SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(200):
        if not eng.has_work():
            break
        eng.step()
        eng.check_integrity()
    req = eng.pop_finished(rid)
    assert req.finish_reason == "capacity"
    assert 20 <= len(req.output_ids) < 100  # it ran until the arena was full
    assert eng.pool.kv_pages == 0
    with pytest.raises(ConfigError, match="KV pages"):
        eng.add_request(A, [1] * 40, SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        Engine([A], 64 * MiB, max_batch_tokens=8).add_request(A, [1] * 9)


def test_fused_qkv_and_gate_up_are_views_of_the_layer_and_compute_the_same() -> None:
    """fuse_views stacks q/k/v and gate/up of a layer buffer without copying; the
    fused GEMMs give what the separate ones give; separate tensors get no fusion."""
    from fleetserve.runtime.engine.model import (
        fuse_views,
        layer_views,
        linear,
        mlp,
        qkv,
        rms_norm,
    )
    from fleetserve.runtime.engine.weights import layer_tensors

    src = load_weight_source("tiny-llama-b")
    cfg = src.cfg
    flat = torch.zeros(layer_numel(cfg))
    w = layer_views(cfg, flat)
    for k, t in layer_tensors(src, 1).items():
        w[k].copy_(t)
    loose = {k: t.clone() for k, t in w.items()}
    fuse_views(w)
    fuse_views(loose)  # separate buffers: not adjacent, nothing added
    assert "qkv" in w and "gate_up" in w and "qkv" not in loose and "gate_up" not in loose
    assert w["qkv"].data_ptr() == w["q"].data_ptr()
    assert w["gate_up"][cfg.spec.intermediate_size :].data_ptr() == w["up"].data_ptr()
    x = torch.randn(5, cfg.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)
    from fleetserve.runtime.engine.model import Rotary

    cos, sin = Rotary(cfg, torch.device("cpu")).cos_sin(pos, x.dtype)
    for a, b in zip(qkv(cfg, w, x, cos, sin), qkv(cfg, loose, x, cos, sin), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(mlp(cfg, w, x), mlp(cfg, loose, x))
    xn = rms_norm(x, w["ln1"], cfg.rms_norm_eps)
    torch.testing.assert_close(linear(xn, w["q"]), torch.nn.functional.linear(xn, w["q"]))
