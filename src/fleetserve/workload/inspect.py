"""Summary statistics of a workload, for ``fleetserve trace inspect FILE``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.table import Table

from fleetserve.workload.request import Request

_QUANTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


def _lengths(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": float(a.mean())}
    out.update({k: float(np.percentile(a, q)) for k, q in _QUANTILES})
    out["max"] = float(a.max())
    return out


def trace_stats(requests: Sequence[Request]) -> dict[str, Any]:
    """Summary statistics of a workload.

    Args:
        requests: the requests (any order; sorted by arrival here).

    Returns:
        A JSON-serializable dict::

            rows            number of requests
            span_s          last arrival - first arrival
            rate_rps        (rows - 1) / span_s, i.e. 1 / mean inter-arrival gap (None if
                            span_s == 0)
            interarrival_cv std / mean of the inter-arrival gaps (None with < 2 gaps or
                            a zero mean)
            prompt_tokens   {mean, p50, p90, p99, max}
            output_tokens   {mean, p50, p90, p99, max}
            models          {model name: request count}, most requests first
            length_capped   number of requests a length transform capped
    """
    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    times = np.asarray([r.arrival_s for r in reqs], dtype=np.float64)
    span = float(times[-1] - times[0]) if len(times) else 0.0
    gaps = np.diff(times)
    rate = (len(reqs) - 1) / span if span > 0 else None
    cv = None
    if len(gaps) >= 2 and gaps.mean() > 0:
        cv = float(gaps.std() / gaps.mean())
    return {
        "rows": len(reqs),
        "span_s": span,
        "rate_rps": rate,
        "interarrival_cv": cv,
        "prompt_tokens": _lengths([r.prompt_tokens for r in reqs]),
        "output_tokens": _lengths([r.output_tokens for r in reqs]),
        "models": dict(Counter(r.model for r in reqs).most_common()),
        "length_capped": sum(r.length_capped for r in reqs),
    }


def _num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:,.{digits}f}"


def stats_table(stats: dict[str, Any], title: str) -> Table:
    """A rich table of :func:`trace_stats` output.

    Args:
        stats: the dict from :func:`trace_stats`.
        title: table title, usually the file name.
    """
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("statistic")
    for col in ("value", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="right")
    table.add_row("requests", _num(stats["rows"]), "", "", "", "")
    table.add_row("span (s)", _num(stats["span_s"], 1), "", "", "", "")
    table.add_row("rate (req/s)", _num(stats["rate_rps"]), "", "", "", "")
    table.add_row("inter-arrival CV", _num(stats["interarrival_cv"]), "", "", "", "")
    for key, label in (
        ("prompt_tokens", "prompt tokens (mean)"),
        ("output_tokens", "output tokens (mean)"),
    ):
        d = stats[key]
        table.add_row(
            label, _num(d["mean"], 1), *(_num(d[k], 1) for k in ("p50", "p90", "p99", "max"))
        )
    if stats.get("length_capped"):
        table.add_row("length-capped", _num(stats["length_capped"]), "", "", "", "")
    for name, count in stats["models"].items():
        share = count / stats["rows"] if stats["rows"] else 0.0
        table.add_row(f"model {name}", f"{count:,} ({share:.1%})", "", "", "", "")
    return table
