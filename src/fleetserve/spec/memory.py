"""Memory math: how much KV cache a tensor-parallel group of GPUs can hold.

Per GPU of a TP group of ``tp`` GPUs::

    |<------------------------ hbm_bytes ------------------------>|
    |<------------ budget = floor(hbm * mem_util) ---------->|    |
    |<- weights: ceil(W / tp) ->|<------- KV cache -------->|    |

    KV bytes of the group = tp * (budget - ceil(W / tp))

KV heads are split over the group; when ``tp`` exceeds ``num_kv_heads`` each KV
head is replicated ``ceil(tp / num_kv_heads)`` times (as vLLM does), so a token
costs that many times ``kv_bytes_per_token`` of the group's memory.

Emulated GPUs (``gpu.arena`` set, :mod:`fleetserve.spec.emulated`) are runtime
workers whose memory is the engine's paged arena: their capacity is counted in
the engine's pages instead (layer weights rounded up to whole pages, the
embedding and LM head outside the arena, KV in blocks of ``L * kv_heads``
pages), so that it equals the engine's exactly. They run ``tp = 1`` only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fleetserve.errors import ConfigError
from fleetserve.spec.emulated import arena_kv_blocks, arena_kv_pages, arena_pages
from fleetserve.spec.types import GpuSpec, ModelSpec

_GB = 1e9
_HINT_MAX_TP = 1024


def _validate(tp: int, mem_util: float) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor parallel degree must be an integer >= 1, got {tp!r}")
    if not 0 < mem_util <= 1:
        raise ConfigError(f"mem_util must be in (0, 1], got {mem_util!r}")


def weight_bytes_per_gpu(model: ModelSpec, tp: int = 1) -> int:
    """Weight bytes each GPU of a TP group holds (weights split evenly, rounded up).

    Args:
        model: the model.
        tp: tensor-parallel degree (GPUs in the group).

    Returns:
        ``ceil(model.weight_bytes / tp)``.

    Raises:
        ConfigError: ``tp < 1``.
    """
    _validate(tp, 1.0)
    return -(-model.weight_bytes // tp)


def _check_arena_tp(gpu: GpuSpec, tp: int) -> None:
    if tp != 1:
        raise ConfigError(
            f"emulated GPU {gpu.name} runs one engine per worker: tensor parallelism "
            f"is not emulated (tp must be 1, got {tp})"
        )


def _arena_misfit(model: ModelSpec, gpu: GpuSpec, mem_util: float) -> ConfigError:
    pages, _, page_bytes = arena_pages(gpu, model.head_dim, mem_util)
    weights = pages - arena_kv_pages([model], gpu, mem_util)
    per_block = model.num_layers * model.num_kv_heads
    return ConfigError(
        f"model {model.name}: its {model.num_layers} layers take {weights} pages "
        f"({weights * page_bytes / 2**20:.2f} MiB) of the {pages}-page arena of emulated GPU "
        f"{gpu.name} at mem_util {mem_util:.2f}, which leaves no KV block ({per_block} pages); "
        "give the workers more memory (serve.gpu_memory_mb)"
    )


def _budget_per_gpu(gpu: GpuSpec, mem_util: float) -> int:
    return math.floor(gpu.hbm_bytes * mem_util)


def _kv_free_bytes(model: ModelSpec, gpu: GpuSpec, tp: int, mem_util: float) -> int:
    """KV bytes of the group, possibly <= 0 (no validation of fit)."""
    return tp * (_budget_per_gpu(gpu, mem_util) - weight_bytes_per_gpu(model, tp))


def kv_replication(model: ModelSpec, tp: int) -> int:
    """Times each KV head is stored on a TP group (``ceil(tp / num_kv_heads)``, >= 1)."""
    return max(1, -(-tp // model.num_kv_heads))


def group_kv_bytes(
    models: Sequence[ModelSpec], tp: int, gpu: GpuSpec, mem_util: float = 0.9
) -> int:
    """KV bytes a TP group of ``tp`` GPUs has left after the weights of every
    one of ``models`` (a multi-LLM sharing group / LLM unit).

    ``tp * (floor(hbm_bytes * mem_util) - sum_m ceil(weight_bytes_m / tp))``;
    zero or negative when the weights do not fit.

    Raises:
        ConfigError: invalid ``tp`` or ``mem_util``.
    """
    _validate(tp, mem_util)
    if gpu.arena is not None:
        _check_arena_tp(gpu, tp)
        page_bytes = arena_pages(gpu, max(m.head_dim for m in models), mem_util)[2]
        return arena_kv_pages(list(models), gpu, mem_util) * page_bytes
    return tp * (_budget_per_gpu(gpu, mem_util) - sum(weight_bytes_per_gpu(m, tp) for m in models))


def fits(model: ModelSpec, gpu: GpuSpec, tp: int = 1, mem_util: float = 0.9) -> bool:
    """Whether the weights fit on ``tp`` GPUs with some KV memory left over.

    Args:
        model: the model.
        gpu: the GPU type.
        tp: tensor-parallel degree.
        mem_util: share of each GPU's memory the engine may use, in (0, 1].

    Returns:
        True when more than zero KV bytes remain (emulated GPU: at least one KV
        block, and ``tp == 1``).

    Raises:
        ConfigError: invalid ``tp`` or ``mem_util``.
    """
    _validate(tp, mem_util)
    if gpu.arena is not None:
        return tp == 1 and arena_kv_blocks(model, gpu, mem_util) >= 1
    return _kv_free_bytes(model, gpu, tp, mem_util) > 0


def min_tp(model: ModelSpec, gpu: GpuSpec, mem_util: float = 0.9, max_tp: int = 8) -> int:
    """Smallest power-of-two tensor-parallel degree (<= ``max_tp``) on which the model fits.

    Args:
        model: the model.
        gpu: the GPU type.
        mem_util: share of each GPU's memory the engine may use, in (0, 1].
        max_tp: the largest degree to try.

    Returns:
        1, 2, 4, ... the first degree for which :func:`fits` holds.

    Raises:
        ConfigError: it does not fit even on ``max_tp`` GPUs, or invalid arguments.
    """
    _validate(max_tp, mem_util)
    tp = 1
    while tp <= max_tp:
        if fits(model, gpu, tp, mem_util):
            return tp
        tp *= 2
    raise ConfigError(
        f"model {model.name} does not fit on {max_tp} x {gpu.name} at mem_util "
        f"{mem_util:.2f}: it needs {model.weight_bytes / _GB:.1f} GB of weights but they "
        f"offer {max_tp * _budget_per_gpu(gpu, mem_util) / _GB:.1f} GB; use a larger --gpu"
    )


def kv_capacity_bytes(model: ModelSpec, gpu: GpuSpec, tp: int = 1, mem_util: float = 0.9) -> int:
    """KV-cache bytes available on a TP group of ``tp`` GPUs after the weights.

    ``tp * (floor(hbm_bytes * mem_util) - ceil(weight_bytes / tp))``.

    Args:
        model: the model.
        gpu: the GPU type.
        tp: tensor-parallel degree.
        mem_util: share of each GPU's memory the engine may use, in (0, 1].

    Returns:
        Bytes (> 0) of the whole group; for an emulated GPU, the bytes of the
        arena pages left for KV.

    Raises:
        ConfigError: invalid arguments, or the weights leave no KV memory. The message
            names the model and GPU and suggests the smallest TP degree that fits.
    """
    _validate(tp, mem_util)
    if gpu.arena is not None:
        _check_arena_tp(gpu, tp)
        if arena_kv_blocks(model, gpu, mem_util) < 1:
            raise _arena_misfit(model, gpu, mem_util)
        return arena_kv_pages([model], gpu, mem_util) * arena_pages(gpu, model.head_dim)[2]
    free = _kv_free_bytes(model, gpu, tp, mem_util)
    if free > 0:
        return free
    hint_tp = next(
        (
            t
            for t in (2**i for i in range(11))
            if t > tp and t <= _HINT_MAX_TP and _kv_free_bytes(model, gpu, t, mem_util) > 0
        ),
        None,
    )
    hint = f"tensor parallelism (tp >= {hint_tp})" if hint_tp else "more GPUs"
    raise ConfigError(
        f"model {model.name} needs {model.weight_bytes / _GB:.1f} GB of weights but "
        f"{tp} x {gpu.name} at mem_util {mem_util:.2f} offers "
        f"{tp * _budget_per_gpu(gpu, mem_util) / _GB:.1f} GB; use a larger --gpu or {hint}"
    )


def kv_capacity_tokens(model: ModelSpec, gpu: GpuSpec, tp: int = 1, mem_util: float = 0.9) -> int:
    """Tokens of KV cache a TP group can hold.

    Args:
        model: the model.
        gpu: the GPU type.
        tp: tensor-parallel degree.
        mem_util: share of each GPU's memory the engine may use, in (0, 1].

    Returns:
        ``floor(kv_capacity_bytes / (kv_bytes_per_token * replication))`` where
        replication is ``ceil(tp / num_kv_heads)`` when ``tp > num_kv_heads``, else 1;
        for an emulated GPU, its KV blocks times its ``block_size``.

    Raises:
        ConfigError: as :func:`kv_capacity_bytes`.
    """
    if gpu.arena is not None:
        return _arena_blocks(model, gpu, tp, mem_util) * gpu.arena.block_size
    per_token = model.kv_bytes_per_token * kv_replication(model, tp)
    return kv_capacity_bytes(model, gpu, tp, mem_util) // per_token


def kv_capacity_blocks(
    model: ModelSpec,
    gpu: GpuSpec,
    tp: int = 1,
    mem_util: float = 0.9,
    block_size: int = 16,
) -> int:
    """Whole KV blocks of ``block_size`` tokens a TP group can hold.

    Args:
        model: the model.
        gpu: the GPU type.
        tp: tensor-parallel degree.
        mem_util: share of each GPU's memory the engine may use, in (0, 1].
        block_size: tokens per block (>= 1).

    Returns:
        ``kv_capacity_tokens // block_size``; for an emulated GPU, exactly the
        blocks its engine holds (``block_size`` must be the arena's).

    Raises:
        ConfigError: invalid ``block_size``, or as :func:`kv_capacity_bytes`.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
    if gpu.arena is not None:
        if block_size != gpu.arena.block_size:
            raise ConfigError(
                f"emulated GPU {gpu.name} has {gpu.arena.block_size}-token KV blocks, the run "
                f"uses {block_size} (cluster.block_size); name the GPU with -bs{block_size}"
            )
        return _arena_blocks(model, gpu, tp, mem_util)
    return kv_capacity_tokens(model, gpu, tp, mem_util) // block_size


def _arena_blocks(model: ModelSpec, gpu: GpuSpec, tp: int, mem_util: float) -> int:
    """KV blocks of an emulated GPU (> 0), or the errors of :func:`kv_capacity_bytes`."""
    _validate(tp, mem_util)
    _check_arena_tp(gpu, tp)
    blocks = arena_kv_blocks(model, gpu, mem_util)
    if blocks < 1:
        raise _arena_misfit(model, gpu, mem_util)
    return blocks
