"""Static hardware and model facts, and the memory math derived from them.

Units: bytes, FLOP/s, bytes/s, seconds. ``GB`` in names means 10**9 bytes and
``GiB`` 2**30 bytes; HBM sizes are stored in bytes exactly as the vendor sells
them (an "A100-40GB" has 40 GiB = 42,949,672,960 bytes of HBM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetserve.errors import ConfigError

Arch = Literal["llama", "qwen2", "opt"]


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """The paged arena of an emulated GPU (the runtime engine's ``KVPool``).

    The arena (the GPU's whole ``hbm_bytes``) is cut into pages of
    ``2 * block_size * head_dim`` elements of ``elem_bytes`` bytes each: one
    page is ``block_size`` tokens of one KV head of one layer (keys and
    values). A model's layer weights take whole pages; the rest is KV.

    Attributes:
        elem_bytes: bytes per element of the arena (the engine's dtype:
            4 for float32, 2 for float16 / bfloat16).
        block_size: tokens per KV block of the engine.
    """

    elem_bytes: int = 4
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.elem_bytes < 1 or self.block_size < 1:
            raise ConfigError(
                f"arena elem_bytes and block_size must be >= 1, got {self.elem_bytes} "
                f"and {self.block_size}"
            )


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU type.

    Attributes:
        name: catalog name, lowercase with hyphens (``a100-40gb``).
        hbm_bytes: device memory in bytes.
        bf16_flops: dense (no sparsity) bf16/fp16 tensor-core peak, FLOP/s.
        hbm_bw: memory bandwidth, bytes/s.
        intra_node_link: ``"nvlink"`` or ``"pcie"`` between GPUs of one node;
            ``"host"`` for emulated GPUs (workers exchanging data through host
            memory, e.g. the Ray object store).
        intra_node_bw: GPU-to-GPU bandwidth inside a node, bytes/s per direction.
        network_bw: inter-node bandwidth per GPU, bytes/s per direction.
        gpus_per_node: GPUs in a typical node of this type.
        arena: None for a real GPU (memory math of :mod:`fleetserve.spec.memory`:
            bytes of weights and KV). An *emulated* GPU — a runtime worker whose
            memory is the engine's paged arena — sets it: its KV capacity is
            then counted in the engine's pages (see :mod:`fleetserve.spec.emulated`).
    """

    name: str
    hbm_bytes: int
    bf16_flops: float
    hbm_bw: float
    intra_node_link: Literal["nvlink", "pcie", "host"]
    intra_node_bw: float
    network_bw: float
    gpus_per_node: int = 8
    arena: ArenaLayout | None = None

    def __post_init__(self) -> None:
        for field in ("hbm_bytes", "bf16_flops", "hbm_bw", "intra_node_bw", "network_bw"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"GPU {self.name!r}: {field} must be positive")
        if self.gpus_per_node < 1:
            raise ConfigError(f"GPU {self.name!r}: gpus_per_node must be >= 1")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer, enough for memory and FLOP math.

    Attributes:
        name: catalog name or the path it was loaded from.
        arch: ``llama`` (RMSNorm, SwiGLU, no biases), ``qwen2`` (llama + q/k/v
            biases) or ``opt`` (LayerNorm, 2-matrix ReLU MLP, biases, learned
            positions).
        num_layers: decoder layers.
        hidden_size: model width.
        num_heads: attention (query) heads.
        num_kv_heads: key/value heads (== num_heads without GQA).
        head_dim: per-head width.
        intermediate_size: MLP inner width.
        vocab_size: vocabulary size.
        max_context: maximum sequence length the model supports.
        tied_embeddings: lm_head shares the input embedding.
        dtype_bytes: bytes per weight and per KV element (2 for fp16/bf16).
        cross_attn_layers: how many of ``num_layers`` are cross-attention layers
            (Llama 3.2 Vision). They hold weights like any decoder layer (counted
            as one self-attention-sized layer each; their q/k norms and two gate
            scalars, 2 x head_dim + 2 parameters, are left out) but no per-token
            KV: they attend to the image tokens' keys/values, which do not grow
            with the text. Text-only requests skip them entirely.
    """

    name: str
    arch: Arch
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int = 4096
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    cross_attn_layers: int = 0

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_context",
            "dtype_bytes",
        ):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model {self.name!r}: {field} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple "
                f"of num_kv_heads ({self.num_kv_heads})"
            )
        if not 0 <= self.cross_attn_layers < self.num_layers:
            raise ConfigError(
                f"model {self.name!r}: cross_attn_layers ({self.cross_attn_layers}) must be "
                f"in [0, num_layers={self.num_layers})"
            )

    # --- parameter counts -------------------------------------------------
    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (attention + MLP + norms)."""
        h = self.hidden_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.arch == "opt":
            attn += q + 2 * kv + h  # q, k, v, out biases
            mlp = 2 * h * self.intermediate_size + self.intermediate_size + h
            norms = 4 * h  # two LayerNorms with weight and bias
        else:
            if self.arch == "qwen2":
                attn += q + 2 * kv  # q/k/v biases
            mlp = 3 * h * self.intermediate_size  # gate, up, down
            norms = 2 * h  # two RMSNorm weights
        return attn + mlp + norms

    @property
    def embedding_params(self) -> int:
        """Input embedding, lm_head (unless tied), final norm, learned positions (OPT)."""
        h = self.hidden_size
        n = self.vocab_size * h
        if not self.tied_embeddings:
            n += self.vocab_size * h
        if self.arch == "opt":
            n += (self.max_context + 2) * h + 2 * h  # learned positions, final LayerNorm
        else:
            n += h
        return n

    @property
    def num_params(self) -> int:
        """Total parameter count."""
        return self.num_layers * self.params_per_layer + self.embedding_params

    # --- bytes ------------------------------------------------------------
    @property
    def weight_bytes_per_layer(self) -> int:
        """Bytes of one decoder layer's weights."""
        return self.params_per_layer * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer: 2 x kv_heads x head_dim x dtype."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_layers(self) -> int:
        """Layers that keep per-token KV (self-attention layers)."""
        return self.num_layers - self.cross_attn_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all self-attention layers."""
        return self.kv_layers * self.kv_bytes_per_token_per_layer
