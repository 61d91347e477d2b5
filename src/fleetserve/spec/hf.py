"""Read a :class:`ModelSpec` from a HuggingFace ``config.json``.

Supported ``model_type`` values (or ``architectures`` entries):

* ``llama`` / ``LlamaForCausalLM``
* ``qwen2`` / ``Qwen2ForCausalLM``
* ``opt`` / ``OPTForCausalLM`` (``ffn_dim`` is the MLP width)
* ``mllama`` / ``MllamaForConditionalGeneration`` (Llama 3.2 Vision): the text
  decoder from ``text_config``; its ``cross_attention_layers`` become
  ``ModelSpec.cross_attn_layers`` (weights counted, no per-token KV).

Weights and KV are taken as fp16/bf16 (2 bytes) whatever ``torch_dtype`` says:
that is how the models are served.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fleetserve.errors import FleetserveError, InputError
from fleetserve.spec.types import Arch, ModelSpec

logger = logging.getLogger(__name__)

_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "opt": "opt",
    "mllama": "mllama",
}
_BY_ARCHITECTURE: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "OPTForCausalLM": "opt",
    "MllamaForConditionalGeneration": "mllama",
}
# HF config-class defaults used when a key is absent.
_DEFAULT_MAX_POS = {"llama": 2048, "qwen2": 32768, "opt": 2048, "mllama": 131072}
_DEFAULT_TIED = {"llama": False, "qwen2": False, "opt": True, "mllama": False}


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise InputError(
            "no such file; expected a HuggingFace config.json or a folder holding one",
            file=str(p),
        )
    return p


def _int_field(cfg: dict[str, Any], key: str, file: str, *, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is not None:
            return default
        raise InputError("required field is missing", file=file, field=key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"expected a positive integer, got {value!r}", file=file, field=key)
    return value


def _detect_family(cfg: dict[str, Any], file: str) -> str:
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    archs = cfg.get("architectures") or []
    if isinstance(archs, list):
        for a in archs:
            if isinstance(a, str) and a in _BY_ARCHITECTURE:
                return _BY_ARCHITECTURE[a]
    supported = ", ".join(sorted(_BY_MODEL_TYPE))
    if model_type is None and not archs:
        raise InputError(
            f"required field is missing (supported model types: {supported})",
            file=file,
            field="model_type",
        )
    raise InputError(
        f"unsupported model type {model_type!r} (architectures {archs!r}); "
        f"supported model types: {supported}",
        file=file,
        field="model_type",
    )


def load_hf_config(path: str | Path) -> ModelSpec:
    """Load a model shape from a HuggingFace ``config.json``.

    Args:
        path: the ``config.json`` file, or a folder that contains one. The returned
            spec's ``name`` is ``str(path)`` as given.

    Returns:
        The model's :class:`ModelSpec`.

    Raises:
        InputError: missing file, invalid JSON, unsupported ``model_type``, or a
            missing/invalid field; the message names the file and the field.
    """
    file_path = _resolve(path)
    file = str(file_path)
    try:
        text = file_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read file: {e}", file=file) from e
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            f"not valid JSON ({e.msg} at column {e.colno}); expected a HuggingFace config.json",
            file=file,
            line=e.lineno,
        ) from e
    if not isinstance(cfg, dict):
        raise InputError("expected a JSON object at the top level", file=file)

    family = _detect_family(cfg, file)
    cross_attn_layers = 0
    tied_default = _DEFAULT_TIED[family]
    top = cfg
    if family == "mllama":
        text_cfg = cfg.get("text_config")
        if not isinstance(text_cfg, dict):
            raise InputError(
                "required object is missing (the text decoder's config)",
                file=file,
                field="text_config",
            )
        cfg = text_cfg
        xattn = cfg.get("cross_attention_layers") or []
        if not isinstance(xattn, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in xattn
        ):
            raise InputError(
                f"expected a list of layer indices, got {xattn!r}",
                file=file,
                field="text_config.cross_attention_layers",
            )
        cross_attn_layers = len(set(xattn))
    arch: Arch = "llama" if family == "mllama" else family  # type: ignore[assignment]

    hidden = _int_field(cfg, "hidden_size", file)
    layers = _int_field(cfg, "num_hidden_layers", file)
    heads = _int_field(cfg, "num_attention_heads", file)
    kv_heads = _int_field(cfg, "num_key_value_heads", file, default=heads)
    inter_key = "ffn_dim" if arch == "opt" else "intermediate_size"
    inter = _int_field(cfg, inter_key, file)
    vocab = _int_field(cfg, "vocab_size", file)
    max_pos_default = _DEFAULT_MAX_POS[family]
    if cfg.get("max_position_embeddings") is None:
        logger.info(
            "%s: no max_position_embeddings, using the %s default %d",
            file,
            family,
            max_pos_default,
        )
    max_pos = _int_field(cfg, "max_position_embeddings", file, default=max_pos_default)
    if cfg.get("head_dim") is not None:
        head_dim = _int_field(cfg, "head_dim", file)
    else:
        if hidden % heads:
            raise InputError(
                f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                "and no head_dim is given",
                file=file,
                field="head_dim",
            )
        head_dim = hidden // heads
    tied = cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", tied_default))
    if not isinstance(tied, bool):
        raise InputError(
            f"expected true or false, got {tied!r}", file=file, field="tie_word_embeddings"
        )
    if arch == "opt":
        proj = cfg.get("word_embed_proj_dim")
        if proj is not None and proj != hidden:
            logger.warning(
                "%s: word_embed_proj_dim (%s) != hidden_size (%d); the projection "
                "matrices are not counted",
                file,
                proj,
                hidden,
            )

    try:
        return ModelSpec(
            name=str(path),
            arch=arch,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            max_context=max_pos,
            tied_embeddings=tied,
            cross_attn_layers=cross_attn_layers,
        )
    except FleetserveError as e:
        field = "num_key_value_heads" if "num_kv_heads" in str(e) else None
        raise InputError(str(e), file=file, field=field) from e
