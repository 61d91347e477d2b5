"""Tests of the KunServe bursty workloads (fleetserve.workload.bursty)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError, InputError
from fleetserve.workload import bursty
from fleetserve.workload.bursty import (
    AGIEVAL_COT_LENGTHS,
    BURSTGPT_LENGTHS,
    PROFILE_TABLE,
    PROFILES,
    TableRow,
    azure_burst_arrivals,
    default_azure_path,
    gamma_burst_arrivals,
    knot_mean,
    kunserve_workload,
    length_profile,
    solve_knots,
)
from fleetserve.workload.request import Request
from fleetserve.workload.synthetic import EmpiricalLengths, QuantileLengths

SHARED = Path(__file__).parents[1].parent / "shared" / "data"
AZURE_CONV = SHARED / "azure_llm_2023_conv.csv"
needs_azure = pytest.mark.skipif(
    not AZURE_CONV.exists(),
    reason=f"shared trace {AZURE_CONV} not present (see shared/data/README.md)",
)

SYNTHETIC = {"burstgpt": BURSTGPT_LENGTHS, "agieval-cot": AGIEVAL_COT_LENGTHS}


def _tiny_azure(tmp_path: Path, gaps: list[float]) -> Path:
    """An Azure-format trace whose requests are ``gaps`` seconds apart (first at 0)."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    t = 0.0
    for i, g in enumerate([0.0, *gaps]):
        t += g
        sec = 10.0 + t
        lines.append(f"2023-11-16 18:{int(sec // 60):02d}:{sec % 60:010.7f},{100 + i},{10 + i}")
    p = tmp_path / "tiny_azure.csv"
    p.write_text("\n".join(lines) + "\n")
    return p


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_knots_rederive_from_table(name: str) -> None:
    sampler = SYNTHETIC[name]
    assert isinstance(sampler, QuantileLengths)
    for side, knots in (("input", sampler.prompt_knots), ("output", sampler.output_knots)):
        row = PROFILE_TABLE[name][side]
        assert solve_knots(row) == knots
        assert [q for q, _ in knots] == [0.0, 0.5, 0.8, 0.95, 0.99, 1.0]
        assert [v for _, v in knots][1:5] == [row.p50, row.p80, row.p95, row.p99]
        assert knots[0][1] >= 1 and knots[-1][1] >= row.p99
        assert knot_mean(knots) == pytest.approx(row.mean, rel=0.02)


@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_profile_sampled_stats_match_table(name: str) -> None:
    prompts, outputs = length_profile(name)(200_000, _rng(1))
    for side, values in (("input", prompts), ("output", outputs)):
        row = PROFILE_TABLE[name][side]
        assert values.dtype == np.int64 and values.min() >= 1
        pct = np.percentile(values, [50, 80, 95, 99])
        for got, want in zip(pct, (row.p50, row.p80, row.p95, row.p99), strict=True):
            assert got == pytest.approx(want, rel=0.03), (name, side, pct)
        assert float(values.mean()) == pytest.approx(row.mean, rel=0.03)


def test_knot_mean_analytic() -> None:
    assert knot_mean(((0.0, 5), (1.0, 5))) == 5.0
    # log-linear from 1 to e: integral of e^u over [0, 1] = e - 1
    assert knot_mean(((0.0, 1), (1.0, 100))) == pytest.approx(99 / np.log(100))


def test_solve_knots_fallbacks() -> None:
    # a mean too high for v0 <= P50: v0 = P50 and the maximum is raised
    high = solve_knots(TableRow(5000, 100, 200, 300, 400))
    assert high[0][1] == 100 and high[-1][1] > 400
    assert knot_mean(high) == pytest.approx(5000, rel=0.02)
    # a mean too low even with v0 = 1: as close as allowed (v0 = 1, v1 = P99)
    low = solve_knots(TableRow(50, 100, 200, 300, 400))
    assert low[0][1] == 1 and low[-1][1] == 400
    with pytest.raises(ConfigError, match="P50"):
        solve_knots(TableRow(10, 300, 200, 300, 400))


def test_profile_names() -> None:
    assert PROFILES == ("burstgpt", "agieval-cot", "azure-conv")
    assert set(PROFILE_TABLE) == set(PROFILES)
    with pytest.raises(ConfigError) as ei:
        length_profile("sharegpt")
    msg = str(ei.value)
    assert "'sharegpt'" in msg and all(p in msg for p in PROFILES)


@needs_azure
def test_azure_conv_profile_resamples_trace() -> None:
    sampler = length_profile("azure-conv", azure_path=AZURE_CONV)
    assert isinstance(sampler, EmpiricalLengths) and len(sampler.prompt) == 19366
    pairs = set(zip(sampler.prompt, sampler.output, strict=True))
    p, o = sampler(20_000, _rng(2))
    assert set(zip(p.tolist(), o.tolist(), strict=True)) <= pairs
    assert float(p.mean()) == pytest.approx(1155, rel=0.05)
    assert float(o.mean()) == pytest.approx(211, rel=0.05)


def test_missing_azure_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(InputError, match=re.escape("nope.csv")) as ei:
        length_profile("azure-conv", azure_path=missing)
    assert "not found" in str(ei.value)
    with pytest.raises(InputError, match=re.escape("nope.csv")):
        azure_burst_arrivals(
            1.0, 10.0, burst_start_s=1.0, burst_len_s=1.0, azure_path=missing, rng=_rng()
        )
    with pytest.raises(InputError, match=re.escape("nope.csv")):
        kunserve_workload(
            "burstgpt",
            "azure-burst",
            1.0,
            10.0,
            burst_start_s=1,
            burst_len_s=1,
            azure_path=missing,
        )


def test_default_azure_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLEETSERVE_DATA_DIR", raising=False)
    monkeypatch.delenv("FLEETSERVE_DATA", raising=False)
    repo = Path(bursty.__file__).resolve().parents[3]
    assert default_azure_path() == repo.parent / "shared" / "data" / "azure_llm_2023_conv.csv"
    monkeypatch.setenv("FLEETSERVE_DATA_DIR", str(tmp_path))
    assert default_azure_path() == tmp_path / "azure_llm_2023_conv.csv"
    with pytest.raises(InputError, match=re.escape(str(tmp_path))):
        length_profile("azure-conv")


# --------------------------------------------------------------------------- azure-burst


def _rates(t: np.ndarray, d: float, start: float, length: float) -> tuple[float, float]:
    inside = int(((t >= start) & (t < start + length)).sum())
    return (len(t) - inside) / (d - length), inside / length


def _check_arrivals(t: np.ndarray, d: float) -> None:
    assert t.dtype == np.float64
    assert np.all(np.diff(t) >= 0)
    assert len(t) == 0 or (t[0] >= 0.0 and t[-1] < d)


def test_azure_burst_exact_on_regular_trace(tmp_path: Path) -> None:
    # 10 requests 1 s apart: period 10 s, trace rate 1 req/s
    path = _tiny_azure(tmp_path, [1.0] * 9)
    t = azure_burst_arrivals(
        2.0,
        20.0,
        burst_start_s=5.0,
        burst_len_s=1.0,
        burst_factor=4.0,
        azure_path=path,
        rng=_rng(),
    )
    # 0.5 s gaps before 5 s, 0.125 s inside [5, 6), 0.5 s after; wraps around seamlessly
    want = np.concatenate([np.arange(0, 5, 0.5), np.arange(5, 6, 0.125), np.arange(6, 20, 0.5)])
    np.testing.assert_allclose(t, want, atol=1e-6)
    # an offset starts mid-trace and the replay wraps
    t2 = azure_burst_arrivals(
        1.0,
        30.0,
        burst_start_s=0.0,
        burst_len_s=30.0,
        burst_factor=1.0,
        azure_path=path,
        offset_s=3.5,
        rng=_rng(),
    )
    np.testing.assert_allclose(t2, np.arange(0.5, 30, 1.0), atol=1e-6)


def test_azure_burst_random_offset(tmp_path: Path) -> None:
    path = _tiny_azure(tmp_path, [1.0, 3.0, 0.5, 2.0, 1.5, 4.0])

    def run(seed: int) -> np.ndarray:
        return azure_burst_arrivals(
            1.0,
            50.0,
            burst_start_s=2.0,
            burst_len_s=3.0,
            azure_path=path,
            offset_s=None,
            rng=_rng(seed),
        )

    a, b, c = run(1), run(1), run(2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    _check_arrivals(a, 50.0)
    with pytest.raises(ConfigError, match="offset_s"):
        azure_burst_arrivals(
            1.0,
            5.0,
            burst_start_s=1.0,
            burst_len_s=1.0,
            azure_path=path,
            offset_s=1e6,
            rng=_rng(),
        )


@needs_azure
def test_azure_burst_long_run_rates() -> None:
    # window consumes 4 trace periods, the rest ~8.3: the trace's own swings average out
    rate, d, start, length = 5.53, 30_000.0, 10_000.0, 1_000.0
    t = azure_burst_arrivals(
        rate, d, burst_start_s=start, burst_len_s=length, azure_path=AZURE_CONV, rng=_rng()
    )
    _check_arrivals(t, d)
    assert t[0] == 0.0
    outside, inside = _rates(t, d, start, length)
    assert outside == pytest.approx(rate, rel=0.10)
    assert inside == pytest.approx(14.0 * rate, rel=0.15)


@needs_azure
def test_azure_burst_paper_like_run() -> None:
    # BurstGPT-like: 1,400 s at 20 req/s with a 14x minute at 150 s (the trace wraps)
    t = azure_burst_arrivals(
        20.0, 1400.0, burst_start_s=150.0, burst_len_s=60.0, azure_path=AZURE_CONV, rng=_rng()
    )
    _check_arrivals(t, 1400.0)
    outside, inside = _rates(t, 1400.0, 150.0, 60.0)
    assert outside == pytest.approx(20.0, rel=0.10)
    assert inside == pytest.approx(280.0, rel=0.15)
    # the replay keeps the trace's burstiness outside the window (gap CV ~1.09, not 1/14)
    gaps = np.diff(t[t >= 210.0])
    assert 0.9 < gaps.std() / gaps.mean() < 1.3


# --------------------------------------------------------------------------- gamma


@pytest.mark.parametrize("cv", [1.0, 3.0, 4.0])
def test_gamma_cv_and_rate(cv: float) -> None:
    t = gamma_burst_arrivals(5.0, 40_000.0, cv=cv, rng=_rng(3))
    _check_arrivals(t, 40_000.0)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)
    assert len(t) / 40_000.0 == pytest.approx(5.0, rel=0.05)


def test_gamma_burst_rates() -> None:
    d, start, length = 20_000.0, 5_000.0, 2_000.0
    t = gamma_burst_arrivals(
        2.0, d, cv=3.0, rng=_rng(4), burst_start_s=start, burst_len_s=length, burst_factor=14.0
    )
    _check_arrivals(t, d)
    outside, inside = _rates(t, d, start, length)
    assert outside == pytest.approx(2.0, rel=0.10)
    assert inside == pytest.approx(28.0, rel=0.15)


@settings(max_examples=40, deadline=None)
@given(
    rate=st.floats(0.1, 50.0),
    d=st.floats(1.0, 500.0),
    frac=st.tuples(st.floats(0.0, 0.99), st.floats(0.001, 0.999)),
    factor=st.floats(0.1, 30.0),
    cv=st.floats(0.2, 5.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_gamma_burst_properties(
    rate: float, d: float, frac: tuple[float, float], factor: float, cv: float, seed: int
) -> None:
    start = frac[0] * d
    length = frac[1] * (d - start)
    t = gamma_burst_arrivals(
        rate,
        d,
        cv=cv,
        rng=_rng(seed),
        burst_start_s=start,
        burst_len_s=length,
        burst_factor=factor,
    )
    _check_arrivals(t, d)
    again = gamma_burst_arrivals(
        rate,
        d,
        cv=cv,
        rng=_rng(seed),
        burst_start_s=start,
        burst_len_s=length,
        burst_factor=factor,
    )
    np.testing.assert_array_equal(t, again)


# --------------------------------------------------------------------------- workload


def test_workload_gamma_determinism_and_independence() -> None:

    def run(profile: str, seed: int = 7) -> list[Request]:
        return kunserve_workload(
            profile, "gamma", 4.0, 600.0, burst_start_s=150.0, burst_len_s=60.0, seed=seed
        )

    a, b, c = run("burstgpt"), run("burstgpt"), run("agieval-cot")
    assert a == b
    assert [r.arrival_s for r in a] == [r.arrival_s for r in c]
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in c]
    assert [r.id for r in a] == list(range(len(a)))
    assert all(x.arrival_s <= y.arrival_s for x, y in itertools.pairwise(a))
    assert all(0.0 <= r.arrival_s < 600.0 for r in a)
    assert {r.model for r in a} == {"qwen-2.5-14b"}
    other = run("burstgpt", seed=8)
    assert [r.arrival_s for r in other] != [r.arrival_s for r in a]


@needs_azure
def test_workload_azure_burst_all_profiles() -> None:

    def run(profile: str) -> list[Request]:
        return kunserve_workload(
            profile,
            "azure-burst",
            8.0,
            600.0,
            burst_start_s=150.0,
            burst_len_s=60.0,
            seed=3,
            azure_path=AZURE_CONV,
        )

    runs = {p: run(p) for p in PROFILES}
    times = {p: [r.arrival_s for r in reqs] for p, reqs in runs.items()}
    assert times["burstgpt"] == times["agieval-cot"] == times["azure-conv"]
    reqs = runs["azure-conv"]
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert reqs[0].arrival_s == 0.0 and reqs[-1].arrival_s < 600.0
    assert runs["burstgpt"] == run("burstgpt")


_GOOD: dict[str, object] = {
    "profile": "burstgpt",
    "arrival": "gamma",
    "rate": 2.0,
    "duration_s": 100.0,
    "burst_start_s": 10.0,
    "burst_len_s": 5.0,
}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"profile": "sharegpt"}, "profile: unknown length profile 'sharegpt'"),
        ({"arrival": "poisson"}, "arrival: unknown arrival process 'poisson'"),
        ({"rate": 0.0}, "rate must be"),
        ({"rate": float("nan")}, "rate must be a finite number"),
        ({"rate": -1.0}, "rate must be"),
        ({"duration_s": float("inf")}, "duration_s must be a finite number"),
        ({"burst_start_s": 100.0}, "burst_start_s must be in [0, duration_s=100)"),
        ({"burst_start_s": -1.0}, "burst_start_s must be in"),
        ({"burst_len_s": 0.0}, "burst_len_s must be"),
        ({"burst_len_s": 95.0}, "ends after duration_s=100"),
        ({"burst_factor": 0.0}, "burst_factor must be"),
        ({"cv": -3.0}, "cv must be"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"seed": 1.5}, "seed must be an integer >= 0"),
        ({"model": "qwen-9000"}, "model: unknown model 'qwen-9000'"),
        ({"offset_s": float("nan")}, "offset_s must be a finite number"),
    ],
)
def test_workload_bad_arguments(change: dict[str, object], needle: str) -> None:
    args = {**_GOOD, **change}
    with pytest.raises(ConfigError) as ei:
        kunserve_workload(**args)  # type: ignore[arg-type]
    msg = str(ei.value)
    assert needle in msg
    assert "\n" not in msg


def test_gamma_window_arguments() -> None:
    with pytest.raises(ConfigError, match="given together"):
        gamma_burst_arrivals(1.0, 10.0, rng=_rng(), burst_start_s=1.0)
    with pytest.raises(ConfigError, match="cv must be"):
        gamma_burst_arrivals(1.0, 10.0, cv=0.0, rng=_rng())
    with pytest.raises(ConfigError, match=re.escape("rng must be a numpy.random.Generator")):
        gamma_burst_arrivals(1.0, 10.0, rng=0)  # type: ignore[arg-type]
