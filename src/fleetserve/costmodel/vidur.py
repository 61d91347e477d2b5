r"""The roofline cost model against measured GPU kernels: Vidur's MLP profiles.

``../shared/data/profiles/compute/<gpu>/<hf-model>/mlp.csv`` (Vidur, MIT; see
that folder's README) times every non-attention operator of one transformer
layer on a real GPU, for a grid of ``num_tokens`` (1 to 4,096) and
tensor-parallel degrees (1, 2, 4, 8). This module reads that format, predicts
the same work with the cost model's roofline, and fits the two efficiencies
the roofline has for it (issue 22, item 1, for the linear layers).

What is compared. The roofline prices a layer's four matmuls (QKV projection,
output projection, MLP up/gate and down projections) as one term::

    t = max( 2 N P / (tp F ce) ,  W / (tp B me) )

``N`` tokens, ``P`` the layer's linear parameters (from the profile's own
shape columns: hidden ``h``, heads, KV heads, MLP width ``f``, gated or not:
``P = h (n_head + 2 n_kv_head) h / n_head + h^2 + (3 or 2) h f``), ``W = 2 P``
bytes (16-bit weights), ``F`` and ``B`` the GPU's peak bf16 FLOP/s and HBM
bandwidth (the catalog's datasheet numbers), ``ce`` and ``me`` the compute
and memory efficiencies (:class:`~fleetserve.costmodel.params.EfficiencyParams`,
defaults 0.65 and 0.8). Measured: the sum of the four matmuls' median times
(``attn_pre_proj``, ``attn_post_proj``, ``mlp_up_proj``, ``mlp_down_proj``).
The element-wise operators (layer norms, RoPE, activation, add) are reported
apart: the roofline has no term for them (its per-iteration ``overhead_s``
stands for launches; their activation traffic is not modelled).

Fit. Per GPU, ``ce``, ``me`` and a fixed latency per matmul kernel ``l`` (the
roofline prices none per layer: its ``overhead_s`` is one per iteration;
``t + 4 l``) minimizing the squared relative error of the
matmul time over the *training* rows, each token class (1-16, 17-256, 257+
tokens) weighing the same (the grid is dense at many tokens), by a grid
search refined by a finer one (three parameters); rows whose ``num_tokens`` is
every fifth value of the grid are *held out* and the errors are reported on
them, per operation class (few tokens: memory-bound; many: compute-bound).
A smooth knee. The ``max`` is optimistic where neither term dominates (the
profiles show it between 17 and 256 tokens); :func:`fit_efficiencies` also
fits ``(c^q + m^q)^(1/q) + 4 l`` with ``q`` from :data:`KNEES` (``q = 1`` adds
the two terms, ``q -> inf`` is the ``max``) and reports its errors too.

Element-wise operators. :func:`fit_elementwise` fits their time as memory
traffic plus a latency per layer, ``l_e + N h b (rep + shard / tp) / (B me)``
(``rep`` activations' worth of bytes per token replicated on every GPU of the
tensor-parallel group, ``shard`` split over it).

Applied. The catalog's defaults (:data:`~fleetserve.costmodel.params.GPU_PARAMS`)
are these fits, rounded; ``fleetserve calibrate`` prints any difference.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetserve.costmodel.params import EfficiencyParams
from fleetserve.errors import InputError
from fleetserve.spec.types import GpuSpec

__all__ = [
    "MATMULS",
    "OTHERS",
    "MlpRow",
    "VidurFit",
    "fit_efficiencies",
    "load_mlp_profile",
    "matmul_time",
    "profile_files",
]

MATMULS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
"""The per-layer matmuls the roofline prices."""

OTHERS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
"""The per-layer element-wise operators (reported apart)."""

_SHAPE = (
    "n_head",
    "n_kv_head",
    "n_embd",
    "n_expanded_embd",
    "use_gated_mlp",
    "num_tokens",
    "num_tensor_parallel_workers",
)

VIDUR_GPUS = {"a100": "a100-80gb", "h100": "h100-80gb"}
"""Vidur's GPU folder names and the catalog GPU each stands for (Vidur profiled
A100-80GB SXM and H100-80GB SXM nodes)."""


@dataclass(frozen=True, slots=True)
class MlpRow:
    """One profiled point: a layer's shape, tokens, TP degree, median times (s)."""

    file: str
    line: int
    n_head: int
    n_kv_head: int
    hidden: int
    mlp_width: int
    gated: bool
    tokens: int
    tp: int
    matmul_s: float
    others_s: float

    @property
    def params(self) -> int:
        """The layer's linear parameters (all TP shards)."""
        h = self.hidden
        qkv = h * (self.n_head + 2 * self.n_kv_head) * (h // self.n_head)
        return qkv + h * h + (3 if self.gated else 2) * h * self.mlp_width


def csv_number(raw: dict[str, str | None], col: str, file: str, line: int) -> float:
    """Column ``col`` of a profile row as a finite number >= 0.

    Raises:
        InputError: missing, not a number, or negative (names file, line, column).
    """
    text = raw.get(col)
    if text is None or text == "":
        raise InputError(f"{file}:{line}: column {col!r} is missing or empty")
    try:
        v = float(text)
    except ValueError:
        raise InputError(
            f"{file}:{line}: column {col!r}: expected a number, got {text!r}"
        ) from None
    if not math.isfinite(v) or v < 0:
        raise InputError(f"{file}:{line}: column {col!r}: expected a number >= 0, got {text!r}")
    return v


def _median_sum(raw: dict[str, str | None], ops: Sequence[str], file: str, line: int) -> float:
    """Seconds: the sum of ``ops``' median times (ms in the profile)."""
    return sum(csv_number(raw, f"time_stats.{op}.median", file, line) for op in ops) / 1e3


def _pos_int(raw: dict[str, str | None], col: str, file: str, line: int) -> int:
    v = csv_number(raw, col, file, line)
    if v < 1 or v != int(v):
        raise InputError(f"{file}:{line}: column {col!r}: expected an integer >= 1, got {v!r}")
    return int(v)


def load_mlp_profile(path: str | Path) -> list[MlpRow]:
    """Read one Vidur ``mlp.csv``.

    Raises:
        InputError: a missing file or column, or a value that is not what the
            column holds (the message names the file, line and column).
    """
    p = Path(path)
    try:
        fh = p.open(newline="")
    except OSError as e:
        raise InputError(f"{p}: cannot read the profile ({e.strerror or e})") from None
    with fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or ())
        need = [f"time_stats.{op}.median" for op in MATMULS + OTHERS] + list(_SHAPE)
        missing = [c for c in need if c not in cols]
        if missing:
            raise InputError(
                f"{p}:1: not a Vidur MLP profile: columns {', '.join(missing[:4])} missing"
            )
        out = []
        for i, raw in enumerate(reader, start=2):
            f = str(p)
            gated_text = (raw.get("use_gated_mlp") or "").strip().lower()
            if gated_text not in ("true", "false"):
                raise InputError(
                    f"{f}:{i}: column 'use_gated_mlp': expected True or False, got {gated_text!r}"
                )
            row = MlpRow(
                file=f,
                line=i,
                n_head=_pos_int(raw, "n_head", f, i),
                n_kv_head=_pos_int(raw, "n_kv_head", f, i),
                hidden=_pos_int(raw, "n_embd", f, i),
                mlp_width=_pos_int(raw, "n_expanded_embd", f, i),
                gated=gated_text == "true",
                tokens=_pos_int(raw, "num_tokens", f, i),
                tp=_pos_int(raw, "num_tensor_parallel_workers", f, i),
                matmul_s=sum(csv_number(raw, f"time_stats.{op}.median", f, i) for op in MATMULS)
                / 1e3,
                others_s=sum(csv_number(raw, f"time_stats.{op}.median", f, i) for op in OTHERS)
                / 1e3,
            )
            if row.hidden % row.n_head:
                raise InputError(f"{f}:{i}: n_embd {row.hidden} is not a multiple of n_head")
            out.append(row)
    if not out:
        raise InputError(f"{p}: the profile has no rows")
    return out


def profile_files(root: str | Path) -> dict[str, list[Path]]:
    """Every ``compute/<gpu>/**/mlp.csv`` under ``root``, by Vidur GPU name.

    Raises:
        InputError: ``root`` holds no such file.
    """
    base = Path(root) / "compute"
    found: dict[str, list[Path]] = {}
    if base.is_dir():
        for gpu_dir in sorted(d for d in base.iterdir() if d.is_dir()):
            files = sorted(gpu_dir.rglob("mlp.csv"))
            if files:
                found[gpu_dir.name] = files
    if not found:
        raise InputError(f"{root}: no compute/<gpu>/<model>/mlp.csv (Vidur's profile layout)")
    return found


def matmul_time(
    rows: Sequence[MlpRow],
    gpu: GpuSpec,
    compute_eff: float,
    mem_eff: float,
    kernel_latency_s: float = 0.0,
    knee: float = math.inf,
) -> np.ndarray:
    """The roofline's time of each row's four matmuls (module docstring), plus
    ``kernel_latency_s`` per matmul kernel, seconds. ``knee`` ``q`` < inf
    replaces ``max(c, m)`` by the smooth ``(c^q + m^q)^(1/q)``."""
    n = np.array([r.tokens for r in rows], dtype=np.float64)
    p = np.array([r.params for r in rows], dtype=np.float64)
    tp = np.array([r.tp for r in rows], dtype=np.float64)
    compute = 2.0 * n * p / (tp * gpu.bf16_flops * compute_eff)
    memory = 2.0 * p / (tp * gpu.hbm_bw * mem_eff)
    out: np.ndarray = _combine(compute, memory, knee) + len(MATMULS) * kernel_latency_s
    return out


def _combine(c: np.ndarray, m: np.ndarray, knee: float) -> np.ndarray:
    if math.isinf(knee):
        out: np.ndarray = np.maximum(c, m)
        return out
    big = np.maximum(c, m)  # scaled, so the powers stay finite
    out = big * ((c / big) ** knee + (m / big) ** knee) ** (1.0 / knee)
    return out


KNEES = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The smooth-knee exponents tried (``q``; 1 is ``c + m``, large q tends to ``max``)."""


def held_out(rows: Sequence[MlpRow]) -> np.ndarray:
    """Which rows are held out of the fit: every fifth ``num_tokens`` of the grid."""
    grid = sorted({r.tokens for r in rows})
    held = {t for i, t in enumerate(grid) if i % 5 == 2}
    return np.array([r.tokens in held for r in rows], dtype=bool)


@dataclass(frozen=True, slots=True)
class VidurFit:
    """The fitted efficiencies of one GPU and the errors before and after.

    Errors are relative, ``predicted / measured - 1``, on the held-out rows;
    ``classes`` splits them by tokens: ``1-16``, ``17-256``, ``257-4096``.
    """

    gpu: str
    catalog_gpu: str
    rows: int
    held_out: int
    compute_eff: float
    mem_eff: float
    kernel_latency_s: float
    default_errors: dict[str, dict[str, float]]
    fitted_errors: dict[str, dict[str, float]]
    others_share: float
    knee: float
    knee_compute_eff: float
    knee_mem_eff: float
    knee_latency_s: float
    knee_errors: dict[str, dict[str, float]]
    elem_rep: float = 0.0
    elem_shard: float = 0.0
    elem_latency_s: float = 0.0
    elem_errors: dict[str, dict[str, float]] | None = None
    layer_errors: dict[str, dict[str, float]] | None = None


CLASSES = ((1, 16, "1-16 tokens"), (17, 256, "17-256 tokens"), (257, 1 << 30, "257+ tokens"))


def class_error_stats(
    err: np.ndarray, classes: Sequence[str], names: Sequence[str] | None = None
) -> dict[str, dict[str, float]]:
    """``n``, median and P90 of ``|err|`` and median of ``err``, for all rows
    (``"all"``) and per class in ``names`` order (default: sorted); classes
    without rows are left out."""
    cls = np.asarray(classes)
    out: dict[str, dict[str, float]] = {}
    for name in ["all", *(sorted(set(classes)) if names is None else names)]:
        sel = np.ones(len(cls), dtype=bool) if name == "all" else cls == name
        if not sel.any():
            continue
        e = np.abs(err[sel])
        out[name] = {
            "n": float(sel.sum()),
            "median_abs": float(np.median(e)),
            "p90_abs": float(np.quantile(e, 0.9)),
            "median_signed": float(np.median(err[sel])),
        }
    return out


def equal_class_weights(classes: Sequence[str]) -> np.ndarray:
    """Row weights giving each class the same total (summing to 1)."""
    counts: dict[str, int] = {}
    for c in classes:
        counts[c] = counts.get(c, 0) + 1
    w = np.array([1.0 / counts[c] for c in classes], dtype=np.float64)
    out: np.ndarray = w / w.sum()
    return out


def _error_stats(err: np.ndarray, tokens: np.ndarray) -> dict[str, dict[str, float]]:
    classes = [token_class(int(t)) for t in tokens]
    return class_error_stats(err, classes, [name for _, _, name in CLASSES])


def _class_weights(rows: Sequence[MlpRow]) -> np.ndarray:
    """Weights giving each token class (:data:`CLASSES`) the same total: the
    profile grid is dense at many tokens (a plain mean would fit those only)."""
    return equal_class_weights([token_class(r.tokens) for r in rows])


def fit_efficiencies(
    name: str, rows: Sequence[MlpRow], gpu: GpuSpec, default: tuple[float, float]
) -> VidurFit:
    """Fit ``(compute_eff, mem_eff)`` on the training rows of one GPU; errors of
    the default and the fitted values on the held-out rows.

    Raises:
        InputError: no training or no held-out row.
    """
    rows = list(rows)
    measured = np.array([r.matmul_s for r in rows], dtype=np.float64)
    if not (measured > 0).all():
        bad = next(r for r, m in zip(rows, measured, strict=True) if m <= 0)
        raise InputError(f"{bad.file}:{bad.line}: the matmuls' median time is 0")
    held = held_out(rows)
    train = [r for r, h in zip(rows, held, strict=True) if not h]
    test = [r for r, h in zip(rows, held, strict=True) if h]
    if not train or not test:
        raise InputError(f"{name}: too few num_tokens values to hold some out")
    m_train, m_test = measured[~held], measured[held]
    weights = _class_weights(train)
    n = np.array([r.tokens for r in train], dtype=np.float64)
    p = np.array([r.params for r in train], dtype=np.float64)
    tp = np.array([r.tp for r in train], dtype=np.float64)
    c_unit = 2.0 * n * p / (tp * gpu.bf16_flops)  # compute seconds at ce = 1
    m_unit = 2.0 * p / (tp * gpu.hbm_bw)  # memory seconds at me = 1

    def search(
        ces: np.ndarray,
        mes: np.ndarray,
        lats: np.ndarray,
        best: tuple[float, float, float, float],
        knee: float = math.inf,
    ) -> tuple[float, float, float, float]:
        extra = len(MATMULS) * lats[:, None]
        for ce in ces:
            for me in mes:
                base = _combine(c_unit / ce, m_unit / me, knee)
                err = (base[None, :] + extra) / m_train[None, :] - 1.0
                loss = (err * err) @ weights
                k = int(np.argmin(loss))
                if loss[k] < best[0]:
                    best = (float(loss[k]), float(ce), float(me), float(lats[k]))
        return best

    best = search(
        np.linspace(0.1, 1.0, 46),
        np.linspace(0.1, 1.0, 46),
        np.arange(0.0, 21e-6, 1e-6),
        (math.inf, default[0], default[1], 0.0),
    )
    _, ce0, me0, lat0 = best
    best = search(
        np.linspace(max(0.01, ce0 - 0.02), min(1.0, ce0 + 0.02), 21),
        np.linspace(max(0.01, me0 - 0.02), min(1.0, me0 + 0.02), 21),
        np.linspace(max(0.0, lat0 - 1e-6), lat0 + 1e-6, 9),
        best,
    )
    _, ce, me, lat = best
    # the smooth knee: every exponent, coarse, then the best one refined
    knee_best: tuple[float, float, float, float, float] = (math.inf, math.inf, ce, me, lat)
    for q in KNEES:
        got = search(
            np.linspace(0.1, 1.0, 37),
            np.linspace(0.1, 1.0, 37),
            np.arange(0.0, 21e-6, 1e-6),
            (math.inf, ce, me, lat),
            q,
        )
        if got[0] < knee_best[0]:
            knee_best = (got[0], q, got[1], got[2], got[3])
    _, q, kce0, kme0, klat0 = knee_best
    kfit = search(
        np.linspace(max(0.01, kce0 - 0.025), min(1.0, kce0 + 0.025), 21),
        np.linspace(max(0.01, kme0 - 0.025), min(1.0, kme0 + 0.025), 21),
        np.linspace(max(0.0, klat0 - 1e-6), klat0 + 1e-6, 9),
        (knee_best[0], kce0, kme0, klat0),
        q,
    )
    _, kce, kme, klat = kfit
    tokens = np.array([r.tokens for r in test], dtype=np.float64)
    err_default = matmul_time(test, gpu, *default) / m_test - 1.0
    err_fit = matmul_time(test, gpu, ce, me, lat) / m_test - 1.0
    err_knee = matmul_time(test, gpu, kce, kme, klat, q) / m_test - 1.0
    total = measured + np.array([r.others_s for r in rows], dtype=np.float64)
    others = float(np.median(np.array([r.others_s for r in rows]) / total))
    rep, shard, elat = fit_elementwise(train, gpu, kme)
    e_test = np.array([r.others_s for r in test], dtype=np.float64)
    e_pred = elementwise_time(test, gpu, kme, rep, shard, elat)
    layer_pred = matmul_time(test, gpu, kce, kme, klat, q) + e_pred
    return VidurFit(
        gpu=name,
        catalog_gpu=gpu.name,
        rows=len(rows),
        held_out=len(test),
        compute_eff=round(ce, 4),
        mem_eff=round(me, 4),
        kernel_latency_s=lat,
        default_errors=_error_stats(err_default, tokens),
        fitted_errors=_error_stats(err_fit, tokens),
        others_share=others,
        knee=q,
        knee_compute_eff=round(kce, 4),
        knee_mem_eff=round(kme, 4),
        knee_latency_s=klat,
        knee_errors=_error_stats(err_knee, tokens),
        elem_rep=rep,
        elem_shard=shard,
        elem_latency_s=elat,
        elem_errors=_error_stats(e_pred / e_test - 1.0, tokens),
        layer_errors=_error_stats(layer_pred / (m_test + e_test) - 1.0, tokens),
    )


def elementwise_time(
    rows: Sequence[MlpRow],
    gpu: GpuSpec,
    mem_eff: float,
    rep: float,
    shard: float,
    latency_s: float,
) -> np.ndarray:
    """The element-wise operators' time of each row (module docstring):
    ``latency + N h b (rep + shard / tp) / (B me)``, seconds."""
    n = np.array([r.tokens for r in rows], dtype=np.float64)
    h = np.array([r.hidden for r in rows], dtype=np.float64)
    tp = np.array([r.tp for r in rows], dtype=np.float64)
    unit = n * h * 2.0 / (gpu.hbm_bw * mem_eff)
    out: np.ndarray = latency_s + unit * (rep + shard / tp)
    return out


def fit_elementwise(
    rows: Sequence[MlpRow], gpu: GpuSpec, mem_eff: float
) -> tuple[float, float, float]:
    """``(rep, shard, latency_s)`` of :func:`elementwise_time` minimising the
    class-weighted squared relative error of the element-wise operators' time
    over ``rows`` (linear least squares; each term kept >= 0)."""
    rows = list(rows)
    y = np.array([r.others_s for r in rows], dtype=np.float64)
    if not (y > 0).all():
        bad = next(r for r, v in zip(rows, y, strict=True) if v <= 0)
        raise InputError(f"{bad.file}:{bad.line}: the element-wise operators' median time is 0")
    n = np.array([r.tokens for r in rows], dtype=np.float64)
    h = np.array([r.hidden for r in rows], dtype=np.float64)
    tp = np.array([r.tp for r in rows], dtype=np.float64)
    unit = n * h * 2.0 / (gpu.hbm_bw * mem_eff)
    cols = np.stack([unit, unit / tp, np.ones_like(y)], axis=1)
    scale = np.sqrt(_class_weights(rows)) / y
    best: tuple[float, np.ndarray] = (math.inf, np.zeros(3))
    for keep in ((0, 1, 2), (0, 2), (1, 2), (0, 1), (2,)):  # active sets: no negative term
        sol, *_ = np.linalg.lstsq(cols[:, keep] * scale[:, None], y * scale, rcond=None)
        if (sol < 0).any():
            continue
        x = np.zeros(3)
        x[list(keep)] = sol
        loss = float(np.sum(((cols @ x - y) * scale) ** 2))
        if loss < best[0]:
            best = (loss, x)
    rep, shard, lat = (float(v) for v in best[1])
    return rep, shard, lat


def load_all(files: Iterable[Path]) -> list[MlpRow]:
    """Every row of several profiles."""
    out: list[MlpRow] = []
    for f in files:
        out.extend(load_mlp_profile(f))
    return out


def model_of(row: MlpRow) -> str:
    """The profiled model's name: the folder holding the row's ``mlp.csv``
    (``compute/<gpu>/<org>/<model>/mlp.csv``)."""
    return Path(row.file).parent.name


def token_class(tokens: int) -> str:
    """The :data:`CLASSES` name of a row with ``tokens`` tokens."""
    for lo, hi, name in CLASSES:
        if lo <= tokens <= hi:
            return name
    raise ValueError(f"tokens must be >= 1, got {tokens}")


@dataclass(frozen=True, slots=True)
class RowCheck:
    """One profiled row, measured against the cost model: the matmuls' time
    with the single roofline ``max`` at the legacy defaults (compute 0.65,
    memory 0.8: what the simulator used before the calibration was applied)
    and with the catalog's per-operation defaults (the GPU's entry of
    :data:`~fleetserve.costmodel.params.GPU_PARAMS`: what it uses now)."""

    gpu: str
    model: str
    tp: int
    tokens: int
    token_class: str
    held_out: bool
    measured_s: float
    legacy_s: float
    catalog_s: float

    @property
    def legacy_error(self) -> float:
        return self.legacy_s / self.measured_s - 1.0

    @property
    def catalog_error(self) -> float:
        return self.catalog_s / self.measured_s - 1.0


def check_rows(
    name: str,
    rows: Sequence[MlpRow],
    gpu: GpuSpec,
    legacy: tuple[float, float],
    params: EfficiencyParams,
) -> list[RowCheck]:
    """Every row of one GPU's profiles, predicted with the legacy ``max`` at
    ``legacy`` (compute, memory efficiency) and with ``params`` (per-operation
    form: its knee, efficiencies and kernel latency)."""
    rows = list(rows)
    held = held_out(rows)
    d = matmul_time(rows, gpu, *legacy)
    knee = params.matmul_knee if params.matmul_knee is not None else math.inf
    f = matmul_time(rows, gpu, params.compute_eff, params.mem_eff, params.kernel_latency_s, knee)
    return [
        RowCheck(
            gpu=name,
            model=model_of(r),
            tp=r.tp,
            tokens=r.tokens,
            token_class=token_class(r.tokens).replace(" tokens", ""),
            held_out=bool(h),
            measured_s=r.matmul_s,
            legacy_s=float(ds),
            catalog_s=float(fs),
        )
        for r, h, ds, fs in zip(rows, held, d, f, strict=True)
    ]


def summarize_checks(checks: Sequence[RowCheck]) -> list[dict[str, object]]:
    """Per (GPU, model, token class): rows, median measured and predicted time,
    median signed and absolute error with the legacy ``max`` and with the
    catalog's per-operation defaults."""
    groups: dict[tuple[str, str, str], list[RowCheck]] = {}
    order = {name.replace(" tokens", ""): i for i, (_, _, name) in enumerate(CLASSES)}
    for c in checks:
        groups.setdefault((c.gpu, c.model, c.token_class), []).append(c)
    out: list[dict[str, object]] = []
    for (g, m, cls), cs in sorted(groups.items(), key=lambda kv: (*kv[0][:2], order[kv[0][2]])):
        de = np.array([c.legacy_error for c in cs])
        fe = np.array([c.catalog_error for c in cs])
        out.append(
            {
                "gpu": g,
                "model": m,
                "tokens": cls,
                "rows": len(cs),
                "measured_median_s": float(np.median([c.measured_s for c in cs])),
                "legacy_median_s": float(np.median([c.legacy_s for c in cs])),
                "legacy_median_signed": float(np.median(de)),
                "legacy_median_abs": float(np.median(np.abs(de))),
                "catalog_median_s": float(np.median([c.catalog_s for c in cs])),
                "catalog_median_signed": float(np.median(fe)),
                "catalog_median_abs": float(np.median(np.abs(fe))),
            }
        )
    return out
