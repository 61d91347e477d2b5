"""fleetserve.workload: requests, trace loaders, synthetic generators and transforms."""

from __future__ import annotations

from fleetserve.workload.inspect import stats_table, trace_stats
from fleetserve.workload.loaders import (
    FORMATS,
    LoadedTrace,
    SkippedRow,
    detect_format,
    load_trace,
)
from fleetserve.workload.request import Request
from fleetserve.workload.synthetic import (
    EmpiricalLengths,
    FixedLengths,
    LengthSampler,
    LognormalLengths,
    QuantileLengths,
    default_workload,
    fixed_lengths,
    gamma_arrivals,
    lengths_from_file,
    lognormal_lengths,
    poisson_arrivals,
    power_law_rates,
    quantile_lengths,
    synthesize,
)
from fleetserve.workload.transforms import (
    assign_models,
    max_requests,
    scale_lengths,
    scale_rate,
    select_and_scale,
    time_window,
)

__all__ = [
    "FORMATS",
    "EmpiricalLengths",
    "FixedLengths",
    "LengthSampler",
    "LoadedTrace",
    "LognormalLengths",
    "QuantileLengths",
    "Request",
    "SkippedRow",
    "assign_models",
    "default_workload",
    "detect_format",
    "fixed_lengths",
    "gamma_arrivals",
    "lengths_from_file",
    "load_trace",
    "lognormal_lengths",
    "max_requests",
    "poisson_arrivals",
    "power_law_rates",
    "quantile_lengths",
    "scale_lengths",
    "scale_rate",
    "select_and_scale",
    "stats_table",
    "synthesize",
    "time_window",
    "trace_stats",
]
