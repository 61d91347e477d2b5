"""The simulator half of the fidelity experiment: emulated GPUs, the engine's
models in ``spec``, the calibrated cost model with decode attention, and the
simulated-vs-measured table.

The KV-capacity tests build real engines (torch); everything else runs
without torch.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from png_util import skip_run_rendering

from fleetserve.cli.serve import serve_config_dict
from fleetserve.config import SimConfig
from fleetserve.config import config_from_dict as _config_from_dict
from fleetserve.costmodel import (
    CostModel,
    EfficiencyParams,
    ProfileRow,
    calibrate,
    fit,
    load_profile,
    predict_row,
    relative_errors,
    write_profile,
)
from fleetserve.errors import ConfigError, InputError, UnknownNameError
from fleetserve.experiments.fidelity import (
    emulated_gpu_for,
    emulated_sim_config,
    engine_step_check,
    fidelity_markdown,
    fidelity_table,
    in_situ_factors,
    load_measured_requests,
    operating_rows,
    read_summary,
    rescale_profile,
    runtime_placement,
    simulate_emulated,
)
from fleetserve.metrics.io import write_requests_csv
from fleetserve.metrics.records import RequestRecord
from fleetserve.spec import (
    ENGINE_MODELS,
    emulated_gpu,
    fits,
    get_gpu,
    get_model,
    kv_capacity_blocks,
    kv_capacity_tokens,
)
from fleetserve.spec.emulated import arena_kv_blocks, arena_pages, arena_weight_pages
from fleetserve.spec.memory import group_kv_bytes

A, B = "tiny-llama-a", "tiny-llama-b"


@pytest.fixture(autouse=True)
def _run_rendering_once(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated runs' plots are rendered by the test of the result folder
    only; elsewhere they are built but not rendered (nothing else looks at them)."""
    if request.node.name != "test_simulate_emulated_writes_a_result_dir":
        skip_run_rendering(monkeypatch)


def config_from_dict(data: dict) -> SimConfig:
    """The config as ``fleetserve serve`` resolves it (a fixed pool unless elastic)."""
    return _config_from_dict(serve_config_dict(data))


# ------------------------------------------------------------------ spec: models, GPUs


def test_engine_models_resolve_without_torch() -> None:
    code = (
        "import sys; from fleetserve.spec import get_model; "
        "from fleetserve.experiments import fidelity; "
        "import fleetserve.sim.simulator; "
        "m = get_model('tiny-llama-b'); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(m.num_layers)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "6"


def test_engine_models_shapes() -> None:
    a, b = get_model(A), get_model("TINY-LLAMA-B")
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (
        4,
        256,
        4,
        2,
        64,
    )
    assert (b.num_layers, b.hidden_size, b.intermediate_size) == (6, 384, 1024)
    assert a.dtype_bytes == b.dtype_bytes == 4  # float32 engine
    assert a.kv_bytes_per_token == 4 * 2 * 2 * 64 * 4
    assert set(ENGINE_MODELS) == {A, B, "small-llama"}
    with pytest.raises(UnknownNameError, match="tiny-llama-a"):
        get_model("tiny-llama-z")


def test_engine_config_takes_the_spec_objects() -> None:
    pytest.importorskip("torch")
    from fleetserve.runtime.engine.config import BUILTIN_MODELS, BYTE_VOCAB, builtin_config

    for name in (A, B):
        assert builtin_config(name).spec is get_model(name)
    assert BUILTIN_MODELS[A].seed == 1 and BUILTIN_MODELS[B].seed == 2
    assert BUILTIN_MODELS[A].bos_token_id == 256 and BUILTIN_MODELS[A].eos_token_ids == (257,)
    assert BYTE_VOCAB == 260


def test_emulated_gpu_names() -> None:
    g = get_gpu("emu-64mib")
    assert g.hbm_bytes == 64 * 2**20 and g.arena is not None
    assert (g.arena.elem_bytes, g.arena.block_size) == (4, 16)
    assert g.intra_node_link == "host" and g.intra_node_bw == 1e9
    g2 = get_gpu("EMU-96.5MiB-float16-t2-bs32")
    assert g2.name == "emu-96.5mib-float16-t2-bs32"
    assert g2.hbm_bytes == int(96.5 * 2**20)
    assert g2.arena is not None and (g2.arena.elem_bytes, g2.arena.block_size) == (2, 32)
    assert g2.bf16_flops == 2 * g.bf16_flops and g2.hbm_bw == 2 * g.hbm_bw
    assert emulated_gpu(64) == g
    assert get_gpu(emulated_gpu(12.25, dtype="bfloat16").name) == emulated_gpu(
        12.25, dtype="bfloat16"
    )
    for bad in ("emu-64", "emu-64mib-int8", "emu-mib", "emu-64mib-t0x"):
        with pytest.raises(ConfigError, match="emu-<MiB>mib"):
            get_gpu(bad)
    with pytest.raises(ConfigError, match="threads"):
        emulated_gpu(64, threads=0)


def test_catalog_gpus_unchanged_by_the_arena_field() -> None:
    a100 = get_gpu("a100-40gb")
    assert a100.arena is None
    m = get_model("llama-2-7b")
    want = (math.floor(a100.hbm_bytes * 0.9) - m.weight_bytes) // m.kv_bytes_per_token // 16
    assert kv_capacity_blocks(m, a100, 1, 0.9, 16) == want == 3001


# --------------------------------------------------------- KV capacity vs a real engine


def _engine_blocks(model: str, arena_bytes: int, dtype: str, block_size: int) -> int:
    """KV blocks a real Engine holds, probed through its pool's check/commit pair."""
    torch = pytest.importorskip("torch")
    from fleetserve.runtime.engine.engine import Engine

    dt = {"float32": torch.float32, "float16": torch.float16}[dtype]
    eng = Engine([model], arena_bytes, block_size=block_size, dtype=dt)
    pool = eng.pool
    per_block = pool.pages_per_token_block(model)
    blocks = (pool.num_pages - pool.weight_pages()) // per_block
    # the pool agrees: one request can grow to exactly that many blocks, not a token more
    pool.open(1 << 41, model)
    assert pool.can_grow(1 << 41, blocks * block_size)
    assert not pool.can_grow(1 << 41, blocks * block_size + 1)
    # the engine's own admission limit for a prompt: its KV must fit the KV pages
    assert pool.num_free >= blocks * per_block
    return blocks


@pytest.fixture(autouse=False)
def one_thread() -> Iterator[None]:
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("model", [A, B])
@pytest.mark.parametrize("mib", [40.0, 48.5, 64.0, 100.0])
def test_kv_capacity_matches_the_engine(model: str, mib: float) -> None:
    gpu = emulated_gpu(mib)
    spec = get_model(model)
    want = _engine_blocks(model, int(mib * 2**20), "float32", 16)
    assert kv_capacity_blocks(spec, gpu, 1, 1.0, 16) == want
    assert kv_capacity_tokens(spec, gpu, 1, 1.0) == want * 16
    assert arena_kv_blocks(spec, gpu) == want


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("model", "mib", "dtype", "bs"), [(A, 24.0, "float16", 16), (B, 72.0, "float32", 32)]
)
def test_kv_capacity_matches_other_dtypes_and_block_sizes(
    model: str, mib: float, dtype: str, bs: int
) -> None:
    gpu = get_gpu(emulated_gpu(mib, dtype=dtype, block_size=bs).name)
    want = _engine_blocks(model, int(mib * 2**20), dtype, bs)
    assert kv_capacity_blocks(get_model(model), gpu, 1, 1.0, bs) == want


@pytest.mark.usefixtures("one_thread")
def test_an_arena_too_small_for_kv_does_not_fit() -> None:
    spec = get_model(A)
    gpu = emulated_gpu(64)
    _, elems, page_bytes = arena_pages(gpu, spec.head_dim)
    weights = arena_weight_pages(spec, elems)
    per_block = spec.num_layers * spec.num_kv_heads
    # room for the layers and one page short of one KV block
    tight_mib = (weights + per_block - 1) * page_bytes / 2**20
    tight = emulated_gpu(tight_mib)
    assert not fits(spec, tight, 1, 1.0)
    with pytest.raises(ConfigError, match=r"serve\.gpu_memory_mb"):
        kv_capacity_blocks(spec, tight, 1, 1.0, 16)
    assert _engine_blocks(A, tight.hbm_bytes, "float32", 16) == 0
    one = emulated_gpu((weights + per_block) * page_bytes / 2**20)
    assert fits(spec, one, 1, 1.0) and kv_capacity_blocks(spec, one, 1, 1.0, 16) == 1


def test_arena_rules() -> None:
    spec, gpu = get_model(A), emulated_gpu(64)
    with pytest.raises(ConfigError, match="tp must be 1"):
        kv_capacity_blocks(spec, gpu, 2, 1.0, 16)
    with pytest.raises(ConfigError, match="-bs32"):
        kv_capacity_blocks(spec, gpu, 1, 1.0, 32)
    assert not fits(spec, gpu, tp=2)
    # a shared arena: both models' layers, pages as wide as the widest head
    both = group_kv_bytes([spec, get_model(B)], 1, gpu, 1.0)
    pages, elems, page_bytes = arena_pages(gpu, 64)
    w = arena_weight_pages(spec, elems) + arena_weight_pages(get_model(B), elems)
    assert both == (pages - w) * page_bytes
    # mem_util scales the arena
    assert kv_capacity_blocks(spec, gpu, 1, 0.5, 16) == arena_kv_blocks(spec, emulated_gpu(32))


# ------------------------------------------------------------- cost model: extension


TRUE = EfficiencyParams(
    compute_eff=0.35,
    mem_eff=0.5,
    overhead_s=1.5e-3,
    attn_eff=0.2,
    decode_attn_eff=0.04,
)


def _synthetic_rows(params: EfficiencyParams, model: str = A, gpu_col: str = "cpu") -> list:
    """Rows of the profiler's default grid, timed by the cost model with ``params``."""
    gpu = emulated_gpu(64)
    cost = CostModel(params).bind(get_model(model), gpu)
    rows = []
    for b in (1, 2, 4, 8, 16, 32):
        for p in (32, 128, 512):
            r = ProfileRow(model, gpu.name, 1, "prefill", b, b * p, 0, 1.0)
            rows.append(replace(r, time_s=predict_row(cost, r), gpu=gpu_col))
        for c in (64, 256, 1024):
            r = ProfileRow(model, gpu.name, 1, "decode", b, b, b * c, 1.0)
            rows.append(replace(r, time_s=predict_row(cost, r), gpu=gpu_col))
    return rows


def test_calibration_round_trip_recovers_decode_attention() -> None:
    gpu = emulated_gpu(64)
    rows = [replace(r, gpu=gpu.name) for r in _synthetic_rows(TRUE)]
    got = fit(rows, get_model(A), gpu, decode_attention=True)
    for name in ("compute_eff", "attn_eff", "decode_attn_eff", "overhead_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    cost = CostModel(got).bind(get_model(A), gpu)
    assert np.abs(relative_errors(cost, rows)).max() < 1e-9
    # without the extension the same rows cannot be fitted exactly
    plain = fit(rows, get_model(A), gpu)
    assert plain.decode_attn_eff is None
    worse = relative_errors(CostModel(plain).bind(get_model(A), gpu), rows)
    assert np.abs(worse).max() > 0.05


def test_calibration_round_trip_through_a_csv(tmp_path: Path) -> None:
    path = tmp_path / "prof.csv"
    write_profile(path, _synthetic_rows(TRUE, model=B))
    gpu = emulated_gpu(64)
    cal = calibrate(load_profile(path), get_model, lambda _: gpu, decode_attention=True)
    got = cal.get(B, gpu.name, 1)
    assert got is not None and got.decode_attn_eff == pytest.approx(0.04, rel=1e-6)
    cal.save(tmp_path / "cal.json")
    doc = json.loads((tmp_path / "cal.json").read_text())
    assert doc["entries"][0]["params"]["decode_attn_eff"] == pytest.approx(0.04, rel=1e-6)


def test_decode_attention_unset_changes_nothing() -> None:
    assert "decode_attn_eff" not in EfficiencyParams().to_dict()
    assert EfficiencyParams.from_dict(TRUE.to_dict()) == TRUE
    assert EfficiencyParams().decode_attention_eff == EfficiencyParams().attn_eff
    with pytest.raises(ConfigError, match="decode_attn_eff"):
        EfficiencyParams(decode_attn_eff=0.0)
    spec, gpu = get_model("llama-2-7b"), get_gpu("a100-40gb")
    plain = CostModel(EfficiencyParams()).bind(spec, gpu)
    same = CostModel(EfficiencyParams(decode_attn_eff=0.5)).bind(spec, gpu)  # = attn_eff
    x = np.array([100.0, 5000.0, 40000.0])
    assert np.allclose(plain.decode_time(8, x), same.decode_time(8, x), rtol=1e-12)
    assert plain.mixed_time([(300, 0)], 8, 4000) == pytest.approx(
        same.mixed_time([(300, 0)], 8, 4000), rel=1e-12
    )


def test_decode_attention_prices_decode_pairs_only() -> None:
    spec, gpu = get_model(A), emulated_gpu(64)
    params = replace(TRUE, mem_eff=1.0)  # both on the compute side of the max
    c = CostModel(params).bind(spec, gpu)
    base = CostModel(replace(params, decode_attn_eff=None)).bind(spec, gpu)
    pair = c.raw.pair_flop_s
    # a prefill is unaffected; a decode pays 1/decode_attn_eff per context token
    assert c.prefill_time([100, 50]) == base.prefill_time([100, 50])
    assert c.decode_time_scalar(4, 1000) - base.decode_time_scalar(4, 1000) == pytest.approx(
        1000 * pair * (1 / 0.04 - 1 / 0.2), rel=1e-9
    )
    # mixed: chunk pairs at attn_eff, decode context at decode_attn_eff
    mixed = c.mixed_time([(64, 0)], 4, 1000)
    assert mixed - base.mixed_time([(64, 0)], 4, 1000) == pytest.approx(
        1000 * pair * (1 / 0.04 - 1 / 0.2), rel=1e-9
    )
    # ideal times use the decode coefficient for their decode steps
    p, o = np.array([20.0]), np.array([30.0])
    steps = sum(c.decode_time_scalar(1, 20 + j) for j in range(1, 30))
    assert c.ideal_times(p, o)[0] == pytest.approx(c.prefill_time([20]) + steps, rel=1e-9)


# ------------------------------------------------------------------- emulated config


def _trace(path: Path, n: int = 60, rate: float = 20.0, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    t = 0.0
    with path.open("w") as f:
        for _ in range(n):
            t += float(rng.exponential(1 / rate))
            p, o = int(rng.integers(8, 160)), int(rng.integers(2, 40))
            f.write(json.dumps({"arrival_s": round(t, 5), "prompt_tokens": p, "output_tokens": o}))
            f.write("\n")
    return path


def _config(tmp_path: Path, **serve: object) -> SimConfig:
    data = {
        "model": A,
        "workload": {"trace": str(_trace(tmp_path / "t.jsonl")), "format": "jsonl"},
        "serve": {"workers": 2, "gpu_memory_mb": 48, "max_running": 16, **serve},
    }
    return config_from_dict(data)


def _profile(tmp_path: Path, models: tuple[str, ...] = (A,)) -> Path:
    path = tmp_path / "prof.csv"
    write_profile(path, [r for m in models for r in _synthetic_rows(TRUE, model=m)])
    return path


def test_emulated_sim_config_maps_the_serve_section(tmp_path: Path) -> None:
    cfg = _config(tmp_path, max_batch_tokens=1024, threads_per_worker=2)
    em = emulated_sim_config(cfg, _profile(tmp_path))
    sc = em.config
    assert sc.cluster.gpu == em.gpu.name == "emu-48mib-t2"
    assert (sc.cluster.elastic, sc.cluster.gpus, sc.cluster.tp, sc.cluster.mem_util) == (
        False,
        2,
        1,
        1.0,
    )
    assert sc.engine.max_num_seqs == 16 and sc.engine.max_batched_tokens == 1024
    assert sc.engine.watermark == 0.0 and sc.engine.chunked_prefill
    assert em.placement == (A, A)
    assert em.kv_blocks == {A: arena_kv_blocks(get_model(A), em.gpu)}
    assert em.calibration is not None
    p = em.calibration.get(A, em.gpu.name, 1)
    assert p is not None and p.decode_attn_eff is not None
    # the rows named 'cpu' were fitted against the emulated GPU (threads: 2x nominal)
    assert p.compute_eff == pytest.approx(TRUE.compute_eff / 2, rel=1e-6)


def test_emulated_sim_config_errors(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with pytest.raises(ConfigError, match="CPU workers"):
        emulated_gpu_for(replace(cfg, serve=replace(cfg.serve, device="cuda")))
    with pytest.raises(ConfigError, match=r"serve\.gpu_memory_mb"):
        emulated_sim_config(replace(cfg, serve=replace(cfg.serve, gpu_memory_mb=8)), None)
    other = tmp_path / "other.csv"
    write_profile(other, _synthetic_rows(TRUE, model=B))
    with pytest.raises(InputError, match="--threads 1"):
        emulated_sim_config(cfg, other)
    mixed = tmp_path / "mixed.csv"
    rows = _synthetic_rows(TRUE)
    write_profile(mixed, rows + [replace(r, gpu="l4-24gb") for r in rows])
    em = emulated_sim_config(cfg, mixed)  # 'cpu' rows win
    assert em.calibration is not None and len(em.calibration) == 1
    two = tmp_path / "two.csv"
    write_profile(two, [replace(r, gpu="x") for r in rows] + [replace(r, gpu="y") for r in rows])
    with pytest.raises(InputError, match="several GPUs"):
        emulated_sim_config(cfg, two)


def test_two_models_are_placed_as_the_runtime_places_them(tmp_path: Path) -> None:
    data = {
        "model": A,
        "workload": {
            "trace": str(_trace(tmp_path / "t.jsonl", n=80)),
            "format": "jsonl",
            "models": [A, B],
            "model_weights": [1.0, 3.0],
        },
        "serve": {"workers": 4, "gpu_memory_mb": 64, "models": [A, B]},
    }
    cfg = config_from_dict(data)
    em = emulated_sim_config(cfg, _profile(tmp_path, (A, B)))
    assert sorted(em.placement) == [A, B, B, B]
    assert set(em.kv_blocks) == {A, B}
    from fleetserve.runtime.plan import plan_workers

    assert tuple(m for (m,) in plan_workers(cfg, [A, B])) == em.placement
    assert runtime_placement(cfg, [A, B]) == em.placement
    summary = simulate_emulated(cfg, _profile(tmp_path, (A, B)), tmp_path / "out")
    assert summary["requests"]["finished"] == summary["requests"]["total"] == 80
    assert set(summary["services"]) == {A, B}


def test_simulate_emulated_writes_a_result_dir(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    out = tmp_path / "sim"
    summary = simulate_emulated(cfg, _profile(tmp_path), out)
    r = summary["requests"]
    assert r["finished"] == r["total"] == 60 and r["rejected"] == r["unfinished"] == 0
    for name in ("summary.json", "requests.csv", "report.md", "calibration.json"):
        assert (out / name).is_file(), name
    fid = summary["fidelity"]
    assert fid["gpu"] == "emu-48mib" and fid["placement"] == [A, A]
    assert fid["calibration"][A]["decode_attn_eff"] == pytest.approx(0.04, rel=1e-6)
    assert summary["config"]["engine"]["chunked_prefill"] is True
    assert read_summary(out)["latency_s"] == summary["latency_s"]
    assert summary["latency_s"]["ttft"]["mean"] > 0 and summary["latency_s"]["tpot"]["mean"] > 0
    # replaying its own requests gives the same run
    again = simulate_emulated(
        cfg,
        _profile(tmp_path),
        tmp_path / "again",
        requests=load_measured_requests(out),
    )
    assert again["latency_s"] == summary["latency_s"]


def test_a_full_arena_preempts_at_the_engines_capacity(tmp_path: Path) -> None:
    """Long requests on a small arena: the simulated instance has exactly the
    engine's blocks, and runs out of them (preempting) rather than rejecting."""
    data = {
        "model": A,
        "workload": {"trace": str(tmp_path / "long.jsonl"), "format": "jsonl"},
        "serve": {"workers": 1, "gpu_memory_mb": 40, "max_running": 64},
    }
    spec, gpu = get_model(A), emulated_gpu(40)
    blocks = arena_kv_blocks(spec, gpu)
    per_req = 600  # tokens of KV each request ends with
    n = math.ceil(blocks * 16 / per_req) + 4
    with (tmp_path / "long.jsonl").open("w") as f:
        for i in range(n):
            f.write(json.dumps({"arrival_s": i * 1e-3, "prompt_tokens": 400, "output_tokens": 200}))
            f.write("\n")
    cfg = config_from_dict(data)
    summary = simulate_emulated(cfg, _profile(tmp_path), tmp_path / "out")
    assert summary["fidelity"]["kv_blocks"] == {A: blocks}
    assert summary["requests"]["finished"] == n
    rows = list(csv.DictReader((tmp_path / "out" / "requests.csv").open()))
    assert sum(int(r["preemptions"]) for r in rows) > 0


def test_unknown_request_model_is_a_clear_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    path = tmp_path / "m" / "requests.csv"
    path.parent.mkdir()
    write_requests_csv(path, [RequestRecord(0, B, 0.0, 10, 5)])
    with pytest.raises(ConfigError, match="does not serve"):
        simulate_emulated(
            cfg,
            None,
            tmp_path / "o",
            requests=load_measured_requests(path.parent),
        )


def test_load_measured_requests_sorts_and_renumbers(tmp_path: Path) -> None:
    recs = [
        RequestRecord(7, A, 0.5, 10, 5, status="finished", first_token_s=0.6, finish_s=0.9),
        RequestRecord(3, A, 0.25, 20, 4, status="rejected", reason="HTTP 429"),
    ]
    write_requests_csv(tmp_path / "requests.csv", recs)
    reqs = load_measured_requests(tmp_path)
    assert [(r.id, r.arrival_s, r.prompt_tokens) for r in reqs] == [(0, 0.25, 20), (1, 0.5, 10)]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "requests.csv").write_text("model,arrival_s\nx,1\n")
    with pytest.raises(InputError, match="prompt_tokens"):
        load_measured_requests(tmp_path / "bad")


# --------------------------------------------------------------------- the table


def _summary(ttft: tuple[float, float], tpot: tuple[float, float], rps: float | None) -> dict:
    lat = {
        "ttft": {"mean": ttft[0], "p50": ttft[0], "p90": ttft[1], "p99": ttft[1]},
        "tpot": {"mean": tpot[0], "p50": tpot[0], "p90": tpot[1], "p99": tpot[1]},
        "e2e": {"mean": 1.0, "p50": 1.0, "p90": None, "p99": 2.0},
    }
    return {"latency_s": lat, "throughput_rps": rps, "throughput_tokens_s": 100.0}


def test_fidelity_table_math() -> None:
    sim = _summary((0.110, 0.30), (0.010, 0.020), 5.0)
    meas = _summary((0.100, 0.25), (0.010, 0.025), None)
    rows = fidelity_table(sim, meas)
    by = {r["metric"]: r for r in rows}
    assert [r["metric"] for r in rows if r["target"]] == [
        "TTFT mean",
        "TTFT P99",
        "TPOT mean",
        "TPOT P99",
    ]
    assert by["TTFT mean"]["rel_error_pct"] == pytest.approx(10.0)
    assert by["TTFT mean"]["within"] is True
    assert by["TTFT P99"]["rel_error_pct"] == pytest.approx(20.0)
    assert by["TTFT P99"]["within"] is False
    assert by["TPOT mean"]["rel_error_pct"] == pytest.approx(0.0)
    assert by["TPOT P99"]["rel_error_pct"] == pytest.approx(-20.0)
    assert by["TPOT P99"]["key"] == "latency_s.tpot.p99"
    assert by["throughput (req/s)"]["rel_error_pct"] is None  # not measured
    assert by["throughput (req/s)"]["within"] is None and not by["throughput (req/s)"]["target"]
    assert by["E2E P99"]["rel_error_pct"] == pytest.approx(0.0)
    # the edge of the tolerance counts as within
    edge = fidelity_table(_summary((0.115, 1), (1, 1), 1), _summary((0.1, 1), (1, 1), 1))
    assert edge[0]["within"] is True
    md = fidelity_markdown(rows)
    assert "2 of 4 target metrics within 15%" in md
    assert "| TTFT mean | 0.11 | 0.1 | +10.0% | yes |" in md
    assert "| throughput (req/s) (extra) | 5 | - | - | - |" in md


def test_operating_rows_keep_what_the_engines_can_run() -> None:
    rows = _synthetic_rows(TRUE)
    kept, dropped = operating_rows(rows, max_running=16, max_batch_tokens=4096)
    assert dropped == len(rows) - len(kept) > 0
    assert all(r.tokens <= 4096 and r.batch_size <= 16 for r in kept)
    # too few left: every row of that model stays
    few, none = operating_rows(rows, max_running=1, max_batch_tokens=8)
    assert none == 0 and few == rows


def test_elastic_pool_stays_elastic(tmp_path: Path) -> None:
    data = {
        "model": A,
        "workload": {"trace": str(_trace(tmp_path / "t.jsonl", n=30)), "format": "jsonl"},
        "cluster": {"elastic": True},
        "serve": {"workers": 3, "gpu_memory_mb": 48},
    }
    cfg = config_from_dict(data)
    em = emulated_sim_config(cfg, _profile(tmp_path))
    assert em.config.cluster.elastic and em.config.cluster.max_gpus == 3
    assert em.placement == ()
    summary = simulate_emulated(cfg, _profile(tmp_path), tmp_path / "out")
    assert summary["requests"]["finished"] == 30
    assert 1 <= summary["gpus"]["peak"] <= 3
    two = {**data, "serve": {**data["serve"], "models": [A, B]}}
    with pytest.raises(ConfigError, match="elastic"):
        emulated_sim_config(config_from_dict(two), None)


def test_serve_models_set_the_simulated_model(tmp_path: Path) -> None:
    data = {
        "workload": {"trace": str(_trace(tmp_path / "t.jsonl", n=20)), "format": "jsonl"},
        "serve": {"workers": 1, "gpu_memory_mb": 64, "models": [B]},
    }
    cfg = config_from_dict(data)
    em = emulated_sim_config(cfg, None)
    assert em.config.model == B and em.placement == (B,)
    assert any("not calibrated" in n for n in em.notes)
    summary = simulate_emulated(cfg, None, tmp_path / "out")
    assert set(summary["services"]) == {B}


def test_calibration_error_is_reported(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    em = emulated_sim_config(cfg, _profile(tmp_path))
    errs = em.fit_errors[A]
    assert set(errs) == {"prefill", "decode"}
    assert errs["decode"]["max_abs_pct"] < 1e-6  # synthetic rows: an exact fit
    assert errs["prefill"]["rows"] > 0
    assert any(n.startswith(f"calibration fit of {A}") for n in em.notes)
    summary = simulate_emulated(cfg, _profile(tmp_path), tmp_path / "out")
    assert summary["fidelity"]["calibration_error"][A]["decode"]["rows"] == errs["decode"]["rows"]


def _step(t: float, dur: float, model: str, chunks: list[list[int]], b: int, ctx: int) -> str:
    fw = {"model": model, "chunks": chunks, "decode_batch": b, "decode_ctx": ctx}
    return json.dumps({"worker": 0, "start_s": t, "duration_s": dur, "forwards": [fw]})


def test_engine_step_check_measures_the_engines_speed_against_the_cost_model(
    tmp_path: Path,
) -> None:
    em = emulated_sim_config(_config(tmp_path), _profile(tmp_path))
    bound = em.cost.bind(get_model(A), em.gpu)
    lines = []
    for i in range(40):  # 1.25x slower than the model in the first half, as fast after
        k = 1.25 if i < 20 else 1.0
        if i % 4 == 0:  # a prompt of 30 with 3 decodes beside it
            pred = bound.mixed_time([(30, 0)], 3, 120)
            lines.append(_step(100.0 + i, k * pred, A, [[30, 0]], 3, 120))
        else:
            pred = bound.decode_time_scalar(4, 200.0)
            lines.append(_step(100.0 + i, k * pred, A, [], 4, 200))
    lines.append(_step(200.0, 1.0, "no-such-model", [], 1, 1))
    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join(lines) + "\n")
    chk = engine_step_check(em, log, windows=2)
    assert chk["skipped"] == 1
    assert chk["all"]["steps"] == 40
    assert chk["all"]["ratio"] == pytest.approx(1.125, rel=0.05)
    assert (chk["mixed"]["steps"], chk["decode"]["steps"]) == (10, 30)
    d = chk["decode"]
    assert (d["p10_ratio"], d["p90_ratio"]) == (pytest.approx(1.0), pytest.approx(1.25))
    assert [w["ratio"] for w in chk["windows"]] == [pytest.approx(1.25), pytest.approx(1.0)]
    late = engine_step_check(em, log, span=(120.0, 139.0))
    assert late["all"]["steps"] == 20 and late["all"]["ratio"] == pytest.approx(1.0)
    log.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(InputError, match=r"steps.jsonl:2"):
        engine_step_check(em, log)
    log.write_text(json.dumps({"worker": 0, "start_s": 1.0}) + "\n")
    with pytest.raises(InputError, match=r"steps.jsonl:1.*forwards"):
        engine_step_check(em, log)


def test_in_situ_factors_rescale_the_profile_from_the_steps_outside_the_replay(
    tmp_path: Path,
) -> None:
    prof = _profile(tmp_path)
    em = emulated_sim_config(_config(tmp_path), prof)
    bound = em.cost.bind(get_model(A), em.gpu)
    lines = []
    for i in range(60):  # probes (t < 100 or t > 200): decode 1.4x, prompts 1.2x slower
        t = 50.0 + i if i < 30 else 250.0 + i
        if i % 3 == 0:
            lines.append(_step(t, 1.2 * bound.mixed_time([(40, 0)], 0, 0), A, [[40, 0]], 0, 0))
        else:
            lines.append(_step(t, 1.4 * bound.decode_time_scalar(2, 300.0), A, [], 2, 300))
    for i in range(50):  # the replay: 3x, must not count
        lines.append(_step(120.0 + i, 3 * bound.decode_time_scalar(1, 99.0), A, [], 1, 99))
    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join(lines) + "\n")
    f = in_situ_factors(em, log, exclude=(100.0, 200.0))[A]
    assert (f["prefill_steps"], f["decode_steps"]) == (20, 40)
    assert f["prefill"] == pytest.approx(1.2) and f["decode"] == pytest.approx(1.4)
    assert in_situ_factors(em, log, exclude=(0.0, 1e9))[A] == {
        "prefill": 1.0,
        "decode": 1.0,
        "prefill_steps": 0,
        "decode_steps": 0,
    }  # too few steps: no factor
    scaled = rescale_profile(prof, {A: f}, tmp_path / "scaled.csv")
    before, after = load_profile(prof), load_profile(scaled)
    assert len(before) == len(after)
    for r0, r1 in zip(before, after, strict=True):
        k = 1.2 if r0.phase == "prefill" else 1.4
        assert r1 == replace(r0, time_s=pytest.approx(k * r0.time_s))
    # the calibration from the rescaled rows predicts the logged probe steps (not
    # exactly: prefill and decode share the fitted per-iteration overhead, so two
    # different factors are not a pure rescaling of the fitted parameters)
    em2 = emulated_sim_config(_config(tmp_path), scaled)
    chk = engine_step_check(em2, log, span=(0.0, 99.0))
    assert chk["decode"]["ratio"] == pytest.approx(1.0, rel=0.03)
    assert chk["mixed"]["ratio"] == pytest.approx(1.0, rel=0.06)
    chk0 = engine_step_check(em, log, span=(0.0, 99.0))
    assert abs(chk["mixed"]["ratio"] - 1) < abs(chk0["mixed"]["ratio"] - 1) / 3


def test_step_handoff_is_the_wait_between_steps_while_work_was_left(tmp_path: Path) -> None:
    from fleetserve.experiments.fidelity import step_handoff_s

    em = emulated_sim_config(_config(tmp_path), _profile(tmp_path))

    def line(w: int, t: float, dur: float, more: bool) -> str:
        obj = json.loads(_step(t, dur, A, [], 1, 10))
        return json.dumps({**obj, "worker": w, "more": more})

    log = tmp_path / "steps.jsonl"
    rows = [
        line(0, 10.000, 0.010, True),  # next starts 2 ms after its end
        line(1, 10.001, 0.010, True),  # worker 1 interleaved: 4 ms
        line(0, 10.012, 0.010, False),  # idle after: the 5 s wait does not count
        line(1, 10.015, 0.010, False),
        line(0, 15.000, 0.010, True),  # 1 ms
        line(0, 15.011, 0.010, False),
        line(0, 50.000, 0.010, True),  # inside the excluded span: 9 ms, left out
        line(0, 50.019, 0.010, False),
    ]
    log.write_text("\n".join(rows) + "\n")
    sec, n = step_handoff_s(em, log, exclude=(40.0, 60.0)) or (0.0, 0)
    assert n == 3 and sec == pytest.approx((0.002 + 0.004 + 0.001) / 3)
    assert step_handoff_s(em, log)[1] == 4  # type: ignore[index]
    # a step of a model the simulator does not know still times the hand-offs
    other = json.dumps(
        {
            **json.loads(line(0, 1.012, 0.010, True)),
            "forwards": [
                {"model": "no-such-model", "chunks": [], "decode_batch": 1, "decode_ctx": 5}
            ],
        }
    )
    log.write_text("\n".join([line(0, 1.0, 0.010, True), other, line(0, 1.025, 0.01, False)]))
    sec, n = step_handoff_s(em, log) or (0.0, 0)
    assert n == 2 and sec == pytest.approx(0.0025)
    log.write_text(_step(1.0, 0.01, A, [], 1, 10) + "\n")  # an older log: no 'more'
    assert step_handoff_s(em, log) is None
