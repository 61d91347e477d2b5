r"""Emulated GPUs: runtime workers whose memory is the engine's paged arena.

``fleetserve serve`` can run its workers on the CPU, each one an *emulated
GPU*: a Ray actor whose engine owns one arena of ``serve.gpu_memory_mb`` MiB
holding the hosted model's layer weights and the KV cache. To simulate that
cluster (the fidelity experiment, :mod:`fleetserve.experiments.fidelity`),
such a worker is a :class:`~fleetserve.spec.types.GpuSpec` with an
:class:`~fleetserve.spec.types.ArenaLayout`, resolvable by name through
:func:`fleetserve.spec.get_gpu`::

    emu-<MiB>mib[-<dtype>][-t<threads>][-bs<block size>]

    emu-64mib                  64 MiB arena, float32, 1 thread, 16-token blocks
    emu-96.5mib-float16-t2     96.5 MiB, float16 arena, 2 torch threads
    emu-64mib-bs32             32-token KV blocks

The arena size is ``int(MiB * 2**20)`` bytes, as the runtime computes it.

KV capacity (the engine's ``KVPool``, exactly). For a model with ``L``
layers, ``kvh`` KV heads of width ``d``, and ``P_l`` parameters per layer::

    page_elems  = 2 * block_size * d            (K and V of block_size tokens, 1 head)
    page_bytes  = page_elems * elem_bytes
    num_pages   = arena_bytes // page_bytes
    weight_pgs  = L * ceil(P_l / page_elems)    (each layer: one contiguous run of pages)
    KV blocks   = (num_pages - weight_pgs) // (L * kvh)

    arena: [ KV pages (lowest first) ...        free ...   | layer L-1 | ... | layer 0 ]
                                                              weights, from the top down

The embedding, final norm and LM head are ordinary tensors outside the arena
and cost nothing here. A request needs ``L * kvh`` pages per started block of
``block_size`` tokens, so the engine holds exactly ``KV blocks`` blocks of
KV: :func:`fleetserve.spec.memory.kv_capacity_blocks` returns that number for
an emulated GPU, and ``tests/test_fidelity_sim.py`` checks it against a real
``Engine``. (A worker hosting several models shares one arena, pages as wide
as the widest head; :func:`fleetserve.spec.memory.group_kv_bytes` counts
that case.)

Nominal speeds (what calibration then corrects). The roofline divides FLOPs
and bytes by a GPU's peak rates times fitted efficiencies, each fitted within
``[0.01, 1]`` (:mod:`fleetserve.costmodel.calibration`). An emulated GPU's
peaks are therefore *nominal*: figures the achieved rates of a CPU engine
stay below, near the middle of that range, scaled by the worker's torch
threads:

* ``NOMINAL_FLOPS_PER_THREAD = 200 GFLOP/s``: the fp32 FMA peak of one server
  core with two 512-bit FMA pipes at about 3.1 GHz (2 x 16 lanes x 2 FLOP x
  3.1e9). On this project's 2-core AMD EPYC machine the tiny models' matmuls
  reach ~70 GFLOP/s on one thread (``compute_eff`` ~0.35) and decode
  attention, a gather of the paged KV, ~7 GFLOP/s (~0.035).
* ``NOMINAL_MEM_BW_PER_THREAD = 50 GB/s``: the order of one core's streaming
  rate from its caches and DRAM; the tiny models' weights (12-38 MB) stream
  from L3 / DRAM.
* ``OBJECT_STORE_BW = 1 GB/s`` (``intra_node_bw`` and ``network_bw``, link
  ``host``): the runtime moves KV between workers through the Ray object
  store on one machine; the runtime's controller uses the same figure
  (measured there at 0.5-2 GB/s for chunks of a few MB).
* ``EMULATED_GPUS_PER_NODE = 1024``: every worker of an emulated cluster is
  on one machine (one node).
"""

from __future__ import annotations

import math
import re

from fleetserve.errors import ConfigError
from fleetserve.spec.types import ArenaLayout, GpuSpec, ModelSpec

__all__ = [
    "DTYPE_BYTES",
    "EMULATED_GPUS_PER_NODE",
    "EMULATED_PREFIX",
    "NOMINAL_FLOPS_PER_THREAD",
    "NOMINAL_MEM_BW_PER_THREAD",
    "OBJECT_STORE_BW",
    "arena_kv_blocks",
    "arena_kv_pages",
    "arena_pages",
    "arena_weight_pages",
    "emulated_gpu",
    "emulated_gpu_name",
    "parse_emulated_gpu",
]

EMULATED_PREFIX = "emu-"
NOMINAL_FLOPS_PER_THREAD = 200e9
NOMINAL_MEM_BW_PER_THREAD = 50e9
OBJECT_STORE_BW = 1e9
EMULATED_GPUS_PER_NODE = 1024

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Element size of each engine dtype (``serve.dtype``)."""

_NAME = re.compile(
    r"emu-(?P<mib>\d+(?:\.\d+)?)mib"
    r"(?:-(?P<dtype>float32|float16|bfloat16))?"
    r"(?:-t(?P<threads>\d+))?"
    r"(?:-bs(?P<bs>\d+))?"
)


def _mib_text(memory_mb: float) -> str:
    """``memory_mb`` as it appears in a name (shortest text that reads back exactly)."""
    text = repr(float(memory_mb))
    if not math.isfinite(memory_mb) or memory_mb <= 0 or "e" in text:
        raise ConfigError(
            f"emulated GPU memory must be a positive number of MiB in plain decimal "
            f"(1e-4 to 1e15), got {memory_mb!r}"
        )
    return text.removesuffix(".0")


def emulated_gpu_name(
    memory_mb: float, *, dtype: str = "float32", threads: int = 1, block_size: int = 16
) -> str:
    """The catalog-style name of an emulated GPU (the defaults are left out)."""
    name = f"{EMULATED_PREFIX}{_mib_text(memory_mb)}mib"
    if dtype != "float32":
        name += f"-{dtype}"
    if threads != 1:
        name += f"-t{threads}"
    if block_size != 16:
        name += f"-bs{block_size}"
    return name


def emulated_gpu(
    memory_mb: float, *, dtype: str = "float32", threads: int = 1, block_size: int = 16
) -> GpuSpec:
    """One runtime worker as a GPU: ``memory_mb`` MiB of arena, nominal speeds.

    Args:
        memory_mb: the worker's arena (``serve.gpu_memory_mb``), in MiB.
        dtype: the engine's dtype (``serve.dtype``): the arena's element size.
        threads: torch threads of the worker (``serve.threads_per_worker``);
            the nominal FLOP/s and bandwidth scale with it.
        block_size: tokens per KV block (``cluster.block_size``, which the
            runtime's engines use).

    Raises:
        ConfigError: a bad size, dtype, thread count or block size.
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
    name = emulated_gpu_name(memory_mb, dtype=dtype, threads=threads, block_size=block_size)
    return GpuSpec(
        name=name,
        hbm_bytes=int(memory_mb * 2**20),
        bf16_flops=NOMINAL_FLOPS_PER_THREAD * threads,
        hbm_bw=NOMINAL_MEM_BW_PER_THREAD * threads,
        intra_node_link="host",
        intra_node_bw=OBJECT_STORE_BW,
        network_bw=OBJECT_STORE_BW,
        gpus_per_node=EMULATED_GPUS_PER_NODE,
        arena=ArenaLayout(elem_bytes=DTYPE_BYTES[dtype], block_size=block_size),
    )


def parse_emulated_gpu(name: str) -> GpuSpec | None:
    """The emulated GPU a name describes; None when it does not start with ``emu-``.

    Raises:
        ConfigError: it starts with ``emu-`` but does not follow the grammar
            (module docstring).
    """
    key = name.strip().lower()
    if not key.startswith(EMULATED_PREFIX):
        return None
    m = _NAME.fullmatch(key)
    if m is None:
        raise ConfigError(
            f"bad emulated GPU name {name!r}: expected emu-<MiB>mib[-float16|-bfloat16]"
            "[-t<threads>][-bs<block size>], e.g. emu-64mib or emu-96.5mib-float16-t2"
        )
    return emulated_gpu(
        float(m["mib"]),
        dtype=m["dtype"] or "float32",
        threads=int(m["threads"] or 1),
        block_size=int(m["bs"] or 16),
    )


# --------------------------------------------------------------------- arena math


def _arena(gpu: GpuSpec) -> ArenaLayout:
    if gpu.arena is None:
        raise ConfigError(f"GPU {gpu.name!r} is not an emulated GPU (it has no arena)")
    return gpu.arena


def arena_pages(gpu: GpuSpec, head_dim_max: int, mem_util: float = 1.0) -> tuple[int, int, int]:
    """``(num_pages, page_elems, page_bytes)`` of an emulated GPU's arena whose
    pages are ``head_dim_max`` wide (the widest head of the models it hosts)."""
    arena = _arena(gpu)
    page_elems = 2 * arena.block_size * head_dim_max
    page_bytes = page_elems * arena.elem_bytes
    return math.floor(gpu.hbm_bytes * mem_util) // page_bytes, page_elems, page_bytes


def arena_weight_pages(model: ModelSpec, page_elems: int) -> int:
    """Pages the layer weights of ``model`` take: each layer a whole run of pages."""
    return model.num_layers * -(-model.params_per_layer // page_elems)


def arena_kv_pages(models: list[ModelSpec], gpu: GpuSpec, mem_util: float = 1.0) -> int:
    """Pages of the arena left for KV after the layers of every one of ``models``
    (negative when they do not fit); page width: the widest head among them."""
    if not models:
        raise ValueError("arena_kv_pages needs at least one model")
    pages, elems, _ = arena_pages(gpu, max(m.head_dim for m in models), mem_util)
    return pages - sum(arena_weight_pages(m, elems) for m in models)


def arena_kv_blocks(model: ModelSpec, gpu: GpuSpec, mem_util: float = 1.0) -> int:
    """KV blocks (of the arena's ``block_size`` tokens) an engine hosting only
    ``model`` on ``gpu`` holds; zero or negative when the layers leave none."""
    return arena_kv_pages([model], gpu, mem_util) // (model.num_layers * model.num_kv_heads)
