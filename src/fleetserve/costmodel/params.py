"""Efficiency parameters of the roofline cost model and where their defaults come from.

The roofline (see :mod:`fleetserve.costmodel.roofline`) turns FLOPs, bytes and
all-reduce volumes into seconds by dividing by the *peak* rates of a
:class:`~fleetserve.spec.types.GpuSpec` times an achieved fraction. Those
fractions, plus a fixed per-iteration overhead and a per-collective latency, are
the :class:`EfficiencyParams`. Calibration (:mod:`fleetserve.costmodel.calibration`)
fits them per (model, GPU, tensor degree) from profile measurements; the defaults
below are used where no calibration exists.

Catalog GPUs: fitted to measured kernels (:data:`GPU_PARAMS`). A catalog GPU's
default is the *per-operation form* (``matmul_knee`` set; the roofline module
docstring) with values fitted by ``fleetserve calibrate``
(``docs/calibration.md``), :data:`A100_PARAMS` for the A100/A800 and
:data:`H100_PARAMS` for the H100/H200:

* linear layers (``compute_eff``, ``mem_eff``, ``matmul_knee`` = 1.5,
  ``kernel_latency_s``) and element-wise operators (``elementwise_*``): Vidur's
  measured A100 and H100 MLP profiles (``../shared/data/profiles``; MIT), every
  fifth token count held out: a layer's time within a median 2.9 % (A100) and
  4.2 % (H100), no token class above 4.5 % in median;
* attention (``attn_eff``, ``kv_mem_eff``, ``attn_latency_s``,
  ``attn_causal_factor``, ``attn_query_waste``): on the A100 Vidur's measured
  attention profile (microsoft/vidur e2d00e9, ``data/profiling/a100/attention.csv``:
  FlashAttention in Sarathi-Serve, Llama-2-70B at TP 2), held-out median 8.9 %;
  on the H100 the published figures of :mod:`fleetserve.costmodel.attention`
  (FlashAttention-2 forward, FlashAttention-3 paper Fig. 5; FlashAttention-2
  paged decode, onnxruntime PR 21414), 16 rows. The two sources differ in
  kind: Vidur's A100 kernel computes the whole causal square of a prompt
  (``attn_causal_factor`` 2), the H100 microbenchmark skips most of the masked
  half (1.2); part of an A100-vs-H100 difference in long prompts is that.
* GPUs measured by neither (L4, RTX 4090, V100) take the A100's values;
  emulated GPUs (runtime workers on CPUs) keep :data:`DEFAULT_PARAMS` (the
  single roofline ``max``), which their own calibration replaces.

* the tensor-parallel all-reduce (``allreduce_eff``, ``allreduce_latency_s``):
  Vidur's NCCL all-reduce profiles of DGX nodes (``network/{a100,h100}_dgx``,
  intra-node rows, :mod:`fleetserve.costmodel.network`): held out, messages
  above 1 MB within a median 11.7% (A100) and 7.1% (H100); below 1 MB the
  profiles are bimodal (10-60 µs at one size) and no single latency fits
  them within 35%.

``overhead_s`` (the CPU-side step) is not in those profiles and keeps the
value below. Checked against published end-to-end figures in
``tests/test_costmodel.py`` (within 30 %), as the legacy values were.

The legacy defaults, :data:`DEFAULT_PARAMS`, and where they come from (each
checked in ``tests/test_costmodel.py`` against the cited public measurement,
within 30 %; the simulator used them for every GPU before the calibration was
applied):

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

__all__ = [
    "A100_PARAMS",
    "DEFAULT_PARAMS",
    "GPU_PARAMS",
    "H100_PARAMS",
    "EfficiencyParams",
    "gpu_defaults",
]


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
        decode_batch_scale: per-batch-size correction of decode iterations
            (module docstring).
        matmul_knee: ``q`` of the linear layers' smooth knee
            ``(c^q + m^q)^(1/q)``; setting it selects the per-operation form
            (:mod:`fleetserve.costmodel.roofline`); None: the single roofline
            ``max`` (legacy).
        kernel_latency_s: fixed time of each linear-layer kernel (per-operation
            form; ``4 L + 1`` kernels per iteration).
        elementwise_latency_s: fixed time of a layer's element-wise operators
            (norms, RoPE, activation, adds) per iteration.
        elementwise_rep: the element-wise operators' memory traffic per token
            and layer, in hidden states (``h b`` bytes), on every GPU of the
            tensor-parallel group; ``elementwise_shard``: the part split over it.
        kv_mem_eff: achieved fraction of HBM bandwidth when attention streams
            the KV cache (None: ``mem_eff``).
        attn_latency_s: fixed time of an attention kernel (per layer; a mixed
            iteration runs a prompt and a decode kernel).
        attn_causal_factor: ``kappa`` in [1, 2]: a prompt's causal triangle
            costs ``kappa n (n + 1) / 2`` pairs (1: masked tiles skipped; 2: the
            whole square computed).
        attn_query_waste: pairs' worth of work each prompt token pays beyond
            its own (tile rounding, softmax rescaling).
    """

    compute_eff: float = 0.65
    mem_eff: float = 0.8
    overhead_s: float = 1.5e-3
    allreduce_eff: float = 0.7
    attn_eff: float = 0.5
    allreduce_latency_s: float = 20e-6
    decode_attn_eff: float | None = None
    decode_batch_scale: tuple[tuple[int, float], ...] | None = None
    matmul_knee: float | None = None
    kernel_latency_s: float = 0.0
    elementwise_latency_s: float = 0.0
    elementwise_rep: float = 0.0
    elementwise_shard: float = 0.0
    kv_mem_eff: float | None = None
    attn_latency_s: float = 0.0
    attn_causal_factor: float = 1.0
    attn_query_waste: float = 0.0

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
        if self.kv_mem_eff is not None:
            names.append("kv_mem_eff")
        if self.matmul_knee is None:
            extra = {
                "kernel_latency_s": self.kernel_latency_s,
                "elementwise_latency_s": self.elementwise_latency_s,
                "elementwise_rep": self.elementwise_rep,
                "elementwise_shard": self.elementwise_shard,
                "attn_latency_s": self.attn_latency_s,
                "attn_query_waste": self.attn_query_waste,
            }
            if self.attn_causal_factor != 1.0:
                extra["attn_causal_factor"] = self.attn_causal_factor
            used = [k for k, v in extra.items() if v] + (["kv_mem_eff"] if self.kv_mem_eff else [])
            if used:
                raise ConfigError(
                    f"EfficiencyParams.{', '.join(used)} belong to the per-operation form: "
                    "set matmul_knee too (e.g. 1.5)"
                )
        elif not (math.isfinite(self.attn_causal_factor) and 1.0 <= self.attn_causal_factor <= 2.0):
            raise ConfigError(
                "EfficiencyParams.attn_causal_factor must be in [1, 2] (the share of the causal "
                f"triangle's masked half computed, plus one), got {self.attn_causal_factor!r}"
            )
        elif not (math.isfinite(self.matmul_knee) and self.matmul_knee >= 1.0):
            raise ConfigError(
                f"EfficiencyParams.matmul_knee must be >= 1 (1 adds compute and memory time, "
                f"larger values approach their max), got {self.matmul_knee!r}"
            )
        for name in names:
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 < value <= 1.0):
                raise ConfigError(f"EfficiencyParams.{name} must be in (0, 1], got {value!r}")
        for name in (
            "overhead_s",
            "allreduce_latency_s",
            "kernel_latency_s",
            "elementwise_latency_s",
            "elementwise_rep",
            "elementwise_shard",
            "attn_latency_s",
            "attn_query_waste",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ConfigError(f"EfficiencyParams.{name} must be >= 0, got {value!r}")

    @property
    def per_operation(self) -> bool:
        """Whether the per-operation form prices the iteration (``matmul_knee`` set)."""
        return self.matmul_knee is not None

    @property
    def kv_memory_eff(self) -> float:
        """The efficiency attention streams the KV cache at (``kv_mem_eff`` or ``mem_eff``)."""
        return self.mem_eff if self.kv_mem_eff is None else self.kv_mem_eff

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
        extensions (``decode_attn_eff``, ``decode_batch_scale`` and the
        per-operation form's fields) are left out (so the dict is what it was
        before they existed)."""
        out: dict[str, Any] = asdict(self)
        for name in ("decode_attn_eff", "matmul_knee", "kv_mem_eff"):
            if out[name] is None:
                del out[name]
        for name in (
            "kernel_latency_s",
            "elementwise_latency_s",
            "elementwise_rep",
            "elementwise_shard",
            "attn_latency_s",
            "attn_query_waste",
        ):
            if not out[name]:
                del out[name]
        if out["attn_causal_factor"] == 1.0:
            del out["attn_causal_factor"]
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


A100_PARAMS = EfficiencyParams(
    # linear layers and element-wise operators: `fleetserve calibrate` on Vidur's
    # A100 MLP profiles (../shared/data/profiles; docs/calibration.md)
    compute_eff=0.725,
    mem_eff=0.8225,
    matmul_knee=1.5,
    kernel_latency_s=6e-6,
    elementwise_latency_s=17e-6,
    elementwise_rep=7.75,
    elementwise_shard=24.5,
    # attention: `fleetserve calibrate --attention` on Vidur's A100 attention
    # profile (microsoft/vidur e2d00e9, data/profiling/a100/attention.csv)
    attn_eff=0.39,
    kv_mem_eff=0.76,
    attn_latency_s=15e-6,
    attn_causal_factor=2.0,
    attn_query_waste=256.0,
    # tensor-parallel all-reduce: Vidur's a100_dgx collective profile
    allreduce_eff=0.5,
    allreduce_latency_s=30e-6,
)
"""A100 (SXM, 40 and 80 GB) and A800: fitted to measured kernels (module docstring)."""

H100_PARAMS = EfficiencyParams(
    # linear layers and element-wise operators: Vidur's H100 MLP profiles
    compute_eff=0.705,
    mem_eff=0.9325,
    matmul_knee=1.5,
    kernel_latency_s=5e-6,
    elementwise_latency_s=14e-6,
    elementwise_rep=7.9,
    elementwise_shard=22.2,
    # attention: the published H100 figures of fleetserve.costmodel.attention
    attn_eff=0.40,
    kv_mem_eff=0.79,
    attn_latency_s=17e-6,
    attn_causal_factor=1.2,
    attn_query_waste=128.0,
    # tensor-parallel all-reduce: Vidur's h100_dgx collective profile
    allreduce_eff=0.695,
    allreduce_latency_s=21e-6,
)
"""H100 and H200 (SXM): fitted to measured kernels (module docstring)."""

GPU_PARAMS: dict[str, EfficiencyParams] = {
    "a100-40gb": A100_PARAMS,
    "a100-80gb": A100_PARAMS,
    "a800-80gb": A100_PARAMS,
    "h100-80gb": H100_PARAMS,
    "h200-141gb": H100_PARAMS,
}
"""Per catalog GPU, the parameters fitted to measured kernels (module docstring);
a GPU without measurements of its own takes :data:`A100_PARAMS` (see
:func:`gpu_defaults`)."""


def gpu_defaults(gpu_name: str) -> EfficiencyParams:
    """The default parameters of a catalog GPU: its entry of :data:`GPU_PARAMS`,
    else :data:`A100_PARAMS` (L4, RTX 4090, V100: no measured kernels here; the
    per-operation form with the A100's fitted values is closer to measured GPU
    kernels than the single roofline ``max``, whose knee the profiles show to be
    25-40 % optimistic on every GPU measured)."""
    return GPU_PARAMS.get(gpu_name, A100_PARAMS)
