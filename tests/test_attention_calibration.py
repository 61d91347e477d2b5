"""Attention kernels against measurements (issue 22 item 1): the Vidur
``attention.csv`` reader, the fit (it recovers the parameters of rows the
model generated), and the catalog's H100 defaults being the fit of the
published figures."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from fleetserve.cli.calibrate import stale_defaults
from fleetserve.costmodel import A100_PARAMS, H100_PARAMS, CostModel
from fleetserve.costmodel.attention import (
    H100_PUBLISHED,
    AttnRow,
    attention_time,
    fit_attention,
    load_vidur_attention,
)
from fleetserve.errors import InputError
from fleetserve.spec import get_gpu, get_model

COLS = [
    "time_stats.attn_prefill.median",
    "time_stats.attn_decode.median",
    "n_embd",
    "n_q_head",
    "n_kv_head",
    "num_tensor_parallel_workers",
    "batch_size",
    "prefill_chunk_size",
    "kv_cache_size",
    "is_prefill",
]
TRUE = (0.45, 0.7, 12e-6, 1.5, 128.0)  # attn_eff, kv_mem_eff, latency, causal factor, waste


def _rows() -> list[AttnRow]:
    out = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        for c in (64, 512, 2048, 4032):
            out.append(AttnRow("x", True, 32, 4, 128, b, 1, c, True, 1.0))
    for n in (64, 128, 256, 512, 1024, 2048, 3072, 4096):
        for c in (0, 512, 2048):
            out.append(AttnRow("x", False, 32, 4, 128, 1, n, c, True, 1.0))
    return out


def _write(path: Path, *, bad: str | None = None) -> Path:
    gpu = get_gpu("a100-80gb")
    rows = _rows()
    t = attention_time(rows, gpu, *TRUE)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLS if bad != "column" else COLS[1:])
        w.writeheader()
        for r, s in zip(rows, t, strict=True):
            d = {
                "time_stats.attn_prefill.median": "" if r.decode else s * 1e3,
                "time_stats.attn_decode.median": s * 1e3 if r.decode else "",
                "n_embd": 8192,
                "n_q_head": 64,
                "n_kv_head": 8,
                "num_tensor_parallel_workers": 2,
                "batch_size": r.batch,
                "prefill_chunk_size": 0 if r.decode else r.new,
                "kv_cache_size": r.cached,
                "is_prefill": "maybe" if bad == "flag" else str(not r.decode),
            }
            w.writerow({k: v for k, v in d.items() if k in (w.fieldnames or ())})
    return path


def test_the_fit_recovers_the_parameters_of_model_generated_rows(tmp_path: Path) -> None:
    rows = load_vidur_attention(_write(tmp_path / "attention.csv"))
    assert {(r.q_heads, r.kv_heads, r.head_dim) for r in rows} == {(32, 4, 128)}  # per GPU
    fit = fit_attention("a100", rows, get_gpu("a100-80gb"))
    got = (fit.attn_eff, fit.kv_mem_eff, fit.latency_s, fit.causal_factor, fit.query_waste)
    assert got == pytest.approx(TRUE, rel=1e-6)
    assert fit.errors["all"]["median_abs"] < 1e-9 and fit.held_out > 0
    # the legacy model (no latency, full causal skipping, attn_eff 0.5, mem 0.8) is off
    assert fit.default_errors["all"]["median_abs"] > 0.05


def test_bad_attention_profiles_are_named_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"columns time_stats\.attn_prefill\.median missing"):
        load_vidur_attention(_write(tmp_path / "a.csv", bad="column"))
    with pytest.raises(InputError, match=r"b\.csv:2: column 'is_prefill'"):
        load_vidur_attention(_write(tmp_path / "b.csv", bad="flag"))
    with pytest.raises(InputError, match="cannot read"):
        load_vidur_attention(tmp_path / "nope.csv")


def test_the_h100_defaults_are_the_fit_of_the_published_figures() -> None:
    fit = fit_attention("h100", list(H100_PUBLISHED), get_gpu("h100-80gb"))
    assert stale_defaults([], [fit], {"h100": H100_PARAMS}) == []
    assert fit.in_sample_errors["all"]["median_abs"] < 0.10


def test_the_simulator_prices_attention_as_the_fitted_kernels() -> None:
    """The cost model's attention term is :func:`attention_time` times the layers:
    a whole-prompt prefill's time minus the same prompt without attention work."""
    m, gpu = get_model("llama-2-70b"), get_gpu("a100-80gb")
    tp = 2  # the Vidur profile's shape: 32 query, 4 KV heads per GPU
    c = CostModel().bind(m, gpu, tp)
    p = c.params
    assert p is A100_PARAMS
    for n in (128, 1024, 4096):
        row = AttnRow("x", False, 32, 4, 128, 1, n, 0, True, 1.0)
        per_layer = attention_time(
            [row],
            gpu,
            p.attn_eff,
            p.kv_memory_eff,
            p.attn_latency_s,
            p.attn_causal_factor,
            p.attn_query_waste,
        )[0]
        without = c._fixed + n * c._comm_tok + c._linear(float(n), 1.0)
        assert c.prefill_time([n]) - without == pytest.approx(80 * per_layer, rel=1e-9)
    dec = AttnRow("x", True, 32, 4, 128, 16, 1, 1000, True, 1.0)
    per_layer = attention_time([dec], gpu, p.attn_eff, p.kv_memory_eff, p.attn_latency_s, 1.0, 0.0)[
        0
    ]
    a_c, _, _, _ = c.decode_lines(16)
    attn = c.decode_time_scalar(16, 16 * 1000.0) - (a_c - c._lat_a)
    assert attn == pytest.approx(80 * per_layer, rel=1e-9)
    assert np.isfinite(attn)
