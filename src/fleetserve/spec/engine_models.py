"""The runtime engine's built-in tiny models, as the simulator sees them.

The PyTorch engine (:mod:`fleetserve.runtime.engine`) ships two small
LLaMA-shaped models with seeded random weights and a byte-level tokenizer, so
the runtime can be run, and compared with the simulator, on a CPU. Their
shapes live here, in ``spec`` (no torch), so that
:func:`fleetserve.spec.get_model` resolves them for a simulation and
:mod:`fleetserve.runtime.engine.config` builds its configs from the very same
:class:`ModelSpec` objects::

    name          layers  hidden  heads  kv heads  head_dim  inter  vocab  context
    tiny-llama-a       4     256      4         2        64    688    260     4096
    tiny-llama-b       6     384      6         2        64   1024    260     4096
    small-llama        6     768     12         4        64   2048    260     4096

``small-llama`` (37M parameters, ~150 MB at float32) is there for fidelity
runs: on one CPU thread its decode step takes ~15 ms and a 128-token prefill
~150 ms, the order of a 7B model's on a GPU, so engine time dominates the
serving path's few milliseconds of Python and HTTP as it does on real hardware
(a tiny model's 2-3 ms step is shorter than that overhead).

``dtype_bytes`` is 4: the engine's default dtype (``serve.dtype``) is
float32. A run at another dtype takes :func:`engine_model_spec` with that
dtype's size (the arena math of an emulated GPU uses the GPU's own element
size either way, see :mod:`fleetserve.spec.emulated`).

They are kept out of :data:`fleetserve.spec.MODELS`, the catalog of real
models, on purpose: that catalog is what the papers' experiments choose from.
"""

from __future__ import annotations

from dataclasses import replace

from fleetserve.errors import ConfigError
from fleetserve.spec.types import ModelSpec

__all__ = ["BYTE_VOCAB", "ENGINE_MODELS", "engine_model_spec"]

BYTE_VOCAB = 260
"""Byte-level tokenizer vocabulary: 256 bytes + BOS, EOS, PAD and one spare."""


def _tiny(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        arch="llama",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=inter,
        vocab_size=BYTE_VOCAB,
        max_context=4096,
        dtype_bytes=4,
    )


ENGINE_MODELS: dict[str, ModelSpec] = {
    "tiny-llama-a": _tiny("tiny-llama-a", 4, 256, 4, 2, 688),
    "tiny-llama-b": _tiny("tiny-llama-b", 6, 384, 6, 2, 1024),
    "small-llama": _tiny("small-llama", 6, 768, 12, 4, 2048),
}
"""Built-in engine models by name (float32: ``dtype_bytes=4``)."""


def engine_model_spec(name: str, dtype_bytes: int = 4) -> ModelSpec:
    """A built-in engine model's spec, with ``dtype_bytes`` for its weights and KV.

    Raises:
        ConfigError: not a built-in engine model (the message lists them), or a
            non-positive ``dtype_bytes``.
    """
    spec = ENGINE_MODELS.get(name.strip().lower())
    if spec is None:
        raise ConfigError(
            f"unknown built-in engine model {name!r}; built-in: {', '.join(sorted(ENGINE_MODELS))}"
        )
    if dtype_bytes == spec.dtype_bytes:
        return spec
    if dtype_bytes < 1:
        raise ConfigError(f"dtype_bytes must be >= 1, got {dtype_bytes}")
    return replace(spec, dtype_bytes=dtype_bytes)
