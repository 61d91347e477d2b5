"""Tests of fleetserve.workload: loaders, synthetic generators, transforms, stats."""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.table import Table

from fleetserve.errors import ConfigError, InputError, UnknownNameError
from fleetserve.workload import (
    FORMATS,
    LoadedTrace,
    Request,
    assign_models,
    default_workload,
    detect_format,
    fixed_lengths,
    gamma_arrivals,
    lengths_from_file,
    load_trace,
    lognormal_lengths,
    max_requests,
    poisson_arrivals,
    power_law_rates,
    quantile_lengths,
    scale_lengths,
    scale_rate,
    stats_table,
    synthesize,
    time_window,
    trace_stats,
)

FIX = Path(__file__).parent / "fixtures" / "workload"
SHARED = Path(__file__).parents[1].parent / "shared" / "data"
AZURE_CONV = SHARED / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "mooncake_conversation_trace.jsonl"
SHAREGPT = SHARED / "sharegpt_8k_lengths.csv"


def _needs(path: Path) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not path.exists(), reason=f"shared trace {path} not present (see shared/data/README.md)"
    )


def _check_ordered(reqs: list[Request] | tuple[Request, ...]) -> None:
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))


def _error(path: Path, fmt: str, **kw: object) -> InputError:
    with pytest.raises(InputError) as ei:
        load_trace(path, fmt, **kw)  # type: ignore[arg-type]
    err = ei.value
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(str(path))
    return err


# --------------------------------------------------------------------------- loaders: good files


def test_load_azure_fixture() -> None:
    tr = load_trace(FIX / "azure_ok.csv", "azure", model="llama-2-13b")
    assert isinstance(tr, LoadedTrace)
    assert tr.fmt == "azure" and tr.source.endswith("azure_ok.csv")
    assert len(tr) == 5 and tr.skipped == ()
    _check_ordered(tr.requests)
    r = tr.requests
    assert r[0].arrival_s == 0.0
    assert r[1].arrival_s == pytest.approx(4.314579, abs=1e-9)  # 7-digit fraction kept
    assert r[2].arrival_s == r[1].arrival_s  # ties allowed
    assert r[4].arrival_s == pytest.approx(5.31941, abs=1e-9)  # no fraction at all
    assert (r[0].prompt_tokens, r[0].output_tokens) == (374, 44)
    assert all(x.model == "llama-2-13b" for x in r)


def test_azure_timestamp_variants(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16T23:59:59.5Z,10,10\n"
        "2023-11-17 00:00:00.25+00:00,10,10\n"
        "2023-11-17 01:00:01+01:00,10,10\n"
    )
    r = load_trace(f, "azure").requests
    assert [x.arrival_s for x in r] == pytest.approx([0.0, 0.75, 1.5])


def test_load_burstgpt_skips_failed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fleetserve.workload.loaders"):
        tr = load_trace(FIX / "burstgpt_ok.csv", "burstgpt")
    assert len(tr) == 4
    assert [s.line for s in tr.skipped] == [3, 6]
    assert all("output tokens is 0" in s.reason for s in tr.skipped)
    assert [r.arrival_s for r in tr.requests] == [0.0, 113.0, 113.0, 136.0]
    assert [r.prompt_tokens for r in tr.requests] == [472, 417, 1360, 300]
    assert "skipped 2 of 6 rows" in caplog.text


def test_zero_prompt_and_output_rows_skipped() -> None:
    tr = load_trace(FIX / "azure_zero_tokens.csv", "azure")
    assert [(s.line, s.reason.split(" ")[0]) for s in tr.skipped] == [(2, "prompt"), (4, "output")]
    # arrivals re-based to the first *kept* request
    assert [r.arrival_s for r in tr.requests] == pytest.approx([0.0, 2.25])


def test_all_rows_skipped_is_error() -> None:
    err = _error(FIX / "burstgpt_all_failed.csv", "burstgpt")
    assert "no usable requests" in str(err) and "line 2" in str(err)


def test_load_mooncake_fixture() -> None:
    tr = load_trace(FIX / "mooncake_ok.jsonl", "mooncake")
    assert [r.arrival_s for r in tr.requests] == [0.0, 0.0, 3.0, 6.0]
    assert tr.requests[3].output_tokens == 3
    _check_ordered(tr.requests)


def test_load_lengths_poisson() -> None:
    a = load_trace(FIX / "lengths_ok.csv", "lengths", rate=2.0, seed=7)
    b = load_trace(FIX / "lengths_ok.csv", "lengths", rate=2.0, seed=7)
    c = load_trace(FIX / "lengths_ok.csv", "lengths", rate=2.0, seed=8)
    assert a == b and a != c
    assert [r.prompt_tokens for r in a.requests] == [74, 290, 1500, 33]
    assert a.requests[0].arrival_s == 0.0
    _check_ordered(a.requests)


def test_lengths_needs_rate() -> None:
    with pytest.raises(ConfigError, match="rate"):
        load_trace(FIX / "lengths_ok.csv", "lengths")
    with pytest.raises(ConfigError, match="> 0"):
        load_trace(FIX / "lengths_ok.csv", "lengths", rate=-1.0)
    with pytest.raises(ConfigError, match="only to format 'lengths'"):
        load_trace(FIX / "azure_ok.csv", "azure", rate=3.0)


def test_load_native_jsonl() -> None:
    tr = load_trace(FIX / "native_ok.jsonl", "jsonl")
    r = tr.requests
    assert [x.arrival_s for x in r] == [0.0, 0.5, 2.0]
    assert r[0].model == "llama-2-7b" and r[1].model == "llama-2-13b"
    assert (r[1].slo_ttft_s, r[1].slo_tpot_s) == (1.5, 0.1)
    assert r[2].slo_ttft_s is None


def test_detect_format(tmp_path: Path) -> None:
    cases = {
        "azure_ok.csv": "azure",
        "burstgpt_ok.csv": "burstgpt",
        "lengths_ok.csv": "lengths",
        "mooncake_ok.jsonl": "mooncake",
        "native_ok.jsonl": "jsonl",
    }
    for name, fmt in cases.items():
        assert detect_format(FIX / name) == fmt
    assert len(load_trace(FIX / "azure_ok.csv")) == 5  # fmt=None detects
    junk = tmp_path / "junk.csv"
    junk.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(InputError, match="cannot detect"):
        detect_format(junk)
    with pytest.raises(InputError, match="empty"):
        detect_format(FIX / "azure_empty.csv")
    assert set(cases.values()) == set(FORMATS)


def test_unknown_format() -> None:
    with pytest.raises(UnknownNameError, match="azure"):
        load_trace(FIX / "azure_ok.csv", "azur")


# --------------------------------------------------------------------------- loaders: errors


def test_missing_file() -> None:
    err = _error(FIX / "nope.csv", "azure")
    assert "file not found" in str(err)


def test_missing_column_names_it_and_lists_found() -> None:
    err = _error(FIX / "azure_missing_column.csv", "azure")
    assert err.field == "GeneratedTokens" and err.line == 1
    assert "missing required column 'GeneratedTokens'" in str(err)
    assert "'TIMESTAMP', 'ContextTokens'" in str(err)


def test_non_numeric_tokens() -> None:
    err = _error(FIX / "azure_nonnumeric.csv", "azure")
    assert (err.line, err.field) == (3, "ContextTokens")
    assert ":3, field 'ContextTokens'" in str(err) and "'abc'" in str(err)
    assert "integer" in str(err)


def test_negative_tokens() -> None:
    err = _error(FIX / "azure_negative.csv", "azure")
    assert (err.line, err.field) == (4, "GeneratedTokens")
    assert ">= 0" in str(err) and "-5" in str(err)


def test_unsorted_timestamps() -> None:
    err = _error(FIX / "azure_unsorted.csv", "azure")
    assert (err.line, err.field) == (7, "TIMESTAMP")
    assert (
        "timestamps must be non-decreasing: line 7 has 2023-11-16 18:15:49.5000000 < previous "
        "2023-11-16 18:15:50.0000000 (line 6)" in str(err)
    )


def test_empty_and_header_only() -> None:
    assert "empty" in str(_error(FIX / "azure_empty.csv", "azure"))
    assert "no data rows" in str(_error(FIX / "azure_header_only.csv", "azure"))


def test_bad_timestamp() -> None:
    err = _error(FIX / "azure_bad_timestamp.csv", "azure")
    assert (err.line, err.field) == (3, "TIMESTAMP")
    assert "2023-11-16 18:15:46.6805900" in str(err)


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "x,ChatGPT,1,1,2,API log\n", "Timestamp", "seconds"),
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "1,ChatGPT,1.5,1,2,API log\n", "Request tokens", "'1.5'"),
        ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "1,ChatGPT,,1,2,API log\n", "Request tokens", "empty value"),
    ],
)  # fmt: skip
def test_burstgpt_bad_values(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    f = tmp_path / "b.csv"
    f.write_text(text)
    err = _error(f, "burstgpt")
    assert (err.line, err.field) == (2, field) and fragment in str(err)


def test_wrong_field_count(tmp_path: Path) -> None:
    f = tmp_path / "w.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n1,2\n3,4,5\n")
    err = _error(f, "lengths", rate=1.0)
    assert err.line == 3 and "expected 2" in str(err)


def test_float_tokens_integral_ok(tmp_path: Path) -> None:
    f = tmp_path / "f.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n12.0,3\n")
    assert load_trace(f, "lengths", rate=1.0).requests[0].prompt_tokens == 12


def test_mooncake_errors(tmp_path: Path) -> None:
    err = _error(FIX / "mooncake_missing_key.jsonl", "mooncake")
    assert (err.line, err.field) == (2, "output_length")
    assert "'hash_ids'" in str(err)  # lists the keys found
    err = _error(FIX / "mooncake_bad_json.jsonl", "mooncake")
    assert err.line == 2 and "invalid JSON" in str(err)
    f = tmp_path / "m.jsonl"
    f.write_text('{"timestamp": 5, "input_length": "10", "output_length": 3}\n')
    err = _error(f, "mooncake")
    assert (err.line, err.field) == (1, "input_length")
    f.write_text("[1, 2]\n")
    assert "JSON object" in str(_error(f, "mooncake"))
    f.write_text("\n\n")
    assert "empty" in str(_error(f, "mooncake"))
    f.write_text(
        '{"timestamp": 6000, "input_length": 1, "output_length": 1}\n'
        '{"timestamp": 3000, "input_length": 1, "output_length": 1}\n'
    )
    err = _error(f, "mooncake")
    assert (err.line, err.field) == (2, "timestamp") and "3000 < previous 6000" in str(err)


def test_native_errors(tmp_path: Path) -> None:
    err = _error(FIX / "native_unknown_key.jsonl", "jsonl")
    assert (err.line, err.field) == (2, "priority") and "unknown key 'priority'" in str(err)
    err = _error(FIX / "native_negative.jsonl", "jsonl")
    assert (err.line, err.field) == (1, "prompt_tokens")
    f = tmp_path / "n.jsonl"
    f.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1, "slo_ttft_s": -1}\n')
    assert _error(f, "jsonl").field == "slo_ttft_s"
    f.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1, "model": 3}\n')
    assert _error(f, "jsonl").field == "model"
    f.write_text('{"arrival_s": "soon", "prompt_tokens": 1, "output_tokens": 1}\n')
    assert _error(f, "jsonl").field == "arrival_s"
    f.write_text('{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 1}\n')
    assert _error(f, "jsonl").field == "prompt_tokens"
    f.write_text('{"prompt_tokens": 1, "output_tokens": 1}\n')
    assert _error(f, "jsonl").field == "arrival_s"


# --------------------------------------------------------------------------- real shared traces


@_needs(AZURE_CONV)
def test_real_azure_conv() -> None:
    tr = load_trace(AZURE_CONV, "azure")
    assert len(tr) == 19_366 and tr.skipped == ()
    _check_ordered(tr.requests)
    s = trace_stats(tr.requests)
    assert s["rate_rps"] == pytest.approx(5.53, abs=0.01)
    assert s["interarrival_cv"] == pytest.approx(1.09, abs=0.01)
    assert s["prompt_tokens"]["mean"] == pytest.approx(1155, abs=1)
    assert (s["prompt_tokens"]["p50"], s["prompt_tokens"]["p99"]) == (1020, 4142)
    assert s["output_tokens"]["mean"] == pytest.approx(211, abs=1)
    assert (s["output_tokens"]["p50"], s["output_tokens"]["p99"]) == (129, 601)


@_needs(MOONCAKE)
def test_real_mooncake() -> None:
    tr = load_trace(MOONCAKE, "mooncake")
    assert len(tr) == 12_031 and tr.skipped == ()
    s = trace_stats(tr.requests)
    assert s["rate_rps"] == pytest.approx(3.40, abs=0.01)
    assert s["prompt_tokens"]["p50"] == 6909


@_needs(SHAREGPT)
def test_real_sharegpt_lengths() -> None:
    tr = load_trace(SHAREGPT, "lengths", rate=10.0, seed=1)
    assert len(tr) == 30_731 and tr.skipped == ()
    s = trace_stats(tr.requests)
    assert s["rate_rps"] == pytest.approx(10.0, rel=0.03)
    assert s["interarrival_cv"] == pytest.approx(1.0, abs=0.03)
    assert s["prompt_tokens"]["p50"] == pytest.approx(1730, rel=0.01)
    sampler = lengths_from_file(SHAREGPT)
    p, o = sampler(50_000, np.random.default_rng(0))
    assert p.mean() == pytest.approx(2340, rel=0.03) and o.max() <= 1024


# --------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("rate", [0.5, 20.0])
def test_poisson_rate_and_cv(rate: float) -> None:
    t = poisson_arrivals(rate, n=50_000, rng=np.random.default_rng(1))
    gaps = np.diff(t)
    assert len(t) == 50_000 and np.all(gaps >= 0)
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("cv", [0.5, 1.09, 2.0])
def test_gamma_rate_and_cv(cv: float) -> None:
    t = gamma_arrivals(5.53, cv, n=100_000, rng=np.random.default_rng(2))
    gaps = np.diff(t)
    assert 1 / gaps.mean() == pytest.approx(5.53, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.04)


def test_arrivals_duration_and_determinism() -> None:
    a = gamma_arrivals(3.0, 1.5, duration_s=2000.0, rng=np.random.default_rng(3))
    b = gamma_arrivals(3.0, 1.5, duration_s=2000.0, rng=np.random.default_rng(3))
    assert np.array_equal(a, b)
    assert a.max() < 2000.0 and len(a) == pytest.approx(6000, rel=0.1)
    both = poisson_arrivals(1.0, n=10, duration_s=1e6, rng=np.random.default_rng(0))
    assert len(both) == 10
    even = gamma_arrivals(2.0, 0.0, n=4, rng=np.random.default_rng(0))
    assert even.tolist() == [0.5, 1.0, 1.5, 2.0]
    with pytest.raises(ConfigError):
        poisson_arrivals(1.0, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError):
        poisson_arrivals(0.0, n=3, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError):
        gamma_arrivals(1.0, -1.0, n=3, rng=np.random.default_rng(0))


@given(
    total=st.floats(min_value=0.01, max_value=1e4),
    n=st.integers(min_value=1, max_value=50),
    alpha=st.floats(min_value=0.0, max_value=5.0),
)
def test_power_law_rates_sum(total: float, n: int, alpha: float) -> None:
    rates = power_law_rates(total, n, alpha)
    assert len(rates) == n
    assert math.fsum(rates) == pytest.approx(total, rel=1e-9)
    assert all(a >= b for a, b in itertools.pairwise(rates))


def test_power_law_rates_values() -> None:
    assert power_law_rates(6.0, 3, 0.0) == pytest.approx([2.0, 2.0, 2.0])
    r = power_law_rates(1.0, 2, 1.0)
    assert r[0] == pytest.approx(2 * r[1])
    with pytest.raises(ConfigError):
        power_law_rates(1.0, 0, 1.0)


def test_length_samplers() -> None:
    rng = np.random.default_rng(4)
    p, o = fixed_lengths(10, 3)(5, rng)
    assert p.tolist() == [10] * 5 and o.tolist() == [3] * 5
    ln = lognormal_lengths(1155, 1020, 211, 129, output_max=1000)
    p, o = ln(200_000, rng)
    assert np.median(p) == pytest.approx(1020, rel=0.02)
    assert p.mean() == pytest.approx(1155, rel=0.02)
    assert o.max() <= 1000 and o.min() >= 1
    with pytest.raises(ConfigError, match="mean >= median"):
        lognormal_lengths(10, 20, 5, 5)
    with pytest.raises(ConfigError):
        fixed_lengths(0, 1)
    q = quantile_lengths([(0, 1), (0.5, 100), (1, 1000)], [(0, 1), (1, 1)])
    p, o = q(100_000, rng)
    assert np.median(p) == pytest.approx(100, rel=0.03) and p.max() <= 1000
    with pytest.raises(ConfigError):
        quantile_lengths([(0.1, 1), (1, 10)], [(0, 1), (1, 1)])


def test_lengths_from_file_fixture() -> None:
    s = lengths_from_file(FIX / "lengths_ok.csv")
    p, o = s(1000, np.random.default_rng(0))
    pairs = set(zip(p.tolist(), o.tolist(), strict=True))
    assert pairs <= {(74, 918), (290, 905), (1500, 20), (33, 2)}
    s2 = lengths_from_file(FIX / "azure_ok.csv", "azure")
    assert s2(3, np.random.default_rng(0))[0].min() >= 91


def test_synthesize_multi_model() -> None:
    models = ["llama-2-7b", "llama-2-13b", "opt-6.7b"]
    rates = power_law_rates(12.0, 3, 1.0)
    reqs = synthesize(
        models, rates, fixed_lengths(64, 8), rng=np.random.default_rng(5), duration_s=500.0
    )
    _check_ordered(reqs)
    assert all(r.arrival_s < 500.0 for r in reqs)
    counts = trace_stats(reqs)["models"]
    for m, rate in zip(models, rates, strict=True):
        assert counts[m] == pytest.approx(rate * 500, rel=0.1)
    again = synthesize(
        models, rates, fixed_lengths(64, 8), rng=np.random.default_rng(5), duration_s=500.0
    )
    assert again == reqs
    first = synthesize(
        models,
        rates,
        [fixed_lengths(1, 1)] * 3,
        rng=np.random.default_rng(5),
        n=100,
        cv=2.0,
        slo_ttft_s=1.0,
    )
    assert len(first) == 100 and first[0].slo_ttft_s == 1.0
    with pytest.raises(ConfigError):
        synthesize(models, [1.0], fixed_lengths(1, 1), rng=np.random.default_rng(0), n=5)


def test_default_workload_matches_azure_stats() -> None:
    reqs = default_workload(np.random.default_rng(0), duration_s=3600.0)
    _check_ordered(reqs)
    s = trace_stats(reqs)
    assert s["rate_rps"] == pytest.approx(5.53, rel=0.03)
    assert s["interarrival_cv"] == pytest.approx(1.09, rel=0.05)
    assert s["prompt_tokens"]["mean"] == pytest.approx(1155, rel=0.03)
    assert s["prompt_tokens"]["p50"] == pytest.approx(1020, rel=0.03)
    assert s["prompt_tokens"]["p99"] == pytest.approx(4142, rel=0.06)
    assert s["output_tokens"]["mean"] == pytest.approx(211, rel=0.03)
    assert s["output_tokens"]["p50"] == pytest.approx(129, rel=0.03)
    assert s["output_tokens"]["p99"] == pytest.approx(601, rel=0.03)
    assert default_workload(np.random.default_rng(0), duration_s=60.0) == [
        r for r in default_workload(np.random.default_rng(0), duration_s=60.0)
    ]


# --------------------------------------------------------------------------- transforms


def _req(i: int, t: float, p: int = 100, o: int = 10, model: str = "m") -> Request:
    return Request(id=i, model=model, arrival_s=t, prompt_tokens=p, output_tokens=o)


req_lists = st.lists(
    st.builds(
        _req,
        i=st.integers(min_value=0, max_value=10_000),
        t=st.floats(min_value=0.0, max_value=1e5, allow_nan=False),
        p=st.integers(min_value=1, max_value=200_000),
        o=st.integers(min_value=1, max_value=20_000),
    ),
    max_size=40,
)


@given(
    reqs=req_lists,
    factor=st.floats(min_value=0.01, max_value=20.0),
    cap=st.integers(min_value=1, max_value=50_000),
)
def test_scale_lengths_cap_property(reqs: list[Request], factor: float, cap: int) -> None:
    out, n_capped = scale_lengths(reqs, factor, cap)
    _check_ordered(out)
    assert len(out) == len(reqs)
    assert n_capped == sum(r.length_capped for r in out)
    for r in out:
        assert r.max_kv_tokens <= cap
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        if r.length_capped:
            assert r.max_kv_tokens == cap


@given(reqs=req_lists, factor=st.floats(min_value=0.01, max_value=20.0))
def test_scale_lengths_uncapped(reqs: list[Request], factor: float) -> None:
    out, n_capped = scale_lengths(reqs, factor, None)
    assert n_capped == 0
    ordered = sorted(reqs, key=lambda r: (r.arrival_s, r.id))
    for a, b in zip(ordered, out, strict=True):
        assert b.prompt_tokens == max(1, round(a.prompt_tokens * factor))
        assert b.output_tokens == max(1, round(a.output_tokens * factor))


def test_scale_lengths_examples() -> None:
    out, n = scale_lengths([_req(0, 0.0, 300, 100), _req(1, 1.0, 10, 10)], 10.0, 2000)
    assert n == 1
    assert (out[0].prompt_tokens, out[0].output_tokens, out[0].length_capped) == (1501, 500, True)
    assert (out[1].prompt_tokens, out[1].output_tokens, out[1].length_capped) == (100, 100, False)
    with pytest.raises(ConfigError):
        scale_lengths([], 0.0)
    with pytest.raises(ConfigError):
        scale_lengths([], 1.0, 0)


@given(reqs=req_lists, factor=st.floats(min_value=0.1, max_value=10.0))
def test_scale_rate_property(reqs: list[Request], factor: float) -> None:
    out = scale_rate(reqs, factor)
    _check_ordered(out)
    if len(out) >= 2:
        span_in = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
        span_out = out[-1].arrival_s - out[0].arrival_s
        assert span_out == pytest.approx(span_in / factor, rel=1e-9, abs=1e-9)


def test_scale_rate_halves_span() -> None:
    reqs = [_req(i, float(t)) for i, t in enumerate([0, 2, 4, 10])]
    out = scale_rate(reqs, 2.0)
    assert [r.arrival_s for r in out] == [0.0, 1.0, 2.0, 5.0]
    with pytest.raises(ConfigError):
        scale_rate(reqs, -2.0)
    with pytest.raises(ConfigError):
        scale_rate(reqs, math.inf)


@given(reqs=req_lists, n=st.integers(min_value=1, max_value=50))
@settings(max_examples=50)
def test_max_requests_and_renumbering(reqs: list[Request], n: int) -> None:
    out = max_requests(reqs, n)
    _check_ordered(out)
    assert len(out) == min(n, len(reqs))
    assert sorted(r.arrival_s for r in reqs)[: len(out)] == [r.arrival_s for r in out]


def test_time_window() -> None:
    reqs = [_req(i, float(t)) for i, t in enumerate([9, 1, 5, 3, 7])]
    out = time_window(reqs, 3.0, 7.0)
    assert [r.arrival_s for r in out] == [0.0, 2.0]
    assert [r.id for r in out] == [0, 1]
    assert len(time_window(reqs, 0.0, math.inf)) == 5
    with pytest.raises(ConfigError):
        time_window(reqs, 5.0, 5.0)
    with pytest.raises(ConfigError):
        time_window(reqs, -1.0, 5.0)


def test_assign_models() -> None:
    reqs = [_req(i, float(i)) for i in range(20_000)]
    out = assign_models(reqs, ["a", "b"], [3.0, 1.0], np.random.default_rng(0))
    _check_ordered(out)
    share = sum(r.model == "a" for r in out) / len(out)
    assert share == pytest.approx(0.75, abs=0.02)
    uniform = assign_models(reqs[:10], ["x"], None, np.random.default_rng(0))
    assert {r.model for r in uniform} == {"x"}
    assert reqs[0].model == "m"  # input untouched
    with pytest.raises(ConfigError):
        assign_models(reqs, ["a", "b"], [1.0], np.random.default_rng(0))
    with pytest.raises(ConfigError):
        assign_models(reqs, ["a", "b"], [0.0, 0.0], np.random.default_rng(0))
    with pytest.raises(ConfigError):
        assign_models(reqs, [], None, np.random.default_rng(0))


# --------------------------------------------------------------------------- inspect


def test_trace_stats_and_table() -> None:
    reqs = [_req(0, 0.0, 10, 1, "a"), _req(1, 1.0, 20, 2, "b"), _req(2, 3.0, 30, 3, "a")]
    s = trace_stats(reqs)
    assert s["rows"] == 3 and s["span_s"] == 3.0
    assert s["rate_rps"] == pytest.approx(2 / 3)
    assert s["interarrival_cv"] == pytest.approx(1 / 3)
    assert s["prompt_tokens"]["mean"] == 20 and s["prompt_tokens"]["max"] == 30
    assert s["models"] == {"a": 2, "b": 1}
    table = stats_table(s, "demo")
    assert isinstance(table, Table) and table.row_count >= 8
    empty = trace_stats([])
    assert empty["rows"] == 0 and empty["rate_rps"] is None
    stats_table(empty, "empty")
