"""``fleet.generator: trace``: a recorded trace spread over a fleet of models by Zipf."""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetserve.config import config_from_dict, load_config
from fleetserve.errors import ConfigError, InputError
from fleetserve.spec import get_model
from fleetserve.workload.fleet import DEFAULT_MODELS
from fleetserve.workload.fleet_trace import SYNTHETIC_DURATION_S, trace_fleet_workload
from fleetserve.workload.loaders import load_trace
from fleetserve.workload.synthetic import power_law_rates

REPO = Path(__file__).resolve().parents[1]


def write_azure(path: Path, n: int = 400, span_s: float = 120.0, seed: int = 1) -> Path:
    """A small Azure-format trace: ``n`` requests over ``span_s`` seconds."""
    rng = np.random.default_rng(seed)
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    times = np.sort(rng.uniform(0.0, span_s, size=n))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t in times:
        stamp = (t0 + timedelta(seconds=float(t))).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
        lines.append(f"{stamp},{int(rng.integers(50, 3000))},{int(rng.integers(5, 900))}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_azure(tmp_path / "azure.csv")


def _key(r: Any) -> tuple[float, int, int]:
    return (round(r.arrival_s, 9), r.prompt_tokens, r.output_tokens)


def test_same_seed_same_workload_other_seed_other_assignment(trace: Path) -> None:
    a = trace_fleet_workload(trace, "azure", seed=3)
    b = trace_fleet_workload(trace, "azure", seed=3)
    c = trace_fleet_workload(trace, "azure", seed=4)
    assert a.requests == b.requests and a.notes == b.notes
    assert [r.model for r in a.requests] != [r.model for r in c.requests]
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in c.requests]


def test_injected_generator_is_deterministic_and_global_rng_untouched(trace: Path) -> None:
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    a = trace_fleet_workload(trace, "azure", rng=np.random.default_rng(7))
    assert np.random.random() == before
    b = trace_fleet_workload(trace, "azure", rng=np.random.default_rng(7))
    assert a.requests == b.requests


def test_every_trace_request_is_assigned_exactly_once(trace: Path) -> None:
    loaded = load_trace(trace, "azure")
    wl = trace_fleet_workload(trace, "azure", fit_context=False, seed=0)
    assert [r.id for r in wl.requests] == list(range(len(loaded.requests)))
    assert Counter(_key(r) for r in wl.requests) == Counter(_key(r) for r in loaded.requests)
    assert {r.model for r in wl.requests} <= set(DEFAULT_MODELS)
    assert sum(wl.counts.values()) == len(wl.requests)
    assert wl.counts == dict(Counter(r.model for r in wl.requests)) | {
        m: 0 for m in wl.models if m not in {r.model for r in wl.requests}
    }
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals == sorted(arrivals)


def test_models_follow_the_zipf_shares() -> None:
    # the synthetic stand-in (no file needed): ~20k requests over the trace's hour
    wl = trace_fleet_workload("/nonexistent/azure.csv", "azure", if_missing="synthetic", zipf=1.0)
    assert wl.synthetic and any("not found" in n for n in wl.notes)
    assert wl.requests[-1].arrival_s < SYNTHETIC_DURATION_S
    n = len(wl.requests)
    shares = power_law_rates(1.0, len(DEFAULT_MODELS), 1.0)
    for m, share in zip(DEFAULT_MODELS, shares, strict=True):
        assert wl.shares[m] == pytest.approx(share)
        sd = (share * (1 - share) / n) ** 0.5
        assert abs(wl.counts[m] / n - share) < 5 * sd, m
    uniform = trace_fleet_workload(
        "/nonexistent/azure.csv", "azure", if_missing="synthetic", zipf=0
    )
    assert list(uniform.shares.values()) == pytest.approx([1 / 8] * 8)


def test_lengths_are_scaled_then_fit_to_each_models_context(trace: Path) -> None:
    loaded = {r.id: r for r in load_trace(trace, "azure").requests}
    models = ["opt-6.7b", "llama-3.1-8b"]  # 2,048 and 131,072 tokens
    raw = trace_fleet_workload(trace, "azure", models=models, length_scale=4, fit_context=False)
    for r in raw.requests:  # same order: the assignment does not reorder
        src = loaded[r.id]
        assert (r.prompt_tokens, r.output_tokens) == (
            round(src.prompt_tokens * 4),
            round(src.output_tokens * 4),
        )
        assert not r.length_capped
    fit = trace_fleet_workload(trace, "azure", models=models, length_scale=4)
    assert [r.model for r in fit.requests] == [r.model for r in raw.requests]
    for a, b in zip(raw.requests, fit.requests, strict=True):
        ctx = get_model(a.model).max_context
        assert b.prompt_tokens + b.output_tokens <= ctx
        changed = (a.prompt_tokens, a.output_tokens) != (b.prompt_tokens, b.output_tokens)
        assert b.length_capped == changed
        assert changed == (a.prompt_tokens + a.output_tokens > ctx or a.output_tokens >= ctx)
    assert fit.capped["opt-6.7b"] > 0 and fit.capped["llama-3.1-8b"] == 0
    assert sum(fit.capped.values()) == sum(r.length_capped for r in fit.requests)
    assert any("context window" in n for n in fit.notes)


def test_end_s_keeps_a_window(trace: Path) -> None:
    full = trace_fleet_workload(trace, "azure")
    part = trace_fleet_workload(trace, "azure", end_s=30.0)
    assert 0 < len(part.requests) < len(full.requests)
    assert all(r.arrival_s < 30.0 for r in part.requests)
    assert len(part.requests) == sum(r.arrival_s < 30.0 for r in full.requests)


def test_missing_trace_is_an_input_error_unless_synthetic(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=re.escape(str(tmp_path / "nope.csv"))):
        trace_fleet_workload(tmp_path / "nope.csv", "azure")
    wl = trace_fleet_workload(tmp_path / "nope.csv", "azure", if_missing="synthetic", end_s=60)
    assert wl.synthetic and wl.requests and wl.requests[-1].arrival_s < 60


# --------------------------------------------------------------------------- the config


def _trace_section(**extra: Any) -> dict[str, Any]:
    return {"generator": "trace", "trace": "x.csv", "format": "azure", **extra}


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"generator": "trace"}, "fleet.trace"),
        (_trace_section(format=None), "fleet.format"),
        (_trace_section(format="lengths"), "fleet.format"),
        (_trace_section(if_missing="maybe"), "fleet.if_missing"),
        (_trace_section(end_s=0), "fleet.end_s"),
        (_trace_section(length_scale=0), "fleet.length_scale"),
        (_trace_section(zipf=-1), "fleet.zipf"),
        (_trace_section(models=["llama-2-7b", "llama-2-7b"]), "fleet.models"),
        (_trace_section(models=["no-such-model"]), "fleet.models"),
        (_trace_section(rate=3), "fleet.rate"),  # the synthetic generator's field
        (_trace_section(bursts=1), "fleet.bursts"),
        ({"generator": "fleet", "end_s": 60}, "fleet.end_s"),  # the trace generator's
        ({"trace": "x.csv"}, "fleet.trace"),  # no generator: nothing reads it
    ],
)
def test_bad_trace_field_is_named(section: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}\b"):
        config_from_dict({"cluster": {"gpus": 16}, "fleet": section})


def test_a_workload_section_next_to_a_fleet_generator_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"workload\.length_scale.*fleet\.trace"):
        config_from_dict(
            {
                "cluster": {"gpus": 16},
                "fleet": _trace_section(),
                "workload": {"length_scale": 10},
            }
        )


def test_trace_generator_runs_in_the_multi_llm_world(trace: Path) -> None:
    """A relative ``fleet.trace`` is resolved against the config's folder; one service
    per model; placement sees the first ``multi.history_s`` seconds."""
    from fleetserve.policy.catalog import MULTI, world_of
    from fleetserve.sim.multi_build import build_multi

    cfg = config_from_dict(
        {
            "cluster": {"gpu": "a100-80gb", "gpus": 4},
            "fleet": _trace_section(trace=trace.name, models=["llama-2-7b", "opt-6.7b"]),
            "multi": {"history_s": 30},
        }
    )
    assert world_of(cfg) == MULTI
    assert cfg.fleet.generator_kwargs()["trace"] == trace.name
    got = build_multi(cfg, trace.parent)
    assert set(got.services) == {"llama-2-7b", "opt-6.7b"}
    assert all(r.arrival_s < 30 for r in got.history)
    assert len(got.history) + len(got.requests) == len(load_trace(trace, "azure").requests)
    with pytest.raises(InputError, match="not found"):
        build_multi(cfg, trace.parent / "elsewhere")


def test_fleet_trace_config_file_is_valid() -> None:
    path = REPO / "configs" / "fleet-trace.yaml"
    cfg = config_from_dict(load_config(path), str(path))
    assert cfg.fleet.generator == "trace" and cfg.is_multi
    assert cfg.fleet.models == DEFAULT_MODELS
    assert cfg.fleet.end_s == 1200 and cfg.fleet.length_scale == 1
    assert cfg.fleet.if_missing == "synthetic"
