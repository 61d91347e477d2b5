"""Efficiency parameters of the roofline cost model and where their defaults come from.

The roofline (see :mod:`fleetserve.costmodel.roofline`) turns FLOPs, bytes and
all-reduce volumes into seconds by dividing by the *peak* rates of a
:class:`~fleetserve.spec.types.GpuSpec` times an achieved fraction. Those
fractions, plus a fixed per-iteration overhead and a per-collective latency, are
the :class:`EfficiencyParams`. Calibration (:mod:`fleetserve.costmodel.calibration`)
fits them per (model, GPU, tensor degree) from profile measurements; the defaults
below are used where no calibration exists.

Where the defaults come from (each checked in ``tests/test_costmodel.py`` against
the cited public measurement, within 30 %):

* ``compute_eff = 0.65``: TensorRT-LLM v0.5 reports a 133 ms first-token latency
  for LLaMA-7B, batch 1, 2048 input tokens, FP16 on A100 (``docs/source/performance.md``
  of NVIDIA/TensorRT-LLM, "Low Latency" table). That prefill is 2.76e13 FLOP,
  i.e. ~0.67 of the 312 TFLOP/s peak; large-GEMM MFU of 0.6-0.7 on A100 is also what
  Megatron-style training and FlashAttention papers report.
* ``attn_eff = 0.5``: attention kernels (FlashAttention-2 forward on A100 reaches
  ~50-70 % of peak for long sequences, less for short ones); it only matters for
  long prompts.
* ``mem_eff = 0.8``: decode at batch 1 is a weight-streaming loop; vLLM on an
  A100-40GB decodes Llama-3.1-8B at ~75 tokens/s, "roughly 77 % of the GPU's
  memory-bandwidth ceiling" (johnmusgrave.com, "vLLM throughput-latency sweep on
  NVIDIA A100"). Microbenchmarks of HBM copy reach 85-90 %.
* ``overhead_s = 1.5e-3``: per-iteration scheduling, kernel launches (CUDA graphs in
  vLLM) and sampling; vLLM's CPU-side step overhead is 1-3 ms.
* ``allreduce_eff = 0.7`` and ``allreduce_latency_s = 20e-6``: NCCL ring all-reduce
  reaches ~70 % of NVLink bus bandwidth for tens-of-MB messages (nccl-tests
  ``busbw``), and small (decode-sized) all-reduces cost ~10-30 µs each.
* ``decode_attn_eff = None``: decode attention is priced like any attention
  (``attn_eff``). It is an extension for engines whose single-query attention
  runs a different, slower kernel than prompt attention — the runtime's CPU
  engine gathers each decode's paged K/V and runs small matmuls (~7 GFLOP/s on
  one core) while prompts use fused SDPA (~40 GFLOP/s). Calibration fits it
  only when asked (``fit(..., decode_attention=True)``); left None, every
  result is exactly what it was without the field.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from fleetserve.errors import ConfigError

__all__ = ["DEFAULT_PARAMS", "EfficiencyParams"]


@dataclass(frozen=True, slots=True)
class EfficiencyParams:
    """Achieved fractions of peak and fixed costs of one (model, GPU, tp) deployment.

    Attributes:
        compute_eff: achieved fraction of peak bf16 FLOP/s for the dense matmuls
            (QKV/O projections, MLP, lm_head); model FLOPs utilisation.
        mem_eff: achieved fraction of HBM bandwidth when streaming weights and KV.
        overhead_s: fixed per-iteration overhead in seconds (scheduler, kernel
            launches, sampling, Python).
        allreduce_eff: achieved fraction of the intra-node link bandwidth in the
            tensor-parallel ring all-reduce.
        attn_eff: achieved fraction of peak FLOP/s for attention score/value
            products (FlashAttention-style kernels).
        allreduce_latency_s: fixed latency of one all-reduce collective (only
            paid when tp > 1; two per layer).
        decode_attn_eff: achieved fraction of peak FLOP/s for the attention of
            decode sequences (one new token over its cached context); None:
            ``attn_eff`` (the default, and the model's behaviour before the
            field existed).
    """

    compute_eff: float = 0.65
    mem_eff: float = 0.8
    overhead_s: float = 1.5e-3
    allreduce_eff: float = 0.7
    attn_eff: float = 0.5
    allreduce_latency_s: float = 20e-6
    decode_attn_eff: float | None = None

    def __post_init__(self) -> None:
        names = ["compute_eff", "mem_eff", "allreduce_eff", "attn_eff"]
        if self.decode_attn_eff is not None:
            names.append("decode_attn_eff")
        for name in names:
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ConfigError(f"EfficiencyParams.{name} must be in (0, 1], got {value!r}")
        for name in ("overhead_s", "allreduce_latency_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ConfigError(f"EfficiencyParams.{name} must be >= 0, got {value!r}")

    @property
    def decode_attention_eff(self) -> float:
        """The efficiency decode attention runs at (``decode_attn_eff`` or ``attn_eff``)."""
        return self.attn_eff if self.decode_attn_eff is None else self.decode_attn_eff

    def to_dict(self) -> dict[str, float]:
        """The parameters as a plain ``{name: value}`` dict (JSON-ready); an unset
        ``decode_attn_eff`` is left out (so the dict is what it was before it existed)."""
        out = asdict(self)
        if out["decode_attn_eff"] is None:
            del out["decode_attn_eff"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> EfficiencyParams:
        """Build from :meth:`to_dict` output; missing keys take the defaults.

        Raises:
            ConfigError: on an unknown key or an out-of-range value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown EfficiencyParams key(s) {unknown}; expected some of {sorted(known)}"
            )
        return cls(**{k: None if v is None else float(v) for k, v in data.items()})


DEFAULT_PARAMS = EfficiencyParams()
"""The defaults documented in this module's docstring."""
