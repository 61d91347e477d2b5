"""The engine profiler and ``fleetserve profile-engine``: a profile the calibration reads."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fleetserve.cli.main import main  # noqa: E402
from fleetserve.costmodel.calibration import (  # noqa: E402
    PROFILE_COLUMNS,
    calibrate,
    load_profile,
)
from fleetserve.errors import ConfigError  # noqa: E402
from fleetserve.runtime.engine.config import builtin_config  # noqa: E402
from fleetserve.runtime.engine.profiler import (  # noqa: E402
    ProfileGrid,
    build_engine,
    profile_engine,
)
from fleetserve.spec import get_gpu  # noqa: E402

TINY = ProfileGrid(batch_sizes=(1, 3), context_lengths=(5, 20), prompt_lengths=(4, 17), repeats=1)


@pytest.fixture(autouse=True)
def _plain_console_one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Plain console text; one torch thread (tiny matmuls, and a loaded CI box)."""
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_writes_a_profile_the_calibration_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sub" / "profile.csv"
    rc, stdout, err = run_cli(
        capsys,
        "profile-engine",
        "--model",
        "tiny-llama-a",
        "--quick",
        "--batch-sizes",
        "2,1,2",
        "--context-lengths",
        "33,9",
        "--prompt-lengths",
        "5",
        "--repeats",
        "1",
        "--no-progress",
        "--out",
        out,
    )
    assert rc == 0, err
    assert "Traceback" not in stdout + err
    assert out.read_text().splitlines()[0] == ",".join(PROFILE_COLUMNS)
    rows = load_profile(out)
    prefill = [r for r in rows if r.phase == "prefill"]
    decode = [r for r in rows if r.phase == "decode"]
    assert [(r.batch_size, r.tokens, r.context_tokens) for r in prefill] == [(1, 5, 0), (2, 10, 0)]
    assert [(r.batch_size, r.context_tokens) for r in decode] == [(1, 9), (2, 18), (1, 33), (2, 66)]
    assert all(r.tokens == r.batch_size for r in decode)
    assert all(r.time_s > 0 for r in rows)
    assert {(r.model, r.gpu, r.tp) for r in rows} == {("tiny-llama-a", "cpu", 1)}
    assert "6 rows (2 prefill, 4 decode)" in stdout
    # the fit runs on it (the 'cpu' name needs a resolver: it is not a catalog GPU)
    cal = calibrate(rows, lambda n: builtin_config(n).spec, lambda _: get_gpu("l4-24gb"))
    params = cal.get("tiny-llama-a", "l4-24gb", 1)
    assert params is not None and params.overhead_s >= 0


def test_cli_gpu_name_goes_to_the_gpu_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.csv"
    argv = ["profile-engine", "--model", "tiny-llama-a", "--quick", "--no-progress"]
    rc, _, err = run_cli(
        capsys, *argv, "--batch-sizes", "1", "--gpu-name", "A100-40GB", "--out", out
    )
    assert rc == 0, err
    assert {r.gpu for r in load_profile(out)} == {"a100-40gb"}


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--batch-sizes", "1,x"], "--batch-sizes"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--context-lengths", ""], "--context-lengths"),
        (["--repeats", "0"], "--repeats"),
        (["--device", "tpu"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--arena-gib", "-1"], "--arena-gib"),
    ],
)
def test_cli_bad_flag_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    out = tmp_path / "p.csv"
    rc, stdout, err = run_cli(
        capsys, "profile-engine", "--model", "tiny-llama-a", "--quick", *flags, "--out", out
    )
    assert rc == 2
    assert "Traceback" not in stdout + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_cuda_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run_cli(
        capsys,
        "profile-engine",
        "--model",
        "tiny-llama-a",
        "--device",
        "cuda",
        "--out",
        tmp_path / "p.csv",
    )
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0], err


@pytest.mark.gpu
def test_cli_profiles_on_cuda_with_a_catalog_gpu_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fleetserve.spec import GPUS

    out = tmp_path / "p.csv"
    argv = ["profile-engine", "--model", "tiny-llama-b", "--device", "cuda", "--quick"]
    rc, _, err = run_cli(capsys, *argv, "--no-progress", "--out", out)
    assert rc == 0, err
    rows = load_profile(out)
    assert {r.phase for r in rows} == {"prefill", "decode"}
    assert all(r.time_s > 0 for r in rows)
    gpus = {r.gpu for r in rows}
    assert len(gpus) == 1
    name = torch.cuda.get_device_name().lower()
    if any(f in name for f in ("h100", "h200", "a100")):
        assert gpus <= set(GPUS), gpus


def test_cli_unknown_model_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run_cli(
        capsys, "profile-engine", "--model", "no-such-model", "--out", tmp_path / "p.csv"
    )
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no-such-model" in lines[0] and "tiny-llama-a" in lines[0]


def test_points_that_do_not_fit_are_skipped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = build_engine("tiny-llama-a", TINY)
    weights = probe.pool.weight_pages() * probe.pool.page_bytes
    per_block = probe.pool.pages_per_token_block("tiny-llama-a")
    # room for 3 token blocks: batch 1 fits everywhere, batch 3 only at <= 16 tokens
    arena = weights + 3 * per_block * probe.pool.page_bytes
    eng = build_engine("tiny-llama-a", TINY, arena_bytes=arena)
    seen: list[tuple[int, int]] = []
    with caplog.at_level(logging.WARNING, logger="fleetserve.runtime.engine.profiler"):
        res = profile_engine(eng, TINY, progress=lambda d, n, _: seen.append((d, n)))
    got = {(r.phase, r.batch_size, r.tokens, r.context_tokens) for r in res.rows}
    assert got == {
        ("prefill", 1, 4, 0),
        ("prefill", 3, 12, 0),
        ("prefill", 1, 17, 0),
        ("decode", 1, 1, 5),
        ("decode", 3, 3, 15),
        ("decode", 1, 1, 20),
    }
    assert {(s.phase, s.batch_size, s.length) for s in res.skipped} == {
        ("prefill", 3, 17),
        ("decode", 3, 20),
    }
    assert sum("skipping" in m for m in caplog.messages) == 2
    assert seen[-1] == (8, 8) and len(seen) == 8
    # the profiler leaves the pool as it found it
    eng.pool.check_integrity()
    assert eng.pool.kv_pages == 0


def test_decode_timing_uses_the_prefilled_cache() -> None:
    """A decode point's KV is really there: the forward's logits equal a fresh prefill's."""
    eng = build_engine("tiny-llama-a", TINY)
    pool = eng.pool
    ids = list(range(10, 30))
    pool.open(1, "tiny-llama-a")
    pool.grow(1, 20)
    eng.forward("tiny-llama-a", [1], [0], [19], ids[:19])
    step = eng.forward("tiny-llama-a", [1], [19], [1], ids[19:])
    pool.free(1)
    pool.open(2, "tiny-llama-a")
    pool.grow(2, 20)
    whole = eng.forward("tiny-llama-a", [2], [0], [20], ids)
    pool.free(2)
    torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-4)


def test_grid_and_engine_errors() -> None:
    with pytest.raises(ConfigError, match="batch_sizes"):
        ProfileGrid(batch_sizes=(0,), context_lengths=(8,), prompt_lengths=())
    with pytest.raises(ConfigError, match="at least one"):
        ProfileGrid(batch_sizes=(1,), context_lengths=(), prompt_lengths=())
    with pytest.raises(ConfigError, match="cannot hold the layers"):
        build_engine("tiny-llama-a", TINY, arena_bytes=4096)
    eng = build_engine("tiny-llama-a", TINY)
    eng.add_request("tiny-llama-a", [1, 2, 3])
    with pytest.raises(ConfigError, match="idle"):
        profile_engine(eng, TINY)


def test_max_prefill_tokens_leaves_larger_prefills_out() -> None:
    grid = ProfileGrid(
        batch_sizes=(1, 3), context_lengths=(5,), prompt_lengths=(4, 17), max_prefill_tokens=17
    )
    # 3 x 17 = 51 > 17 is not a point of the grid (not a skipped one)
    assert grid.prefill_points() == [(4, 1), (4, 3), (17, 1)]
    assert grid.points == 5
    seen: list[tuple[int, int]] = []
    res = profile_engine(
        build_engine("tiny-llama-a", grid), grid, progress=lambda d, n, _: seen.append((d, n))
    )
    assert sorted((r.batch_size, r.tokens) for r in res.rows if r.phase == "prefill") == [
        (1, 4),
        (1, 17),
        (3, 12),
    ]
    assert not res.skipped and seen[-1] == (5, 5)
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        ProfileGrid(
            batch_sizes=(1,), context_lengths=(8,), prompt_lengths=(4,), max_prefill_tokens=0
        )
    with pytest.raises(ConfigError, match="every prefill point"):
        ProfileGrid(batch_sizes=(2,), context_lengths=(), prompt_lengths=(4,), max_prefill_tokens=5)


def test_cli_max_prefill_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.csv"
    rc, stdout, _ = run_cli(
        capsys,
        "profile-engine",
        "--model",
        "tiny-llama-a",
        "--quick",
        "--max-prefill-tokens",
        "24",
        "--no-progress",
        "--out",
        out,
    )
    assert rc == 0, stdout
    rows = load_profile(out)
    assert max(r.tokens for r in rows if r.phase == "prefill") == 24
    assert sum(r.phase == "prefill" for r in rows) == 3  # 8x1, 8x2, 24x1 (48 is out)
