"""fleetserve.costmodel: how long things take.

* :mod:`~fleetserve.costmodel.roofline`: iteration times (prefill, decode, mixed
  chunked-prefill) of a model on ``tp`` GPUs, and the idle execution time of whole
  requests; formulas in that module's docstring.
* :mod:`~fleetserve.costmodel.params`: the efficiency parameters and their
  documented defaults.
* :mod:`~fleetserve.costmodel.transfer`: bytes over links (KV migration, host
  offload).
* :mod:`~fleetserve.costmodel.calibration`: profile CSV, fitting, JSON store.

Typical use::

    from fleetserve.costmodel import CostModel
    from fleetserve.spec import get_gpu, get_model

    cost = CostModel().bind(get_model("llama-2-7b"), get_gpu("a100-40gb"), tp=1)
    ttft = cost.prefill_time([512])
"""

from __future__ import annotations

from fleetserve.costmodel.calibration import (
    PROFILE_COLUMNS,
    Calibration,
    ProfileRow,
    calibrate,
    fit,
    load_profile,
    predict_row,
    relative_errors,
    write_profile,
)
from fleetserve.costmodel.params import (
    A100_PARAMS,
    DEFAULT_PARAMS,
    GPU_PARAMS,
    H100_PARAMS,
    EfficiencyParams,
)
from fleetserve.costmodel.roofline import (
    CostModel,
    Ends,
    InstanceCost,
    RawCoefficients,
    gpu_params,
    raw_coefficients,
)
from fleetserve.costmodel.transfer import (
    Link,
    host_link,
    intra_node_link,
    network_link,
    transfer_time,
)

__all__ = [
    "A100_PARAMS",
    "DEFAULT_PARAMS",
    "GPU_PARAMS",
    "H100_PARAMS",
    "PROFILE_COLUMNS",
    "Calibration",
    "CostModel",
    "EfficiencyParams",
    "Ends",
    "InstanceCost",
    "Link",
    "ProfileRow",
    "RawCoefficients",
    "calibrate",
    "fit",
    "gpu_params",
    "host_link",
    "intra_node_link",
    "load_profile",
    "network_link",
    "predict_row",
    "raw_coefficients",
    "relative_errors",
    "transfer_time",
    "write_profile",
]
