r"""Iteration time of a pipelined group of instances (KunServe's cooperative execution).

A *buddy group* of ``k`` instances runs one model as a ``k``-stage pipeline:
stage ``s`` holds a contiguous range of ``n_s`` of the model's ``L`` layers
(fraction ``f_s = n_s / L``). A batch is split into ``m = min(k, parts)``
micro-batches (requests for decode, whole prompts for prefill) that flow
through the stages one after another, so up to ``k`` of them are in flight.

Per micro-batch ``j`` the single-instance cost model gives its full-model
time ``t_j = o + c_j`` (``o`` = the per-iteration fixed overhead, ``c_j`` =
everything that scales with the layers: compute, weight and KV streaming,
tensor-parallel all-reduces). One stage's share is ``o + f_s c_j``: each
stage launches its own kernels (the overhead is paid per stage), and
everything else is split by layers. The lm_head and embedding are split with
the layers too — a simplification (they are ~10 % of a 14B model's work).
Between stages a micro-batch sends its activations, ``tokens x hidden x
dtype_bytes`` bytes, over the link (``a_j = latency + bytes / bandwidth``).

One *round* (every micro-batch advancing by one iteration) takes::

    latency_j = sum_s (o + f_s c_j) + (k - 1) a_j + extra_j
              = k o + c_j + (k - 1) a_j + extra_j        one micro-batch end to end
    busy_s    = sum_j (o + f_s c_j)                      stage s's GPU per round
    round     = max( max_j latency_j , max_s busy_s )

The first term is the critical path of one micro-batch (each one's next
iteration needs its previous output token); the second is the busiest GPU.
With ``k`` equal micro-batches the GPUs are busy all round (``busy ~
latency``); with a single micro-batch (a small batch, or one long prompt)
``k - 1`` stages idle while one works — the pipeline *bubble* — and the round
is the micro-batch's full latency, slower than a replica by ``(k - 1)(o +
a)``. For ``k = 1`` the round is exactly the replica's iteration time.
``extra_j`` is time a micro-batch spends on anything else on its critical
path (remote-attention round trips of KunServe's live KV exchange).

*Remote attention moves work between GPUs.* While a request's KV for some
layers still lies on another GPU (KunServe's live exchange and live
restore), that GPU runs the request's attention for those layers: it reads
that KV, and the GPU that owns the layers does not. ``moved_kv[s]`` counts
these reads per stage, in KV tokens of the whole model (token-layers divided
by ``L``): positive for the reads stage ``s`` runs for layers it does not
own, negative for its own layers' reads that run elsewhere. Each stage's
busy time changes by :meth:`~fleetserve.costmodel.roofline.InstanceCost.kv_read_s`
of its count (never below 0)::

    busy_s = sum_j (o + f_s c_j) + kv_read(moved_kv[s])

Within one pipeline the counts sum to 0 (the work moves, it is not added),
so a micro-batch's critical path is unchanged; what changes is the busiest
stage: right after a merge each source still reads its own victims' KV for
every layer. A replica (``k = 1``) reads ``ctx_total + moved_kv[0]`` tokens
(through the roofline, like any context). A remote read runs on the
source GPU between its own kernels, at its full HBM bandwidth (attention
over a long context is memory-bound); its time counts from the next round
the source starts, not within a round already in flight.

Micro-batching choices: decode requests are split into ``m`` near-equal
groups, the KV context divided in proportion; prompts (never split, no
chunked prefill) go to ``m`` bins by longest-processing-time first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetserve.costmodel.roofline import InstanceCost, tokens_within
from fleetserve.costmodel.transfer import Link, transfer_time
from fleetserve.errors import ConfigError

__all__ = ["PipelineCost", "StagedCost"]


class PipelineCost:
    """Round times of one pipelined group (``k`` stages) of identical instances.

    Args:
        cost: the single-instance cost model (model, GPU, tensor degree).
        stage_layers: layers each stage holds, in pipeline order (sum = model layers).
        link: the link activations cross between consecutive stages.
    """

    __slots__ = (
        "_frac",
        "_frac_max",
        "_hop_bytes",
        "_hops",
        "cost",
        "k",
        "link",
        "overhead_s",
        "stage_layers",
    )

    def __init__(self, cost: InstanceCost, stage_layers: Sequence[int], link: Link) -> None:
        total = cost.model.num_layers
        layers = [int(n) for n in stage_layers]
        if not layers or any(n < 1 for n in layers) or sum(layers) != total:
            raise ConfigError(
                f"pipeline stages must hold >= 1 layer each and {total} in all, got {layers}"
            )
        self.cost = cost
        self.stage_layers = tuple(layers)
        self.k = len(layers)
        self.link = link
        self.overhead_s = cost.params.overhead_s
        self._frac = tuple(n / total for n in layers)
        self._frac_max = max(self._frac)  # the busiest stage's fraction of the layers
        self._hop_bytes = cost.model.hidden_size * cost.model.dtype_bytes
        self._hops: dict[int, float] = {}  # hop_time by tokens (a decode round's sizes)

    def hop_time(self, tokens: int) -> float:
        """One activation transfer of ``tokens`` tokens between two stages."""
        t = self._hops.get(tokens)
        if t is None:
            t = transfer_time(tokens * self._hop_bytes, self.link) if self.k > 1 else 0.0
            if len(self._hops) < 4096:  # (decode batch sizes; prompts' counts vary more)
                self._hops[tokens] = t
        return t

    def _parts(
        self, full: Sequence[float], tokens: Sequence[int], extra: Sequence[float]
    ) -> tuple[float, float]:
        """``(max_j latency_j, max_s busy_s)`` of one round (module docstring)."""
        o = self.overhead_s
        k = self.k
        if k == 1:
            t = max(t + e for t, e in zip(full, extra, strict=True))
            return t, t
        cores = [max(t - o, 0.0) for t in full]
        lat = max(
            k * o + c + (k - 1) * self.hop_time(n) + e
            for c, n, e in zip(cores, tokens, extra, strict=True)
        )
        busy = len(cores) * o + self._frac_max * sum(cores)
        return lat, busy

    def _round(self, full: Sequence[float], tokens: Sequence[int], extra: Sequence[float]) -> float:
        lat, busy = self._parts(full, tokens, extra)
        return max(lat, busy)

    def decode_round(
        self,
        batch: int,
        ctx_total: float,
        extra_s: float = 0.0,
        share: float = 1.0,
        moved_kv: Sequence[float] | None = None,
    ) -> tuple[float, float]:
        """One decode round alone: ``(round time, busiest stage's busy time)``
        (arguments as :meth:`decode_time`, which is its first value;
        ``moved_kv``, one count per stage: remote attention, see the module
        docstring).

        Their ratio is the share of the busiest stage the round keeps busy,
        which :class:`~fleetserve.sim.contention.BandwidthSharing` divides
        among the jobs a pipelined executor runs at once (KunServe's
        simulator: prefill micro-batches beside the decode round).
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if moved_kv is not None and len(moved_kv) != self.k:
            raise ValueError(f"moved_kv needs one count per stage ({self.k}), got {len(moved_kv)}")
        if self.k == 1:
            if moved_kv is not None:
                ctx_total = max(ctx_total + moved_kv[0], 0.0)
            t = self.cost.decode_time_scalar(batch, ctx_total, share) + extra_s
            return t, t
        m = min(self.k, batch)
        base, rem = divmod(batch, m)
        # the micro-batches have two sizes at most (``rem`` of ``base + 1``
        # first, then ``base``): the module docstring's round, each size once
        cost, o, k = self.cost.decode_time_scalar, self.overhead_s, self.k
        sizes = ((base + 1, rem), (base, m - rem)) if rem else ((base, m),)
        lat = 0.0
        sum_c = 0.0
        first = True
        for b, count in sizes:
            c = max(cost(b, ctx_total * b / batch, share) - o, 0.0)
            sum_c += count * c
            path = k * o + c + (k - 1) * self.hop_time(b)
            lat = max(lat, path + extra_s if first else path)
            first = False
        if moved_kv is None:
            busy = m * o + self._frac_max * sum_c
        else:
            read = self.cost.kv_read_s
            busy = m * o + max(
                max(f * sum_c + read(batch, x), 0.0)
                for f, x in zip(self._frac, moved_kv, strict=True)
            )
        return max(lat, busy), busy

    def prefill_micro_batch(self, prompt_lens: Sequence[int]) -> tuple[float, float]:
        """Whole prompts as *one* micro-batch through every stage, alone:
        ``(latency, busiest stage's busy time)``.

        This is a virtual engine's prefill step in vLLM's pipeline-parallel
        engine: the micro-batch crosses the ``k`` stages one after another
        (latency ``k o + c + (k - 1) a``), keeping each stage busy for only
        its ``o + f_s c``, so the other stages are free for other micro-batches
        meanwhile (decode micro-batches, other prompts).
        """
        lens = [int(x) for x in prompt_lens]
        if not lens:
            return 0.0, 0.0
        full = [self.cost.prefill_time(lens)]
        return self._parts(full, [sum(lens)], [0.0])

    def decode_time(
        self, batch: int, ctx_total: float, extra_s: float = 0.0, share: float = 1.0
    ) -> float:
        """One decode round of ``batch`` requests reading ``ctx_total`` KV tokens in all.

        ``extra_s`` is added to the critical path of the first micro-batch
        (KunServe's remote attention, see the module docstring); ``share``
        is the fraction of each stage's compute units the round runs on
        (MuxServe's spatial sharing, as
        :meth:`~fleetserve.costmodel.roofline.InstanceCost.decode_time_scalar`).
        """
        return self.decode_round(batch, ctx_total, extra_s, share)[0]

    def prefill_time(self, prompt_lens: Sequence[int], share: float = 1.0) -> float:
        """One prefill round over whole prompts (micro-batches of whole prompts)
        on a ``share`` of each stage's compute units."""
        n = len(prompt_lens)
        if n == 0:
            return 0.0
        if self.k == 1:
            return self.cost.prefill_time(prompt_lens, share)
        m = min(self.k, n)
        bins: list[list[int]] = [[] for _ in range(m)]
        loads = [0] * m
        for length in sorted((int(x) for x in prompt_lens), reverse=True):
            j = loads.index(min(loads))
            bins[j].append(length)
            loads[j] += length
        full = [self.cost.prefill_time(b, share) for b in bins]
        return self._round(full, loads, [0.0] * m)


class StagedCost:
    """A pipelined group's job times with the surface of
    :class:`~fleetserve.costmodel.roofline.InstanceCost` a sharing group uses
    (:class:`~fleetserve.sim.group.SharingGroup`): one service's job on a
    ``k``-stage pipeline is one round of :class:`PipelineCost` (its
    micro-batches in flight together), so a group that dropped layers
    schedules exactly like one that did not.

    Args:
        pipeline: the round times of the service's pipeline.
    """

    __slots__ = ("model", "pipeline")

    def __init__(self, pipeline: PipelineCost) -> None:
        self.pipeline = pipeline
        self.model = pipeline.cost.model

    @property
    def stages(self) -> int:
        """The pipeline's stages ``k`` (its virtual engines)."""
        return self.pipeline.k

    def prefill_lane(self, prompt_lens: Sequence[int]) -> tuple[float, float]:
        """Whole prompts as one micro-batch through every stage, beside the other
        jobs: ``(latency, busiest stage's busy time)``
        (:meth:`PipelineCost.prefill_micro_batch`)."""
        return self.pipeline.prefill_micro_batch([int(x) for x in prompt_lens])

    def decode_round(self, batch: int, ctx_total: float) -> tuple[float, float]:
        """One decode round: ``(round time, busiest stage's busy time)``
        (:meth:`PipelineCost.decode_round`)."""
        return self.pipeline.decode_round(batch, float(ctx_total))

    def prefill_time(self, prompt_lens: Sequence[int], share: float = 1.0) -> float:
        """One prefill round over whole prompts."""
        return self.pipeline.prefill_time([int(x) for x in prompt_lens], share)

    def decode_time_scalar(self, batch: int, ctx_total: float, share: float = 1.0) -> float:
        """One decode round of ``batch`` requests reading ``ctx_total`` tokens."""
        return self.pipeline.decode_time(batch, float(ctx_total), 0.0, share)

    def decode_time(
        self, batch: int, ctx_total: npt.NDArray[np.number[Any]]
    ) -> npt.NDArray[np.float64]:
        """:meth:`decode_time_scalar` elementwise."""
        flat = np.asarray(ctx_total, dtype=np.float64)
        out = [self.decode_time_scalar(batch, float(x)) for x in flat.ravel()]
        return np.asarray(out, dtype=np.float64).reshape(flat.shape)

    def prefill_memory_s(self, prompt_lens: Sequence[int]) -> float:
        """0: a pipelined group's rounds are not re-timed for memory contention
        (its stages are on different GPUs; no stack runs a spatial scheduler on
        a pipelined group)."""
        return 0.0

    def decode_memory_s(self, batch: int, ctx_total: float) -> float:
        """0 (see :meth:`prefill_memory_s`)."""
        return 0.0

    def re_prefill_time(self, tokens: int) -> float:
        """Seconds to rebuild ``tokens`` tokens of KV by one prefill round."""
        return self.prefill_time([tokens]) if tokens > 0 else 0.0

    def re_prefill_tokens(self, budget_s: float) -> int:
        """The most tokens one re-prefill round rebuilds within ``budget_s``
        (as :meth:`InstanceCost.re_prefill_tokens`)."""
        return tokens_within(self.re_prefill_time, budget_s)
