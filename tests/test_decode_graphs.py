"""Decode steps as static padded graphs (runtime/engine/decode_graphs.py).

On the CPU the static step runs eagerly (``decode_graphs="static"``): the
same padded buffers, padding rows and masked keys a CUDA graph replays. Its
greedy tokens must equal the eager step's for any batch and context layout.
The CUDA tests capture real graphs; they run on a lent GPU
(``benchmarks/gpu_check.sh``)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fleetserve.errors import ConfigError  # noqa: E402
from fleetserve.runtime.engine.decode_graphs import pow2_at_least  # noqa: E402
from fleetserve.runtime.engine.engine import Engine  # noqa: E402
from fleetserve.runtime.engine.sampling import SamplingParams  # noqa: E402

A, B = "tiny-llama-a", "tiny-llama-b"
MiB = 1 << 20


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(eng: Engine, model: str, ps: list[list[int]], n_new: int) -> list[list[int]]:
    """Requests arrive one per step (so batches of every size decode), to the end."""
    p = SamplingParams(max_tokens=n_new, ignore_eos=True)
    rids: list[int] = []
    pending = list(ps)
    while pending or eng.has_work():
        if pending:
            rids.append(eng.add_request(model, pending.pop(0), p))
        eng.step()
        eng.check_integrity()
    return [eng.pop_finished(r).output_ids for r in rids]


def test_pow2_buckets() -> None:
    assert [pow2_at_least(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 33)] == [1, 1, 2, 4, 4, 8, 8, 16, 64]


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    kw = {"block_size": 4, "attention": "gather"}
    eager = Engine([A, B], 48 * MiB, decode_graphs="off", **kw)  # type: ignore[arg-type]
    static = Engine([A, B], 48 * MiB, decode_graphs="static", **kw)  # type: ignore[arg-type]
    return eager, static


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 11),
    lo=st.integers(1, 20),
    span=st.integers(0, 40),
    n_new=st.integers(2, 12),
    seed=st.integers(0, 10**6),
    model=st.sampled_from([A, B]),
)
def test_the_static_step_gives_the_eager_steps_tokens(
    engines: tuple[Engine, Engine], n: int, lo: int, span: int, n_new: int, seed: int, model: str
) -> None:
    eager, static = engines
    ps = prompts(n, lo, lo + span, seed)
    before = static._graphs.eager_steps  # type: ignore[union-attr]
    assert run(static, model, ps, n_new) == run(eager, model, ps, n_new)
    assert static._graphs.eager_steps > before  # type: ignore[union-attr]
    assert eager._graphs is None


def test_two_models_decode_in_one_step_each_through_its_graph() -> None:
    kw = {"attention": "gather"}
    eager = Engine([A, B], 48 * MiB, decode_graphs="off", **kw)  # type: ignore[arg-type]
    static = Engine([A, B], 48 * MiB, decode_graphs="static", **kw)  # type: ignore[arg-type]
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = []
    for eng in (eager, static):
        ra = [eng.add_request(A, q, p) for q in prompts(3, 5, 40, 1)]
        rb = [eng.add_request(B, q, p) for q in prompts(5, 5, 40, 2)]
        while eng.has_work():
            eng.step()
        outs.append([eng.pop_finished(r).output_ids for r in ra + rb])
    assert outs[0] == outs[1]
    keys = {k[0] for k in static._graphs._graphs}  # type: ignore[union-attr]
    assert keys == {A, B}


@pytest.mark.parametrize("features", ["preemption", "prefix+chunked"])
def test_the_static_step_under_preemption_prefix_caching_and_chunked_prefill(
    features: str,
) -> None:
    """Pages taken back and recomputed (preemption), pages shared by cached
    prefixes, mixed steps between decode-only ones: the static step's tokens
    are still the eager step's."""
    kw: dict[str, object] = {"attention": "gather", "block_size": 4}
    if features == "preemption":
        probe = Engine([A], 48 * MiB, **kw)  # type: ignore[arg-type]
        spec = probe.models[A].cfg.spec
        page = probe.pool.page_bytes
        weights = probe.pool.weight_pages() * page
        arena = weights + 12 * spec.num_layers * spec.num_kv_heads * page  # 48 tokens of KV
        ps = prompts(6, 3, 14, 5)
    else:
        kw |= {"prefix_caching": True, "chunked_prefill": True, "max_batch_tokens": 24}
        arena = 48 * MiB
        base = prompts(1, 30, 30, 9)[0]
        ps = [base + q for q in prompts(6, 1, 12, 6)]
    outs, preempted = [], []
    for mode in ("off", "static"):
        eng = Engine([A], arena, decode_graphs=mode, **kw)  # type: ignore[arg-type]
        p = SamplingParams(max_tokens=16, ignore_eos=True)
        rids = [eng.add_request(A, q, p) for q in ps]
        n = 0
        while eng.has_work():
            n += len(eng.step().preempted)
            eng.check_integrity()
        outs.append([eng.pop_finished(r).output_ids for r in rids])
        preempted.append(n)
        if mode == "static":
            assert eng._graphs is not None and eng._graphs.eager_steps > 0
        if features != "preemption":
            assert eng.prefix_hits > 0
    assert outs[0] == outs[1]
    assert preempted[0] == preempted[1]
    if features == "preemption":
        assert preempted[1] > 0


def test_every_bucket_of_a_model_reads_its_tables_from_one_buffer() -> None:
    """One table buffer per model, grown to a power of two when a larger
    bucket comes (the model's graphs then go): memory of one bucket, not of
    every bucket."""
    eng = Engine([A], 48 * MiB, decode_graphs="static", attention="gather", block_size=4)
    dg = eng._graphs
    assert dg is not None
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    eng.generate(A, prompts(1, 3, 5, 1), p)
    small = dg._tables[A].numel()
    out = eng.generate(A, prompts(7, 20, 60, 2), p)
    flat = dg._tables[A]
    assert flat.numel() > small and flat.numel() & (flat.numel() - 1) == 0
    ptr = flat.untyped_storage().data_ptr()
    assert len(dg) >= 1
    assert all(g.tab.untyped_storage().data_ptr() == ptr for g in dg._graphs.values())
    ref = Engine([A], 48 * MiB, decode_graphs="off", attention="gather", block_size=4)
    assert out == ref.generate(A, prompts(7, 20, 60, 2), p)


def test_a_moved_layer_drops_the_captured_steps_and_tokens_stay_exact() -> None:
    eng = Engine([A], 48 * MiB, decode_graphs="static", attention="gather")
    ref = Engine([A], 48 * MiB, decode_graphs="off", attention="gather")
    ps = prompts(4, 3, 30, 7)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    first = eng.generate(A, ps, p)
    assert len(eng._graphs) > 0  # type: ignore[arg-type]
    eng.drop_layer(A, 1)
    assert len(eng._graphs) == 0  # type: ignore[arg-type]
    eng.restore_layer(A, 1)
    assert eng.generate(A, ps, p) == first == ref.generate(A, ps, p)
    eng.sleep()
    assert len(eng._graphs) == 0  # type: ignore[arg-type]
    eng.wake()
    assert eng.generate(A, ps, p) == first


def test_a_model_holding_some_layers_runs_the_eager_step() -> None:
    eng = Engine([(A, [0, 1])], 48 * MiB, decode_graphs="static", attention="gather")
    assert eng._graphs is not None
    assert eng.models[A].cfg.spec.num_layers > 2  # a partial holder: no forward() here


def test_bad_modes_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="decode_graphs 'sometimes'"):
        Engine([A], 48 * MiB, decode_graphs="sometimes")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            Engine([A], 48 * MiB, decode_graphs="capture")
    with pytest.raises(ConfigError, match="not attention 'flex'"):
        Engine([A], 48 * MiB, decode_graphs="static", attention="flex")
    assert Engine([A], 48 * MiB)._graphs is None  # auto on a CPU: off


def test_a_failed_capture_runs_the_step_eagerly_and_gives_up_after_three(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng = Engine([A], 48 * MiB, decode_graphs="static", attention="gather")
    ref = Engine([A], 48 * MiB, decode_graphs="off", attention="gather")
    dg = eng._graphs
    assert dg is not None
    tries: list[int] = []

    def broken(g: object, fn: object) -> None:
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    dg.capture = True  # as on CUDA, with a capture that always fails
    monkeypatch.setattr(dg, "_capture", broken)
    ps = [[11, 12, 13, 14, 15]]  # 5 + 10 tokens: every step in one bucket (1 request, 1 block)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    assert eng.generate(A, ps, p) == ref.generate(A, ps, p)
    assert len(tries) == 3  # then the bucket stays eager
    assert dg.replays == 0 and dg.eager_steps == 9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_captured_steps_equal_the_eager_steps(dtype: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dt = getattr(torch, dtype)
    kw = {"device": "cuda", "dtype": dt}
    graphs = Engine([A, B], 64 * MiB, decode_graphs="capture", **kw)  # type: ignore[arg-type]
    eager = Engine([A, B], 64 * MiB, decode_graphs="off", **kw)  # type: ignore[arg-type]
    static = Engine([A, B], 64 * MiB, decode_graphs="static", **kw)  # type: ignore[arg-type]
    ps = prompts(13, 3, 90, 11)
    got = run(graphs, A, ps, 24)
    assert graphs._graphs is not None and graphs._graphs.captured > 0
    assert graphs._graphs.failed == 0  # the table buffer grew on the way: graphs went
    want_static = run(static, A, ps, 24)
    want_eager = run(eager, A, ps, 24)
    # weights moved: the steps are captured again, the tokens stay
    graphs.drop_layer(A, 0)
    graphs.restore_layer(A, 0)
    assert len(graphs._graphs) == 0
    captured = graphs._graphs.captured
    again = run(graphs, A, ps, 24)
    graphs.check_integrity()
    # captured again after every graph went (a stale pool made each capture fail,
    # and the steps ran eagerly with the same tokens)
    assert graphs._graphs.captured > captured
    assert graphs._graphs.failed == 0
    # a replay computes what the static step computes, kernel for kernel
    assert got == want_static
    assert again == got
    if dtype == "float32":  # other kernels (buckets, no padding): the same greedy tokens
        assert got == want_eager


@pytest.mark.parametrize("on", [True, False])
def test_serve_cuda_graphs_reaches_each_workers_engine(
    on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve.cuda_graphs`` (default true) -> WorkerSpec -> the engine's
    ``decode_graphs`` ("auto": graphs on CUDA; "off": eager)."""
    from fleetserve.cli.serve import serve_config_dict
    from fleetserve.config import config_from_dict
    from fleetserve.runtime import cluster, worker

    data = {"serve": {"workers": 1, "gpu_memory_mb": 48, "models": [A], "cuda_graphs": on}}
    cfg = config_from_dict(serve_config_dict(data))
    (spec,) = cluster.worker_specs(cfg, cluster.served_models(cfg))
    assert spec.cuda_graphs is on
    seen: list[str] = []

    def engine(*args: object, **kw: object) -> Engine:
        seen.append(str(kw["decode_graphs"]))
        return Engine(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(worker, "Engine", engine)
    worker.WorkerCore(spec)
    assert seen == ["auto" if on else "off"]
    assert config_from_dict(serve_config_dict({"serve": {}})).serve.cuda_graphs is True
