"""fleetserve.spec: GPU and model catalogs, HF config loading, and memory math.

Typical use::

    from fleetserve.spec import get_gpu, get_model, kv_capacity_tokens

    tokens = kv_capacity_tokens(get_model("llama-2-13b"), get_gpu("a100-40gb"), tp=1)
"""

from __future__ import annotations

from pathlib import Path

from fleetserve.errors import UnknownNameError
from fleetserve.spec.gpus import GPUS
from fleetserve.spec.hf import load_hf_config
from fleetserve.spec.memory import (
    fits,
    kv_capacity_blocks,
    kv_capacity_bytes,
    kv_capacity_tokens,
    min_tp,
    weight_bytes_per_gpu,
)
from fleetserve.spec.models import MODELS
from fleetserve.spec.types import GpuSpec, ModelSpec

__all__ = [
    "GPUS",
    "MODELS",
    "GpuSpec",
    "ModelSpec",
    "fits",
    "get_gpu",
    "get_model",
    "kv_capacity_blocks",
    "kv_capacity_bytes",
    "kv_capacity_tokens",
    "load_hf_config",
    "min_tp",
    "weight_bytes_per_gpu",
]


def get_gpu(name: str) -> GpuSpec:
    """Look up a GPU by catalog name (case-insensitive).

    Args:
        name: e.g. ``"a100-40gb"``.

    Returns:
        The :class:`GpuSpec`.

    Raises:
        UnknownNameError: not in :data:`GPUS`; the message suggests close names.
    """
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise UnknownNameError("GPU", name, GPUS)
    return spec


def get_model(name_or_path: str | Path) -> ModelSpec:
    """Look up a model by catalog name, or load it from a HuggingFace config.

    Args:
        name_or_path: a catalog name (case-insensitive, e.g. ``"llama-2-13b"``), or
            the path of a ``config.json`` or of a folder holding one.

    Returns:
        The :class:`ModelSpec`.

    Raises:
        UnknownNameError: neither a catalog name nor an existing path; the message
            suggests close names.
        InputError: the path exists but its config cannot be read.
    """
    if isinstance(name_or_path, str):
        spec = MODELS.get(name_or_path.strip().lower())
        if spec is not None:
            return spec
    path = Path(name_or_path)
    if path.exists():
        return load_hf_config(path)
    raise UnknownNameError("model", str(name_or_path), MODELS)
