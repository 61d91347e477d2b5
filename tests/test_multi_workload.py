"""Tests of fleetserve.workload.multi: SeaLLM and MuxServe multi-service workloads."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetserve.errors import ConfigError, InputError
from fleetserve.workload.multi import (
    LONGBENCH_OUTPUT_MEAN,
    LONGBENCH_PROMPT_MEAN,
    MultiWorkload,
    muxserve_models,
    muxserve_workload,
    seallm_workload,
)
from fleetserve.workload.request import Request
from fleetserve.workload.synthetic import power_law_rates

SHARED_SHAREGPT = Path(__file__).parents[1].parent / "shared" / "data" / "sharegpt_8k_lengths.csv"
needs_sharegpt = pytest.mark.skipif(
    not SHARED_SHAREGPT.exists(),
    reason=f"shared trace {SHARED_SHAREGPT} not present (see shared/data/README.md)",
)

TINY_PAIRS = [(12, 30), (40, 7), (100, 250), (5, 3), (800, 60), (64, 64)]


@pytest.fixture
def tiny_csv(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_lengths.csv"
    lines = ["num_prefill_tokens,num_decode_tokens"] + [f"{p},{o}" for p, o in TINY_PAIRS]
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_ordered(reqs: list[Request], end_s: float) -> None:
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    assert all(0.0 <= r.arrival_s < end_s for r in reqs)


def _absolute(w: MultiWorkload, history_s: float) -> list[tuple[float, str, int, int]]:
    """(absolute arrival, service, prompt, output) of history then run."""
    return [(r.arrival_s, r.model, r.prompt_tokens, r.output_tokens) for r in w.history] + [
        (r.arrival_s + history_s, r.model, r.prompt_tokens, r.output_tokens) for r in w.requests
    ]


def _as_data(w: MultiWorkload) -> tuple[Any, ...]:
    return (w.history, w.requests, w.services, w.notes, w.source)


# --------------------------------------------------------------------------- models


def test_muxserve_models_are_19_llamas_in_the_papers_size_buckets() -> None:
    from fleetserve.spec import get_model

    names = muxserve_models()
    assert len(names) == 19
    specs = [get_model(n) for n in names]
    assert all(s.arch == "llama" for s in specs)
    buckets = Counter(
        next(i for i, hi in enumerate((8e9, 21e9, 41e9, 70e9)) if s.num_params <= hi) for s in specs
    )
    assert buckets == {0: 12, 1: 4, 2: 2, 3: 1}
    # non-decreasing size: the order rates are handed out in
    sizes = [s.num_params for s in specs]
    assert sizes == sorted(sizes)
    assert names[-3:] == ["llama-30b", "llama-30b", "llama-65b"]


# --------------------------------------------------------------------------- SeaLLM


def test_seallm_services_and_lengths_from_explicit_csv(tiny_csv: Path) -> None:
    w = seallm_workload(8.0, duration_s=300, history_s=300, seed=1, sharegpt=tiny_csv)
    expected = [
        f"{m}/{p}"
        for m in ("llama-2-7b", "llama-2-13b", "llama-2-70b", "opt-6.7b")
        for p in ("chat", "summarization")
    ]
    assert list(w.services) == expected
    assert {r.model for r in w.requests} <= set(expected)
    pairs = set(TINY_PAIRS)
    chat = [r for r in w.history + w.requests if r.model.endswith("/chat")]
    summ = [r for r in w.history + w.requests if r.model.endswith("/summarization")]
    assert chat and summ
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in chat)
    assert float(np.mean([r.prompt_tokens for r in summ])) > 5000
    assert w.services["llama-2-70b/chat"].spec.name == "llama-2-70b"
    assert w.source and any("LongBench" in n for n in w.notes)
    assert any(str(tiny_csv) in n for n in w.notes)


def test_seallm_is_deterministic(tiny_csv: Path) -> None:
    def make(seed: int) -> MultiWorkload:
        return seallm_workload(6.0, duration_s=200, history_s=100, seed=seed, sharegpt=tiny_csv)

    assert _as_data(make(3)) == _as_data(make(3))
    assert make(3).requests != make(4).requests


def test_seallm_total_rate_matches() -> None:
    # summarization only: no ShareGPT needed. 4 services, CV 4: relative std of the
    # total count is about cv / sqrt(rate * T) = 4 / sqrt(36000) = 2.1%.
    rate, hist, dur = 10.0, 1800.0, 1800.0
    w = seallm_workload(rate, duration_s=dur, history_s=hist, seed=0, profiles=("summarization",))
    total = (len(w.history) + len(w.requests)) / (hist + dur)
    assert total == pytest.approx(rate, rel=0.1)
    # every service's long-run rate is total_rate / n (30 full rotations of 4 services)
    counts = Counter(m for _, m, _, _ in _absolute(w, hist))
    for name in w.services:
        assert counts[name] / (hist + dur) == pytest.approx(rate / 4, rel=0.25)


def test_seallm_single_service_gets_the_whole_rate() -> None:
    w = seallm_workload(
        5.0,
        duration_s=1000,
        history_s=1000,
        seed=2,
        models=("llama-2-7b",),
        profiles=("summarization",),
        cv=1.0,
    )
    assert list(w.services) == ["llama-2-7b/summarization"]
    assert (len(w.history) + len(w.requests)) / 2000 == pytest.approx(5.0, rel=0.1)


def test_seallm_rotation_is_visible() -> None:
    rate, rotate, hist, dur = 10.0, 60.0, 960.0, 960.0
    w = seallm_workload(
        rate,
        duration_s=dur,
        history_s=hist,
        seed=5,
        rotate_s=rotate,
        burst_share=0.6,
        profiles=("summarization",),
    )
    names = list(w.services)
    events = _absolute(w, hist)
    n_win = int((hist + dur) / rotate)
    hot_is_top = 0
    hot_total = 0
    for k in range(n_win):
        c = Counter(m for t, m, _, _ in events if k * rotate <= t < (k + 1) * rotate)
        hot = names[k % len(names)]
        hot_total += c[hot]
        hot_is_top += c[hot] > max(v for m, v in c.items() if m != hot)
    assert hot_is_top >= 0.9 * n_win
    # the hot service gets burst_share of all requests overall (cold: 0.4 / 3 each)
    assert hot_total / len(events) == pytest.approx(0.6, abs=0.06)


def test_seallm_no_burst_when_share_is_one_over_n() -> None:
    w = seallm_workload(
        20.0,
        duration_s=600,
        history_s=600,
        seed=0,
        burst_share=0.25,
        cv=1.0,
        profiles=("summarization",),
    )
    names = list(w.services)
    events = _absolute(w, 600.0)
    hot = sum(1 for t, m, _, _ in events if m == names[int(t // 60.0) % 4])
    assert hot / len(events) == pytest.approx(0.25, abs=0.03)


def test_history_run_split_has_no_gap_or_overlap() -> None:
    # same span (history + run) and seed: the same absolute requests, split differently
    kw: dict[str, Any] = {"seed": 7, "profiles": ("summarization",), "rotate_s": 30.0}
    a = seallm_workload(5.0, duration_s=900, history_s=300, **kw)
    b = seallm_workload(5.0, duration_s=500, history_s=700, **kw)
    for w, hist, dur in ((a, 300.0, 900.0), (b, 700.0, 500.0)):
        _check_ordered(w.history, hist)
        _check_ordered(w.requests, dur)
        assert w.history and w.requests
    ea, eb = _absolute(a, 300.0), _absolute(b, 700.0)
    assert len(ea) == len(eb)
    for x, y in zip(ea, eb, strict=True):
        assert x[0] == pytest.approx(y[0], abs=1e-9)
        assert x[1:] == y[1:]
    assert len(a.history) == sum(1 for t, *_ in ea if t < 300.0)


def test_services_are_estimated_from_history_only(tiny_csv: Path) -> None:
    hist = 400.0
    w = seallm_workload(8.0, duration_s=400, history_s=hist, seed=11, sharegpt=tiny_csv)
    for name, svc in w.services.items():
        seen = [r for r in w.history if r.model == name]
        assert seen, name
        assert svc.rate == pytest.approx(len(seen) / hist)
        assert svc.mean_prompt == pytest.approx(np.mean([r.prompt_tokens for r in seen]))
        assert svc.mean_output == pytest.approx(np.mean([r.output_tokens for r in seen]))
    # a longer run after the same history: same history and services, run extended
    longer = seallm_workload(8.0, duration_s=800, history_s=hist, seed=11, sharegpt=tiny_csv)
    assert longer.history == w.history
    assert longer.services == w.services
    assert longer.requests[: len(w.requests)] == w.requests
    assert longer.requests[len(w.requests)].arrival_s >= 400.0


def test_summarization_lengths_match_longbench_means() -> None:
    w = seallm_workload(
        400.0,
        duration_s=200,
        history_s=100,
        seed=0,
        profiles=("summarization",),
        cv=1.0,
    )
    reqs = w.history + w.requests
    assert len(reqs) > 100_000
    prompts = np.array([r.prompt_tokens for r in reqs])
    outputs = np.array([r.output_tokens for r in reqs])
    assert prompts.mean() == pytest.approx(LONGBENCH_PROMPT_MEAN, rel=0.02)
    assert outputs.mean() == pytest.approx(LONGBENCH_OUTPUT_MEAN, rel=0.03)
    assert np.median(prompts) == pytest.approx(11_000, rel=0.03)
    assert np.median(outputs) == pytest.approx(16, abs=1)
    assert prompts.min() >= 1 and outputs.min() >= 1
    # not clipped to LLaMA-2's 4096-token context
    assert prompts.max() > 4096


@needs_sharegpt
def test_seallm_with_shared_sharegpt_file() -> None:
    w = seallm_workload(10.0, duration_s=600, history_s=600, seed=0, sharegpt=SHARED_SHAREGPT)
    chat = [r for r in w.history + w.requests if r.model.endswith("/chat")]
    assert len(chat) > 1000
    # the file's means are 2340 / 439 tokens
    assert float(np.mean([r.prompt_tokens for r in chat])) == pytest.approx(2340, rel=0.15)
    assert float(np.mean([r.output_tokens for r in chat])) == pytest.approx(439, rel=0.1)


# --------------------------------------------------------------------------- MuxServe


def test_muxserve_power_law_rates_and_counts(tiny_csv: Path) -> None:
    total, alpha, hist, dur = 40.0, 1.3, 300.0, 300.0
    w = muxserve_workload(total, alpha, duration_s=dur, history_s=hist, seed=0, sharegpt=tiny_csv)
    names = list(w.services)
    assert len(names) == 19 and len(set(names)) == 19
    assert names[0] == "m00-llama-2-7b" and names[-1] == "m18-llama-65b"
    assert [w.services[n].spec.name for n in names] == muxserve_models()
    expected = power_law_rates(total, 19, alpha)
    assert expected == sorted(expected, reverse=True)
    counts = Counter(m for _, m, _, _ in _absolute(w, hist))
    span = hist + dur
    for name, rate in zip(names, expected, strict=True):
        mu = rate * span
        assert abs(counts[name] - mu) <= 5 * math.sqrt(mu) + 3, (name, counts[name], mu)
    # the counts follow the power law: most popular first, and well ordered at a coarse level
    c = [counts[n] for n in names]
    assert c[0] == max(c)
    assert sum(c[:4]) > sum(c[4:8]) > sum(c[8:12]) > sum(c[15:19])
    assert sum(c) / span == pytest.approx(total, rel=0.05)
    # Service rates come from the history
    for n in names:
        seen = sum(1 for r in w.history if r.model == n)
        if seen:
            assert w.services[n].rate == pytest.approx(seen / hist)
    assert all((r.prompt_tokens, r.output_tokens) in set(TINY_PAIRS) for r in w.requests)


def test_muxserve_alpha_zero_is_uniform(tiny_csv: Path) -> None:
    w = muxserve_workload(19.0, 0.0, duration_s=200, history_s=200, seed=1, sharegpt=tiny_csv)
    counts = Counter(m for _, m, _, _ in _absolute(w, 200.0))
    for name in w.services:
        assert abs(counts[name] - 400) <= 5 * math.sqrt(400)


def test_muxserve_deterministic_and_split(tiny_csv: Path) -> None:
    def make(seed: int) -> MultiWorkload:
        return muxserve_workload(
            10.0, 0.9, duration_s=120, history_s=60, seed=seed, sharegpt=tiny_csv
        )

    a = make(0)
    assert _as_data(a) == _as_data(make(0))
    assert a.requests != make(1).requests
    _check_ordered(a.history, 60.0)
    _check_ordered(a.requests, 120.0)


def test_muxserve_custom_models_and_empty_history_fallback(tiny_csv: Path) -> None:
    # a 0.5 s history at 0.2 req/s in all: most services see no request
    w = muxserve_workload(
        0.2,
        1.0,
        duration_s=10,
        history_s=0.5,
        seed=0,
        models=("llama-2-7b", "llama-2-13b", "llama-2-7b"),
        sharegpt=tiny_csv,
    )
    assert list(w.services) == ["m00-llama-2-7b", "m01-llama-2-13b", "m02-llama-2-7b"]
    mean_p = np.mean([p for p, _ in TINY_PAIRS])
    mean_o = np.mean([o for _, o in TINY_PAIRS])
    empty = [n for n in w.services if not any(r.model == n for r in w.history)]
    assert empty
    for n in empty:
        svc = w.services[n]
        assert svc.rate == pytest.approx(1 / 0.5)
        assert svc.mean_prompt == pytest.approx(mean_p)
        assert svc.mean_output == pytest.approx(mean_o)
    assert any("no request in the" in note for note in w.notes)


@needs_sharegpt
def test_muxserve_with_shared_sharegpt_file() -> None:
    w = muxserve_workload(20.0, 1.3, duration_s=120, history_s=120, seed=0)
    assert len(w.services) == 19
    assert w.requests and w.history
    assert any("sharegpt_8k_lengths.csv" in n for n in w.notes)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"total_rate": 0.0}, "total_rate"),
        ({"total_rate": -1.0}, "total_rate"),
        ({"total_rate": float("nan")}, "total_rate"),
        ({"duration_s": 0.0}, "duration_s"),
        ({"history_s": -5.0}, "history_s"),
        ({"cv": -0.5}, "cv"),
        ({"burst_share": 1.0}, "burst_share"),
        ({"burst_share": -0.1}, "burst_share"),
        ({"rotate_s": 0.0}, "rotate_s"),
        ({"profiles": ("chat", "code")}, "profile"),
        ({"profiles": ()}, "profiles"),
        ({"models": ("llama-2-7b", "gpt-5")}, "models"),
        ({"models": ("llama-2-7b", "llama-2-7b")}, "models"),
        ({"models": "llama-2-7b"}, "models"),
        ({"seed": -1}, "seed"),
    ],
)
def test_seallm_bad_arguments(kwargs: dict[str, Any], needle: str, tiny_csv: Path) -> None:
    args: dict[str, Any] = {
        "total_rate": 1.0,
        "duration_s": 10.0,
        "history_s": 10.0,
        "sharegpt": tiny_csv,
    }
    args.update(kwargs)
    with pytest.raises(ConfigError, match=needle):
        seallm_workload(**args)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"total_rate": 0.0}, "total_rate"),
        ({"alpha": -1.0}, "alpha"),
        ({"duration_s": -1.0}, "duration_s"),
        ({"history_s": 0.0}, "history_s"),
        ({"models": ("llama-7b",)}, "models"),
        ({"models": ()}, "models"),
    ],
)
def test_muxserve_bad_arguments(kwargs: dict[str, Any], needle: str, tiny_csv: Path) -> None:
    args: dict[str, Any] = {
        "total_rate": 1.0,
        "alpha": 1.0,
        "duration_s": 10.0,
        "history_s": 10.0,
        "sharegpt": tiny_csv,
    }
    args.update(kwargs)
    with pytest.raises(ConfigError, match=needle):
        muxserve_workload(**args)


def test_unknown_model_suggests_close_names(tiny_csv: Path) -> None:
    with pytest.raises(ConfigError, match="llama-2-7b"):
        seallm_workload(1.0, duration_s=1, history_s=1, models=("llama2-7b",), sharegpt=tiny_csv)


def test_missing_sharegpt_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    with pytest.raises(InputError, match=re.escape("nope.csv")):
        seallm_workload(1.0, duration_s=10, history_s=10, sharegpt=missing)
    with pytest.raises(InputError, match=re.escape("nope.csv")):
        muxserve_workload(1.0, 1.0, duration_s=10, history_s=10, sharegpt=missing)


def test_missing_shared_data_folder_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETSERVE_DATA", str(tmp_path))
    with pytest.raises(InputError, match=re.escape("sharegpt_8k_lengths.csv")):
        seallm_workload(1.0, duration_s=10, history_s=10)
    # summarization alone needs no ShareGPT file
    w = seallm_workload(1.0, duration_s=10, history_s=10, profiles=("summarization",))
    assert len(w.services) == 4


def test_malformed_sharegpt_file_is_an_input_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,output\n1,2\n")
    with pytest.raises(InputError, match=re.escape("bad.csv")):
        muxserve_workload(1.0, 1.0, duration_s=10, history_s=10, sharegpt=bad)
