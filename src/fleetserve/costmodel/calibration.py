"""Fit the roofline's efficiency parameters to profile measurements.

Profile CSV format
------------------

One header line, then one line per measured iteration (extra columns are
ignored, column order is free, blank lines are skipped)::

    model,gpu,tp,phase,batch_size,tokens,context_tokens,time_s
    llama-2-7b,a100-40gb,1,prefill,4,2048,0,0.1412
    llama-2-7b,a100-40gb,1,decode,32,32,41230,0.0198

==============  =====================================================================
column          meaning
==============  =====================================================================
model           model name as the catalog / :class:`ModelSpec` spells it
gpu             GPU catalog name (``a100-40gb``)
tp              tensor-parallel degree, integer >= 1
phase           ``prefill`` or ``decode``
batch_size      sequences in the iteration, integer >= 1
tokens          prefill: total new prompt tokens of the batch (>= batch_size);
                decode: must equal ``batch_size`` (one new token per sequence)
context_tokens  prefill: total tokens already cached before this chunk (0 for
                whole prompts); decode: total KV context read, i.e. the sum over
                sequences of their context including the token being appended
                (>= batch_size)
time_s          measured wall time of the iteration in seconds, > 0
==============  =====================================================================

A prefill row is taken to have equal-length sequences: ``tokens`` (and
``context_tokens``) are split over ``batch_size`` sequences as evenly as integers
allow. The runtime's profiler writes this format.

Fitting
-------

With the raw per-unit costs of :func:`~fleetserve.costmodel.roofline.raw_coefficients`
the model of one row is (``u_x = 1 / x_eff``)::

    t = overhead_s + n_coll * allreduce_latency_s + X_comm u_allreduce
        + max(X_tok u_compute + X_attn u_attn, X_mem u_mem)

:func:`fit` minimises the sum of squared *relative* errors over the rows with
``overhead_s`` in [0, 0.5] s and every efficiency in [0.01, 1]. Given which side of
the ``max`` each row is on, the model is linear in ``(overhead, u_*)``; the fit
alternates between solving that bounded linear least-squares problem (exactly, by
enumerating which bounds are active) and re-assigning rows to the side that the
new parameters make larger, from several starting assignments, and keeps the best
solution of the true (max) model. Parameters the rows cannot determine (e.g.
``allreduce_eff`` at tp = 1, or ``compute_eff`` from decode-only rows) keep the
``base`` values; ``allreduce_latency_s`` is never fitted (it is collinear with the
overhead at a fixed tp).

Decode attention (optional). With ``decode_attention=True`` the attention pairs
of decode rows get their own unknown, ``u_dattn = 1 / decode_attn_eff``
(:mod:`fleetserve.costmodel.params`): ``X_attn`` splits into prompt pairs
(``u_attn``) and decode pairs (``u_dattn``). Engines whose decode attention
runs another kernel than prompt attention (the runtime's CPU engine: a gather
of paged K/V and small matmuls, several times slower per pair than SDPA on
prompts) need it; without it the fit, and its result, is exactly what it was.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from fleetserve.costmodel.params import DEFAULT_PARAMS, EfficiencyParams
from fleetserve.costmodel.roofline import InstanceCost, RawCoefficients, raw_coefficients
from fleetserve.errors import ConfigError, InputError
from fleetserve.spec.types import GpuSpec, ModelSpec

__all__ = [
    "PROFILE_COLUMNS",
    "Calibration",
    "ProfileRow",
    "calibrate",
    "fit",
    "load_profile",
    "predict_row",
    "relative_errors",
    "write_profile",
]

PROFILE_COLUMNS = (
    "model",
    "gpu",
    "tp",
    "phase",
    "batch_size",
    "tokens",
    "context_tokens",
    "time_s",
)
"""Required columns of a profile CSV, in the order :func:`write_profile` writes them."""

Phase = Literal["prefill", "decode"]

_OVERHEAD_MAX_S = 0.5
_EFF_MIN = 0.01
_CALIBRATION_FORMAT = "fleetserve-calibration"
_CALIBRATION_VERSION = 1


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One measured iteration (a line of the profile CSV; see module docstring)."""

    model: str
    gpu: str
    tp: int
    phase: Phase
    batch_size: int
    tokens: int
    context_tokens: int
    time_s: float


# --- CSV ---------------------------------------------------------------------


def _parse_int(text: str, *, file: str, line: int, col: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise InputError(
            f"expected an integer >= {minimum}, got {text!r}", file=file, line=line, field=col
        ) from None
    if value < minimum:
        raise InputError(
            f"expected an integer >= {minimum}, got {value}", file=file, line=line, field=col
        )
    return value


def _parse_row(raw: Mapping[str, str | None], *, file: str, line: int) -> ProfileRow:
    values: dict[str, str] = {}
    for col in PROFILE_COLUMNS:
        text = raw.get(col)
        if text is None or not text.strip():
            raise InputError("missing value", file=file, line=line, field=col)
        values[col] = text.strip()
    phase = values["phase"].lower()
    if phase not in ("prefill", "decode"):
        raise InputError(
            f"expected 'prefill' or 'decode', got {values['phase']!r}",
            file=file,
            line=line,
            field="phase",
        )
    tp = _parse_int(values["tp"], file=file, line=line, col="tp", minimum=1)
    batch = _parse_int(values["batch_size"], file=file, line=line, col="batch_size", minimum=1)
    tokens = _parse_int(values["tokens"], file=file, line=line, col="tokens", minimum=1)
    ctx = _parse_int(
        values["context_tokens"], file=file, line=line, col="context_tokens", minimum=0
    )
    try:
        time_s = float(values["time_s"])
    except ValueError:
        raise InputError(
            f"expected a number of seconds > 0, got {values['time_s']!r}",
            file=file,
            line=line,
            field="time_s",
        ) from None
    if not (math.isfinite(time_s) and time_s > 0):
        raise InputError(
            f"expected a number of seconds > 0, got {values['time_s']!r}",
            file=file,
            line=line,
            field="time_s",
        )
    if phase == "decode":
        if tokens != batch:
            raise InputError(
                f"decode rows need tokens == batch_size ({batch}), got {tokens}",
                file=file,
                line=line,
                field="tokens",
            )
        if ctx < batch:
            raise InputError(
                f"decode context_tokens counts the appended tokens, so it must be >= "
                f"batch_size ({batch}), got {ctx}",
                file=file,
                line=line,
                field="context_tokens",
            )
    elif tokens < batch:
        raise InputError(
            f"prefill rows need tokens >= batch_size ({batch}), got {tokens}",
            file=file,
            line=line,
            field="tokens",
        )
    return ProfileRow(
        model=values["model"],
        gpu=values["gpu"].lower(),
        tp=tp,
        phase="prefill" if phase == "prefill" else "decode",
        batch_size=batch,
        tokens=tokens,
        context_tokens=ctx,
        time_s=time_s,
    )


def load_profile(path: str | Path) -> list[ProfileRow]:
    """Read a profile CSV (format in the module docstring).

    Raises:
        InputError: unreadable file, missing columns, a bad value (naming the line
            and column), or no data rows.
    """
    name = str(path)
    try:
        handle = open(path, newline="", encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise InputError(f"cannot read profile: {exc.strerror or exc}", file=name) from None
    with handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames
        if not header:
            raise InputError(
                f"empty profile; expected a header line with columns {','.join(PROFILE_COLUMNS)}",
                file=name,
                line=1,
            )
        present = {h.strip() for h in header if h is not None}
        missing = [c for c in PROFILE_COLUMNS if c not in present]
        if missing:
            raise InputError(
                f"missing column(s) {', '.join(missing)}; expected {','.join(PROFILE_COLUMNS)}",
                file=name,
                line=1,
            )
        rows: list[ProfileRow] = []
        for raw in reader:
            stripped = {(k.strip() if k else k): v for k, v in raw.items()}
            if all(v is None or not str(v).strip() for v in stripped.values()):
                continue
            rows.append(_parse_row(stripped, file=name, line=reader.line_num))
    if not rows:
        raise InputError("profile has a header but no data rows", file=name)
    return rows


def write_profile(path: str | Path, rows: Iterable[ProfileRow]) -> None:
    """Write rows in the profile CSV format (``repr`` of floats: exact round trip)."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(PROFILE_COLUMNS)
        for r in rows:
            writer.writerow(
                [
                    r.model,
                    r.gpu,
                    r.tp,
                    r.phase,
                    r.batch_size,
                    r.tokens,
                    r.context_tokens,
                    repr(r.time_s),
                ]
            )


# --- prediction ----------------------------------------------------------------


def _split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers as evenly as possible (largest first)."""
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


def _row_work(row: ProfileRow) -> tuple[float, float, float, float]:
    """(new tokens, logit rows, attention query-key pairs, cached KV tokens read);
    a decode row's pairs are its ``context_tokens``."""
    if row.phase == "decode":
        return (
            float(row.batch_size),
            float(row.batch_size),
            float(row.context_tokens),
            float(row.context_tokens),
        )
    lens = _split(row.tokens, row.batch_size)
    cached = _split(row.context_tokens, row.batch_size)
    pairs2 = sum(2 * n * c + n * (n + 1) for n, c in zip(lens, cached, strict=True))
    return float(row.tokens), float(row.batch_size), pairs2 * 0.5, float(row.context_tokens)


def predict_row(cost: InstanceCost, row: ProfileRow) -> float:
    """The cost model's time for the iteration a profile row measured."""
    if row.phase == "decode":
        return cost.decode_time_scalar(row.batch_size, row.context_tokens)
    lens = _split(row.tokens, row.batch_size)
    cached = _split(row.context_tokens, row.batch_size)
    return cost.mixed_time(list(zip(lens, cached, strict=True)), 0, 0)


def relative_errors(cost: InstanceCost, rows: Sequence[ProfileRow]) -> npt.NDArray[np.float64]:
    """``(predicted - measured) / measured`` per row."""
    pred = np.array([predict_row(cost, r) for r in rows], dtype=np.float64)
    meas = np.array([r.time_s for r in rows], dtype=np.float64)
    out: npt.NDArray[np.float64] = (pred - meas) / meas
    return out


# --- fitting ---------------------------------------------------------------------

# unknowns: overhead, u_compute, u_attn, u_mem, u_allreduce, u_dattn  (u = 1 / efficiency)
_O, _UC, _UA, _UM, _UR, _UD = range(6)
_LOWER = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
_UPPER = np.array(
    [_OVERHEAD_MAX_S, 1 / _EFF_MIN, 1 / _EFF_MIN, 1 / _EFF_MIN, 1 / _EFF_MIN, 1 / _EFF_MIN]
)
# order in which columns are admitted when the rows cannot determine all of them
_PRIORITY = (_UM, _UC, _O, _UR, _UA, _UD)


@dataclass(frozen=True, slots=True)
class _Features:
    x_c: npt.NDArray[np.float64]
    x_a: npt.NDArray[np.float64]
    x_d: npt.NDArray[np.float64]  # decode pairs (all zero unless fitted on their own)
    x_m: npt.NDArray[np.float64]
    x_r: npt.NDArray[np.float64]
    y: npt.NDArray[np.float64]  # measured time minus the known collective latency
    t: npt.NDArray[np.float64]  # measured time

    def compute(self, u: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """The compute side of the max (the decode term adds exact zeros when unused)."""
        out: npt.NDArray[np.float64] = self.x_c * u[_UC] + self.x_a * u[_UA]
        if self.x_d.any():
            out = out + self.x_d * u[_UD]
        return out


def _features(
    rows: Sequence[ProfileRow],
    raw: RawCoefficients,
    base: EfficiencyParams,
    decode_attention: bool = False,
) -> _Features:
    work = np.array([_row_work(r) for r in rows], dtype=np.float64)
    tokens, logits, pairs, kv_read = work.T
    t = np.array([r.time_s for r in rows], dtype=np.float64)
    decode = np.array([r.phase == "decode" for r in rows], dtype=bool)
    split = decode if decode_attention else np.zeros(len(rows), dtype=bool)
    x_pairs = pairs * raw.pair_flop_s
    return _Features(
        x_c=tokens * raw.tok_flop_s + logits * raw.logit_flop_s,
        x_a=np.where(split, 0.0, x_pairs),
        x_d=np.where(split, x_pairs, 0.0),
        x_m=raw.weight_mem_s + (kv_read + tokens) * raw.kv_mem_s,
        x_r=tokens * raw.comm_tok_s,
        y=t - raw.n_collectives * base.allreduce_latency_s,
        t=t,
    )


def _model(f: _Features, u: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    out: npt.NDArray[np.float64] = u[_O] + f.x_r * u[_UR] + np.maximum(f.compute(u), f.x_m * u[_UM])
    return out


def _objective(f: _Features, u: npt.NDArray[np.float64]) -> float:
    rel = (_model(f, u) - f.y) / f.t
    return float(rel @ rel)


def _design(f: _Features, compute_side: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    cols = np.zeros((f.t.size, 6))
    cols[:, _O] = 1.0
    cols[:, _UC] = np.where(compute_side, f.x_c, 0.0)
    cols[:, _UA] = np.where(compute_side, f.x_a, 0.0)
    cols[:, _UD] = np.where(compute_side, f.x_d, 0.0)
    cols[:, _UM] = np.where(compute_side, 0.0, f.x_m)
    cols[:, _UR] = f.x_r
    out: npt.NDArray[np.float64] = cols / f.t[:, None]  # relative residuals
    return out


def _identifiable(a: npt.NDArray[np.float64]) -> list[int]:
    """Columns of ``a`` admitted in priority order while they add rank."""
    norms = np.linalg.norm(a, axis=0)
    chosen: list[int] = []
    for j in _PRIORITY:
        if norms[j] <= 0.0:
            continue
        trial = [*chosen, j]
        scaled = a[:, trial] / norms[trial]
        if np.linalg.matrix_rank(scaled, tol=1e-8 * math.sqrt(a.shape[0])) == len(trial):
            chosen = trial
    return chosen


def _bounded_lstsq(
    a: npt.NDArray[np.float64],
    b: npt.NDArray[np.float64],
    free: list[int],
    u0: npt.NDArray[np.float64],
) -> npt.NDArray[np.float64]:
    """Minimise ``|a u - b|`` over ``u[free]`` within bounds, other entries fixed at ``u0``.

    Exact for the few unknowns here: every combination of (free, at lower bound, at
    upper bound) is tried and the best feasible one kept.
    """
    best_u = u0.copy()
    best_r = math.inf
    fixed = [j for j in range(a.shape[1]) if j not in free]
    b_fixed = b - a[:, fixed] @ u0[fixed] if fixed else b
    for states in itertools.product((0, 1, 2), repeat=len(free)):
        u = u0.copy()
        solve = [j for j, s in zip(free, states, strict=True) if s == 0]
        for j, s in zip(free, states, strict=True):
            if s == 1:
                u[j] = _LOWER[j]
            elif s == 2:
                u[j] = _UPPER[j]
        clamped = [j for j in free if j not in solve]
        rhs = b_fixed - a[:, clamped] @ u[clamped] if clamped else b_fixed
        if solve:
            sol, *_ = np.linalg.lstsq(a[:, solve], rhs, rcond=None)
            u[solve] = sol
            if np.any(u[solve] < _LOWER[solve] - 1e-12) or np.any(u[solve] > _UPPER[solve] + 1e-12):
                continue
            u[solve] = np.clip(u[solve], _LOWER[solve], _UPPER[solve])
        resid = a @ u - b
        r = float(resid @ resid)
        if r < best_r:
            best_r, best_u = r, u
    return best_u


def _refine(
    f: _Features, u_start: npt.NDArray[np.float64], mask: npt.NDArray[np.bool_] | None
) -> npt.NDArray[np.float64]:
    u = u_start.copy()
    best_u, best_obj = u.copy(), _objective(f, u)
    b = f.y / f.t
    for _ in range(50):
        if mask is None:
            mask = f.compute(u) >= f.x_m * u[_UM]
        a = _design(f, mask)
        u = _bounded_lstsq(a, b, _identifiable(a), u_start)
        obj = _objective(f, u)
        if obj < best_obj:
            best_u, best_obj = u.copy(), obj
        new_mask = f.compute(u) >= f.x_m * u[_UM]
        if np.array_equal(new_mask, mask):
            break
        mask = new_mask
    return best_u


def fit(
    rows: Sequence[ProfileRow],
    model: ModelSpec,
    gpu: GpuSpec,
    tp: int = 1,
    *,
    base: EfficiencyParams | None = None,
    decode_attention: bool = False,
    decode_batch_residuals: bool = False,
) -> EfficiencyParams:
    """Fit efficiency parameters of (model, gpu, tp) to its profile rows.

    Only rows whose ``model``, ``gpu`` and ``tp`` match are used.

    Args:
        rows: profile rows (others are ignored).
        model: the model; ``model.name`` selects rows.
        gpu: the GPU type; ``gpu.name`` selects rows.
        tp: tensor-parallel degree; selects rows.
        base: values for the parameters the rows cannot determine, and the fixed
            ``allreduce_latency_s`` (default :data:`DEFAULT_PARAMS`).
        decode_attention: fit ``decode_attn_eff`` on its own (module
            docstring); False leaves it as ``base`` has it.
        decode_batch_residuals: after the fit, set ``decode_batch_scale`` to
            the median measured/predicted ratio of the decode rows at each
            batch size (:class:`EfficiencyParams`); False leaves it as
            ``base`` has it.

    Returns:
        The fitted parameters (see module docstring for the method and bounds).

    Raises:
        InputError: no row matches (model, gpu, tp).
    """
    base = base if base is not None else DEFAULT_PARAMS
    mine = [r for r in rows if r.model == model.name and r.gpu == gpu.name and r.tp == tp]
    if not mine:
        have = sorted({(r.model, r.gpu, r.tp) for r in rows})
        raise InputError(
            f"no profile rows for model={model.name!r} gpu={gpu.name!r} tp={tp}; "
            f"the profile has {have}"
        )
    raw = raw_coefficients(model, gpu, tp)
    f = _features(mine, raw, base, decode_attention)
    u0 = np.array(
        [
            base.overhead_s,
            1 / base.compute_eff,
            1 / base.attn_eff,
            1 / base.mem_eff,
            1 / base.allreduce_eff,
            1 / base.decode_attention_eff,
        ]
    )
    u0 = np.clip(u0, _LOWER, _UPPER)
    n = f.t.size
    starts: list[npt.NDArray[np.bool_] | None] = [
        None,
        np.zeros(n, dtype=bool),
        np.ones(n, dtype=bool),
    ]
    best = u0
    best_obj = _objective(f, u0)
    for mask in starts:
        u = _refine(f, u0, mask)
        obj = _objective(f, u)
        if obj < best_obj:
            best, best_obj = u, obj
    params = EfficiencyParams(
        compute_eff=float(1 / best[_UC]),
        mem_eff=float(1 / best[_UM]),
        overhead_s=float(best[_O]),
        allreduce_eff=float(1 / best[_UR]),
        attn_eff=float(1 / best[_UA]),
        allreduce_latency_s=base.allreduce_latency_s,
        decode_attn_eff=(
            float(1 / best[_UD]) if decode_attention and f.x_d.any() else base.decode_attn_eff
        ),
        decode_batch_scale=base.decode_batch_scale,
    )
    if decode_batch_residuals:
        params = _with_decode_residuals(params, mine, model, gpu, tp)
    return params


def _with_decode_residuals(
    params: EfficiencyParams, rows: Sequence[ProfileRow], model: ModelSpec, gpu: GpuSpec, tp: int
) -> EfficiencyParams:
    """``params`` with ``decode_batch_scale`` from the decode rows' residuals
    (unchanged when there is no decode row)."""
    plain = InstanceCost(model, gpu, tp, replace(params, decode_batch_scale=None))
    ratios: dict[int, list[float]] = {}
    for r in rows:
        if r.phase == "decode":
            ratios.setdefault(r.batch_size, []).append(r.time_s / predict_row(plain, r))
    if not ratios:
        return params
    pts = tuple((b, float(np.median(ratios[b]))) for b in sorted(ratios))
    return replace(params, decode_batch_scale=pts)


# --- calibration store ---------------------------------------------------------------

CalibrationKey = tuple[str, str, int]


@dataclass(frozen=True, slots=True)
class Calibration:
    """Fitted :class:`EfficiencyParams` per (model name, GPU name, tp).

    Attributes:
        entries: the fitted parameters by key.
    """

    entries: Mapping[CalibrationKey, EfficiencyParams] = field(default_factory=dict)

    def get(self, model: str, gpu: str, tp: int) -> EfficiencyParams | None:
        """The parameters for (model, gpu, tp), or None when not calibrated."""
        return self.entries.get((model, gpu.lower(), tp))

    def with_params(self, model: str, gpu: str, tp: int, params: EfficiencyParams) -> Calibration:
        """A copy with (model, gpu, tp) set to ``params``."""
        entries = dict(self.entries)
        entries[(model, gpu.lower(), tp)] = params
        return Calibration(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def save(self, path: str | Path) -> None:
        """Write as JSON (``{"format", "version", "entries": [{model, gpu, tp, params}]}``)."""
        doc = {
            "format": _CALIBRATION_FORMAT,
            "version": _CALIBRATION_VERSION,
            "entries": [
                {"model": m, "gpu": g, "tp": tp, "params": p.to_dict()}
                for (m, g, tp), p in sorted(self.entries.items())
            ],
        }
        Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a file written by :meth:`save`.

        Raises:
            InputError: unreadable file, bad JSON, or a malformed entry.
        """
        name = str(path)
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise InputError(f"cannot read calibration: {exc.strerror or exc}", file=name) from None
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON: {exc.msg}", file=name, line=exc.lineno) from None
        if not isinstance(doc, dict) or doc.get("format") != _CALIBRATION_FORMAT:
            raise InputError(
                f'not a calibration file (expected "format": "{_CALIBRATION_FORMAT}")',
                file=name,
                field="format",
            )
        if doc.get("version") != _CALIBRATION_VERSION:
            raise InputError(
                f"unsupported version {doc.get('version')!r}, expected {_CALIBRATION_VERSION}",
                file=name,
                field="version",
            )
        entries_doc = doc.get("entries")
        if not isinstance(entries_doc, list):
            raise InputError("expected a list", file=name, field="entries")
        entries: dict[CalibrationKey, EfficiencyParams] = {}
        for i, e in enumerate(entries_doc):
            where = f"entries[{i}]"
            if not isinstance(e, dict):
                raise InputError("expected an object", file=name, field=where)
            model, gpu, tp, params = e.get("model"), e.get("gpu"), e.get("tp"), e.get("params")
            if not isinstance(model, str) or not model:
                raise InputError("expected a model name", file=name, field=f"{where}.model")
            if not isinstance(gpu, str) or not gpu:
                raise InputError("expected a GPU name", file=name, field=f"{where}.gpu")
            if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
                raise InputError("expected an integer >= 1", file=name, field=f"{where}.tp")
            if not isinstance(params, dict):
                raise InputError("expected an object", file=name, field=f"{where}.params")
            try:
                entries[(model, gpu.lower(), tp)] = EfficiencyParams.from_dict(params)
            except (ConfigError, TypeError, ValueError) as exc:
                raise InputError(str(exc), file=name, field=f"{where}.params") from None
        return cls(entries)


def calibrate(
    rows: Sequence[ProfileRow],
    resolve_model: Callable[[str], ModelSpec],
    resolve_gpu: Callable[[str], GpuSpec],
    *,
    base: EfficiencyParams | None = None,
    decode_attention: bool = False,
    decode_batch_residuals: bool = False,
) -> Calibration:
    """Fit every (model, gpu, tp) present in ``rows``.

    Args:
        rows: profile rows, e.g. from :func:`load_profile`.
        resolve_model: name -> spec, e.g. :func:`fleetserve.spec.get_model`.
        resolve_gpu: name -> spec, e.g. :func:`fleetserve.spec.get_gpu`.
        base: see :func:`fit`.
        decode_attention: see :func:`fit`.
        decode_batch_residuals: see :func:`fit`.

    Returns:
        A :class:`Calibration` with one entry per distinct key.
    """
    keys = sorted({(r.model, r.gpu, r.tp) for r in rows})
    entries: dict[CalibrationKey, EfficiencyParams] = {}
    for model_name, gpu_name, tp in keys:
        model = resolve_model(model_name)
        gpu = resolve_gpu(gpu_name)
        mine = [r for r in rows if (r.model, r.gpu, r.tp) == (model_name, gpu_name, tp)]
        # match on the names the rows use even if the resolver normalises them
        mine = [
            ProfileRow(
                model.name,
                gpu.name,
                r.tp,
                r.phase,
                r.batch_size,
                r.tokens,
                r.context_tokens,
                r.time_s,
            )
            for r in mine
        ]
        entries[(model.name, gpu.name.lower(), tp)] = fit(
            mine,
            model,
            gpu,
            tp,
            base=base,
            decode_attention=decode_attention,
            decode_batch_residuals=decode_batch_residuals,
        )
    return Calibration(entries)
