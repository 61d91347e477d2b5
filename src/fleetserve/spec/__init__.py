"""fleetserve.spec: GPU and model catalogs, HF config loading, and memory math.

Typical use::

    from fleetserve.spec import get_gpu, get_model, kv_capacity_tokens

    tokens = kv_capacity_tokens(get_model("llama-2-13b"), get_gpu("a100-40gb"), tp=1)

Besides the catalogs, :func:`get_model` knows the runtime engine's built-in
tiny models (:data:`ENGINE_MODELS`) and :func:`get_gpu` builds *emulated*
GPUs — runtime workers on the CPU — from names like ``emu-64mib``
(:mod:`fleetserve.spec.emulated`).
"""

from __future__ import annotations

from pathlib import Path

from fleetserve.errors import UnknownNameError
from fleetserve.spec.emulated import emulated_gpu, emulated_gpu_name, parse_emulated_gpu
from fleetserve.spec.engine_models import ENGINE_MODELS
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
from fleetserve.spec.types import ArenaLayout, GpuSpec, ModelSpec

__all__ = [
    "ENGINE_MODELS",
    "GPUS",
    "MODELS",
    "ArenaLayout",
    "GpuSpec",
    "ModelSpec",
    "emulated_gpu",
    "emulated_gpu_name",
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
    """Look up a GPU by catalog name (case-insensitive), or build an emulated one.

    Args:
        name: e.g. ``"a100-40gb"``, or an emulated GPU such as ``"emu-64mib"``
            (grammar in :mod:`fleetserve.spec.emulated`).

    Returns:
        The :class:`GpuSpec`.

    Raises:
        UnknownNameError: not in :data:`GPUS` and not an emulated GPU; the
            message suggests close names.
        ConfigError: a malformed emulated GPU name (``emu-...``).
    """
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        spec = parse_emulated_gpu(name)
    if spec is None:
        raise UnknownNameError("GPU", name, GPUS)
    return spec


def get_model(name_or_path: str | Path) -> ModelSpec:
    """Look up a model by catalog name, or load it from a HuggingFace config.

    Args:
        name_or_path: a catalog name (case-insensitive, e.g. ``"llama-2-13b"``), a
            built-in engine model (``"tiny-llama-a"``, :data:`ENGINE_MODELS`), or
            the path of a ``config.json`` or of a folder holding one.

    Returns:
        The :class:`ModelSpec`.

    Raises:
        UnknownNameError: neither a catalog name nor an existing path; the message
            suggests close names.
        InputError: the path exists but its config cannot be read.
    """
    if isinstance(name_or_path, str):
        key = name_or_path.strip().lower()
        spec = MODELS.get(key) or ENGINE_MODELS.get(key)
        if spec is not None:
            return spec
    path = Path(name_or_path)
    if path.exists():
        return load_hf_config(path)
    raise UnknownNameError("model", str(name_or_path), {**MODELS, **ENGINE_MODELS})
