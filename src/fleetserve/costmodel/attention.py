r"""Attention kernels against measurements: the cost model's attention term, fitted.

Issue 22 item 1 asks for attention calibrated from measured kernels. Two
sources are used, one per GPU family, each cited where its rows are built:

* **A100**: Vidur's measured attention profile,
  ``data/profiling/a100/attention.csv`` of microsoft/vidur at commit
  ``e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a`` (MIT; 14,658 rows; Llama-2-70B
  at TP 2: 32 query and 4 KV heads of 128 per GPU; FlashAttention backend of
  Sarathi-Serve, fp16, kineto kernel times; prefill chunks of 64 to 4,096
  tokens over 0 to 4,032 cached ones, decode batches of 1 to 128 over 32 to
  4,032 cached tokens each). Not shipped: ``fleetserve calibrate --attention
  FILE`` reads it (or any file in that format) and refits; see
  ``docs/calibration.md`` for how to get it.
* **H100**: published figures, in :data:`H100_PUBLISHED`: FlashAttention-2's
  forward pass on an H100 80GB SXM5 (Shah et al., "FlashAttention-3", 2024,
  arXiv 2407.08608, Fig. 5; the bar labels of ``assets/flash3_fp16_fwd.png``
  in Dao-AILab/flash-attention): head dim 128, causal and not, 512 to 16k
  tokens, batch such that 16k tokens in all, 16 heads; and FlashAttention-2's
  paged batch decode on an H100 SXM (microsoft/onnxruntime pull request
  21414, nvbench table: 64 sequences, 64 query / 8 KV heads of 128, 32 to 256
  cached tokens).

The model (per layer and attention kernel; :mod:`fleetserve.costmodel.roofline`
prices the iteration with it when ``matmul_knee`` is set)::

    t = attn_latency_s + max( (pairs + w n) 4 H d / (F attn_eff) ,
                              (c + n) kv_bytes / (B kv_mem_eff) )
    pairs = n c + kappa n (n + 1) / 2      (a chunk of n new over c cached)

``w`` (``attn_query_waste``) is work each query row pays beyond its pairs
(tile rounding, softmax rescaling), ``kappa`` (``attn_causal_factor``) the
fraction of the causal triangle's masked half a kernel still computes (1: it
skips every masked pair; 2: it computes the full square). A decode is
``n = 1`` over ``c`` cached tokens (its one pair per cached token; no waste:
its kernel is a memory-bound one). Non-causal rows (only in the published
H100 figure) count ``n^2`` pairs.

Fit (:func:`fit_attention`): the decode rows give ``kv_mem_eff`` and the
latency; the prefill rows then ``attn_eff``, ``kappa`` and ``w`` at that
latency; squared relative error, each row class weighing the same, grid
search; every fifth value of the batch (decode) or chunk size (prefill) grid
is held out and the errors are reported on those rows.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetserve.costmodel.vidur import class_error_stats, csv_number, equal_class_weights
from fleetserve.errors import InputError
from fleetserve.spec.types import GpuSpec

__all__ = [
    "H100_PUBLISHED",
    "AttnFit",
    "AttnRow",
    "attention_time",
    "fit_attention",
    "load_vidur_attention",
]


@dataclass(frozen=True, slots=True)
class AttnRow:
    """One measured attention kernel call on one GPU.

    Attributes:
        source: where it comes from (``file:line`` or a citation).
        decode: a decode call (one new token per sequence) or a prefill chunk.
        q_heads: query heads on this GPU; kv_heads: KV heads on this GPU.
        head_dim: head dimension.
        batch: sequences in the call.
        new: new tokens per sequence (1 for decode).
        cached: cached tokens per sequence.
        causal: causal masking (False only for the published non-causal rows).
        time_s: measured seconds.
    """

    source: str
    decode: bool
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int
    new: int
    cached: int
    causal: bool
    time_s: float

    @property
    def row_class(self) -> str:
        """The class errors are reported by (issue 22: prefill at 128-8k
        tokens, decode at batch 1-256 and context 1-8k)."""
        if self.decode:
            return "decode, batch 1-16" if self.batch <= 16 else "decode, batch 17+"
        kind = "prefill" if self.cached == 0 else "chunked prefill"
        return f"{kind}, {'<=512' if self.new <= 512 else '513+'} tokens"


_VIDUR_COLS = (
    "n_embd",
    "n_q_head",
    "n_kv_head",
    "num_tensor_parallel_workers",
    "batch_size",
    "prefill_chunk_size",
    "kv_cache_size",
    "is_prefill",
)


def load_vidur_attention(path: str | Path) -> list[AttnRow]:
    """Read a Vidur ``attention.csv`` (columns ``time_stats.attn_prefill.median``
    / ``time_stats.attn_decode.median`` in ms and the shape columns).

    Raises:
        InputError: a missing file or column, or a bad value (the message names
            the file, line and column).
    """
    p = Path(path)
    try:
        fh = p.open(newline="")
    except OSError as e:
        raise InputError(f"{p}: cannot read the attention profile ({e.strerror or e})") from None
    out: list[AttnRow] = []
    with fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or ())
        need = [*_VIDUR_COLS, "time_stats.attn_prefill.median", "time_stats.attn_decode.median"]
        missing = [c for c in need if c not in cols]
        if missing:
            raise InputError(
                f"{p}:1: not a Vidur attention profile: columns {', '.join(missing[:4])} missing"
            )
        f = str(p)
        for i, raw in enumerate(reader, start=2):
            flag = (raw.get("is_prefill") or "").strip().lower()
            if flag not in ("true", "false"):
                raise InputError(
                    f"{f}:{i}: column 'is_prefill': expected True or False, got {flag!r}"
                )
            prefill = flag == "true"
            v = {c: csv_number(raw, c, f, i) for c in _VIDUR_COLS[:-1]}
            tp = int(v["num_tensor_parallel_workers"])
            q, kv = int(v["n_q_head"]), int(v["n_kv_head"])
            if tp < 1 or q % tp or kv % tp or q < 1 or int(v["n_embd"]) % q:
                raise InputError(
                    f"{f}:{i}: heads ({q} query, {kv} KV) and n_embd {int(v['n_embd'])} do "
                    f"not split over {tp} GPUs"
                )
            col = "time_stats.attn_prefill.median" if prefill else "time_stats.attn_decode.median"
            t = csv_number(raw, col, f, i) / 1e3
            new = int(v["prefill_chunk_size"]) if prefill else 1
            if t <= 0 or new < 1 or int(v["batch_size"]) < 1:
                raise InputError(f"{f}:{i}: expected a time > 0, a batch and a chunk >= 1")
            out.append(
                AttnRow(
                    source=f"{f}:{i}",
                    decode=not prefill,
                    q_heads=q // tp,
                    kv_heads=kv // tp,
                    head_dim=int(v["n_embd"]) // q,
                    batch=int(v["batch_size"]),
                    new=new,
                    cached=int(v["kv_cache_size"]),
                    causal=True,
                    time_s=t,
                )
            )
    if not out:
        raise InputError(f"{p}: the attention profile has no rows")
    return out


def _published_h100() -> list[AttnRow]:
    fa3_fig5 = (
        "Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608) Fig. 5, FlashAttention-2 "
        "forward on H100 80GB SXM5"
    )
    rows = []
    # TFLOP/s of FlashAttention-2, head dim 128, at 512..16k tokens (16k tokens in all,
    # hidden 2048: 16 heads); FLOPs = 4 s^2 d heads per sequence, halved when causal.
    for causal, tflops in (
        (True, (191, 260, 298, 319, 333, 335)),
        (False, (309, 350, 362, 368, 370, 370)),
    ):
        for s, tf in zip((512, 1024, 2048, 4096, 8192, 16384), tflops, strict=True):
            batch = 16384 // s
            flops = 4.0 * s * s * 128 * 16 * batch * (0.5 if causal else 1.0)
            rows.append(
                AttnRow(
                    source=f"{fa3_fig5}, d 128, {'causal' if causal else 'non-causal'}, {s}",
                    decode=False,
                    q_heads=16,
                    kv_heads=16,
                    head_dim=128,
                    batch=batch,
                    new=s,
                    cached=0,
                    causal=causal,
                    time_s=flops / (tf * 1e12),
                )
            )
    ort = "microsoft/onnxruntime PR 21414, FlashAttention-2 paged batch decode on H100 SXM"
    for ctx, us in ((32, 21.135), (64, 22.958), (128, 28.780), (256, 43.563)):
        rows.append(
            AttnRow(
                source=f"{ort}, {ctx} tokens",
                decode=True,
                q_heads=64,
                kv_heads=8,
                head_dim=128,
                batch=64,
                new=1,
                cached=ctx,
                causal=True,
                time_s=us * 1e-6,
            )
        )
    return rows


H100_PUBLISHED: tuple[AttnRow, ...] = tuple(_published_h100())
"""The published H100 attention figures (module docstring), as rows."""


def attention_time(
    rows: Sequence[AttnRow],
    gpu: GpuSpec,
    attn_eff: float,
    kv_mem_eff: float,
    latency_s: float,
    causal_factor: float,
    query_waste: float,
) -> np.ndarray:
    """The model's time of each row's kernel call (module docstring), seconds."""
    b = np.array([r.batch for r in rows], dtype=np.float64)
    n = np.array([r.new for r in rows], dtype=np.float64)
    c = np.array([r.cached for r in rows], dtype=np.float64)
    dec = np.array([r.decode for r in rows])
    causal = np.array([r.causal for r in rows])
    flop = np.array([4.0 * r.q_heads * r.head_dim for r in rows], dtype=np.float64)
    kvb = np.array([2.0 * r.kv_heads * r.head_dim * 2 for r in rows], dtype=np.float64)
    tri = np.where(causal, causal_factor * n * (n + 1.0) * 0.5, n * n)
    pairs = n * c + np.where(dec, c, tri + query_waste * n)
    compute = b * pairs * flop / (gpu.bf16_flops * attn_eff)
    memory = b * (c + n) * kvb / (gpu.hbm_bw * kv_mem_eff)
    out: np.ndarray = latency_s + np.maximum(compute, memory)
    return out


@dataclass(frozen=True, slots=True)
class AttnFit:
    """The fitted attention parameters of one GPU and the held-out errors.

    ``errors[class]`` holds ``n``, ``median_abs``, ``p90_abs`` and
    ``median_signed`` of ``predicted / measured - 1`` on held-out rows
    (``default_errors``: with the parameters the simulator used before,
    ``attn_eff`` 0.5, ``mem_eff`` 0.8, no latency, ``kappa`` 1, no waste;
    ``in_sample_errors``: the fit on every row, training ones included, for
    the small published sets where few rows are held out).
    """

    gpu: str
    rows: int
    held_out: int
    attn_eff: float
    kv_mem_eff: float
    latency_s: float
    causal_factor: float
    query_waste: float
    errors: dict[str, dict[str, float]]
    default_errors: dict[str, dict[str, float]]
    in_sample_errors: dict[str, dict[str, float]]


def held_out(rows: Sequence[AttnRow]) -> np.ndarray:
    """Every fifth value of the batch grid (decode) and of the chunk grid
    (prefill) is held out; a grid of fewer than five values keeps every row
    in training and holds out its middle value's rows too (leave-in: the
    published sets are small)."""
    out = np.zeros(len(rows), dtype=bool)
    for decode in (True, False):
        key = [(r.batch if decode else r.new) for r in rows]
        grid = sorted({k for k, r in zip(key, rows, strict=True) if r.decode == decode})
        held = {g for i, g in enumerate(grid) if i % 5 == 2}
        for i, r in enumerate(rows):
            if r.decode == decode and key[i] in held:
                out[i] = True
    return out


def fit_attention(name: str, rows: Sequence[AttnRow], gpu: GpuSpec) -> AttnFit:
    """Fit the attention parameters of one GPU (module docstring).

    Raises:
        InputError: no decode or no prefill row to fit.
    """
    rows = list(rows)
    held = held_out(rows)
    train = [r for r, h in zip(rows, held, strict=True) if not h] or rows
    test = [r for r, h in zip(rows, held, strict=True) if h] or rows
    dec = [r for r in train if r.decode]
    pre = [r for r in train if not r.decode]
    if not dec or not pre:
        raise InputError(f"{name}: the attention rows need both decode and prefill calls")

    def loss(rs: list[AttnRow], w: np.ndarray, y: np.ndarray, *p: float) -> float:
        e = attention_time(rs, gpu, *p) / y - 1.0
        return float((e * e) @ w)

    y_dec = np.array([r.time_s for r in dec])
    w_dec = equal_class_weights([r.row_class for r in dec])
    best_d = min(
        (loss(dec, w_dec, y_dec, 0.5, kme, lat, 1.0, 0.0), kme, lat)
        for kme, lat in itertools.product(np.linspace(0.3, 1.0, 71), np.arange(0.0, 31e-6, 1e-6))
    )
    _, kme, lat = best_d
    y_pre = np.array([r.time_s for r in pre])
    w_pre = equal_class_weights([r.row_class for r in pre])
    best_p = min(
        (loss(pre, w_pre, y_pre, ae, kme, lat, kappa, waste), ae, kappa, waste)
        for ae, kappa, waste in itertools.product(
            np.linspace(0.1, 1.0, 91),
            np.linspace(1.0, 2.0, 21),
            (0.0, 32.0, 64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0),
        )
    )
    _, ae, kappa, waste = best_p
    y = np.array([r.time_s for r in test])
    classes = [r.row_class for r in test]
    err = attention_time(test, gpu, ae, kme, lat, kappa, waste) / y - 1.0
    err0 = attention_time(test, gpu, 0.5, 0.8, 0.0, 1.0, 0.0) / y - 1.0
    return AttnFit(
        gpu=name,
        rows=len(rows),
        held_out=int(held.sum()),
        attn_eff=round(float(ae), 3),
        kv_mem_eff=round(float(kme), 3),
        latency_s=float(lat),
        causal_factor=round(float(kappa), 3),
        query_waste=float(waste),
        errors=class_error_stats(err, classes),
        default_errors=class_error_stats(err0, classes),
        in_sample_errors=class_error_stats(
            attention_time(rows, gpu, ae, kme, lat, kappa, waste)
            / np.array([r.time_s for r in rows])
            - 1.0,
            [r.row_class for r in rows],
        ),
    )
