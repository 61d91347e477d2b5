"""Pure workload transforms.

Each function takes requests (any iterable, any order) and returns a new list sorted by
arrival time (ties keep their id order) with ids renumbered ``0..n-1``; the input is never
modified. Bad arguments raise :class:`~fleetserve.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from fleetserve.errors import ConfigError
from fleetserve.workload.request import Request, with_lengths


def _renumber(reqs: Iterable[Request]) -> list[Request]:
    ordered = sorted(reqs, key=lambda r: (r.arrival_s, r.id))
    return [r if r.id == i else dataclasses.replace(r, id=i) for i, r in enumerate(ordered)]


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


def time_window(reqs: Iterable[Request], start_s: float, end_s: float) -> list[Request]:
    """The requests arriving in ``[start_s, end_s)``, re-based so ``start_s`` becomes 0.

    Args:
        reqs: requests.
        start_s: window start, seconds (>= 0).
        end_s: window end, seconds (> start_s; may be ``math.inf``).
    """
    start = _finite("start_s", start_s)
    end = _finite("end_s", end_s)
    if not (math.isfinite(start) and start >= 0):
        raise ConfigError(f"start_s must be a finite number >= 0, got {start_s!r}")
    if end <= start:
        raise ConfigError(f"end_s must be > start_s, got start_s={start_s!r}, end_s={end_s!r}")
    kept = [r for r in reqs if start <= r.arrival_s < end]
    return _renumber(dataclasses.replace(r, arrival_s=max(0.0, r.arrival_s - start)) for r in kept)


def scale_rate(reqs: Iterable[Request], factor: float) -> list[Request]:
    """Speed the workload up by ``factor``: every arrival time is divided by it.

    ``factor = 2`` doubles the request rate and halves the span.

    Args:
        reqs: requests.
        factor: rate multiplier (finite, > 0).
    """
    f = _finite("factor", factor)
    if not (math.isfinite(f) and f > 0):
        raise ConfigError(f"rate scale factor must be a finite number > 0, got {factor!r}")
    return _renumber(dataclasses.replace(r, arrival_s=r.arrival_s / f) for r in reqs)


def max_requests(reqs: Iterable[Request], n: int) -> list[Request]:
    """The first ``n`` requests in arrival order (all of them if there are fewer).

    Args:
        reqs: requests.
        n: how many to keep (>= 1).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"max_requests must be an integer >= 1, got {n!r}")
    return _renumber(reqs)[:n]


def select_and_scale(
    reqs: Iterable[Request],
    start_s: float | None,
    end_s: float | None,
    n: int | None,
    rate_factor: float,
) -> list[Request]:
    """The workload transforms every replay applies first, in this order: the
    time window ``[start_s, end_s)`` (either end may be None), the first ``n``
    requests, and the arrival-rate factor (1.0: unchanged)."""
    out = list(reqs)
    if start_s is not None or end_s is not None:
        out = time_window(out, start_s or 0.0, end_s if end_s is not None else math.inf)
    if n is not None and out:
        out = max_requests(out, n)
    if rate_factor != 1.0:
        out = scale_rate(out, rate_factor)
    return out


def assign_models(
    reqs: Iterable[Request],
    models: Sequence[str],
    weights: Sequence[float] | None,
    rng: np.random.Generator,
) -> list[Request]:
    """Give each request a model drawn independently with probability ∝ ``weights``.

    Args:
        reqs: requests.
        models: catalog model names (non-empty).
        weights: one non-negative weight per model (normalized here), or None for uniform.
        rng: random generator; one draw per request in arrival order.
    """
    if not models:
        raise ConfigError("assign_models needs at least one model")
    if weights is None:
        w = np.full(len(models), 1.0 / len(models))
    else:
        if len(weights) != len(models):
            raise ConfigError(f"got {len(models)} models but {len(weights)} weights")
        w = np.asarray([_finite("weight", x) for x in weights], dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ConfigError(f"weights must be finite, >= 0 and not all 0, got {list(weights)!r}")
        w = w / w.sum()
    ordered = _renumber(reqs)
    picks = rng.choice(len(models), size=len(ordered), p=w).tolist()
    return [dataclasses.replace(r, model=models[k]) for r, k in zip(ordered, picks, strict=True)]


def scale_lengths(
    reqs: Iterable[Request], factor: float, cap_tokens: int | None = None
) -> tuple[list[Request], int]:
    """Multiply prompt and output lengths by ``factor`` (Mell's ×10 stress test).

    Each length becomes ``max(1, round(tokens * factor))``. With ``cap_tokens``, a request
    whose ``max_kv_tokens`` (prompt + output - 1) would exceed the cap is shrunk
    proportionally so that it fits exactly::

        total  = cap_tokens + 1                 # prompt + output after capping
        prompt = clamp(round(prompt * total / (prompt + output)), 1, total - 1)
        output = total - prompt                 # so max_kv_tokens == cap_tokens

    and is marked ``length_capped=True``.

    Prefix blocks (:attr:`Request.prefix_blocks`) follow
    (:func:`~fleetserve.workload.request.with_lengths`): their block size is
    scaled by ``factor`` too, and a capped prompt keeps only the blocks of its
    head.

    Args:
        reqs: requests.
        factor: length multiplier (finite, > 0).
        cap_tokens: largest allowed ``max_kv_tokens`` (>= 1), e.g. one GPU's KV capacity.

    Returns:
        The new requests and how many were capped.
    """
    f = _finite("factor", factor)
    if not (math.isfinite(f) and f > 0):
        raise ConfigError(f"length scale factor must be a finite number > 0, got {factor!r}")
    if cap_tokens is not None and (
        isinstance(cap_tokens, bool) or not isinstance(cap_tokens, int) or cap_tokens < 1
    ):
        raise ConfigError(f"cap_tokens must be an integer >= 1 or None, got {cap_tokens!r}")
    out: list[Request] = []
    capped = 0
    for r in _renumber(reqs):
        p = max(1, round(r.prompt_tokens * f))
        o = max(1, round(r.output_tokens * f))
        was_capped = r.length_capped
        if cap_tokens is not None and p + o - 1 > cap_tokens:
            total = cap_tokens + 1  # >= 2, so both parts can be >= 1
            p_new = min(max(round(p * total / (p + o)), 1), total - 1)
            p, o = p_new, total - p_new
            was_capped = True
            capped += 1
        out.append(with_lengths(r, p, o, scale=f, length_capped=was_capped))
    return out, capped
