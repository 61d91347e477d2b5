"""Discrete-event simulation of a replicated model under memory throttling (KunServe §4).

``N`` instances of one model (each on ``tp`` GPUs) serve one request stream.
How the deployment reacts when KV memory runs short is the *stack*'s
``burst`` (:class:`~fleetserve.policy.pressure.KunSettings`): queue (vLLM),
drop KV and recompute, swap KV to host, Llumnix live migration, a static pipeline, or
KunServe's parameter-centric management. All of them share this engine, the
cost model and the memory accounting, so they differ only in that reaction.

Executors. An *executor* is what runs batches: a replica (one instance,
every layer) or a buddy group of ``k`` instances running as a ``k``-stage
pipeline (:class:`~fleetserve.costmodel.pipeline.PipelineCost`). Each
instance belongs to exactly one executor. Since session 30 an executor is a
one-service sharing group (:class:`~fleetserve.sim.group.SharingGroup`, the
instance type of every world) with a staged KV layout over its members; the
group runs what follows, and this module keeps what the KunServe world adds
beside it (layer ranges, KV pieces, the exchange, drops and restores). An
executor schedules like a vLLM instance: FCFS admission while the prompts
fit (prefill-only iterations), otherwise a decode iteration of every running
request; when the next decode
token does not fit, the newest running request is preempted (recomputed
later; ``kv-swap`` swaps it to host instead). One choice differs from vLLM
v0's prefill-first order: after a prefill iteration, a decode iteration of
the running requests comes next when there are any (prefill and decode
alternate under a long queue). Without it, the flood of admissions right
after memory frees (a drop, a burst draining) would stall every running
request for many prefill iterations in a row — chunked-prefill engines
(Sarathi-Serve, vLLM v1) bound that stall too. It applies to every stack
(``kunserve.alternate: false`` turns it off: then a replica runs ``vllm``
as the single-model world's instance does, request for request while no
memory runs short; under pressure the two differ in granularity, tokens
here against 16-token blocks there; ``tests/test_one_model_worlds.py``).
Batch limits: ``max_num_seqs`` per stage and ``max_batched_tokens`` per
prefill micro-batch.

Pipelines. A ``k``-stage executor runs like vLLM's pipeline-parallel engine,
whose ``k`` virtual engines each keep one micro-batch in flight: prompts are
prefilled in *lanes* (up to ``k`` prefill micro-batches in flight, each one
batch of admitted prompts crossing the stages one after another, started at
a decode round's boundary as a virtual engine takes a prompt at its own:
:meth:`~fleetserve.costmodel.pipeline.PipelineCost.prefill_micro_batch`)
*beside* the decode round of the running requests
(:meth:`~fleetserve.costmodel.pipeline.PipelineCost.decode_round`), which is
not stalled by them. The jobs in flight share the stages' time: each alone
keeps the busiest stage busy for a fraction ``busy / latency`` of its time
(a prompt crossing 8 stages about 1/8), and while they ask for more than
the whole stage the time is divided max-min fairly by weight
(:class:`~fleetserve.sim.contention.BandwidthSharing`, re-timed at each
instant some start and end): a lane weighs one virtual engine, the decode round the
``k - lanes`` engines left to decode (every engine prefilling: the decodes
all but wait, as vLLM's prefill-first engines do). So ``k`` lanes of long
prompts fill the pipeline as ``k`` replicas would, and a lone prompt no
longer idles ``k - 1`` stages for its whole prefill. Prefilled requests
join the running batch at the decode round's next boundary. Replicas
(``k = 1``) alternate as described above.
Before this model (session 15), a pipeline's prefill was a round of its
own, stalling every decode and leaving ``k - 1`` stages idle when one
prompt was admitted; on a long-prompt trace (Mooncake, 12k-token prompts,
compute-bound) that cut the ``kunserve`` stack's throughput 5.5x below
``vllm``'s. The simplification: a stage's time is shared as a fluid, not
micro-batch by micro-batch in arrival order.

Memory (per instance, in token-layers; the books are
:class:`~fleetserve.sim.staged_layout.StageMemory`, and each executor counts
its requests' KV through its own KV layout over its members,
:class:`~fleetserve.sim.staged_layout.StagedLayout`)::

    capacity_i = (hbm x mem_util x tp - weights_i) / kv_bytes_per_token_per_layer
    weights_i  = non-layer weights + layers held x layer bytes (+ a reload in flight)
    used_i     = layers_i x T_e + corr_i

``T_e`` is the KV tokens of executor ``e``'s requests (running, prefilling,
stalled, reserved for transfers in); a settled request's KV is spread over
the stages in proportion to their layers. ``corr_i`` corrects for KV that is
not where the proportional rule puts it: a piece of a victim's KV still on
its source (``+layers x tokens`` on the source, ``-`` on the destination until
the destination reserves it when the copy starts). Nothing is ever
over-committed: admission and decode growth check every stage, a copy
starts only when its destination has room, and a drop only frees memory.

KunServe (``pressure="kunserve"``), every ``monitor_interval_s`` (a tick
whose decisions provably change nothing skips them, and the ticks before the
next event are then handled at once: :meth:`KunSimulator._skip_ticks`). The
*decisions* (steps 1, 2 and when to start 5) are
:class:`~fleetserve.policy.kunserve.KunServePolicy`'s, the pure policy the
runtime's controller calls too; the simulator shows it its executors
(:class:`Executor` implements
:class:`~fleetserve.policy.kunserve.KunExecutorView`) and applies the
:class:`~fleetserve.policy.actions.DropLayers`,
:class:`~fleetserve.policy.actions.ActivateSpare` and
:class:`~fleetserve.policy.actions.Restore` actions it returns:

1. the policy's monitor samples each executor's demand (KV in use + the
   head-of-line queued request's prompt, as Llumnix counts it) and
   capacity, and flags those predicted to run out within ``horizon_s``;
2. if any is flagged, the planner (Algorithm 1, or the memory-greedy
   variant) merges groups until the parameter memory freed covers what the
   flagged executors need (the predicted shortfall, or everything their
   queues ask for, whichever is larger); if it cannot, a spare instance is
   started (weights from host memory). The simulator applies each new
   group: executors to merge stop starting iterations, and once all are at
   an iteration boundary they become one pipeline: each instance keeps its
   stage's layers and drops the rest (the bytes join its KV pool at once),
   the queues are merged in arrival order;
3. *victims* (requests that were decoding) have KV for layers now owned by
   another stage; each missing piece crosses its source's link (one piece
   at a time per link, victims in arrival order). ``live``: victims keep
   decoding, with attention for layers not yet moved run on the source
   (remote attention: per such layer, the query and new K/V go out and the
   attention output comes back, on the critical path of the iteration; the
   source GPU reads that KV instead of the layers' owner, so the work moves
   between the stages' busy times, see :meth:`KunSimulator._moved_kv`),
   and KV chunks yield the link to activations. The chunk size is what fits
   the gap between two activation transfers (``bandwidth x gap``, from the
   cost model's round time: the profiled gap of the paper), so the chunks
   fill every gap and the copy runs at ``bandwidth x (1 - activation
   duty)``, re-timed at every iteration; the mean chunk size is reported.
   ``blocking``: victims stall until all their pieces have arrived, and the
   copy runs at full bandwidth (the pipeline's own activations are not
   delayed by it: a simplification in blocking's favour);
4. the dispatcher sends a request to the replica with the most available
   memory that has room for its prompt, else to the executor (group or
   replica) with the most available memory (Worst-Fit, Llumnix's load
   balancing). While any group exists it caps each executor's batch at its
   maximum batch (the largest batch whose decode iteration is at most
   ``max_batch_slowdown`` x the batch-1 one) and moves queued requests beyond
   that cap to executors with spare slots and memory;
5. a group whose demand has stayed at most ``restore_threshold`` of the KV
   capacity its members would have as replicas for ``restore_min_s`` (and
   is not predicted to throttle) stops taking requests (the dispatcher sends
   them elsewhere, or to its queue when every executor is restoring) and
   reloads the dropped
   layers (host PCIe or a peer's link; each instance once it has the room).
   Once reloaded it admits nothing new. Then, with live restore, it splits
   into replicas at its next boundary: its running requests are spread over
   the members (largest KV first, to the member with most room; if they do
   not fit yet it keeps pipelining, draining, and tries again), their
   missing KV moves live like a live exchange, and its queue is dispatched
   again. Without live restore, the group keeps pipelining until its
   requests are done and splits then.

Victims' decode gaps (time between consecutive tokens) are tracked from the
drop until their KV has fully arrived; ``extra["kunserve"]["victims"]``
summarizes them, per request in ``victim_records``.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fleetserve.cluster.state import ClusterState, SeqView
from fleetserve.costmodel import CostModel
from fleetserve.costmodel.pipeline import PipelineCost, StagedCost
from fleetserve.costmodel.transfer import (
    NETWORK_LATENCY_S,
    Link,
    host_link,
    intra_node_link,
    transfer_time,
)
from fleetserve.errors import ConfigError
from fleetserve.metrics.records import (
    GpuInterval,
    MigrationRecord,
    RequestRecord,
    RunResult,
    TimeSeries,
)
from fleetserve.policy.actions import (
    ActivateSpare,
    Dispatch,
    DropLayers,
    KunAction,
    Migrate,
    Reject,
    Restore,
)
from fleetserve.policy.base import DISPATCH
from fleetserve.policy.batching import instance_batching
from fleetserve.policy.kunserve import (
    ExecutorLoad,
    dispatch_candidates,
    max_batch,
    rebalance,
    rebalance_may_move,
    split_layers,
)
from fleetserve.policy.llumnix import Llumnix
from fleetserve.policy.pressure import KunSettings, PressureReaction
from fleetserve.policy.sharing import BATCHING, DECODE
from fleetserve.sim.admission import context_note, context_reason
from fleetserve.sim.batch import SimClock
from fleetserve.sim.events import ATTACH, EPOCH, ITER_END, SAMPLE, TRANSFER, Event
from fleetserve.sim.group import SharingGroup
from fleetserve.sim.kernel import Kernel, ProgressFn
from fleetserve.sim.kun_parts import (
    Channel,
    Piece,
    Transfer,
    activation_gap_share,
    remote_attention_s,
)
from fleetserve.sim.seq import PREFILLING, RUNNING, STALLED, TRANSIT, WAITING, Seq
from fleetserve.sim.staged_layout import StagedLayout, StageMemory
from fleetserve.spec import GpuSpec, get_gpu, get_model
from fleetserve.workload.request import Request, check_run_order

logger = logging.getLogger(__name__)

VIEW_BLOCK = 16  # block size of the InstanceView the shared policies read (vLLM's 16)


class Executor:
    """A replica or a pipelined buddy group: a one-service sharing group
    (:class:`~fleetserve.sim.group.SharingGroup`) over its members, and what
    the KunServe world keeps beside it (implements ``InstanceView`` and
    :class:`~fleetserve.policy.kunserve.KunExecutorView`).

    The group runs the batches: admission in queue order (the ``alternate``
    rule on a replica), prefill lanes beside the decode round on a pipeline,
    the memory-pressure reactions (:class:`PressureReaction`), one iteration
    per job (no macro-steps: the monitor and the KV exchange read every
    iteration). Its KV layout is a
    :class:`~fleetserve.sim.staged_layout.StagedLayout` over the members'
    memory, its job times the pipeline's (:class:`StagedCost`), a decode
    round's through :meth:`KunSimulator._round_cost` (remote attention).

    Args:
        eid: executor id (never reused; its group's id).
        members: instance ids, in stage order.
        stage_layers: ``(lo, hi)`` layer range of each member's stage.
        pcost: round times of this pipeline.
        sim: the simulator (for the memory of its members).
        now: when it starts.
    """

    def __init__(
        self,
        eid: int,
        members: tuple[int, ...],
        stage_layers: Sequence[tuple[int, int]],
        pcost: PipelineCost,
        sim: KunSimulator,
        now: float,
    ) -> None:
        self.id = eid
        self.members = members
        self.ranges = dict(zip(members, stage_layers, strict=True))
        self.layers = {m: hi - lo for m, (lo, hi) in self.ranges.items()}
        self.pcost = pcost
        self.sim = sim
        self.created_s = now
        svc = sim.model.name
        self.svc = svc
        self.layout = StagedLayout(sim.mem, self.layers, svc, sim.model)
        sched = BATCHING.get(sim.batching_name)(**sim.batching_params)
        sched.setup({}, self.layout.capacity_bytes)
        tp = sim.tp
        g = SharingGroup(
            eid,
            tuple(x for m in members for x in range(m * tp, (m + 1) * tp)),
            tp,
            {svc: StagedCost(pcost)},
            self.layout,
            sched,
            max_num_seqs=sim.max_num_seqs * len(members),
            max_batched_tokens=sim.max_batched_tokens,
            macro_steps=False,
            watermark=sim.watermark,
            bound=True,
            clock=sim.clock,
            alternate=sim.alternate,
            pressure=sim.reaction,
        )
        g.host = self  # what a request's ``inst`` names
        g.round_cost = self._round_cost
        g.on_evicted = sim._on_evicted
        g.on_swap = self._on_swap
        self.group = g
        self.batch = g._bound[svc]
        # the running requests (bound to the batch's step counter); the dict
        # is the batch's own, never rebound
        self.running: dict[int, Seq] = self.batch.running
        self.waiting = g.waiting[svc]
        self.stalled = g.stalled[svc]
        self.swapped = g.swapped[svc]
        self.pending_attach = g.pending[svc]
        self.prefilled = g._joining[svc]  # prefilled during a decode round; join after it
        self.accepting = True
        self.restoring = False
        self.reload_left: set[int] = set()
        # pieces keyed in insertion order (not a set: iteration must not depend on
        # object addresses, or float sums and event order vary between builds)
        self.live_pieces: dict[Piece, None] = {}
        self.tracked: dict[int, Seq] = {}
        self.mig_ready: list[Seq] = []
        self.max_batch = sim.max_num_seqs
        self.last_end = now
        mem = sim.mem
        self._replica_kv = tuple(mem.cap_b[m] - mem.full_w for m in members)

    def _round_cost(self, svc: str, batch: int, ctx: int) -> tuple[float, float]:
        return self.sim._round_cost(self, batch, ctx)

    def _on_swap(self, s: Seq, out: bool) -> None:
        self.sim._start_swap(self, s, out)

    # ---------------------------------------------------------------- memory
    def T(self) -> int:
        """KV tokens this executor's requests hold (see the module docstring)."""
        return self.layout.tokens()

    def room_tokens(self) -> int:
        """KV tokens every stage can still take (``min_m avail_tl(m) // n_m``)."""
        return self.layout.room_tokens()

    def capacity_tokens(self) -> int:
        """KV tokens the executor holds when full (all settled)."""
        return self.layout.capacity_tokens()

    def waiting_tokens(self) -> int:
        return self.group.queued_blocks[self.svc]

    @property
    def k(self) -> int:
        return len(self.members)

    @property
    def frozen(self) -> bool:
        """Starts no iteration (merging into a group, or splitting)."""
        return self.group.state == "merging"

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self.group.state = "merging" if value else "live"

    @property
    def at_boundary(self) -> bool:
        """No iteration (decode round or prefill micro-batch) in flight."""
        return not self.group.jobs

    @property
    def decoding(self) -> bool:
        """A decode iteration (round) is in flight."""
        return self.group.busy(self.svc, DECODE)

    @property
    def prefill(self) -> list[Seq]:
        """Requests in a prefill iteration (every lane's, on a pipeline)."""
        return self.group.prefilling(self.svc)

    @property
    def stable(self) -> bool:
        """No merge, restore, KV piece, swap or migration in progress."""
        g = self.group
        return (
            not self.frozen
            and not self.restoring
            and not self.live_pieces
            and not self.stalled
            and not self.pending_attach
            and not g.swap_in_busy
            and not g.swap_out_busy
            and (
                self.sim.llumnix is None
                or not any(s.mig is not None for s in self.running.values())
            )
        )

    # -------------------------------------------------------- InstanceView
    @property
    def model(self) -> str:
        return self.svc

    @property
    def gpus(self) -> tuple[int, ...]:
        return self.group.gpus

    @property
    def tp(self) -> int:
        return self.sim.tp

    @property
    def block_size(self) -> int:
        return VIEW_BLOCK

    @property
    def total_blocks(self) -> int:
        return self.capacity_tokens() // VIEW_BLOCK

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def free_blocks(self) -> int:
        return max(0, self.room_tokens()) // VIEW_BLOCK

    @property
    def reserved_blocks(self) -> int:
        return -(-self.waiting_tokens() // VIEW_BLOCK)

    @property
    def available_blocks(self) -> int:
        wm = int(self.sim.watermark * self.capacity_tokens())
        return (self.room_tokens() - self.waiting_tokens() - wm) // VIEW_BLOCK

    @property
    def num_running(self) -> int:
        g, svc = self.group, self.svc
        return len(g.running[svc]) + len(self.stalled) + g.num_prefilling(svc)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def steps(self) -> int:
        """Decode rounds completed."""
        return self.batch.steps

    @property
    def decode_steps(self) -> int:
        return self.batch.steps

    @property
    def idle(self) -> bool:
        return not self.decoding and not self.waiting and not self.num_running

    def seqs(self) -> list[SeqView]:
        return [*self.running.values(), *self.prefill, *self.prefilled, *self.waiting]

    # ---------------------------------------------------- KunExecutorView
    @property
    def key(self) -> int:
        return self.id

    @property
    def held_layers(self) -> tuple[tuple[int, int], ...]:
        held = self.sim.mem.held
        return tuple(held[m] for m in self.members)

    @property
    def replica_kv_bytes(self) -> tuple[int, ...]:
        return self._replica_kv

    @property
    def kv_used_tokens(self) -> int:
        return self.T()

    @property
    def kv_head_tokens(self) -> int:
        return self.waiting[0].prefill_tokens if self.waiting else 0

    @property
    def kv_queued_tokens(self) -> int:
        return self.waiting_tokens()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.capacity_tokens()

    # -------------------------------------------------------------- requests
    def kv_steps(self) -> int:
        """A bound request holds ``base + kv_steps()`` KV tokens."""
        return self.batch.kv_steps()


class _Merge:
    """Executors frozen to become one buddy group (members in stage order)."""

    __slots__ = ("members", "olds", "ranges")

    def __init__(self, olds: list[Executor], stages: list[tuple[int, tuple[int, int]]]) -> None:
        self.olds = olds
        self.members = tuple(m for m, _ in stages)
        self.ranges = [r for _, r in stages]


class _Migration:
    """A Llumnix live migration: pre-copy of ``tokens`` while running at the source."""

    __slots__ = ("dst", "ready", "src", "tokens")

    def __init__(self, src: Executor, dst: Executor, tokens: int) -> None:
        self.src = src
        self.dst = dst
        self.tokens = tokens
        self.ready = False


class KunSimulator:
    """Simulates ``requests`` on ``instances`` replicas of ``model`` under ``settings``.

    Args:
        requests: the workload (one model), sorted by arrival, ids ``0..n-1``.
        model: catalog name.
        gpu: catalog name, or the GPU itself (the parity report's emulated
            GPU whose memory counts the weights the engine keeps outside its
            arena).
        instances: instances (replicas) in the cluster.
        tp: GPUs per instance (tensor parallel).
        spare_instances: instances that are off at the start; KunServe's
            fallback activates one (weights loaded from host memory over
            PCIe) when dropping layers cannot free what is needed.
        settings: the stack's behaviour (:class:`KunSettings`).
        stack: the stack's name (for results).
        batching: the batching policy (registry name): whom each executor
            admits from its queue, and whom it preempts, swaps out or drops
            the KV of when memory runs out.
        dispatch: the dispatch policy (registry name) that picks among
            KunServe's candidate executors; Worst-Fit is Llumnix's, which the
            paper's systems use.
        mem_util: share of each GPU's HBM the engine may use.
        kv_tokens: KV memory provisioned per instance, in tokens (all layers);
            None: everything ``mem_util`` leaves after the weights. The
            instance's memory is then the weights plus exactly this, so
            dropped layers still join the KV pool (KunServe's experiments
            provision KV at 2.1x the average demand).
        network_gbps: per-GPU network bandwidth in Gbit/s (None: the GPU spec's).
        gpus_per_node: GPUs per server (None: the GPU spec's); instances on
            different servers talk over the network, on one server over NVLink.
        cost: cost model (default: the analytic roofline).
        seed: seeds the policies' RNG.
        max_num_seqs, max_batched_tokens, watermark: vLLM engine limits.
        alternate: a replica decodes once after each prefill iteration while
            requests run (the module docstring; ``kunserve.alternate``);
            False: vLLM v0's prefill-first order, as the single-model world
            runs it.
        sample_interval_s: time-series sampling period.
        check_integrity: check every invariant after every event (slow; tests).
        max_time_s: stop at this simulated time.
        max_model_len: the context window served (None: the model's own
            ``max_context``); longer requests are rejected.
        config: the resolved config to store with the results.
        notes: remarks to carry into the results.
        progress: ``progress(sim_time, events, done)`` every ``progress_every`` events.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        *,
        model: str,
        gpu: str | GpuSpec,
        instances: int,
        tp: int = 1,
        spare_instances: int = 0,
        settings: KunSettings | None = None,
        stack: str = "custom",
        dispatch: str = "worst_fit",
        batching: str = "fcfs",
        mem_util: float = 0.9,
        kv_tokens: int | None = None,
        network_gbps: float | None = None,
        gpus_per_node: int | None = None,
        remote_reads: bool = True,
        alternate: bool = True,
        cost: CostModel | None = None,
        seed: int = 0,
        max_num_seqs: int = 256,
        max_batched_tokens: int = 8192,
        watermark: float = 0.01,
        sample_interval_s: float = 1.0,
        check_integrity: bool = False,
        max_time_s: float | None = None,
        max_model_len: int | None = None,
        config: dict[str, Any] | None = None,
        notes: Sequence[str] = (),
        progress: ProgressFn | None = None,
        progress_every: int = 4096,
    ) -> None:
        self.settings = st = settings or KunSettings()
        self.stack = stack
        self.model = spec = get_model(model)
        self.gpu = gpu if isinstance(gpu, GpuSpec) else get_gpu(gpu)
        if spec.kv_layers != spec.num_layers:
            raise ConfigError(
                f"model {model}: KunServe's layer dropping needs a KV cache in every layer "
                f"({spec.kv_layers} of {spec.num_layers} layers have one)"
            )
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ConfigError(f"instances must be an integer >= 1, got {instances!r}")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")
        if isinstance(spare_instances, bool) or not isinstance(spare_instances, int):
            raise ConfigError(f"spare_instances must be an integer >= 0, got {spare_instances!r}")
        if spare_instances < 0:
            raise ConfigError(f"spare_instances must be an integer >= 0, got {spare_instances!r}")
        if st.static_stages > instances:
            raise ConfigError(
                f"static pipeline of {st.static_stages} stages needs at least that many "
                f"instances, got {instances}"
            )
        if st.static_stages > spec.num_layers:
            raise ConfigError(f"{st.static_stages} stages exceed the {spec.num_layers} layers")
        if not 0 < mem_util <= 1:
            raise ConfigError(f"mem_util must be in (0, 1], got {mem_util!r}")
        self.requests = list(requests)
        check_run_order(self.requests)
        for r in self.requests:
            if r.model != spec.name:
                raise ConfigError(
                    f"request {r.id} is for model {r.model!r}; this deployment serves {spec.name}"
                )
        self.tp = tp
        self.remote_reads = bool(remote_reads)
        self.alternate = bool(alternate)
        self.n = instances + spare_instances  # every instance, active or not
        self.active = [m < instances for m in range(self.n)]
        self.active_since: dict[int, float] = dict.fromkeys(range(instances), 0.0)
        self.activating: set[int] = set()
        self.L = spec.num_layers
        self.kvpl = spec.kv_bytes_per_token_per_layer
        self.kv_tok_bytes = spec.kv_bytes_per_token
        self.layer_b = spec.weight_bytes_per_layer
        cap = int(self.gpu.hbm_bytes * mem_util) * tp
        if spec.weight_bytes >= cap:
            raise ConfigError(
                f"{model} ({spec.weight_bytes / 1e9:.1f} GB) does not fit {tp} x {gpu} "
                f"at mem_util {mem_util}"
            )
        if kv_tokens is not None:
            if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < 1:
                raise ConfigError(f"kv_tokens must be an integer >= 1, got {kv_tokens!r}")
            want = spec.weight_bytes + kv_tokens * spec.kv_bytes_per_token
            if want > cap:
                raise ConfigError(
                    f"kv_tokens={kv_tokens} per instance needs {want / 1e9:.1f} GB with the "
                    f"weights, more than {tp} x {gpu} offers at mem_util {mem_util} "
                    f"({cap / 1e9:.1f} GB)"
                )
            cap = want
        n = self.n
        self.replica_tokens = (cap - spec.weight_bytes) // spec.kv_bytes_per_token
        # every instance's weights, held layers and KV corrections
        # (sim/staged_layout.py); each executor's KV layout reads them
        self.mem = StageMemory(n, cap, spec)
        # live pieces by source instance: the remote attention each instance runs
        # for requests decoding elsewhere (an instance with none has no entry)
        self.live_src: dict[int, dict[Piece, None]] = {}
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.watermark = watermark
        self.sample_interval_s = sample_interval_s
        self.check = check_integrity
        self.max_time_s = max_time_s
        self.max_model_len = max_model_len
        self.config = dict(config or {})
        self.notes = list(notes)
        self.progress = progress
        self.progress_every = progress_every
        self.rng = np.random.default_rng(seed)
        self.cost = (cost or CostModel()).bind(spec, self.gpu, tp)
        per_node = gpus_per_node or self.gpu.gpus_per_node
        self.node_of = [(i * tp) // per_node for i in range(n)]
        bw = (network_gbps * 1e9 / 8) if network_gbps is not None else self.gpu.network_bw
        if not bw > 0:
            raise ConfigError(f"network_gbps must be > 0, got {network_gbps!r}")
        self.net_link = Link(bw, NETWORK_LATENCY_S)
        self.nvlink = intra_node_link(self.gpu)
        self.pcie = host_link(self.gpu)
        self.net = [Channel(f"net{i}", self.net_link) for i in range(n)]
        self.host = [Channel(f"host{i}", self.pcie) for i in range(n)]
        self.nvl = [Channel(f"nvlink{i}", self.nvlink) for i in range(n)]
        self.channels = (*self.net, *self.host, *self.nvl)
        self._queued: set[Channel] = set()  # channels whose queue may hold a transfer
        mean_ctx = (
            float(np.mean([r.prompt_tokens + r.output_tokens / 2 for r in self.requests]))
            if self.requests
            else 1024.0
        )
        self._mean_ctx = mean_ctx
        self._max_batch: dict[tuple[int, ...], int] = {}

        self._out: list[Event] = []  # events caused by the handler running now
        self.records = [
            RequestRecord(r.id, r.model, r.arrival_s, r.prompt_tokens, r.output_tokens)
            for r in self.requests
        ]
        self.seqs: list[Seq | None] = [None] * len(self.requests)
        self.exe_of: list[Executor | None] = [None] * n
        self.execs: dict[int, Executor] = {}
        self._next_eid = 0
        self.state = ClusterState(
            gpus_limit=n * tp,
            elastic=False,
            model_tp={spec.name: tp},
            gpus_per_node=per_node,
            block_size=VIEW_BLOCK,
        )
        self.dispatcher = DISPATCH.get(dispatch)()
        self.batching = instance_batching(batching)  # (refuses one that needs statistics)
        self.batching_name = batching
        self.batching_params: dict[str, Any] = {}
        self.clock = SimClock()
        self.reaction = PressureReaction(st)
        self.llumnix = Llumnix(interval_s=None) if st.pressure == "llumnix" else None
        self.policy = st.policy(spec)
        self.merging: list[_Merge] = []
        self._wd_since = 0.0
        # quiet ticks skip their decisions and are handled at once (:meth:`_quiet`,
        # :meth:`_skip_ticks`); False: every tick through the kernel, decided in full
        self.fast_ticks = True
        self.ticks_skipped = 0  # ticks :meth:`_skip_ticks` handled
        self._chunk_sum = 0.0
        self._chunk_n = 0
        self._wd_done = 0
        self.kernel = Kernel(
            self.requests,
            {
                ITER_END: self._ev_iter_end,
                TRANSFER: self._ev_xfer_end,
                ATTACH: self._ev_attach,
                EPOCH: self._ev_monitor,
                SAMPLE: self._ev_sample,
            },
            max_time_s=self.max_time_s,
            check=self.check,
            progress=self.progress,
            progress_every=self.progress_every,
            clock=self.clock,
        )
        self.n_done = 0
        self.timeseries = TimeSeries(sample_interval_s)
        self.migrations: list[MigrationRecord] = []
        self.aborted = 0
        self.mem_events: list[dict[str, Any]] = []
        self.victim_records: list[dict[str, Any]] = []
        self.drops = 0
        self.restores = 0
        self.bytes_freed = 0
        self.group_seconds = 0.0
        self._pipe_since: float | None = None
        self.time_in_pipeline_s = 0.0
        self.tl_t: list[float] = []
        self.tl_groups: list[int] = []
        self.tl_dropped: list[int] = []
        k = st.static_stages
        for lo in range(0, instances, k):
            self._new_executor(tuple(range(lo, min(lo + k, instances))), 0.0)
        self.bytes_freed = 0  # a static pipeline never held those layers: not a drop
        for e in self.execs.values():
            self._observe(e, 0.0)
        self._update_pipe_clock(0.0)

    # ------------------------------------------------------------- memory
    def used_tl(self, m: int) -> int:
        """Token-layers instance ``m`` holds (through its executor's layout)."""
        exe = self.exe_of[m]
        assert exe is not None
        return exe.layout.used_tl(m)

    def free_tl(self, m: int) -> int:
        """Token-layers of instance ``m`` not holding anything."""
        return self.mem.cap_tl(m) - self.used_tl(m)

    def avail_tl(self, m: int) -> int:
        """Free token-layers not committed to KV pieces still to arrive."""
        return self.free_tl(m) - self.mem.pend_in[m]

    def _link(self, a: int, b: int) -> Link:
        return self.nvlink if self.node_of[a] == self.node_of[b] else self.net_link

    def _chan(self, a: int, b: int) -> Channel:
        """The channel ``a`` sends to ``b`` on (NVLink inside a server, else its NIC)."""
        return self.nvl[a] if self.node_of[a] == self.node_of[b] else self.net[a]

    def _new_executor(
        self,
        members: tuple[int, ...],
        now: float,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> Executor:
        """An executor of ``members`` in stage order holding ``ranges``
        (default: an even split); members drop the layers outside their range."""
        if ranges is None:
            ranges = split_layers(self.L, len(members))
        link = self.net_link
        if all(self.node_of[m] == self.node_of[members[0]] for m in members):
            link = self.nvlink
        pcost = PipelineCost(self.cost, [hi - lo for lo, hi in ranges], link)
        exe = Executor(self._next_eid, members, ranges, pcost, self, now)
        self._next_eid += 1
        for m, (lo, hi) in zip(members, ranges, strict=True):
            self.bytes_freed += self.mem.keep_layers(m, lo, hi)  # drop what it does not need
            self.exe_of[m] = exe
        exe.group.refresh_limits()  # its capacity after the drops
        exe.max_batch = self._batch_cap(exe)
        exe.group.max_num_seqs = self._cap(exe)
        self.execs[exe.id] = exe
        self.state.add(exe)
        return exe

    def _observe(self, e: Executor, now: float) -> None:
        """One monitor sample of ``e`` (:meth:`KunServePolicy.observe`).

        A new executor (start, merge, split, scale-out) gets its first sample
        once its requests are placed on it: a sample of the empty executor
        would make the next one look like sudden growth and predict a throttle
        that is not coming."""
        self.policy.observe(now, (e,))

    def _retire(self, exe: Executor, now: float) -> None:
        self.state.remove(exe.id)
        del self.execs[exe.id]
        self.policy.forget(exe.id)
        if exe.k > 1:
            self.group_seconds += now - exe.created_s

    def _batch_cap(self, exe: Executor) -> int:
        key = exe.pcost.stage_layers
        got = self._max_batch.get(key)
        if got is None:
            pc = exe.pcost
            ctx = self._mean_ctx
            got = max_batch(
                lambda b: pc.decode_time(b, b * ctx),
                self.max_num_seqs * exe.k,
                self.settings.max_batch_slowdown,
            )
            self._max_batch[key] = got
        return got

    def _update_pipe_clock(self, now: float) -> None:
        grouped = any(e.k > 1 for e in self.execs.values())
        if grouped and self._pipe_since is None:
            self._pipe_since = now
        elif not grouped and self._pipe_since is not None:
            self.time_in_pipeline_s += now - self._pipe_since
            self._pipe_since = None
        else:
            return
        for e in self.execs.values():  # the batch cap holds while groups exist
            e.group.max_num_seqs = self._cap(e)

    @property
    def grouped(self) -> bool:
        return self._pipe_since is not None

    # ----------------------------------------------------------------- loop
    def run(self) -> RunResult:
        """Run to completion (or ``max_time_s``) and return the results."""
        wall0 = time.perf_counter()
        k = self.kernel
        k.push(self._caused())  # anything set up before the run
        k.push([(0.0, SAMPLE, None), (0.0, EPOCH, None)])
        end_s = k.run(self)
        self._sample(end_s)
        if self.progress is not None:
            self.progress(end_s, k.n_events, self.n_done)
        return self._result(end_s, time.perf_counter() - wall0)

    @property
    def n_events(self) -> int:
        """Events handled so far."""
        return self.kernel.n_events

    # ---------------------------------------------------------------- events
    # Handlers collect the events they cause in ``_out`` (transfer callbacks
    # and helpers deep in a handler add to it) and return them to the kernel.
    def _caused(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _ev_iter_end(self, payload: tuple[Executor, int], now: float) -> list[Event] | None:
        exe, token = payload
        if exe.id not in self.execs:
            return None  # retired
        g = exe.group
        if g.stale(token):
            return None  # re-timed: a later event ends the job
        entry = g.jobs.get(token)
        if entry is None:
            return None
        phase = entry[0].phase
        done = g.complete(token, now)
        self._on_job_end(exe, phase, done, now)
        return self._caused()

    def _ev_xfer_end(self, payload: tuple[Channel, int], now: float) -> list[Event] | None:
        ch, version = payload
        if ch.version != version:
            return None  # superseded
        self._on_xfer_end(ch, now)
        return self._caused()

    def _ev_attach(self, payload: Seq, now: float) -> list[Event]:
        self._on_attach(payload, now)
        return self._caused()

    def _ev_monitor(self, payload: None, now: float) -> list[Event]:
        self._on_monitor(now, self.kernel.arrivals_left)
        return self._caused()

    def _ev_sample(self, payload: None, now: float) -> list[Event]:
        self._on_sample(now, self.kernel.arrivals_left)
        return self._caused()

    def _push_jobs(self, exe: Executor, started: list[tuple[float, int]]) -> None:
        """The end events of the jobs ``exe``'s group started or re-timed."""
        for end, token in started:
            self._out.append((end, ITER_END, (exe, token)))

    def _push_xfer(self, ch: Channel, end: float | None) -> None:
        if end is not None:
            self._out.append((end, TRANSFER, (ch, ch.version)))

    def _work_left(self, arrivals_left: bool) -> bool:
        """Arrivals, requests somewhere, or transfers under way."""
        return (
            arrivals_left
            or any(
                e.waiting or e.num_running or e.swapped or e.pending_attach or e.group.jobs
                for e in self.execs.values()
            )
            or any(ch.busy for ch in self.channels)
        )

    # ------------------------------------------------------------- arrivals
    def on_arrival(self, req: Request, now: float) -> list[Event]:
        """A request arrives: admitted to an executor, queued or rejected."""
        self._on_arrival(req, now)
        return self._caused()

    def _on_arrival(self, req: Request, now: float) -> None:
        rec = self.records[req.id]
        too_long = context_reason(req, self.model, self.max_model_len)
        if too_long is not None:
            rec.status = "rejected"
            rec.reason = too_long
            self.n_done += 1
            return
        limit = int(self.replica_tokens * (1 - self.watermark))
        if req.max_kv_tokens > limit:
            rec.status = "rejected"
            rec.reason = (
                f"needs {req.max_kv_tokens} KV tokens, more than one instance holds ({limit})"
            )
            self.n_done += 1
            return
        s = Seq(req, rec)
        self.seqs[req.id] = s
        exe = self._choose_executor(req, now)
        if exe is None:
            rec.status = "rejected"
            rec.reason = "no executor accepts requests"
            self.seqs[req.id] = None
            self.n_done += 1
            return
        self._enqueue(s, exe, now)

    def _choose_executor(self, req: Request, now: float) -> Executor | None:
        """The stack's dispatch policy among KunServe's candidates
        (:func:`~fleetserve.policy.kunserve.dispatch_candidates`)."""
        cands = dispatch_candidates(
            list(self.execs.values()),
            -(-req.prompt_tokens // VIEW_BLOCK),
            batch_capped=self.grouped and self.settings.pressure == "kunserve",
        )
        st = ClusterState(block_size=VIEW_BLOCK)
        for e in cands:
            st.add(e)
        action = self.dispatcher.dispatch(st, req, now, self.rng)
        if isinstance(action, Dispatch):
            return self.execs[action.instance_id]
        if isinstance(action, Reject):
            return None
        raise RuntimeError(f"unexpected dispatch action {action!r}")

    def _enqueue(self, s: Seq, exe: Executor, now: float) -> None:
        exe.group.enqueue(s, now, start=False)
        self._schedule(exe, now)

    def _schedule(self, exe: Executor, now: float) -> None:
        """Let ``exe``'s group start what it can now (it decides while no
        iteration, or on a pipeline no decode round, is in flight); a frozen
        executor at a boundary merges or splits."""
        g = exe.group
        self._push_jobs(exe, g.schedule(now))
        if exe.frozen:
            if exe.k > 1 and not exe.decoding:  # at the round's boundary: joiners join
                g.settle(now)
            if exe.at_boundary:
                self._try_merges(now)
                self._try_split(exe, now)
            return
        if exe.restoring and exe.at_boundary and not exe.running and not self.settings.live_restore:
            self._try_split(exe, now)

    def _cap(self, exe: Executor) -> int:
        """Batch slots: ``max_num_seqs`` per stage (a pipeline keeps one
        micro-batch per stage in flight, as vLLM's virtual engines do), and
        the dispatcher's maximum batch while KunServe has groups."""
        cap = self.max_num_seqs * exe.k
        if self.grouped and self.settings.pressure == "kunserve":
            return min(cap, exe.max_batch)
        return cap

    def _round_cost(self, exe: Executor, B: int, ctx: int) -> tuple[float, float]:
        """A decode round of ``exe``'s ``B`` running requests reading ``ctx``
        tokens (its group's ``round_cost``): ``(time, busiest stage's busy
        time)`` with the remote attention of its live pieces; the pieces'
        links get the gaps between its activation transfers."""
        now = self.clock.now
        extra = self._remote_overhead(exe) if exe.live_pieces else 0.0
        moved = self._moved_kv(exe) if self.live_src and self.remote_reads else None
        t, busy = exe.pcost.decode_round(B, ctx, extra, moved_kv=moved)
        if exe.live_pieces:
            share = activation_gap_share(t, exe.pcost.hop_time(B), extra)
            # KV chunk = what fits the gap between activation transfers
            self._chunk_sum += share * t * self.net_link.bandwidth_Bps
            self._chunk_n += 1
            for ch in dict.fromkeys(self._chan(p.src, p.dst) for p in exe.live_pieces):
                self._push_xfer(ch, ch.set_share(share, now))
        return t, busy

    def _moved_kv(self, exe: Executor) -> list[float] | None:
        """Per stage of ``exe``, the KV (tokens of the whole model) its GPU reads
        for remote attention, less what other GPUs read for its own layers
        (:mod:`fleetserve.costmodel.pipeline`): a live piece's request, while it
        decodes, has its attention for the piece's layers run on the piece's
        source over its current KV. None when no member takes part."""
        stage = {m: i for i, m in enumerate(exe.members)}
        tl = [0] * exe.k
        touched = False
        for m, i in stage.items():
            for p in self.live_src.get(m, ()):
                if p.seq.state == RUNNING:
                    tl[i] += p.layers * p.seq.kv_tokens
                    touched = True
        for p in exe.live_pieces:
            if not p.cancelled and p.seq.state == RUNNING:
                tl[stage[p.dst]] -= p.layers * p.seq.kv_tokens
                touched = True
        if not touched:
            return None
        return [x / self.L for x in tl]

    def _remote_overhead(self, exe: Executor) -> float:
        """Remote-attention round trips of live victims, per iteration: for each
        source, per layer not yet moved, the queries and new K/V of its victims
        go out and the attention outputs come back (sequential across layers)."""
        per_src: dict[int, dict[int, int]] = {}
        for p in exe.live_pieces:
            if p.cancelled or p.seq.state != RUNNING:
                continue
            d = per_src.setdefault(p.src, {})
            d[p.seq.id] = d.get(p.seq.id, 0) + p.layers
        total = 0.0
        dst = exe.members[0]
        for src, by_seq in per_src.items():
            link = self._link(src, dst)
            total += remote_attention_s(self.model, len(by_seq), max(by_seq.values()), link)
        return total

    def _on_job_end(self, exe: Executor, phase: str, done: list[Seq], now: float) -> None:
        """A job of ``exe``'s group ended (its group already recorded the
        tokens): the finished requests leave the world's books, a decode
        round's victims count their gaps, migrations ready at this boundary
        move, and the group starts what it can."""
        if phase == DECODE or exe.k == 1:
            exe.last_end = now
        for s in done:
            self._finish(exe, s, now)
        if phase == DECODE and exe.tracked:
            for s in list(exe.tracked.values()):
                if s.state == RUNNING:
                    gap = now - s.last_tok_s
                    if gap > s.max_gap_s:
                        s.max_gap_s = gap
                    s.sum_gap_s += gap
                    s.n_gaps += 1
                    s.last_tok_s = now
                    if not s.pieces:
                        self._untrack(exe, s, now)
        if exe.mig_ready and not exe.decoding:
            self._migrations_at_boundary(exe, now)
        self._schedule(exe, now)

    def _finish(self, exe: Executor, s: Seq, now: float) -> None:
        """``s`` finished (its group recorded it and freed its KV)."""
        self._forget(exe, s, now)
        self.n_done += 1

    def _on_evicted(self, s: Seq) -> None:
        """A group preempted ``s`` or dropped its KV (its group's ``on_evicted``)."""
        exe = s.inst
        assert isinstance(exe, Executor)
        self._forget(exe, s, self.clock.now)

    def _forget(self, exe: Executor, s: Seq, now: float) -> None:
        """``s`` left the running batch of ``exe`` without its KV: its pieces
        and its move are void, its victim record closes."""
        self._cancel_pieces(s)
        self._cancel_migration(s)
        self._untrack(exe, s, now)

    def _enqueue_transfer(self, ch: Channel, tr: Transfer, now: float) -> None:
        ch.queue.append(tr)
        self._queued.add(ch)
        self._push_xfer(ch, ch.try_start(now))

    def _on_xfer_end(self, ch: Channel, now: float) -> None:
        tr = ch.finish()
        tr.on_done(now)
        self._push_xfer(ch, ch.try_start(now))
        self._retry_channels(now)

    def _retry_channels(self, now: float) -> None:
        """Start the head transfer of every free channel that has one ready,
        in channel order (the channels outside ``_queued`` have empty queues)."""
        queued = self._queued
        if not queued:
            return
        for ch in self.channels:
            if ch in queued:
                if ch.cur is None and ch.queue:
                    self._push_xfer(ch, ch.try_start(now))
                if not ch.queue:
                    queued.discard(ch)

    def _on_attach(self, s: Seq, now: float) -> None:
        exe = s.inst
        assert isinstance(exe, Executor)
        exe.group.arrive(s)
        self._schedule(exe, now)

    # ------------------------------------------------------------- KV pieces
    def _add_pieces(self, s: Seq, exe: Executor, pieces: list[Piece], now: float) -> None:
        """Register ``s``'s pieces (proportional accounting corrected) and queue
        them on their sources' links."""
        mem = self.mem
        for p in pieces:
            tl = p.token_layers
            mem.correct(p.src, tl)
            mem.correct(p.dst, -tl)
            if self.free_tl(p.dst) >= tl:  # reserve the destination now if it has room
                mem.correct(p.dst, tl)
                p.started = True
            else:  # commit it: admissions must not take this room
                mem.commit_in(p.dst, tl)
            s.pieces.append(p)
            if p.live:
                exe.live_pieces[p] = None
                self.live_src.setdefault(p.src, {})[p] = None
            self._enqueue_transfer(self._chan(p.src, p.dst), self._piece_transfer(p, exe), now)

    def _piece_transfer(self, p: Piece, exe: Executor) -> Transfer:
        def ready() -> bool:
            return p.cancelled or p.started or self.free_tl(p.dst) >= p.token_layers

        def on_start(now: float) -> None:
            if not p.cancelled and not p.started:
                p.started = True
                self.mem.correct(p.dst, p.token_layers)
                self.mem.commit_in(p.dst, -p.token_layers)

        def on_done(now: float) -> None:
            if p.cancelled:
                return
            self.mem.correct(p.src, -p.token_layers)
            s = p.seq
            s.pieces.remove(p)
            exe.live_pieces.pop(p, None)
            self._unlive(p)
            if not s.pieces and s.state == STALLED:
                exe.group.unstall(s)
                self._schedule(exe, now)

        nbytes = float(p.token_layers * self.kvpl) / self.tp
        tr = Transfer("kv-piece", nbytes, on_done, ready=ready, on_start=on_start, live=p.live)
        p.transfer = tr
        return tr

    def _cancel_pieces(self, s: Seq) -> None:
        """``s`` leaves (finished, preempted): its pending pieces are void."""
        # A piece not reserved still has its destination's negative correction
        # (and commitment); a reserved one is net zero there. Either way the
        # source no longer holds it. A copy in flight runs to its end.
        exe = s.inst
        mem = self.mem
        for p in s.pieces:
            mem.correct(p.src, -p.token_layers)
            if not p.started:
                mem.correct(p.dst, p.token_layers)
                mem.commit_in(p.dst, -p.token_layers)
            p.cancelled = True
            if p.transfer is not None:
                p.transfer.cancelled = True
            if exe is not None:
                exe.live_pieces.pop(p, None)
            self._unlive(p)
        s.pieces = []

    def _unlive(self, p: Piece) -> None:
        """``p`` no longer runs remote attention on its source."""
        at = self.live_src.get(p.src)
        if at is not None:
            at.pop(p, None)
            if not at:
                del self.live_src[p.src]

    def _untrack(self, exe: Executor, s: Seq, now: float) -> None:
        if s.tracked_since is None:
            return
        exe.tracked.pop(s.id, None)
        self.victim_records.append(
            {
                "request": s.id,
                "kind": s.track_kind,
                "mode": self.settings.exchange if s.track_kind == "exchange" else "live",
                "start_s": s.tracked_since,
                "end_s": now,
                "max_gap_s": s.max_gap_s,
                "mean_gap_s": s.sum_gap_s / s.n_gaps if s.n_gaps else None,
                "tokens": s.n_gaps,
                "outcome": s.state,
            }
        )
        s.tracked_since = None

    def _track(self, exe: Executor, s: Seq, now: float, last_tok: float, kind: str) -> None:
        s.tracked_since = now
        s.track_kind = kind
        s.max_gap_s = 0.0
        s.sum_gap_s = 0.0
        s.n_gaps = 0
        s.last_tok_s = last_tok
        exe.tracked[s.id] = s

    # --------------------------------------------------------------- monitor
    def _on_monitor(self, now: float, arrivals_left: bool) -> None:
        st = self.settings
        self.policy.observe(now, self.execs.values())
        quiet = self.fast_ticks and self._quiet()
        if not quiet:  # (quiet: these decisions would change nothing)
            if st.pressure == "kunserve":
                actions = self.policy.plan_drops(now, self.execs.values(), spare=self._spare())
                if actions or self.merging:
                    self._apply(actions, now)
                self._maybe_restore(now)
                if self.grouped:
                    self._rebalance(now)
            elif st.pressure == "llumnix":
                self._llumnix_plan(now)
            self._retry_channels(now)
        if self._work_left(arrivals_left):
            moving = self._watchdog(now)
            nxt = now + st.monitor_interval_s
            if quiet and moving and not self._out:
                nxt = self._skip_ticks(nxt)
            self._out.append((nxt, EPOCH, None))

    def _quiet(self) -> bool:
        """Whether a tick's decisions change nothing, now and while nothing
        else happens (its samples and the watchdog's clock aside): no merge
        pending, no transfer queued (:meth:`_retry_channels`), no group
        restoring (:meth:`_maybe_restore`'s own part), and under KunServe's
        pressure the policy quiet
        (:meth:`~fleetserve.policy.kunserve.KunServePolicy.quiet`: one
        executor at most, so no re-balance either); Llumnix's plan is never
        skipped."""
        st = self.settings
        if self.merging or self._queued or st.pressure == "llumnix":
            return False
        if any(e.restoring for e in self.execs.values()):
            return False
        if st.pressure == "kunserve":
            return self.policy.quiet(self.execs.values(), spare=self._spare())
        return True

    def _spare(self) -> bool:
        """Whether a spare instance could be started (as :meth:`_scale_out` serves)."""
        return not self.activating and not all(self.active)

    def _skip_ticks(self, nxt: float) -> float:
        """The monitor's ticks from ``nxt`` on that come before the kernel's
        next event or arrival, handled at once. The tick that calls found the
        world :meth:`_quiet` (so it changed nothing) with an iteration or a
        transfer in flight (so an event is to come): until then each tick
        would record the same samples, find the world quiet and move the
        watchdog's clock. Handled: their samples (the tick's own again), the
        watchdog's clock, the kernel's event count. Their times are the ones
        the ticks would have had (each the previous plus the interval);
        returns the first one left to the kernel. A run gives the records,
        samples and event count of one without it (``fast_ticks`` False:
        ``tests/test_kun_sim.py`` compares)."""
        k = self.kernel
        limit = k.next_time()
        if k.max_time_s is not None:
            limit = min(limit, math.nextafter(k.max_time_s, math.inf))  # a tick at max is run
        if not nxt < limit:
            return nxt
        dt = self.settings.monitor_interval_s
        times = []
        while nxt < limit:
            times.append(nxt)
            nxt += dt
        self.policy.observe_again(times)  # (the tick's own observe: nothing changed since)
        self._wd_since = times[-1]
        k.n_events += len(times)
        self.ticks_skipped += len(times)
        return nxt

    def _watchdog(self, now: float) -> bool:
        """Fail loudly instead of ticking forever when requests wait but nothing
        can ever move them (a bug, not a workload property). Returns whether
        an iteration or a transfer is in flight."""
        moving = any(e.group.jobs for e in self.execs.values()) or any(
            ch.cur is not None for ch in self.channels
        )
        if moving or self.n_done != self._wd_done:
            self._wd_since = now
            self._wd_done = self.n_done
        elif now - self._wd_since > 600.0:
            state = {
                e.id: (e.members, len(e.waiting), e.num_running, e.restoring, e.frozen)
                for e in self.execs.values()
            }
            raise RuntimeError(f"simulation stalled at t={now:.1f}s: executors {state}")
        return moving

    def _apply(self, actions: Sequence[KunAction], now: float) -> None:
        """Apply the policy's actions in order; then merge the groups whose
        executors are all at an iteration boundary (the others merge when
        their last executor gets there, see :meth:`_schedule`)."""
        for action in actions:
            if isinstance(action, DropLayers):
                self._apply_drop(action)
            elif isinstance(action, Restore):
                self._apply_restore(action, now)
            elif isinstance(action, ActivateSpare):
                self._scale_out(now)
            else:
                raise RuntimeError(f"unexpected KunServe action {action!r}")
        if self.merging:
            self._try_merges(now)

    def _apply_drop(self, action: DropLayers) -> None:
        """Freeze the executors ``action`` merges (they start no iteration);
        :meth:`_merge` forms the group once all are idle."""
        olds = [self.execs[key] for key in action.sources]
        for e in olds:
            e.frozen = True
        self.merging.append(_Merge(olds, list(zip(action.members, action.keep, strict=True))))

    def _scale_out(self, now: float) -> None:
        """KunServe's fallback when dropping cannot free enough (the policy's
        :class:`~fleetserve.policy.actions.ActivateSpare`): activate a spare
        instance (its weights come from host memory over PCIe), unless there
        is none or one is already starting."""
        spare = [m for m in range(self.n) if not self.active[m] and m not in self.activating]
        if not spare or self.activating:
            return
        m = spare[0]
        self.activating.add(m)
        self.mem_events.append({"t": now, "event": "scale-out-start", "group": [m]})

        def on_done(t: float) -> None:
            self.activating.discard(m)
            self.active[m] = True
            self.active_since[m] = t
            exe = self._new_executor((m,), t)
            self._observe(exe, t)
            self.mem_events.append({"t": t, "event": "scale-out", "group": [m]})
            self._schedule(exe, t)

        nbytes = float(self.model.weight_bytes) / self.tp
        self._enqueue_transfer(self.host[m], Transfer("weights", nbytes, on_done), now)

    def _try_merges(self, now: float) -> None:
        for mg in list(self.merging):
            if all(e.at_boundary for e in mg.olds):
                self.merging.remove(mg)
                self._merge(mg, now)

    def _merge(self, mg: _Merge, now: float) -> None:
        """Form one buddy group from ``mg.olds`` (all at a boundary)."""
        live = self.settings.exchange == "live"
        old_owner: dict[int, list[int]] = {}
        for e in mg.olds:
            owner = [0] * self.L
            for m, (lo, hi) in e.ranges.items():
                for layer in range(lo, hi):
                    owner[layer] = m
            old_owner[e.id] = owner
        for e in mg.olds:
            self._retire(e, now)
        new = self._new_executor(mg.members, now, mg.ranges)
        new_owner = [0] * self.L
        for m, (lo, hi) in new.ranges.items():
            for layer in range(lo, hi):
                new_owner[layer] = m
        waiting: list[Seq] = []
        victims: list[tuple[Seq, int, dict[tuple[int, int], int], float]] = []
        for e in mg.olds:
            assert not e.stalled and not e.prefill and not e.pending_attach and not e.prefilled
            waiting.extend(e.group.take_waiting())
            owner = old_owner[e.id]
            moves: dict[tuple[int, int], int] = {}
            for layer in range(self.L):
                a, b = owner[layer], new_owner[layer]
                if a != b:
                    moves[(a, b)] = moves.get((a, b), 0) + 1
            for s in e.group.take_running():
                victims.append((s, s.kv_saved, moves, e.last_end))
        waiting.sort(key=lambda s: (s.arrival_s, s.id))
        for s in waiting:
            new.group.enqueue(s, now, start=False)
        victims.sort(key=lambda v: (v[0].arrival_s, v[0].id))
        for s, kv, moves, last_end in victims:
            pieces = [Piece(s, a, b, n, kv, live) for (a, b), n in sorted(moves.items())]
            if live or not pieces:
                new.group.adopt_resident(s, kv)
            else:
                new.group.stall(s, kv)
            if pieces:
                self._track(new, s, now, last_end, "exchange")
                self._add_pieces(s, new, pieces, now)
        self.drops += 1
        self.mem_events.append(
            {"t": now, "event": "drop", "group": list(mg.members), "victims": len(victims)}
        )
        self._update_pipe_clock(now)
        self._observe(new, now)
        self._schedule(new, now)

    # --------------------------------------------------------------- restore
    def _maybe_restore(self, now: float) -> None:
        """Restore decisions, executor by executor: a restored group whose
        split found no room is retried (mechanism); any other executor is
        the policy's to judge (:meth:`KunServePolicy.decide_restore`). One
        pass in executor order, so a split retried here is seen by the
        executors after it."""
        live = self.settings.live_restore
        for e in list(self.execs.values()):
            if e.restoring and not e.reload_left and live and not e.frozen:
                e.frozen = True  # a split that found no room earlier: try again
                if not e.decoding:
                    self._try_split(e, now)
                continue
            action = self.policy.decide_restore(now, e)
            if action is not None:
                self._apply_restore(action, now)

    def _apply_restore(self, action: Restore, now: float) -> None:
        """Start reloading ``action``'s dropped layers; the group takes no new
        requests from now on and splits once every member has them back."""
        e = self.execs[action.executor]
        e.restoring = True
        e.accepting = False
        e.reload_left = set(e.members)
        self.mem_events.append({"t": now, "event": "restore-start", "group": list(e.members)})
        for m, ranges in zip(action.members, action.reload, strict=True):
            need = sum(hi - lo for lo, hi in ranges) * self.layer_b
            ch = self.host[m] if action.source == "host" else self.net[m]
            self._enqueue_transfer(ch, self._reload_transfer(e, m, need), now)

    def _reload_transfer(self, e: Executor, m: int, need: int) -> Transfer:
        def ready() -> bool:
            return self.free_tl(m) * self.kvpl >= need

        def on_start(now: float) -> None:
            self.mem.reload_start(m, need)
            e.group.refresh_limits()  # its capacity (and watermark) shrank

        def on_done(now: float) -> None:
            self.mem.reload_done(m, need)
            e.reload_left.discard(m)
            if not e.reload_left:  # restored: it drains, admitting nothing more
                e.group.admitting = False
            if not e.reload_left:
                if self.settings.live_restore:
                    e.frozen = True
                    if not e.decoding:
                        self._try_split(e, now)
                elif not e.decoding:
                    self._try_split(e, now)

        return Transfer("reload", float(need) / self.tp, on_done, ready=ready, on_start=on_start)

    def _try_split(self, e: Executor, now: float) -> None:
        """Split a restored group into replicas (see the module docstring)."""
        if not e.restoring or e.reload_left or not e.at_boundary or e.id not in self.execs:
            return
        if not self.settings.live_restore and (
            e.running or e.stalled or e.prefill or e.pending_attach or e.prefilled
        ):
            return
        e.group.settle(now)  # prefilled and arrived requests join the batch first
        # assign running requests: largest KV first, to the member with most room
        room = {m: self.mem.cap_tl(m) // self.L for m in e.members}
        wm = {m: int(self.watermark * room[m]) for m in e.members}
        take: dict[int, list[tuple[Seq, int]]] = {m: [] for m in e.members}
        for s in sorted(e.running.values(), key=lambda s: (-s.kv_tokens, s.id)):
            kv = s.kv_tokens
            m = max(e.members, key=lambda m: (room[m] - wm[m], -m))
            if room[m] - wm[m] < kv + 1:
                e.frozen = False  # cannot place everyone yet: keep pipelining (and draining)
                self._schedule(e, now)
                return
            room[m] -= kv
            take[m].append((s, kv))
        waiting = e.group.take_waiting()
        old_ranges = dict(e.ranges)
        e.group.take_running()
        self._retire(e, now)
        news = {m: self._new_executor((m,), now) for m in e.members}
        for m, items in take.items():
            new = news[m]
            for s, kv in items:
                new.group.adopt_resident(s, kv)
                pieces = [
                    Piece(s, src, m, hi - lo, kv, True)
                    for src, (lo, hi) in sorted(old_ranges.items())
                    if src != m
                ]
                self._track(new, s, now, e.last_end, "restore")
                self._add_pieces(s, new, pieces, now)
        self.restores += 1
        self.mem_events.append({"t": now, "event": "restore", "group": list(e.members)})
        self._update_pipe_clock(now)
        for s in waiting:
            exe = self._choose_executor(self.requests[s.id], now)
            assert exe is not None
            self._enqueue(s, exe, now)
        for new in news.values():
            self._observe(new, now)
            self._schedule(new, now)

    # ------------------------------------------------------------- rebalance
    def _rebalance(self, now: float) -> None:
        if len(self.execs) < 2:
            return  # a move needs an overflowed executor and another, spare one
        execs = [e for e in self.execs.values() if e.accepting and not e.frozen]
        counts = ((e.num_running, len(e.waiting), e.max_batch) for e in execs)
        if not rebalance_may_move(counts):
            return  # no executor both overflowed and another spare: nothing to move
        loads = []
        for e in execs:
            loads.append(
                ExecutorLoad(
                    key=e.id,
                    running=e.num_running,
                    waiting=tuple(s.id for s in e.waiting),
                    max_batch=e.max_batch,
                    free_tokens=max(0, e.room_tokens() - e.waiting_tokens()),
                    waiting_tokens=tuple(s.prefill_tokens for s in e.waiting),
                )
            )
        touched: set[int] = set()
        for rid, src, dst in rebalance(loads):
            s = self.seqs[rid]
            assert s is not None and s.state == WAITING
            a, b = self.execs[src], self.execs[dst]
            a.group.remove_waiting(s)
            b.group.enqueue(s, now, start=False)
            touched.add(dst)
        for eid in sorted(touched):
            e = self.execs[eid]
            self._schedule(e, now)

    # ------------------------------------------------------------------ swap
    def _start_swap(self, exe: Executor, s: Seq, out: bool) -> None:
        """``exe``'s group swaps ``s`` out (or in): the copy crosses the first
        member's host link; at its end the group takes it back."""
        g = exe.group

        def on_done(t: float) -> None:
            if out:
                g.swapped_out(s)
            else:
                g.swapped_in(s)
            self._schedule(exe, t)

        nbytes = s.kv_saved * self.kv_tok_bytes / self.tp
        kind = "swap-out" if out else "swap-in"
        self._enqueue_transfer(
            self.host[exe.members[0]], Transfer(kind, nbytes, on_done), self.clock.now
        )

    # --------------------------------------------------------------- llumnix
    def _llumnix_plan(self, now: float) -> None:
        assert self.llumnix is not None
        for action in self.llumnix.plan(self.state, now, self.rng):
            assert isinstance(action, Migrate)
            s = self.seqs[action.request_id]
            dst = self.execs.get(action.dst)
            if s is None or dst is None or s.state != RUNNING or s.mig is not None:
                self.llumnix.on_move_aborted(action.request_id)
                continue
            src = s.inst
            assert src is not None
            kv = s.kv_tokens
            wm = int(self.watermark * dst.capacity_tokens())
            if dst.room_tokens() - wm < kv:
                self.llumnix.on_move_aborted(action.request_id)
                self.aborted += 1
                continue
            dst.group.reserve(dst.svc, kv)
            mig = _Migration(src, dst, kv)
            s.mig = mig

            def on_done(t: float, s: Seq = s, mig: _Migration = mig) -> None:
                if s.mig is not mig:
                    return
                mig.ready = True
                mig.src.mig_ready.append(s)
                if mig.src.at_boundary:
                    self._migrations_at_boundary(mig.src, t)
                    self._schedule(mig.src, t)
                return

            nbytes = kv * self.kv_tok_bytes / self.tp
            self._enqueue_transfer(
                self.net[src.members[0]], Transfer("migration", nbytes, on_done), now
            )

    def _migrations_at_boundary(self, exe: Executor, now: float) -> None:
        """Migrations whose pre-copy is done: stop, copy the tokens added
        meanwhile, resume at the destination."""
        ready, exe.mig_ready = exe.mig_ready, []
        for s in ready:
            mig = s.mig
            if mig is None or s.state != RUNNING or s.inst is not exe:
                continue
            dst = mig.dst
            kv = s.kv_tokens
            delta = kv - mig.tokens
            wm = int(self.watermark * dst.capacity_tokens())
            if dst.id not in self.execs or dst.room_tokens() - wm < delta:
                self._cancel_migration(s)
                self.aborted += 1
                continue
            exe.group.detach(s, keep_blocks=False)
            s.kv_saved = kv
            dst.group.reserve(dst.svc, delta)
            s.state = TRANSIT
            s.inst = dst
            s.mig = None
            stall = transfer_time(delta * self.kv_tok_bytes / self.tp, self.net_link)
            s.record.migrations += 1
            s.record.migration_stall_s += stall
            self.migrations.append(
                MigrationRecord(now + stall, s.id, exe.id, dst.id, "kv", kv * self.kv_tok_bytes, 1)
            )
            self._out.append((now + stall, ATTACH, s))

    def _cancel_migration(self, s: Seq) -> None:
        mig = s.mig
        if mig is None:
            return
        mig.dst.group.unreserve(mig.dst.svc, mig.tokens)
        s.mig = None
        if self.llumnix is not None:
            self.llumnix.on_move_aborted(s.id)

    # --------------------------------------------------------------- samples
    def _on_sample(self, now: float, arrivals_left: bool) -> None:
        self._sample(now)
        if self._work_left(arrivals_left):
            self._out.append((now + self.sample_interval_s, SAMPLE, None))

    def _sample(self, now: float) -> None:
        used = cap = queued = running = waiting_tok = 0
        active = 0
        for m in range(self.n):
            if self.active[m]:
                used += self.used_tl(m)
                cap += self.mem.cap_tl(m)
                active += 1
        for e in self.execs.values():
            queued += len(e.waiting) + len(e.swapped)
            running += e.num_running
            waiting_tok += e.waiting_tokens()
        b = self.kvpl
        self.timeseries.append(
            now,
            active * self.tp,
            used * b,
            cap * b,
            used * b + waiting_tok * self.kv_tok_bytes,
            queued,
            running,
        )
        self.tl_t.append(now)
        self.tl_groups.append(sum(1 for e in self.execs.values() if e.k > 1))
        full = self.mem.full_w
        self.tl_dropped.append(sum(full - w for w in self.mem.weights))

    # --------------------------------------------------------------- results
    def _result(self, end_s: float, wall_s: float) -> RunResult:
        if self.requests:
            p = np.array([r.prompt_tokens for r in self.requests], dtype=np.float64)
            o = np.array([r.output_tokens for r in self.requests], dtype=np.float64)
            for rec, t in zip(self.records, self.cost.ideal_times(p, o).tolist(), strict=True):
                rec.ideal_s = t
        for s in self.seqs:
            if s is not None and s.record.status == "unfinished":
                s.record.generated = s.generated
        if self._pipe_since is not None:
            self.time_in_pipeline_s += end_s - self._pipe_since
            self._pipe_since = None
        for e in self.execs.values():
            if e.k > 1:
                self.group_seconds += end_s - e.created_s
        exch = [v for v in self.victim_records if v["kind"] == "exchange"]
        gaps = [v["max_gap_s"] for v in exch]
        mean_gaps = [v["mean_gap_s"] for v in exch if v["mean_gap_s"] is not None]
        victims = {
            "count": len(exch),
            "mode": self.settings.exchange,
            "max_gap_s": max(gaps, default=0.0),
            "mean_max_gap_s": float(np.mean(gaps)) if gaps else 0.0,
            "mean_decode_time_s": float(np.mean(mean_gaps)) if mean_gaps else 0.0,
            "restore_moves": len(self.victim_records) - len(exch),
            "kv_chunk_bytes_mean": self._chunk_sum / self._chunk_n if self._chunk_n else None,
        }
        kv_per_gpu = (self.mem.cap_b[0] - self.model.weight_bytes) // self.tp
        extra = {
            "memory": {
                "drops": self.drops,
                "restores": self.restores,
                "bytes_freed": self.bytes_freed,
                "time_in_pipeline_s": self.time_in_pipeline_s,
                "group_seconds": self.group_seconds,
                "events": self.mem_events,
                "timeline": {
                    "t": self.tl_t,
                    "groups": self.tl_groups,
                    "dropped_bytes": self.tl_dropped,
                },
            },
            "kunserve": {
                "stack": self.stack,
                "settings": {
                    k: getattr(self.settings, k) for k in self.settings.__dataclass_fields__
                },
                "victims": victims,
                "victim_records": self.victim_records,
            },
        }
        cfg = dict(self.config)
        notes = list(self.notes)
        note = context_note(self.records)
        if note is not None:
            notes.append(note)
        if self.aborted:
            notes.append(f"{self.aborted} planned migrations were aborted")
        return RunResult(
            records=self.records,
            timeseries=self.timeseries,
            gpu_intervals=[
                GpuInterval(g, t0, end_s)
                for m, t0 in sorted(self.active_since.items())
                for g in range(m * self.tp, (m + 1) * self.tp)
            ],
            migrations=self.migrations,
            end_s=end_s,
            kv_bytes_per_gpu=kv_per_gpu,
            config=cfg,
            sim_wall_s=wall_s,
            sim_events=self.n_events,
            notes=notes,
            aborted_migrations=self.aborted,
            extra=extra,
        )

    # ------------------------------------------------------------- integrity
    def check_integrity(self, arrived: int) -> None:
        """Every invariant: no instance over-committed, token accounting,
        corrections equal to the pending pieces, one copy of every layer per
        executor, every arrived request in exactly one place."""
        seen: dict[int, str] = {}

        def place(s: Seq, where: str) -> None:
            assert s.id not in seen, f"request {s.id} in {seen[s.id]} and {where}"
            seen[s.id] = where

        corr = [0] * self.n
        pend = [0] * self.n
        members_seen: set[int] = set()
        for e in self.execs.values():
            # one complete copy of every layer: the stages partition the layers,
            # and every member holds (at least) its stage's layers
            covered = sorted(e.ranges.values())
            assert covered[0][0] == 0 and covered[-1][1] == self.L, (e.id, covered)
            for (_, hi), (lo, _) in itertools.pairwise(covered):
                assert hi == lo, (e.id, covered)
            for m, (lo, hi) in e.ranges.items():
                assert m not in members_seen, f"instance {m} in two executors"
                members_seen.add(m)
                assert self.exe_of[m] is e
                h = self.mem.held[m]
                assert h[0] <= lo and hi <= h[1], (m, h, (lo, hi))
            assert e.room_tokens() == min(self.avail_tl(m) // n for m, n in e.layers.items())
            cap_tl = self.mem.cap_tl
            assert e.capacity_tokens() == min(cap_tl(m) // n for m, n in e.layers.items())
            e.group.check_integrity()  # its requests, layout (members' bytes) and jobs
            assert (e.group.state == "merging") == e.frozen
            assert e.group.max_num_seqs == self._cap(e), (e.id, e.group.max_num_seqs)
            t = 0
            for s in e.running.values():
                place(s, f"running on {e.id}")
                assert s.state == RUNNING and s.bound and s.inst is e
                assert s.base + e.steps <= s.prompt_tokens + s.output_tokens - 1
                t += s.kv_tokens  # (with the token of a decode round in flight)
            for s in e.prefill:
                place(s, f"prefill on {e.id}")
                assert s.state == PREFILLING and s.kv_saved == s.prefill_tokens, s.id
                t += s.prefill_tokens
            for s in e.stalled.values():
                place(s, f"stalled on {e.id}")
                t += s.kv_saved
            for s in e.pending_attach:
                place(s, f"attaching to {e.id}")
                t += s.kv_saved
            for s in e.prefilled:
                place(s, f"prefilled on {e.id}")
                assert e.decoding, f"executor {e.id}: prefilled requests not joined"
                assert s.kv_saved == s.prefill_tokens, s.id
                t += s.prefill_tokens
            assert e.k > 1 or e.group.lanes_in_flight() <= 1, f"replica {e.id} has lanes"
            for s in e.waiting:
                place(s, f"waiting on {e.id}")
                assert s.state == WAITING and not s.pieces and not s.bound and s.kv_saved == 0
            for s in e.swapped:
                place(s, f"swapped from {e.id}")
            reserved = 0
            for s2 in self.seqs[:arrived]:
                if s2 is None:
                    continue
                if s2.mig is not None and s2.mig.dst is e:
                    reserved += s2.mig.tokens
                if s2.state == TRANSIT and s2.inst is e and s2 not in e.pending_attach:
                    reserved += s2.kv_saved
            assert e.T() == t + reserved, (e.id, e.T(), t, reserved)
            for s in [*e.running.values(), *e.stalled.values(), *e.pending_attach]:
                for p in s.pieces:
                    assert not p.cancelled
                    corr[p.src] += p.token_layers
                    if not p.started:
                        corr[p.dst] -= p.token_layers
                        pend[p.dst] += p.token_layers
        for s3 in self.seqs[:arrived]:
            if s3 is not None and s3.state == TRANSIT and s3.id not in seen:
                place(s3, "in transit")
        assert members_seen == {m for m in range(self.n) if self.active[m]}
        live = {p for e in self.execs.values() for p in e.live_pieces}
        assert {p for at in self.live_src.values() for p in at} == live, "live pieces by source"
        assert all(self.live_src.values()), "an instance without live pieces has an entry"
        mem = self.mem
        assert corr == mem.corr, (corr, mem.corr)
        assert pend == mem.pend_in, (pend, mem.pend_in)
        for m in range(self.n):
            if not self.active[m]:
                assert self.exe_of[m] is None and mem.corr[m] == 0 and mem.pend_in[m] == 0
                continue
            used = self.used_tl(m)
            assert used >= 0, (m, used)
            mem.check_instance(m, used)
        for rec in self.records[:arrived]:
            in_flight = rec.id in seen
            terminal = rec.status in ("finished", "rejected")
            assert in_flight != terminal, f"request {rec.id}: in flight={in_flight}, {rec.status}"
