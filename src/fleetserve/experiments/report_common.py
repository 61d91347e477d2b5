"""Pieces every ``reproduce`` report shares: config checks of a run folder and
markdown tables."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["config_leaves", "config_mismatch", "md_table"]

Normalize = Callable[[str, Any, Any], tuple[Any, Any]]


def config_leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config flattened to ``{"a.b.c": value}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(config_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_mismatch(
    expected: Mapping[str, Any], actual: Mapping[str, Any], normalize: Normalize | None = None
) -> str | None:
    """None when ``actual`` has every leaf of ``expected`` (numbers compared with a
    relative tolerance of 1e-9, lists element-wise as numbers), else the first
    difference. ``normalize(key, want, have)`` may rewrite a pair before comparing."""
    got = config_leaves(actual)
    for key, want in config_leaves(expected).items():
        have = got.get(key)
        if normalize is not None:
            want, have = normalize(key, want, have)
        if isinstance(want, list):
            want = [float(x) for x in want]
            have = [float(x) for x in have] if isinstance(have, list) else have
        if isinstance(want, float) and isinstance(have, int | float):
            if not math.isclose(want, float(have), rel_tol=1e-9):
                return f"{key}={have!r}, expected {want!r}"
        elif want != have:
            return f"{key}={have!r}, expected {want!r}"
    return None


def md_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table (and a blank line) as lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return [*lines, ""]


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON-able: {type(x).__name__}")


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (numpy scalars as numbers; NaN refused)."""
    path.write_text(
        json.dumps(obj, indent=2, allow_nan=False, default=_json_default) + "\n",
        encoding="utf-8",
    )
    return path


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> Path:
    """Write ``rows`` as CSV with ``columns`` (missing or None values empty)."""
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})
    return path


def check_stack_config(label: str, config: dict[str, Any]) -> None:
    """Preflight one experiment stack's config; an unknown stack name becomes
    one line telling the user to choose others with ``--stacks``.

    Raises:
        FleetserveError: the first problem, as one line.
    """
    from fleetserve.config import config_from_dict
    from fleetserve.errors import FleetserveError, UnknownNameError
    from fleetserve.sim.simulator import preflight

    try:
        preflight(config_from_dict(config))
    except UnknownNameError as e:
        if "stack" not in e.kind:
            raise
        raise FleetserveError(
            f"experiment stack {label!r} cannot run in this build: {e} "
            "(choose others with --stacks)"
        ) from None
