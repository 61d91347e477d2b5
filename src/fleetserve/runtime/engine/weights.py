"""Where the engine's weights come from: seeded random tensors or a safetensors checkpoint.

A :class:`WeightSource` hands out one fp32 CPU tensor at a time under the
engine's names (see :mod:`.model`)::

    embed               [V, H]
    norm                [H]
    lm_head             [V, H]   (the embedding itself when tied)
    layers.{i}.{short}  shapes of model.layer_shapes(cfg), short in
                        ln1, q, k, v, (q_bias, k_bias, v_bias), o, ln2, gate, up, down

so an engine can load just the layers it holds, and load one layer again later
(restoring a dropped layer) without touching the rest.

* :class:`RandomWeights` draws every tensor from its own generator seeded by
  ``(seed, name)``: the same seed gives the same model whatever is drawn first,
  and one layer can be regenerated alone.
* :class:`SafetensorsCheckpoint` reads a HuggingFace LLaMA / Qwen2 checkpoint
  folder (``config.json`` + one or several ``*.safetensors``) lazily.
* :func:`save_checkpoint` writes any source as such a folder, which both
  fleetserve and ``transformers`` load (tests compare the two).
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fleetserve.errors import ConfigError, InputError
from fleetserve.runtime.engine.config import (
    BUILTIN_MODELS,
    EngineModelConfig,
    builtin_config,
    load_config,
)
from fleetserve.runtime.engine.model import LayerWeights, ModelWeights, layer_shapes

__all__ = [
    "RandomWeights",
    "SafetensorsCheckpoint",
    "WeightSource",
    "engine_names",
    "hf_name",
    "layer_tensors",
    "load_weight_source",
    "model_weights",
    "save_checkpoint",
    "tensor_shape",
]

logger = logging.getLogger(__name__)

_HF_LAYER: dict[str, str] = {
    "ln1": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight",
    "ln2": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_TOP_SLOT = {"embed": 0, "norm": 1, "lm_head": 2}
_LAYER_SLOT = {short: k for k, short in enumerate(_HF_LAYER)}
_HF_TOP: dict[str, str] = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def _parse_name(cfg: EngineModelConfig, name: str) -> tuple[int | None, str]:
    """``(layer, short)`` for a layer tensor, ``(None, name)`` for a top-level one.

    Raises:
        KeyError: not an engine tensor name of this model.
    """
    if name in _HF_TOP:
        return None, name
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        layer, short = int(parts[1]), parts[2]
        n = cfg.spec.num_layers
        if not 0 <= layer < n:
            raise KeyError(f"model {cfg.name!r}: {name!r}: layer {layer} out of range 0..{n - 1}")
        shorts = [s for s, _ in layer_shapes(cfg)]
        if short not in shorts:
            raise KeyError(
                f"model {cfg.name!r}: {name!r}: no layer tensor {short!r}; "
                f"layer tensors: {', '.join(shorts)}"
            )
        return layer, short
    raise KeyError(
        f"model {cfg.name!r}: unknown tensor name {name!r}; expected embed, norm, lm_head "
        "or layers.{i}.{" + ",".join(s for s, _ in layer_shapes(cfg)) + "}"
    )


def tensor_shape(cfg: EngineModelConfig, name: str) -> tuple[int, ...]:
    """The shape of engine tensor ``name`` (KeyError for a name the model lacks)."""
    layer, short = _parse_name(cfg, name)
    if layer is None:
        s = cfg.spec
        return (s.hidden_size,) if short == "norm" else (s.vocab_size, s.hidden_size)
    return dict(layer_shapes(cfg))[short]


def engine_names(cfg: EngineModelConfig) -> list[str]:
    """Every engine tensor name of the model: embed, norm, lm_head, then layer by layer."""
    out = ["embed", "norm", "lm_head"]
    for i in range(cfg.spec.num_layers):
        out += [f"layers.{i}.{short}" for short, _ in layer_shapes(cfg)]
    return out


def hf_name(cfg: EngineModelConfig, name: str) -> str:
    """The HuggingFace checkpoint name of engine tensor ``name``."""
    layer, short = _parse_name(cfg, name)
    if layer is None:
        return _HF_TOP[short]
    return f"model.layers.{layer}.{_HF_LAYER[short]}"


class WeightSource(ABC):
    """Hands out a model's tensors one at a time by engine name.

    Attributes:
        cfg: the model these weights belong to.
    """

    cfg: EngineModelConfig

    @abstractmethod
    def tensor(self, name: str) -> torch.Tensor:
        """One tensor as fp32 on the CPU.

        Args:
            name: ``embed``, ``norm``, ``lm_head`` (the embedding when tied) or
                ``layers.{i}.{short}``.

        Raises:
            KeyError: a name this model does not have.
        """

    def names(self) -> list[str]:
        """Every tensor name this source serves (see :func:`engine_names`)."""
        return engine_names(self.cfg)


def layer_tensors(source: WeightSource, layer: int) -> LayerWeights:
    """All tensors of decoder layer ``layer``, by short name in buffer order."""
    return {
        short: source.tensor(f"layers.{layer}.{short}") for short, _ in layer_shapes(source.cfg)
    }


def model_weights(
    source: WeightSource,
    layers: Iterable[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ModelWeights:
    """Load a model (or some of its layers) as :class:`ModelWeights`.

    Args:
        source: where the tensors come from.
        layers: the decoder layers to load; all of them when None.
        dtype: the dtype to keep them in.
        device: the device to put them on.

    Returns:
        The weights; when the embeddings are tied, ``lm_head`` is the same
        tensor as ``embed``.
    """
    cfg = source.cfg

    def get(name: str) -> torch.Tensor:
        return source.tensor(name).to(device=device, dtype=dtype)

    embed = get("embed")
    lm_head = embed if cfg.spec.tied_embeddings else get("lm_head")
    idx = range(cfg.spec.num_layers) if layers is None else sorted(set(layers))
    held = {i: {short: get(f"layers.{i}.{short}") for short, _ in layer_shapes(cfg)} for i in idx}
    return ModelWeights(embed=embed, norm=get("norm"), lm_head=lm_head, layers=held)


class RandomWeights(WeightSource):
    """Deterministic random weights for a model config (the built-in tiny models).

    Every tensor is drawn from its own ``torch.Generator``, so the result does
    not depend on the order of calls and one layer can be regenerated alone,
    bit for bit. The CPU generator (mt19937) keeps only 32 bits of its seed, so
    the seed is ``crc32("fleetserve.RandomWeights:{seed}")`` plus a fixed slot
    per tensor name (``embed`` 0, ``norm`` 1, ``lm_head`` 2, layer ``i``'s
    tensors ``16 * (i + 1) + k``): stable across runs and versions, and never
    the same for two tensors of one model.

    Initialisation:

    * matrices (embedding, LM head, projections): ``N(0, 1/fan_in)``, i.e. std
      ``1/sqrt(H)`` for ``[*, H]`` matrices and ``1/sqrt(I)`` for ``down``. It
      keeps every projection's output at the scale of its input, so the
      residual stream stays O(1) through the layers, and the logits have std
      about 1 so the greedy continuation depends on the context and varies.
      HF's usual ``std=0.02`` gives logits with std ~0.3 in the tiny models
      whose argmax is dominated by the LM head rows (few distinct tokens);
    * RMSNorm weights: ``1 + 0.1 * N(0, 1)`` (not trivially ones);
    * q/k/v biases (Qwen2): ``0.1 * N(0, 1)``.

    The built-in configs carry their seed (``cfg.seed``);
    :func:`load_weight_source` uses it.

    Args:
        cfg: the model.
        seed: a non-negative integer.
    """

    MATRIX_GAIN = 1.0
    NORM_NOISE = 0.1
    BIAS_STD = 0.1

    def __init__(self, cfg: EngineModelConfig, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(
                f"model {cfg.name!r}: weight seed must be an integer >= 0, not {seed!r}"
            )
        self.cfg = cfg
        self.seed = seed

    def stream(self, name: str) -> int:
        """The 32-bit generator seed of tensor ``name`` (see the class docstring)."""
        layer, short = _parse_name(self.cfg, name)
        slot = _TOP_SLOT[short] if layer is None else 16 * (layer + 1) + _LAYER_SLOT[short]
        base = zlib.crc32(f"fleetserve.RandomWeights:{self.seed}".encode())
        return (base + slot) & 0xFFFFFFFF

    def _generator(self, name: str) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(self.stream(name))
        return g

    def tensor(self, name: str) -> torch.Tensor:
        """See :meth:`WeightSource.tensor`."""
        if name == "lm_head" and self.cfg.spec.tied_embeddings:
            name = "embed"
        shape = tensor_shape(self.cfg, name)
        x = torch.randn(shape, generator=self._generator(name), dtype=torch.float32)
        short = name.rsplit(".", 1)[-1]
        if short in ("norm", "ln1", "ln2"):
            return 1.0 + self.NORM_NOISE * x
        if short.endswith("_bias"):
            return self.BIAS_STD * x
        return x * (self.MATRIX_GAIN / math.sqrt(shape[1]))

    def __repr__(self) -> str:
        return f"RandomWeights({self.cfg.name!r}, seed={self.seed})"


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


class SafetensorsCheckpoint(WeightSource):
    """A HuggingFace LLaMA / Qwen2 checkpoint folder, read lazily.

    The folder holds ``config.json`` (read with :func:`.config.load_config`) and
    the weights as one ``*.safetensors`` file, shards listed in
    ``model.safetensors.index.json``, or several ``*.safetensors`` files. Only
    the tensors asked for are read (memory-mapped by ``safetensors``); each is
    checked against the shape the config implies and returned as fp32.

    Args:
        folder: the checkpoint folder.

    Raises:
        InputError: no config.json, no safetensors files, or an unreadable
            index or file (names the file).
        ConfigError: a model the engine does not run.
    """

    INDEX = "model.safetensors.index.json"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError("no such checkpoint folder", file=str(self.folder))
        self.cfg = load_config(self.folder)
        self._where = self._index()

    def _index(self) -> dict[str, Path]:
        """HF tensor name -> the file holding it."""
        from safetensors import safe_open

        index = self.folder / self.INDEX
        if index.is_file():
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
                weight_map = data["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
                out = {str(k): self.folder / str(v) for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise InputError(
                    f"unreadable safetensors index ({e}); expected an object with a "
                    "'weight_map' of tensor name -> file name",
                    file=str(index),
                    field="weight_map",
                ) from e
            for f in sorted(set(out.values())):
                if not f.is_file():
                    raise InputError(f"shard listed in {self.INDEX} does not exist", file=str(f))
            return out
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise InputError(
                "no *.safetensors files in the checkpoint folder (nor "
                f"{self.INDEX}); the engine reads safetensors weights only",
                file=str(self.folder),
            )
        out = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    keys = list(sf.keys())
            except Exception as e:  # safetensors raises its own error types
                raise InputError(f"not a readable safetensors file ({e})", file=str(f)) from e
            for k in keys:
                if k in out:
                    logger.warning("%s: tensor %s also in %s; using the first", f, k, out[k])
                else:
                    out[k] = f
        return out

    def _read(self, hf: str, expected: tuple[int, ...] | None) -> torch.Tensor:
        from safetensors import safe_open

        f = self._where.get(hf)
        if f is None:
            raise InputError(
                f"tensor {hf!r} is missing from the checkpoint's safetensors files",
                file=str(self.folder),
                field=hf,
            )
        try:
            with safe_open(str(f), framework="pt") as sf:
                if hf not in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    raise InputError(
                        f"tensor {hf!r} is listed in {self.INDEX} but not in the file",
                        file=str(f),
                        field=hf,
                    )
                found = tuple(sf.get_slice(hf).get_shape())
                if expected is not None and found != expected:
                    raise InputError(
                        f"tensor {hf!r} has shape {_shape_str(found)}, expected "
                        f"{_shape_str(expected)} from config.json",
                        file=str(f),
                        field=hf,
                    )
                t = sf.get_tensor(hf)
        except InputError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise InputError(f"cannot read tensor {hf!r} ({e})", file=str(f), field=hf) from e
        if not t.is_floating_point():
            raise InputError(
                f"tensor {hf!r} has dtype {t.dtype}, expected a floating-point type",
                file=str(f),
                field=hf,
            )
        return t.to(torch.float32)

    def tensor(self, name: str) -> torch.Tensor:
        """See :meth:`WeightSource.tensor`.

        Raises:
            KeyError: a name this model does not have.
            InputError: the tensor is missing from the files, has the wrong
                shape or is not floating-point.
            ConfigError: a LLaMA ``o_proj`` bias that is not zero (unsupported).
        """
        if name == "lm_head" and self.cfg.spec.tied_embeddings:
            name = "embed"
        shape = tensor_shape(self.cfg, name)
        hf = hf_name(self.cfg, name)
        t = self._read(hf, shape)
        if name.endswith(".o") and self.cfg.attention_bias:
            # LLaMA's attention_bias also gives o_proj a bias; the engine has none,
            # so accept it only when it is zero (as save_checkpoint writes it).
            ob = hf.replace(".weight", ".bias")
            if ob in self._where and bool(self._read(ob, (shape[0],)).abs().max() > 0):
                raise ConfigError(
                    f"{self.folder}: {ob} is not zero; an o_proj bias is not supported"
                )
        return t

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.folder)!r})"


def _hf_config(cfg: EngineModelConfig) -> dict[str, Any]:
    s = cfg.spec
    if s.arch == "qwen2" and not cfg.attention_bias:
        raise ConfigError(
            f"model {cfg.name!r}: a qwen2 checkpoint always has q/k/v biases "
            "(attention_bias must be true)"
        )
    eos: int | list[int] | None
    eos = None if not cfg.eos_token_ids else list(cfg.eos_token_ids)
    if eos is not None and len(eos) == 1:
        eos = eos[0]
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if s.arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": s.arch,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_context,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": s.tied_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if s.arch == "llama":
        out["attention_bias"] = cfg.attention_bias
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    sc = cfg.rope_scaling
    if sc is not None:
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": sc.factor,
            "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_position_embeddings,
        }
    return out


def save_checkpoint(folder: str | Path, source: WeightSource) -> Path:
    """Write ``source`` as a HuggingFace checkpoint folder (fp32).

    Writes ``config.json`` and ``model.safetensors`` with HF tensor names
    (no ``lm_head.weight`` when the embeddings are tied), loadable by
    :class:`SafetensorsCheckpoint` and by ``transformers``
    (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``). A LLaMA model with
    ``attention_bias`` also gets zero ``o_proj`` biases, which HF expects.

    Args:
        folder: created if missing; existing files of the same names are replaced.
        source: the weights to write.

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    cfg = source.cfg
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = _hf_config(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name in source.names():
        if name == "lm_head" and cfg.spec.tied_embeddings:
            continue
        t = source.tensor(name).to(torch.float32).contiguous()
        tensors[hf_name(cfg, name)] = t
        if cfg.spec.arch == "llama" and cfg.attention_bias and name.endswith(".o"):
            tensors[hf_name(cfg, name).replace(".weight", ".bias")] = torch.zeros(t.shape[0])
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote %d tensors of %s to %s", len(tensors), cfg.name, out)
    return out


def load_weight_source(name_or_folder: str | Path) -> WeightSource:
    """A built-in model's random weights, or a checkpoint folder.

    Args:
        name_or_folder: a built-in name (``tiny-llama-a``, ...; seeded with
            the config's ``seed``) or a folder holding ``config.json`` and
            safetensors weights.

    Raises:
        ConfigError: neither a built-in name nor an existing folder (lists the
            built-in names).
        InputError: a bad checkpoint folder.
    """
    key = str(name_or_folder)
    if key in BUILTIN_MODELS:
        cfg = builtin_config(key)
        return RandomWeights(cfg, cfg.seed if cfg.seed is not None else 0)
    if Path(key).is_dir():
        return SafetensorsCheckpoint(key)
    raise ConfigError(
        f"{key!r} is neither a built-in model nor a checkpoint folder; built-in models: "
        f"{', '.join(sorted(BUILTIN_MODELS))}"
    )
