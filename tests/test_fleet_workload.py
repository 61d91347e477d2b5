"""The fleet workload generator (issue 21 item 6): Zipf popularity, diurnal curve, bursts."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.config import FleetConfigSection, config_from_dict
from fleetserve.errors import ConfigError, InputError
from fleetserve.workload.data import find_data_dir
from fleetserve.workload.fleet import (
    AZURE_BURSTS,
    AZURE_DIURNAL,
    DEFAULT_MODELS,
    FLEET_DEFAULTS,
    burst_shape,
    diurnal_factor,
    diurnal_fit,
    fleet_workload,
)
from fleetserve.workload.synthetic import fixed_lengths, lognormal_lengths

LENGTHS = lognormal_lengths(1000.0, 800.0, 200.0, 150.0)


def _shared(name: str) -> str:
    try:
        return str(find_data_dir([name]) / name)
    except InputError as e:
        pytest.skip(f"shared trace {name} not available: {e}")


def _times(path: str, fmt: str) -> np.ndarray:
    from fleetserve.workload.loaders import load_trace

    return np.array([r.arrival_s for r in load_trace(path, fmt).requests])


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_workload_other_seed_differs() -> None:
    a = fleet_workload(5.0, duration_s=600, period_s=600, burst_gap_s=100, seed=3, sampler=LENGTHS)
    b = fleet_workload(5.0, duration_s=600, period_s=600, burst_gap_s=100, seed=3, sampler=LENGTHS)
    c = fleet_workload(5.0, duration_s=600, period_s=600, burst_gap_s=100, seed=4, sampler=LENGTHS)
    assert a.requests == b.requests and a.bursts == b.bursts and a.notes == b.notes
    assert a.requests != c.requests


def test_injected_generator_is_deterministic_and_global_rng_untouched() -> None:
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    kw: dict[str, Any] = {"duration_s": 300, "period_s": 300, "bursts": 0, "sampler": LENGTHS}
    a = fleet_workload(3.0, rng=np.random.default_rng(11), **kw)
    b = fleet_workload(3.0, rng=np.random.default_rng(11), **kw)
    assert a.requests == b.requests
    assert np.random.random() == before  # no global RNG draws


# --------------------------------------------------------------------------- shapes


def test_popularity_follows_zipf_shares() -> None:
    w = fleet_workload(
        50.0, duration_s=3600, bursts=0, zipf=1.0, seed=0, sampler=fixed_lengths(10, 10)
    )
    n = len(w.requests)
    harmonic = sum(1 / (i + 1) for i in range(len(DEFAULT_MODELS)))
    for i, m in enumerate(DEFAULT_MODELS):
        share = (1 / (i + 1)) / harmonic
        assert w.shares[m] == pytest.approx(share)
        # ~180k requests: one binomial sd of a share is < 0.0012; 0.01 is > 8 sd
        assert w.counts[m] / n == pytest.approx(share, abs=0.01)
        # each count within 6 sd (CV 1.09 renewal ~ 1.09^2 x Poisson variance) of its mean
        assert abs(w.counts[m] - w.expected[m]) < 6 * 1.09 * math.sqrt(w.expected[m])
    assert sum(w.counts.values()) == n


def test_rate_curve_peak_trough_ratio() -> None:
    w = fleet_workload(
        40.0, duration_s=3600, period_s=3600, peak_trough=3.0, peak_at=0.25, bursts=0, seed=1,
        sampler=fixed_lengths(10, 10),
    )  # fmt: skip
    assert max(w.curve_rate) / min(w.curve_rate) == pytest.approx(3.0, rel=1e-3)
    assert w.rate_at(900.0) == pytest.approx(40.0 * 1.5)  # a = 0.5, peak at 0.25 * 3600
    assert w.rate_at(2700.0) == pytest.approx(40.0 * 0.5)
    t = np.array([r.arrival_s for r in w.requests])
    peak = np.count_nonzero(np.abs(t - 900.0) < 150.0)
    trough = np.count_nonzero(np.abs(t - 2700.0) < 150.0)
    # exact expected ratio of the two 300 s windows' integrals of D, and ~17k vs ~6k counts
    grid = np.linspace(-150.0, 150.0, 3001)
    want = np.trapezoid(diurnal_factor(900 + grid, 3600, 3, 0.25), grid) / np.trapezoid(
        diurnal_factor(2700 + grid, 3600, 3, 0.25), grid
    )
    assert peak / trough == pytest.approx(want, rel=0.06)
    assert np.mean(w.curve_rate) == pytest.approx(40.0, rel=0.02)


def test_bursts_are_where_reported() -> None:
    w = fleet_workload(
        20.0, duration_s=1800, period_s=1800, bursts=3, burst_len_s=20, burst_gap_s=300,
        burst_height=2.0, seed=5, sampler=fixed_lengths(10, 10),
    )  # fmt: skip
    assert len(w.bursts) == 3
    starts = [b.start_s for b in w.bursts]
    assert starts == sorted(starts)
    assert all(b - a >= 20 for a, b in itertools.pairwise(starts))
    for b in w.bursts:
        assert b.start_s >= 0 and b.start_s + b.len_s <= 1800
        (m,) = b.models
        assert b.factor == pytest.approx(1.0 + 1.0 / w.shares[m])
        inside = [
            r for r in w.requests if r.model == m and b.start_s <= r.arrival_s < b.start_s + 20
        ]
        base = w.rate_at(b.start_s + 10) * w.shares[m] * 20
        extra = (2.0 - 1.0) * w.rate_at(b.start_s + 10) * 20  # ~400 requests
        # the burst's extra alone is > 10 sd above the model's base count
        assert len(inside) > base + 0.6 * extra
        assert len(inside) < base + 1.4 * extra


@given(after=st.floats(0.0, 1500.0), seed=st.integers(0, 50))
@settings(max_examples=25, deadline=None)
def test_no_burst_starts_before_burst_after_s(after: float, seed: int) -> None:
    """``burst_after_s`` keeps the bursts out of a placement history."""
    w = fleet_workload(
        5.0, duration_s=1800, period_s=1800, bursts=2, burst_len_s=10, burst_gap_s=200,
        burst_after_s=after, seed=seed, sampler=fixed_lengths(10, 10),
    )  # fmt: skip
    assert len(w.bursts) == 2
    for b in w.bursts:
        assert after <= b.start_s and b.start_s + b.len_s <= 1800 + 1e-9


def test_burst_after_s_must_leave_room_for_the_bursts() -> None:
    for after, words in ((1800.0, "burst_after_s must be in"), (1700.0, "burst_gap_s")):
        with pytest.raises(ConfigError, match=words):
            fleet_workload(
                5.0, duration_s=1800, period_s=1800, bursts=2, burst_len_s=10,
                burst_gap_s=200, burst_after_s=after, sampler=fixed_lengths(10, 10),
            )  # fmt: skip


def test_models_are_the_configured_ones_and_context_is_respected() -> None:
    models = ("llama-2-7b", "opt-6.7b", "qwen-2.5-14b")
    w = fleet_workload(
        5.0, duration_s=300, period_s=300, models=models, burst_gap_s=60, seed=2,
        sampler=fixed_lengths(5000, 100),
    )  # fmt: skip
    assert w.models == models
    assert {r.model for r in w.requests} <= set(models)
    for r in w.requests:
        ctx = {"llama-2-7b": 4096, "opt-6.7b": 2048, "qwen-2.5-14b": 131072}[r.model]
        assert r.prompt_tokens + r.output_tokens <= ctx
        assert r.length_capped == (r.model != "qwen-2.5-14b")
    kept = fleet_workload(
        5.0, duration_s=300, period_s=300, models=models, burst_gap_s=60, seed=2,
        sampler=fixed_lengths(5000, 100), fit_context=False,
    )  # fmt: skip
    assert all(r.prompt_tokens == 5000 and not r.length_capped for r in kept.requests)


# --------------------------------------------------------------------------- config


def test_config_section_selects_the_generator() -> None:
    c = config_from_dict(
        {
            "cluster": {"gpus": 2},
            "fleet": {"generator": "fleet", "rate": 4, "models": ["llama-2-7b"]},
        }
    )
    kw = c.fleet.generator_kwargs()
    assert kw["rate"] == 4.0 and kw["models"] == ("llama-2-7b",)
    trace_only = {"trace", "format", "if_missing", "end_s", "length_scale"}
    assert set(kw) | {"generator"} | trace_only == set(FleetConfigSection.__dataclass_fields__)
    assert not set(kw) & trace_only  # fleet_workload's arguments only
    w = fleet_workload(**{**kw, "duration_s": 60.0, "bursts": 0}, sampler=LENGTHS)
    assert {r.model for r in w.requests} == {"llama-2-7b"}
    assert FleetConfigSection().generator is None  # off unless chosen
    assert c.to_dict()["fleet"]["generator"] == "fleet"


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"generator": "nope"}, "fleet.generator"),
        ({"rate": 0}, "fleet.rate"),
        ({"zipf": -0.5}, "fleet.zipf"),
        ({"peak_trough": 0.9}, "fleet.peak_trough"),
        ({"peak_at": 1.0}, "fleet.peak_at"),
        ({"bursts": -1}, "fleet.bursts"),
        ({"burst_height": 0.5}, "fleet.burst_height"),
        ({"burst_len_s": 0}, "fleet.burst_len_s"),
        ({"duration_s": 100, "bursts": 3}, "fleet.burst_gap_s"),
        ({"burst_models": 9}, "fleet.burst_models"),
        ({"models": ["llama-2-7b", "llama-2-7b"]}, "fleet.models"),
        ({"models": ["no-such-model"]}, "fleet.models"),
        ({"models": []}, "fleet.models"),
        ({"cv": 0}, "fleet.cv"),
        ({"lengths": "mooncake"}, "fleet.lengths"),
    ],
)
def test_bad_config_field_is_named(section: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}\b"):
        config_from_dict({"fleet": section})


def test_unknown_fleet_key_and_combination_rejected() -> None:
    with pytest.raises(InputError, match=r"fleet\.zipff"):
        config_from_dict({"fleet": {"zipff": 1.0}})
    with pytest.raises(ConfigError, match=r"fleet\.generator"):
        config_from_dict({"fleet": {"generator": "fleet"}, "kunserve": {"generator": "bursty"}})


def test_function_rejects_bad_arguments_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^seed"):
        fleet_workload(1.0, seed=-1, sampler=LENGTHS)
    with pytest.raises(ConfigError, match=r"^rng"):
        fleet_workload(1.0, rng=42, sampler=LENGTHS)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^models"):
        fleet_workload(1.0, models="llama-2-7b", sampler=LENGTHS)


# --------------------------------------------------------------------------- properties


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rate=st.floats(0.05, 30.0),
    duration=st.floats(5.0, 400.0),
    period=st.floats(10.0, 1000.0),
    n_models=st.integers(1, 5),
    zipf=st.floats(0.0, 2.5),
    peak_trough=st.floats(1.0, 8.0),
    bursts=st.integers(0, 3),
    height=st.floats(1.0, 10.0),
    cv=st.floats(0.2, 4.0),
    seed=st.integers(0, 2**32),
)
def test_properties(
    rate: float,
    duration: float,
    period: float,
    n_models: int,
    zipf: float,
    peak_trough: float,
    bursts: int,
    height: float,
    cv: float,
    seed: int,
) -> None:
    models = DEFAULT_MODELS[:n_models]
    w = fleet_workload(
        rate, duration_s=duration, period_s=period, models=models, zipf=zipf,
        peak_trough=peak_trough, bursts=bursts, burst_height=height,
        burst_len_s=min(5.0, duration / 4), burst_gap_s=duration / 4, cv=cv, seed=seed,
        sampler=LENGTHS,
    )  # fmt: skip
    t = [r.arrival_s for r in w.requests]
    assert t == sorted(t)
    assert all(0.0 <= x < duration for x in t)
    assert [r.id for r in w.requests] == list(range(len(w.requests)))
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in w.requests)
    assert all(r.model in models for r in w.requests)
    assert sum(w.counts.values()) == len(w.requests)
    for m in models:
        assert w.counts[m] == sum(1 for r in w.requests if r.model == m)
        assert w.expected[m] > 0
    assert sum(w.shares.values()) == pytest.approx(1.0)
    assert len(w.bursts) == bursts
    for a, b in itertools.pairwise([x.start_s for x in w.bursts]):
        assert b - a >= min(5.0, duration / 4) - 1e-9
    assert all(b.start_s >= 0 and b.start_s + b.len_s <= duration + 1e-9 for b in w.bursts)
    assert min(w.curve_rate) > 0


# --------------------------------------------------------------------------- trace shapes


def test_shapes_rederived_from_the_shared_traces() -> None:
    t = _times(_shared("azure_llm_2023_conv.csv"), "azure")
    fit = diurnal_fit(t)
    assert fit.peak_trough == pytest.approx(AZURE_DIURNAL.peak_trough, rel=1e-3)
    assert fit.peak_at == pytest.approx(AZURE_DIURNAL.peak_at, abs=1e-3)
    assert fit.amplitude == pytest.approx(AZURE_DIURNAL.amplitude, rel=1e-3)
    bs = burst_shape(t)
    assert bs.count == AZURE_BURSTS.count
    assert bs.height == pytest.approx(AZURE_BURSTS.height, rel=1e-3)
    assert bs.peak == pytest.approx(AZURE_BURSTS.peak, rel=1e-3)
    assert bs.duration_s == AZURE_BURSTS.duration_s
    assert bs.gap_s == pytest.approx(AZURE_BURSTS.gap_s)
    assert FLEET_DEFAULTS.peak_trough == round(fit.peak_trough, 2)
    assert FLEET_DEFAULTS.burst_height == round(bs.height, 2)


def test_burst_shape_finds_an_injected_spike() -> None:
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 3600, 36_000))  # 10 req/s
    spike = rng.uniform(1000, 1020, 200)  # +10 req/s for 20 s: 2x
    bs = burst_shape(np.concatenate((t, spike)))
    assert bs.count >= 1 and bs.duration_s >= 10
    assert bs.height == pytest.approx(2.0, rel=0.25)
    flat = diurnal_fit(t)
    assert flat.peak_trough < 1.1


def test_default_workload_on_the_shared_trace_lengths() -> None:
    path = _shared("azure_llm_2023_conv.csv")
    w = fleet_workload(5.0, duration_s=600, period_s=600, burst_gap_s=100, azure_path=path)
    assert len(w.models) == 8 and w.requests
    assert any("context window" in n for n in w.notes) or all(
        not r.length_capped for r in w.requests
    )


def test_fleet_generator_runs_in_the_multi_llm_world() -> None:
    """``fleet.generator`` selects the multi-LLM world: one service per model,
    placement on the first ``multi.history_s`` seconds, the rest is the run."""
    from fleetserve.config import config_from_dict
    from fleetserve.policy.catalog import MULTI, world_of
    from fleetserve.sim.multi_build import build_multi

    cfg = config_from_dict(
        {
            "cluster": {"gpu": "a100-80gb", "gpus": 2},
            "fleet": {
                "generator": "fleet",
                "rate": 3,
                "duration_s": 120,
                "period_s": 120,
                "models": ["llama-2-7b", "opt-6.7b"],
                "bursts": 1,
            },
            "multi": {"history_s": 30},
        }
    )
    assert cfg.is_multi and world_of(cfg) == MULTI
    got = build_multi(cfg)
    assert set(got.services) == {"llama-2-7b", "opt-6.7b"}
    assert got.history and got.requests
    assert all(r.arrival_s < 30 for r in got.history)
    assert [r.id for r in got.requests] == list(range(len(got.requests)))


def test_fleet_generator_needs_a_fixed_pool_and_no_services() -> None:
    from fleetserve.config import config_from_dict

    with pytest.raises(ConfigError, match=r"cluster\.gpus"):
        config_from_dict({"fleet": {"generator": "fleet"}})
    with pytest.raises(ConfigError, match="services"):
        config_from_dict(
            {
                "cluster": {"gpus": 2},
                "fleet": {"generator": "fleet"},
                "services": [{"name": "a", "model": "llama-2-7b"}],
            }
        )
