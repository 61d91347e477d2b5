"""Measure the engine's prefill and decode iteration times for cost-model calibration.

The profiler drives :meth:`Engine.forward <fleetserve.runtime.engine.engine.Engine.forward>`
directly, the code ``Engine.step()`` runs for every model of an iteration, on
block tables it prepares itself through the engine's pool (``open``/``grow``),
and writes the profile CSV that :func:`fleetserve.costmodel.calibration.load_profile`
reads::

    model,gpu,tp,phase,batch_size,tokens,context_tokens,time_s
    tiny-llama-a,cpu,1,prefill,4,512,0,0.0112
    tiny-llama-a,cpu,1,decode,8,8,2048,0.0031

What one row measures:

* **prefill** (batch ``B``, prompt length ``P``): ``B`` whole prompts of ``P``
  tokens, nothing cached; ``tokens = B*P``, ``context_tokens = 0``.
* **decode** (batch ``B``, context length ``C``): ``B`` sequences whose first
  ``C - 1`` tokens are cached (set up by prefilling them once), each appending
  one token; ``tokens = B``, ``context_tokens = B*C`` (the context of every
  sequence including the appended token, as the CSV format defines it). A
  decode step rewrites the same KV slot, so it can be repeated without growing
  the cache; the batch sizes of one context length share one prefilled set of
  sequences.

The timed region is one forward plus the greedy argmax of its logits brought
to the host (the least an iteration must do to sample), bracketed by
``torch.cuda.synchronize()`` on CUDA; the scheduler's bookkeeping and per-request
sampling are not included. Each point runs ``warmup`` untimed iterations, then
``repeats`` timed ones, and records their median.

Points that cannot run are skipped with a logged warning and listed in
:attr:`ProfileResult.skipped`: a prompt or context longer than the model's
context window, or KV that does not fit in the engine's arena.

The ``gpu`` column is free text for :func:`load_profile`, but
:func:`~fleetserve.costmodel.calibration.calibrate` resolves it to a
:class:`~fleetserve.spec.types.GpuSpec` (e.g. with :func:`fleetserve.spec.get_gpu`),
so a profile meant for calibration must name a catalog GPU. :func:`detect_gpu_name`
maps a CUDA device to its catalog name; on the CPU the name defaults to ``cpu``
(loadable, but not a catalog GPU: the roofline has no CPU entry).
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from fleetserve.costmodel.calibration import ProfileRow, write_profile
from fleetserve.errors import ConfigError
from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.model import layer_numel
from fleetserve.runtime.engine.weights import WeightSource, load_weight_source
from fleetserve.spec.gpus import GPUS

__all__ = [
    "DEFAULT_GRID",
    "DTYPES",
    "QUICK_GRID",
    "ProfileGrid",
    "ProfileResult",
    "ProgressFn",
    "SkippedPoint",
    "build_engine",
    "default_arena_bytes",
    "detect_gpu_name",
    "profile_engine",
    "run_profile",
    "save_profile",
    "throughput_summary",
]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
"""``progress(done, total, label)``: called after every grid point (run or skipped)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""``--dtype`` names."""

_RID_BASE = 1 << 40  # block-table ids of the profiler's sequences (clear of request ids)
_PREFILL_CHUNK_TOKENS = 8192  # most tokens per forward when setting up decode KV
_ARENA_SLACK = 1.05


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    """The points to measure.

    Attributes:
        batch_sizes: sequences per iteration (prefill and decode).
        context_lengths: decode context per sequence, including the appended token.
        prompt_lengths: prefill prompt length per sequence.

        repeats: timed iterations per point (the median is recorded).
        warmup: untimed iterations per point before the timed ones.
        max_prefill_tokens: leave out prefill points of more tokens than this
            (batch x prompt): an engine capped at ``max_batch_tokens`` never
            runs them, and on a CPU a large model takes seconds per point.
            ``None``: no cap.

    The three lists are kept sorted and without duplicates.
    """

    batch_sizes: tuple[int, ...]
    context_lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    repeats: int = 5
    warmup: int = 1
    max_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "context_lengths", "prompt_lengths"):
            values = getattr(self, name)
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ConfigError(f"{name} must be integers >= 1, got {list(values)}")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if not self.batch_sizes:
            raise ConfigError("batch_sizes must not be empty")
        if not (self.context_lengths or self.prompt_lengths):
            raise ConfigError("give at least one context length or prompt length")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        cap = self.max_prefill_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"max_prefill_tokens must be an integer >= 1, got {cap!r}")
        if self.prompt_lengths and not self.prefill_points() and not self.context_lengths:
            raise ConfigError(
                f"every prefill point exceeds max_prefill_tokens={cap} and there is no decode point"
            )

    def prefill_points(self) -> list[tuple[int, int]]:
        """(prompt length, batch size) of every prefill point, in measuring order."""
        cap = self.max_prefill_tokens
        return [
            (p, b)
            for p in self.prompt_lengths
            for b in self.batch_sizes
            if cap is None or b * p <= cap
        ]

    @property
    def points(self) -> int:
        """Prefill plus decode points of the grid."""
        return len(self.prefill_points()) + len(self.batch_sizes) * len(self.context_lengths)


DEFAULT_GRID = ProfileGrid(
    batch_sizes=(1, 2, 4, 8, 16, 32),
    context_lengths=(64, 256, 1024),
    prompt_lengths=(32, 128, 512),
    repeats=5,
    warmup=1,
)
"""``fleetserve profile-engine`` without grid flags."""

QUICK_GRID = ProfileGrid(
    batch_sizes=(1, 2),
    context_lengths=(16, 40),
    prompt_lengths=(8, 24),
    repeats=2,
    warmup=1,
)
"""``--quick``: a few seconds on a CPU with a tiny model (tests, smoke runs)."""


@dataclass(frozen=True, slots=True)
class SkippedPoint:
    """A grid point that was not measured, and why."""

    phase: Literal["prefill", "decode"]
    batch_size: int
    length: int  # prompt length (prefill) or context length (decode)
    reason: str


@dataclass(slots=True)
class ProfileResult:
    """What :func:`profile_engine` measured."""

    rows: list[ProfileRow] = field(default_factory=list)
    skipped: list[SkippedPoint] = field(default_factory=list)


# --------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pages_per_seq(engine: Engine, model: str, tokens: int) -> int:
    pool = engine.pool
    return -(-tokens // pool.block_size) * pool.pages_per_token_block(model)


def detect_gpu_name(device: str | torch.device) -> str:
    """The GPU catalog name of ``device``, for the profile's ``gpu`` column.

    ``cpu`` for the CPU. For a CUDA device, the catalog entry whose family
    (``h100``, ``a100``, ``rtx4090`` ...) appears in the device name and whose
    memory is closest to the device's; when none matches, the device name
    lower-cased with hyphens (with a logged warning: calibration will not
    resolve it).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    props = torch.cuda.get_device_properties(dev)
    label = props.name.lower()
    found = []
    for name, spec in GPUS.items():
        family = name.split("-")[0].removeprefix("rtx")
        if re.search(rf"(?<![a-z0-9]){re.escape(family)}(?![0-9])", label):
            found.append((abs(spec.hbm_bytes - props.total_memory), name))
    if found:
        return min(found)[1]
    slug = re.sub(r"[^a-z0-9]+", "-", label).strip("-")
    logger.warning(
        "CUDA device %r is not in the GPU catalog; writing gpu=%r (give --gpu-name with a "
        "catalog name to calibrate from this profile)",
        props.name,
        slug,
    )
    return slug


def default_arena_bytes(
    source: WeightSource,
    grid: ProfileGrid,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> int:
    """An arena holding the model's layers and the KV of the grid's largest point.

    Capped at 80% of the device's free memory (CUDA) or half the available
    host memory (CPU), less the embedding and LM head; points that no longer
    fit are then skipped.
    """
    cfg = source.cfg
    s = cfg.spec
    esize = torch.empty((), dtype=dtype).element_size()
    page_elems = 2 * block_size * s.head_dim
    page_bytes = page_elems * esize
    weight_pages = s.num_layers * -(-layer_numel(cfg) // page_elems)
    bmax = max(grid.batch_sizes)
    longest = max((*grid.context_lengths, *grid.prompt_lengths))
    kv_pages = bmax * -(-longest // block_size) * s.num_layers * s.num_kv_heads
    want = int((weight_pages + kv_pages) * page_bytes * _ARENA_SLACK) + page_bytes
    outside = (2 - int(s.tied_embeddings)) * s.vocab_size * s.hidden_size * esize
    dev = torch.device(device)
    if dev.type == "cuda":
        free = int(torch.cuda.mem_get_info(dev)[0] * 0.8)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):  # pragma: no cover - not on Linux
            free = want + outside
    cap = max(free - outside, page_bytes)
    if want > cap:
        logger.warning(
            "an arena for the whole grid needs %.2f GiB, %.2f GiB are available; "
            "points that do not fit will be skipped",
            want / 2**30,
            cap / 2**30,
        )
    return min(want, cap)


def build_engine(
    model: str | Path | WeightSource,
    grid: ProfileGrid,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    arena_bytes: int | None = None,
    block_size: int = 16,
) -> Engine:
    """A one-model engine for profiling (arena from :func:`default_arena_bytes` if None).

    Raises:
        ConfigError: unknown model, CUDA unavailable, or an arena too small for
            the model's layers.
        InputError: a bad checkpoint folder.
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} requested but torch sees no CUDA device")
    source = model if isinstance(model, WeightSource) else load_weight_source(model)
    if arena_bytes is None:
        arena_bytes = default_arena_bytes(
            source, grid, block_size=block_size, dtype=dtype, device=device
        )
    s = source.cfg.spec
    esize = torch.empty((), dtype=dtype).element_size()
    page_elems = 2 * block_size * s.head_dim
    need = s.num_layers * -(-layer_numel(source.cfg) // page_elems) * page_elems * esize
    if arena_bytes < need:
        raise ConfigError(
            f"an arena of {arena_bytes / 2**20:.1f} MiB cannot hold the layers of "
            f"{source.cfg.name} ({need / 2**20:.1f} MiB) and any KV; give a larger arena"
        )
    return Engine([source], arena_bytes, block_size=block_size, device=device, dtype=dtype)


class _Timer:
    """Times ``engine.forward`` + greedy argmax on the host, median of repeats."""

    def __init__(self, engine: Engine, model: str, warmup: int, repeats: int) -> None:
        self.engine = engine
        self.model = model
        self.warmup = warmup
        self.repeats = repeats

    def once(
        self, rids: Sequence[int], starts: Sequence[int], lens: Sequence[int], ids: Sequence[int]
    ) -> float:
        dev = self.engine.device
        _sync(dev)
        t0 = time.perf_counter()
        logits = self.engine.forward(self.model, rids, starts, lens, ids)
        logits.argmax(-1).tolist()
        _sync(dev)
        return time.perf_counter() - t0

    def median(
        self, rids: Sequence[int], starts: Sequence[int], lens: Sequence[int], ids: Sequence[int]
    ) -> float:
        for _ in range(self.warmup):
            self.once(rids, starts, lens, ids)
        return statistics.median(self.once(rids, starts, lens, ids) for _ in range(self.repeats))


# --------------------------------------------------------------------------- profiling


def profile_engine(
    engine: Engine,
    grid: ProfileGrid,
    *,
    model: str | None = None,
    gpu_name: str | None = None,
    tp: int = 1,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> ProfileResult:
    """Measure prefill and decode iteration times of ``model`` on ``engine``.

    The engine must be idle: the profiler uses its pool for block tables of its
    own and frees them before returning.

    Args:
        engine: the engine (see :func:`build_engine`).
        grid: the points to measure.
        model: one of the engine's models (default: its only one).
        gpu_name: the ``gpu`` column (default: :func:`detect_gpu_name`).
        tp: the ``tp`` column (the engine runs one device: 1).
        seed: seed of the random prompt tokens.
        progress: called after every point.

    Returns:
        The rows (prefill points first, in grid order) and the skipped points.

    Raises:
        ConfigError: ``model`` is not on the engine, or the engine is busy.
    """
    if model is None:
        if len(engine.models) != 1:
            raise ConfigError(f"the engine hosts {sorted(engine.models)}; name the model")
        model = next(iter(engine.models))
    if model not in engine.models:
        raise ConfigError(f"unknown model {model!r}; this engine hosts {sorted(engine.models)}")
    if engine.has_work():
        raise ConfigError("profile an idle engine (it has queued or running requests)")
    gpu = (gpu_name if gpu_name is not None else detect_gpu_name(engine.device)).strip().lower()
    spec = engine.models[model].cfg.spec
    gen = torch.Generator().manual_seed(seed)
    timer = _Timer(engine, model, grid.warmup, grid.repeats)
    result = ProfileResult()
    done = 0
    total = grid.points

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    def skip(phase: Literal["prefill", "decode"], b: int, n: int, reason: str) -> None:
        what = "prompt" if phase == "prefill" else "context"
        logger.warning("skipping %s batch=%d %s=%d: %s", phase, b, what, n, reason)
        result.skipped.append(SkippedPoint(phase, b, n, reason))
        tick(f"{phase} b={b} {what}={n} skipped")

    def row(phase: Literal["prefill", "decode"], b: int, tokens: int, ctx: int, t: float) -> None:
        result.rows.append(ProfileRow(model, gpu, tp, phase, b, tokens, ctx, t))

    def tokens(n: int) -> list[int]:
        return torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist()

    pool = engine.pool
    batches = grid.batch_sizes
    # --- prefill: B whole prompts of P tokens
    for p, b in grid.prefill_points():
        if p > spec.max_context:
            skip("prefill", b, p, f"longer than the context window ({spec.max_context})")
            continue
        need = b * _pages_per_seq(engine, model, p)
        if need > pool.num_free:
            skip("prefill", b, p, f"needs {need} KV pages, the arena has {pool.num_free}")
            continue
        rids = [_RID_BASE + i for i in range(b)]
        try:
            for r in rids:
                pool.open(r, model)
                pool.grow(r, p)
            t = timer.median(rids, [0] * b, [p] * b, tokens(b * p))
        finally:
            for r in rids:
                if pool.has(r):
                    pool.free(r)
        row("prefill", b, b * p, 0, t)
        tick(f"prefill b={b} prompt={p}")
    # --- decode: B sequences at context C (C - 1 cached, one appended)
    for c in grid.context_lengths:
        if c > spec.max_context:
            for b in batches:
                skip("decode", b, c, f"longer than the context window ({spec.max_context})")
            continue
        per_seq = _pages_per_seq(engine, model, c)
        fit = [b for b in batches if b * per_seq <= pool.num_free]
        for b in batches:
            if b not in fit:
                skip("decode", b, c, f"needs {b * per_seq} KV pages, the arena has {pool.num_free}")
        if not fit:
            continue
        rids = [_RID_BASE + i for i in range(max(fit))]
        try:
            for r in rids:
                pool.open(r, model)
                pool.grow(r, c)
            _prefill_context(engine, model, rids, c - 1, tokens)
            last = tokens(len(rids))
            for b in fit:
                t = timer.median(rids[:b], [c - 1] * b, [1] * b, last[:b])
                row("decode", b, b, b * c, t)
                tick(f"decode b={b} context={c}")
        finally:
            for r in rids:
                if pool.has(r):
                    pool.free(r)
    return result


def _prefill_context(
    engine: Engine,
    model: str,
    rids: Sequence[int],
    n: int,
    tokens: Callable[[int], list[int]],
) -> None:
    """Fill the first ``n`` KV slots of every sequence, a few sequences per forward."""
    if n == 0:
        return
    per = max(1, _PREFILL_CHUNK_TOKENS // n)
    for i in range(0, len(rids), per):
        group = list(rids[i : i + per])
        engine.forward(model, group, [0] * len(group), [n] * len(group), tokens(n * len(group)))
    _sync(engine.device)


def save_profile(out: str | Path, result: ProfileResult) -> Path:
    """Write ``result``'s rows as a profile CSV (parent folders created).

    Raises:
        ConfigError: no row was measured (every point was skipped).
    """
    if not result.rows:
        first = result.skipped[0].reason if result.skipped else "empty grid"
        raise ConfigError(
            f"no grid point fits (all {len(result.skipped)} skipped, e.g. {first}); "
            "give a larger arena or smaller sizes"
        )
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(path, result.rows)
    logger.info("wrote %d profile rows to %s", len(result.rows), path)
    return path


def run_profile(
    model: str | Path,
    out: str | Path,
    grid: ProfileGrid,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    arena_bytes: int | None = None,
    block_size: int = 16,
    gpu_name: str | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> ProfileResult:
    """Build an engine for ``model``, profile it over ``grid`` and write the CSV to ``out``.

    Raises:
        ConfigError: see :func:`build_engine` and :func:`save_profile`.
        InputError: a bad checkpoint folder.
    """
    engine = build_engine(
        model, grid, device=device, dtype=dtype, arena_bytes=arena_bytes, block_size=block_size
    )
    result = profile_engine(engine, grid, gpu_name=gpu_name, seed=seed, progress=progress)
    save_profile(out, result)
    return result


def throughput_summary(rows: Sequence[ProfileRow]) -> dict[str, float]:
    """Peak tokens/s per phase present in ``rows`` (for a one-line CLI summary)."""
    out: dict[str, float] = {}
    for phase in ("prefill", "decode"):
        rates = [r.tokens / r.time_s for r in rows if r.phase == phase]
        if rates:
            out[phase] = max(rates)
    return out
