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
* ``decode_batch_scale = None``: no correction. An extension for engines whose
  decode step does not follow the roofline's straight lines in the batch size:
  on the runtime's CPU engine a small-batch matmul's cost grows almost linearly
  from 1 to 4-5 rows and then flattens (one core: 1, 2, 3, 4, 8 rows of a
  768x2048 linear take ~95, 185, 275, 315, 450 us), which no choice of
  efficiencies reproduces. ``(batch, factor)`` points measured by calibration
  (``fit(..., decode_batch_residuals=True)``: the median measured/predicted
  ratio of the profile's decode rows at each batch size) multiply every decode
  iteration's time, interpolated linearly in the batch size between points and
  held constant beyond the first and last (Vidur-style empirical correction on
  top of the analytical model). Mixed and prefill iterations are not scaled.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

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
    decode_batch_scale: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.decode_batch_scale is not None:
            pts = tuple((int(b), float(f)) for b, f in self.decode_batch_scale)
            if not pts:
                raise ConfigError("EfficiencyParams.decode_batch_scale must not be empty")
            bs = [b for b, _ in pts]
            if any(b < 1 for b in bs) or bs != sorted(set(bs)):
                raise ConfigError(
                    f"EfficiencyParams.decode_batch_scale batches must be increasing and >= 1, "
                    f"got {bs}"
                )
            if any(not (math.isfinite(f) and f > 0) for _, f in pts):
                raise ConfigError(
                    f"EfficiencyParams.decode_batch_scale factors must be > 0, got {pts}"
                )
            object.__setattr__(self, "decode_batch_scale", pts)
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

    def decode_scale(self, batch: int) -> float:
        """The ``decode_batch_scale`` factor of a decode batch (1.0 when unset)."""
        pts = self.decode_batch_scale
        if pts is None:
            return 1.0
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, f0), (b1, f1) in itertools.pairwise(pts):
            if batch <= b1:
                return f0 + (f1 - f0) * (batch - b0) / (b1 - b0)
        return pts[-1][1]

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a plain ``{name: value}`` dict (JSON-ready); unset
        extensions (``decode_attn_eff``, ``decode_batch_scale``) are left out (so
        the dict is what it was before they existed)."""
        out: dict[str, Any] = asdict(self)
        if out["decode_attn_eff"] is None:
            del out["decode_attn_eff"]
        if out["decode_batch_scale"] is None:
            del out["decode_batch_scale"]
        else:
            out["decode_batch_scale"] = [[b, f] for b, f in self.decode_batch_scale or ()]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EfficiencyParams:
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
        vals: dict[str, Any] = {}
        for k, v in data.items():
            if k == "decode_batch_scale" and v is not None:
                try:
                    vals[k] = tuple((int(b), float(f)) for b, f in v)
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"EfficiencyParams.decode_batch_scale must be [[batch, factor], ...], "
                        f"got {v!r}"
                    ) from None
            else:
                vals[k] = None if v is None else float(v)
        return cls(**vals)


DEFAULT_PARAMS = EfficiencyParams()
"""The defaults documented in this module's docstring."""
