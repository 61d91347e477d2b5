"""Model configuration for the engine: a :class:`ModelSpec` plus the numerics.

The shape (layers, heads, widths) is the simulator's :class:`ModelSpec`, so a
model the engine runs is the same object the cost model prices. The engine
also needs what the shape leaves out: RoPE base and scaling, the RMSNorm
epsilon, whether q/k/v carry biases (Qwen2) and the special token ids.

Built-in tiny models (seeded random weights, byte-level tokenizer); their
shapes are :data:`fleetserve.spec.ENGINE_MODELS` (torch-free, so the simulator
resolves the same specs by name)::

    name          layers  hidden  heads  kv heads  head_dim  inter  vocab
    tiny-llama-a       4     256      4         2        64    688    260
    tiny-llama-b       6     384      6         2        64   1024    260
    small-llama        6     768     12         4        64   2048    260
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fleetserve.errors import ConfigError, InputError
from fleetserve.spec.engine_models import BYTE_VOCAB as BYTE_VOCAB  # re-exported
from fleetserve.spec.engine_models import ENGINE_MODELS
from fleetserve.spec.hf import load_hf_config
from fleetserve.spec.types import ModelSpec

__all__ = ["BUILTIN_MODELS", "EngineModelConfig", "RopeScaling", "builtin_config", "load_config"]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class EngineModelConfig:
    """Everything the engine needs to build and run one model.

    Attributes:
        spec: the shape (shared with the simulator and the cost model).
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        attention_bias: q/k/v projections carry biases (Qwen2).
        rope_scaling: Llama-3 frequency scaling, or None.
        bos_token_id: prepended by the tokenizer when not None.
        eos_token_ids: generation stops on any of them.
        seed: weight seed of a built-in model (None for checkpoints).
    """

    spec: ModelSpec
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.spec.arch not in ("llama", "qwen2"):
            raise ConfigError(
                f"model {self.spec.name!r}: the engine runs llama and qwen2 models, "
                f"not {self.spec.arch!r}"
            )
        if self.spec.cross_attn_layers:
            raise ConfigError(f"model {self.spec.name!r}: cross-attention layers unsupported")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError(f"model {self.spec.name!r}: rope_theta and rms_norm_eps > 0")
        if self.spec.head_dim % 2:
            raise ConfigError(f"model {self.spec.name!r}: head_dim must be even for RoPE")

    @property
    def name(self) -> str:
        return self.spec.name

    def with_name(self, name: str) -> EngineModelConfig:
        """The same model under another name (e.g. two copies in one engine)."""
        return replace(self, spec=replace(self.spec, name=name))


def _builtin(name: str, seed: int) -> EngineModelConfig:
    """A built-in model: the shape from :data:`fleetserve.spec.ENGINE_MODELS`
    (the same object the simulator resolves), byte-level special tokens."""
    return EngineModelConfig(
        spec=ENGINE_MODELS[name], bos_token_id=256, eos_token_ids=(257,), seed=seed
    )


BUILTIN_MODELS: dict[str, EngineModelConfig] = {
    "tiny-llama-a": _builtin("tiny-llama-a", seed=1),
    "tiny-llama-b": _builtin("tiny-llama-b", seed=2),
    "small-llama": _builtin("small-llama", seed=3),
}


def builtin_config(name: str) -> EngineModelConfig:
    """A built-in tiny model by name (clear error listing the names)."""
    cfg = BUILTIN_MODELS.get(name)
    if cfg is None:
        raise ConfigError(
            f"unknown built-in model {name!r}; built-in: {', '.join(sorted(BUILTIN_MODELS))} "
            "(or give a checkpoint folder with config.json)"
        )
    return cfg


def _float(cfg: dict[str, Any], key: str, file: str, default: float) -> float:
    v = cfg.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise InputError(f"expected a positive number, got {v!r}", file=file, field=key)
    return float(v)


def _ids(v: Any, file: str, key: str) -> tuple[int, ...]:
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise InputError(f"expected a token id or a list of them, got {v!r}", file=file, field=key)
    return tuple(items)


def load_config(path: str | Path) -> EngineModelConfig:
    """Read a checkpoint folder's ``config.json`` (LLaMA or Qwen2 family).

    Raises:
        InputError: unreadable file or a bad field (names the file and field).
        ConfigError: a model family or feature the engine does not run.
    """
    folder = Path(path)
    file_path = folder / "config.json" if folder.is_dir() else folder
    spec = load_hf_config(file_path)
    spec = replace(spec, name=str(path), dtype_bytes=4)
    file = str(file_path)
    cfg = json.loads(file_path.read_text(encoding="utf-8"))
    scaling = None
    # transformers >= 5 writes "rope_parameters" (rope_type, rope_theta and the
    # scaling keys in one object) instead of top-level rope_theta / rope_scaling.
    rs_field = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    rs = cfg.get(rs_field)
    theta_src: dict[str, Any] = cfg
    theta_key = "rope_theta"
    if rs is not None:
        if not isinstance(rs, dict):
            raise InputError(f"expected an object or null, got {rs!r}", file=file, field=rs_field)
        if rs_field == "rope_parameters" and rs.get("rope_theta") is not None:
            theta_key = "rope_parameters.rope_theta"
            theta_src = {theta_key: rs["rope_theta"]}
        kind = rs.get("rope_type", rs.get("type"))
        if kind in ("default", None):
            scaling = None
        elif kind == "llama3":
            try:
                scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            except (KeyError, TypeError, ValueError) as e:
                raise InputError(
                    f"llama3 rope_scaling needs factor, low_freq_factor, high_freq_factor and "
                    f"original_max_position_embeddings ({e})",
                    file=file,
                    field=rs_field,
                ) from e
        else:
            raise ConfigError(
                f"{file}: {rs_field} type {kind!r} is not supported (supported: default, llama3)"
            )
    bias_default = spec.arch == "qwen2"
    bias = cfg.get("attention_bias", bias_default)
    if not isinstance(bias, bool):
        raise InputError(f"expected true or false, got {bias!r}", file=file, field="attention_bias")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{file}: mlp_bias is not supported")
    if cfg.get("use_sliding_window"):
        raise ConfigError(
            f"{file}: use_sliding_window is true; the engine runs full attention only"
        )
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{file}: hidden_act {hidden_act!r} is not supported (only silu)")
    bos = _ids(cfg.get("bos_token_id"), file, "bos_token_id")
    return EngineModelConfig(
        spec=spec,
        rope_theta=_float(theta_src, theta_key, file, 10000.0),
        rms_norm_eps=_float(cfg, "rms_norm_eps", file, 1e-6),  # HF Llama/Qwen2 default
        attention_bias=bias,
        rope_scaling=scaling,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_ids(cfg.get("eos_token_id"), file, "eos_token_id"),
    )
