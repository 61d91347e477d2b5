"""Mell's scheduler (stack ``mell``): the packer of Fig. 10 driven once per epoch.

Two registered policies share one state:

* dispatch ``mell`` holds every arrival at the controller (:class:`Defer`);
* migration ``mell`` runs Algorithm 1 every ``migration.epoch_s`` seconds.

One :class:`~fleetserve.policy.mell.packer.MellPacker` per model models that
model's instances as bins of capacity ``C = state.request_blocks[model]``
(an instance's KV blocks minus the admission watermark: what requests may
fill). A request's size is ``S_i = ceil(demand_tokens / block_size)``
blocks (its KV now, or what it needs once re-admitted after a preemption),
capped at ``C``. Each epoch, in this order (Algorithm 1 with *request-operation
batching*):

1. **Departs** of the requests that finished since the last epoch
   (``on_finish``), in finishing order.
2. **Updates**: every request seen on an instance whose size in blocks
   changed. A change of class, or one that would overflow its GPU, runs
   ``update`` (Fig. 10); growth inside the class that still fits only
   records the size (``set_size``: ``update`` would do nothing else).
   Requests whose state is in flight (a token move in transit, a KV move
   after its detach) are updated at the next epoch.
3. **Allocates** of the arrivals held since the last epoch, in arrival order,
   with their prompt as size.

All moves the operations cause are buffered. With ``mell.batching`` (the
default) they are netted per request: the request goes from where it was
before the epoch straight to where it is after it (a request moved twice
moves once; one moved back to its GPU does not move; an arrival is
dispatched straight to its final GPU), and a GPU opened and emptied within
the epoch is never activated. With ``mell.batching: false`` every move is
issued as the operation produced it, in order (a request may hop twice;
the simulator runs the hops one after the other), and a GPU opened within
the epoch is activated even when it is empty again by the epoch's end.

The plan is: ``ReleaseGpu`` of instances whose bin the packer closed, once
they are idle (an instance still draining, e.g. a request migrating out, is
released at a later epoch; no new request is ever sent to it), then
``ActivateGpu`` (one per new bin that is used, with a ``ref``), ``Dispatch``
of the arrivals, and ``Migrate`` (mode None: the configured mechanism,
Mell's ``adaptive`` in the stack, picks KV or token and may postpone a move
to a later epoch).

**Growth between epochs.** Sizes are exact only at epoch boundaries; in
between, running requests grow by one token per decode step and the packer
may have filled a GPU up to ``C``. A GPU never over-commits: when its KV is
full, the instance preempts as vLLM does (the newest running request frees
its KV and re-queues for recompute; see the ``fcfs`` batching policy), and
a KV migration into it aborts when the destination has no room. The next
epoch's Updates see the preempted request's full demand (``demand_tokens``
does not shrink when the KV is freed), so the overflowing GPU is repaired by
Fig. 10's overflow handling then. With the default 0.5 s epoch a request
grows by about one block per epoch.

**When reality lags the plan.** The packer assumes its moves happen at once;
the simulator may postpone a move (link and compute budgets) or abort one
(destination full, request preempted or finished). A postponed move keeps
its place in the request's FIFO. An aborted one is reported through
``on_move_aborted``; the next epoch re-issues a move to the GPU the packer
has the request on, if the request is not there. Meanwhile the packer's
view differs from the instances' by the requests in flight; memory is
still never over-committed (the simulator checks every reservation).

**Headroom (an extension, off by default).** With ``mell.headroom_blocks``
= ``h`` > 0 the packer sees every request as ``h`` blocks larger than it is
(capped at ``C``), in Allocates and Updates alike. A GPU it packs full then
holds ``h`` blocks per request less than ``C``: room for the growth until the
next epochs' moves are done, so fewer moves find their destination full
(refused starts) and fewer GPUs preempt, at the cost of GPUs. The paper packs
exact sizes (``h = 0``).

**Pool cap.** Mell needs an elastic pool. An arrival whose allocation would
open a GPU beyond ``cluster.max_gpus`` is departed again (an ordinary
Depart) and stays held until GPUs free up; an Update that needs a GPU beyond
the cap stops the run with an error naming the setting to raise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from fleetserve.cluster.state import ClusterState, blocks_for
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.policy.actions import ActivateGpu, Defer, Dispatch, Migrate, ReleaseGpu
from fleetserve.policy.base import DISPATCH, MIGRATION, DispatchPolicy, MigrationPolicy
from fleetserve.policy.mell.packer import L as L_CLASS
from fleetserve.policy.mell.packer import MellPacker, Move, OpResult, size_class
from fleetserve.workload.request import Request

if TYPE_CHECKING:
    from fleetserve.config import SimConfig


@dataclass(slots=True)
class MellStats:
    """What the scheduler's operations did over a run (for tests and reports).

    Attributes:
        departs, updates, allocates: operations run.
        raw_moves: migrations the operations produced (before netting).
        dropped_moves: of those, moves of requests that departed again in the
            same epoch (an arrival un-allocated at the pool cap): never issued.
        reissued_moves: ``Migrate`` actions repeating an aborted move.
        issued_moves: ``Migrate`` actions in the plans. Without batching,
            ``issued = raw - dropped + reissued``; batching issues fewer.
        item_moves_max: the most item moves (Theorem 3's unit) of one operation.
        moves_by_cause: ``raw_moves`` by the operation that made them:
            ``depart``, ``allocate``, ``update: class change`` (Fig. 10's
            Update), ``update: L growth overflow`` (Fig. 10's L -> L),
            ``update: growth overflow, not L`` (a T/S/M request that grew
            within its class past its GPU's capacity: Algorithm 1 calls no
            operation for it, see :class:`MellScheduler`) and ``pool cap``
            (an arrival allocated and departed again at the pool cap).
        strict_overflows: with ``strict_update``, such overflows only resized.
        cap_holds: Updates undone because they opened a bin beyond a fixed
            pool (``ClusterState.pool_fixed``: the runtime's workers; the
            simulator's cap raises instead). Reported only when nonzero.
    """

    departs: int = 0
    updates: int = 0
    allocates: int = 0
    raw_moves: int = 0
    dropped_moves: int = 0
    reissued_moves: int = 0
    issued_moves: int = 0
    item_moves_max: int = 0
    moves_by_cause: dict[str, int] = field(default_factory=dict)
    strict_overflows: int = 0
    cap_holds: int = 0


@dataclass(slots=True)
class _ModelState:
    packer: MellPacker
    inst: dict[int, int] = field(default_factory=dict)  # bin id -> instance id (or ref)


def net_moves(moves: list[Move]) -> list[tuple[int, int | None, int]]:
    """Request-operation batching of an epoch's moves: per request (in order of
    first appearance) one ``(rid, first source, last destination)``; requests
    that end where they started are left out. A source of None (a new
    request's placement) stays None: it is dispatched to its last GPU."""
    first: dict[int, int | None] = {}
    last: dict[int, int] = {}
    for mv in moves:
        if mv.rid not in first:
            first[mv.rid] = mv.src
        last[mv.rid] = mv.dst
    return [(rid, src, last[rid]) for rid, src in first.items() if src != last[rid]]


@DISPATCH.register("mell")
class MellDispatch(DispatchPolicy):
    """Hold every arrival for the next epoch's Allocates (Algorithm 1).

    Needs migration policy ``mell``, which allocates what this holds.
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.arrivals: list[Request] = []
        self.attached = False

    def dispatch(
        self, state: ClusterState, req: Request, now: float, rng: np.random.Generator
    ) -> Defer:
        if not self.attached:
            raise ConfigError(
                "dispatch 'mell' needs migration 'mell' (use --stack mell, or set both)"
            )
        self.arrivals.append(req)
        return Defer(req.id)


@MIGRATION.register("mell")
class MellScheduler(MigrationPolicy):
    """Algorithm 1 once per epoch over one Mell packer per model (module docstring).

    Args:
        interval_s: epoch length in seconds.
        batching: request-operation batching (net the epoch's moves).
        w_requests, w_free, w_distance: the packer's priority weights.
        strict_update: Update only on a class change or an L-request's
            overflow (Fig. 10, Algorithm 1); a T/S/M request overflowing its
            GPU within its class is only resized (``mell.strict_update``).
        headroom_blocks: blocks added to every request's size (module
            docstring; ``mell.headroom_blocks``).
    """

    def __init__(
        self,
        interval_s: float = 0.5,
        batching: bool = True,
        w_requests: float = 1.0,
        w_free: float = 1.0,
        w_distance: float = 1.0,
        strict_update: bool = False,
        headroom_blocks: int = 0,
        **params: Any,
    ) -> None:
        super().__init__(**params)
        if headroom_blocks < 0:
            raise ConfigError(f"mell.headroom_blocks must be >= 0, got {headroom_blocks}")
        self.interval_s = interval_s
        self.headroom = int(headroom_blocks)
        self.batching = batching
        self.strict_update = strict_update
        self.weights = {"w_requests": w_requests, "w_free": w_free, "w_distance": w_distance}
        self.models: dict[str, _ModelState] = {}
        self.dispatcher: MellDispatch | None = None
        self.finished: list[int] = []
        self.aborted: set[int] = set()
        self.retiring: dict[int, None] = {}  # instances whose bin closed, awaiting idleness
        self._refs: dict[int, tuple[str, int]] = {}  # ref -> (model, bin) of this plan
        self.stats = MellStats()

    @classmethod
    def from_config(cls, config: SimConfig) -> Self:
        """Epoch from ``migration.epoch_s``; batching and weights from ``mell``."""
        if not config.cluster.elastic:
            raise ConfigError(
                "the Mell scheduler activates and releases GPUs: it needs an elastic "
                "pool (cluster.elastic: true)"
            )
        m = config.mell
        return cls(
            interval_s=config.migration.epoch_s,
            batching=m.batching,
            w_requests=m.w_requests,
            w_free=m.w_free,
            w_distance=m.w_distance,
            strict_update=m.strict_update,
            headroom_blocks=m.headroom_blocks,
        )

    # ------------------------------------------------------------------ hooks
    def attach(self, dispatcher: DispatchPolicy) -> None:
        if not isinstance(dispatcher, MellDispatch):
            raise ConfigError(
                f"migration 'mell' needs dispatch 'mell', got {type(dispatcher).__name__} "
                "(use --stack mell)"
            )
        dispatcher.attached = True
        self.dispatcher = dispatcher

    def bind(self, ref: int, instance_id: int) -> None:
        model, bid = self._refs.pop(ref)
        ms = self.models[model]
        if ms.inst.get(bid) == ref:
            ms.inst[bid] = instance_id
        else:  # the bin closed within the plan (unbatched): retire its instance
            self.retiring[instance_id] = None

    def on_finish(self, request_id: int, instance_id: int, now: float) -> None:
        self.finished.append(request_id)

    def on_release(self, instance_id: int, now: float) -> None:
        self.retiring.pop(instance_id, None)

    def on_move_aborted(self, request_id: int) -> None:
        self.aborted.add(request_id)

    # ------------------------------------------------------------------- plan
    def plan(self, state: ClusterState, now: float, rng: np.random.Generator) -> list[Any]:
        stats = self.stats
        moves: dict[str, list[Move]] = {}
        self._refs.clear()

        # 1. Departs.
        finished, self.finished = self.finished, []
        for rid in finished:
            for model, ms in self.models.items():
                if rid in ms.packer.where:
                    self._op(ms.packer.depart(rid), moves.setdefault(model, []), stats, "depart")
                    stats.departs += 1
                    break

        # 2. Updates (and where each visible request really is).
        located: dict[int, int] = {}
        for iid, view in state.instances.items():
            ms_view = self.models.get(view.model)
            for seq in view.seqs():
                if ms_view is None or seq.id not in ms_view.packer.where:
                    raise RuntimeError(
                        f"Mell: request {seq.id} on instance {iid} was not allocated by Mell"
                    )
                if not seq.migrating:
                    located[seq.id] = iid
                p = ms_view.packer
                size = self._size(p, seq.demand_tokens, state.block_size)
                if size == p.size[seq.id]:
                    continue
                if p.needs_update(seq.id, size):
                    old = p.cls[seq.id]
                    if size_class(size, p.C) != old:
                        cause = "update: class change"
                    elif old == L_CLASS:
                        cause = "update: L growth overflow"
                    else:
                        cause = "update: growth overflow, not L"
                        if self.strict_update:  # Algorithm 1 runs no operation for it
                            p.set_size(seq.id, size)
                            stats.strict_overflows += 1
                            continue
                    saved = copy.deepcopy(p) if state.pool_fixed else None
                    res = p.update(seq.id, size)
                    if saved is not None and not self._room(state):
                        # A fixed pool (the runtime's workers) has no GPU for the
                        # bin this Update opens: undo it; the request grows in
                        # place (its engine preempts if the GPU fills).
                        ms_view.packer = saved
                        saved.set_size(seq.id, size)
                        stats.cap_holds += 1
                        continue
                    self._op(res, moves.setdefault(view.model, []), stats, cause)
                    stats.updates += 1
                else:
                    p.set_size(seq.id, size)
        self._check_cap(state, "an Update")

        # 3. Allocates.
        if self.dispatcher is not None and self.dispatcher.arrivals:
            freed = self._freeable(state)
            waiting, self.dispatcher.arrivals = self.dispatcher.arrivals, []
            for i, req in enumerate(waiting):
                ms = self._model(state, req.model)
                p = ms.packer
                size = self._size(p, req.prompt_tokens, state.block_size)
                before = len(p.new_bins)
                res = p.allocate(req.id, size)
                if len(p.new_bins) > before and not self._room(state, freed):
                    # Beyond the pool cap: undo (an ordinary Depart) and keep it held.
                    self._op(res, moves.setdefault(req.model, []), stats, "pool cap")
                    self._op(p.depart(req.id), moves[req.model], stats, "pool cap")
                    self.dispatcher.arrivals = waiting[i:]
                    break
                self._op(res, moves.setdefault(req.model, []), stats, "allocate")
                stats.allocates += 1

        actions = self._actions(state, moves, located)
        stats.issued_moves += sum(isinstance(a, Migrate) for a in actions)
        return actions

    # ---------------------------------------------------------------- helpers
    def _size(self, p: MellPacker, tokens: int, block_size: int) -> int:
        """A request's size in the packer: its blocks plus the headroom, in ``[1, C]``."""
        return min(p.C, max(1, blocks_for(tokens, block_size)) + self.headroom)

    def _model(self, state: ClusterState, model: str) -> _ModelState:
        ms = self.models.get(model)
        if ms is None:
            cap = state.request_blocks.get(model)
            if cap is None:
                raise RuntimeError(f"Mell: no KV capacity known for model {model!r}")
            ms = _ModelState(MellPacker(cap, **self.weights))
            self.models[model] = ms
        return ms

    @staticmethod
    def _op(res: OpResult, out: list[Move], stats: MellStats, cause: str) -> None:
        """Buffer an operation's moves (counted under ``cause``)."""
        out.extend(res.moves)
        stats.raw_moves += res.migrations
        if res.migrations:
            stats.moves_by_cause[cause] = stats.moves_by_cause.get(cause, 0) + res.migrations
        stats.item_moves_max = max(stats.item_moves_max, res.item_moves)

    def report(self) -> dict[str, Any]:
        """:class:`MellStats` (``summary.json``'s ``mell`` section)."""
        st = self.stats
        return {
            "departs": st.departs,
            "updates": st.updates,
            "allocates": st.allocates,
            "raw_moves": st.raw_moves,
            "dropped_moves": st.dropped_moves,
            "reissued_moves": st.reissued_moves,
            "issued_moves": st.issued_moves,
            "item_moves_max": st.item_moves_max,
            "moves_by_cause": dict(sorted(st.moves_by_cause.items())),
            "strict_overflows": st.strict_overflows,
        } | ({"cap_holds": st.cap_holds} if st.cap_holds else {})

    def _freeable(self, state: ClusterState) -> int:
        """GPUs this plan will release before it activates any: idle instances
        whose bin is closed. (Unbatched, a hop may still target such an
        instance, so nothing is counted.)"""
        if not self.batching:
            return 0
        iids = set(self.retiring)
        for ms in self.models.values():
            iids.update(i for b, i in ms.inst.items() if i >= 0 and b not in ms.packer.bins)
        views = (state.instances.get(i) for i in iids)
        return sum(len(v.gpus) for v in views if v is not None and v.idle)

    def _room(self, state: ClusterState, freed: int = 0) -> bool:
        """Whether the bins opened this epoch fit in the pool once ``freed``
        GPUs are released (releases come first in the plan)."""
        gpus = 0
        for model, ms in self.models.items():
            alive = sum(1 for b in ms.packer.new_bins if b in ms.packer.bins)
            gpus += alive * state.model_tp.get(model, 1)
        return state.gpus_active - freed + gpus <= state.gpus_limit

    def _check_cap(self, state: ClusterState, what: str) -> None:
        if not self._room(state):
            raise FleetserveError(
                f"Mell: {what} needs more GPUs than the pool's cap "
                f"(cluster.max_gpus = {state.gpus_limit}); raise cluster.max_gpus"
            )

    def _actions(
        self, state: ClusterState, moves: dict[str, list[Move]], located: dict[int, int]
    ) -> list[Any]:
        activate: list[Any] = []
        dispatch: list[Any] = []
        migrate: list[Any] = []
        targets: set[int] = set()
        next_ref = -1

        for model, ms in self.models.items():
            p = ms.packer
            tp = state.model_tp.get(model, 1)

            def inst(bid: int, ms: _ModelState = ms, model: str = model, tp: int = tp) -> int:
                nonlocal next_ref
                got = ms.inst.get(bid)
                if got is None:
                    got = next_ref
                    next_ref -= 1
                    ms.inst[bid] = got
                    self._refs[got] = (model, bid)
                    activate.append(ActivateGpu(model, tp, ref=got))
                return got

            raw = moves.get(model, [])
            self.stats.dropped_moves += sum(
                1 for mv in raw if mv.src is not None and mv.rid not in p.where
            )
            hops = net_moves(raw) if self.batching else [(m.rid, m.src, m.dst) for m in raw]
            for rid, src, dst in hops:
                if rid not in p.where:
                    continue  # allocated and departed again (pool cap)
                target = inst(dst)
                targets.add(target)
                if src is None:
                    dispatch.append(Dispatch(rid, target))
                else:
                    migrate.append(Migrate(rid, target))
            p.new_bins.clear()

            # Requests whose move was aborted: move them again where the packer has them.
            moved = {a.request_id for a in migrate}
            for rid in sorted(self.aborted):
                b = p.where.get(rid)
                if b is None or rid not in located or rid in moved:
                    continue
                want = ms.inst.get(b.id)
                if want is not None and want >= 0 and located[rid] != want:
                    migrate.append(Migrate(rid, want))
                    targets.add(want)
                    self.stats.reissued_moves += 1
            # Bins the packer closed: their instances retire.
            for bid in [bid for bid in ms.inst if bid not in p.bins]:
                iid = ms.inst.pop(bid)
                if iid >= 0:
                    self.retiring[iid] = None
            # Node of newly bound instances (GPU-to-GPU distance priority).
            for bid, iid in ms.inst.items():
                b = p.bins[bid]
                if b.node is None and iid >= 0 and iid in state.instances:
                    b.node = state.instances[iid].gpus[0] // state.gpus_per_node
        # Forget aborts once handled (request seen) or moot (request departed).
        self.aborted = {
            r
            for r in self.aborted
            if r not in located and any(r in ms.packer.where for ms in self.models.values())
        }

        release: list[Any] = []
        for iid in list(self.retiring):
            view = state.instances.get(iid)
            if view is None:
                del self.retiring[iid]
            elif view.idle and iid not in targets:
                release.append(ReleaseGpu(iid))
        return release + activate + dispatch + migrate
