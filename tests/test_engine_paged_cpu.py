"""The CPU decode kernel over the paged arena (paged_cpu.py) and the engine's
``paged`` attention mode, against attention on each request's own pages."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")
pytest.importorskip("numba")

from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_weights import tiny_cfg

from fleetserve.errors import ConfigError
from fleetserve.runtime.engine import paged_cpu
from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.model import PACKED
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.engine.weights import RandomWeights

MiB = 2**20
A, S = "tiny-llama-a", "tiny-llama-b"
NARROW = tiny_cfg().spec.name


def reference(
    q: torch.Tensor, arena: torch.Tensor, tab: torch.Tensor, ctx: list[int], bs: int, nkv: int
) -> torch.Tensor:
    """Per request and KV head: read its keys and values page by page (the
    pool's layout: ``bs`` key rows of ``d``, then ``bs`` value rows), then
    softmax(q k^T / sqrt(d)) v in float64."""
    n, nh, d = q.shape
    g = nh // nkv
    out = torch.empty(n, nh, d, dtype=torch.float64)
    for b in range(n):
        for h in range(nkv):
            ks, vs = [], []
            for t in range(ctx[b]):
                page = arena[int(tab[b, t // bs, h])].double()
                ks.append(page[(t % bs) * d : (t % bs + 1) * d])
                vs.append(page[(bs + t % bs) * d : (bs + t % bs + 1) * d])
            k, v = torch.stack(ks), torch.stack(vs)
            qh = q[b, h * g : (h + 1) * g].double()
            p = torch.softmax(qh @ k.T / d**0.5, dim=-1)
            out[b, h * g : (h + 1) * g] = p @ v
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], int, int]:
    bs = draw(st.sampled_from([1, 4, 16]))
    d = draw(st.sampled_from([8, 16, 64]))
    d_max = d * draw(st.sampled_from([1, 2]))  # a model narrower than the arena's widest
    nkv = draw(st.sampled_from([1, 2, 4]))
    g = draw(st.integers(1, 3))
    ctx = draw(st.lists(st.integers(1, 70), min_size=1, max_size=5))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    ntb = -(-max(ctx) // bs)
    pages = len(ctx) * ntb * nkv + draw(st.integers(0, 8))
    arena = torch.randn(pages, 2 * bs * d_max, generator=gen)
    # every (request, block, head) its own page, in a random order
    tab = torch.randperm(pages, generator=gen)[: len(ctx) * ntb * nkv].view(len(ctx), ntb, nkv)
    q = torch.randn(len(ctx), nkv * g, d, generator=gen) * 2
    return q, arena, tab, ctx, bs, nkv


@settings(max_examples=60, deadline=None)
@given(cases())
def test_kernel_equals_attention_over_each_requests_pages(case) -> None:  # type: ignore[no-untyped-def]
    q, arena, tab, ctx, bs, nkv = case
    got = paged_cpu.decode_attention(q, arena, tab, torch.tensor(ctx), bs, nkv)
    want = reference(q, arena, tab, ctx, bs, nkv)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-87.0, 0.0, width=32), min_size=1, max_size=64))
def test_kernel_softmax_weights_are_exact_to_a_few_ulp(scores: list[float]) -> None:
    """The kernel's own exp (a vectorised polynomial, not libm's): with value
    rows that are one-hot, the output is the softmax weights themselves; each
    must match float64's to 1e-6 relative (a few float32 ulp), down to
    weights of e^-87."""
    import numpy as np

    from fleetserve.runtime.engine._paged_kernel import decode_serial

    n, d, bs = len(scores), 64, 16
    pages = -(-n // bs)
    kv = np.zeros((pages, 2 * bs, d), np.float32)
    for t, x in enumerate(scores):
        kv[t // bs, t % bs, 0] = x  # key row t: score x against q = e_0
        kv[t // bs, bs + t % bs, t] = 1.0  # value row t: e_t
    q = np.zeros((1, 1, 1, d), np.float32)
    q[0, 0, 0, 0] = 1.0
    tab = np.arange(pages, dtype=np.int64).reshape(1, pages, 1)
    out = np.empty_like(q)
    decode_serial(q, kv, tab, np.array([n], np.int64), out, bs, 1.0, 1)
    # the shift by the maximum is a float32 subtraction in any float32
    # softmax (torch's too), whose rounding exp magnifies by up to |x| ulp:
    # the reference takes the same shifted scores, so the test measures exp
    x32 = np.array(scores, np.float32)
    want = np.exp((x32 - x32.max()).astype(np.float64))
    want /= want.sum()
    np.testing.assert_allclose(out[0, 0, 0, :n], want, rtol=1e-6, atol=0)


def test_parallel_kernel_equals_serial() -> None:
    """With two torch threads the jobs run in a parallel loop (where a
    thread-safe layer exists), dealt round-robin. Each job is the same code,
    but ``fastmath`` lets LLVM reassociate the sums differently in the two
    builds (a clean CI run differed by one float32 ulp in 5% of the outputs),
    so the two agree to rounding, not bit for bit."""
    gen = torch.Generator().manual_seed(7)
    arena = torch.randn(200, 2 * 16 * 64, generator=gen)
    tab = torch.randperm(200, generator=gen)[: 6 * 8 * 4].view(6, 8, 4)
    q = torch.randn(6, 12, 64, generator=gen)
    ctx = torch.tensor([1, 17, 128, 64, 99, 33])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_cpu.decode_attention(q, arena, tab, ctx, 16, 4)
        torch.set_num_threads(2)
        two = paged_cpu.decode_attention(q, arena, tab, ctx, 16, 4)
        assert paged_cpu.threads_note()  # says which build ran
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-5)


def narrow_model() -> RandomWeights:
    """A model whose head_dim (16) is narrower than the built-ins' (64)."""
    cfg = tiny_cfg()
    assert cfg.spec.head_dim == 16
    return RandomWeights(cfg, 5)


def test_engine_paged_outputs_equal_gather() -> None:
    """Greedy outputs with the kernel equal the gather path's: two models of
    different head widths in one arena, decodes beside new prompts and a
    continuation after preemption (a small arena forces some)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(mode: str) -> tuple[list[list[int]], ...]:
        eng = Engine([A, narrow_model()], 24 * MiB, max_running=3, attention=mode)
        assert eng.attention == mode
        outs = (eng.generate(A, prompts, params), eng.generate(NARROW, prompts, params))
        eng.check_integrity()
        return outs

    assert run("paged") == run("gather")


def test_attention_auto_takes_the_kernel_where_it_runs() -> None:
    assert Engine([A], 16 * MiB).attention == "paged"
    # bfloat16 pages: the kernel reads float32 only
    assert Engine([A], 16 * MiB, dtype=torch.bfloat16).attention == "gather"
    with pytest.raises(ConfigError, match="attention 'paged' cannot run: it reads float32"):
        Engine([A], 16 * MiB, dtype=torch.bfloat16, attention="paged")
    with pytest.raises(ConfigError, match="expected one of auto, paged, gather, flex"):
        Engine([A], 16 * MiB, attention="dense")


def test_packed_weights_follow_their_layer() -> None:
    """CPU float32 layers carry oneDNN-packed weight copies; a dropped layer
    takes them with it, a restored one packs again, and outputs do not change."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng = Engine([S], 64 * MiB)
    layer = eng.models[S].layers[0]
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    assert {PACKED + n for n in ("qkv", "o", "gate", "up", "down")} <= set(layer)
    before = eng.generate(S, ["packed weights"], params)
    eng.drop_layer(S, 0)
    assert 0 not in eng.models[S].layers
    eng.restore_layer(S, 0)
    assert PACKED + "qkv" in eng.models[S].layers[0]
    assert eng.generate(S, ["packed weights"], params) == before
