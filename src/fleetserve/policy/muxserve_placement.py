r"""MuxServe placement: enumeration-based greedy (Algorithms 1 and 2) and its estimator.

MuxServe (``shared/papers/003_66cd2b48dd395bf4.txt``, §4.2) groups LLMs into
*LLM units*: a mesh of ``tp`` GPUs holding every unit member's weights (split
``tp`` ways) and one KV pool they share. It searches

.. code-block:: text

    B* = argmax_B  sum_{b in B} F(b, W_b)          F = estimated unit throughput

with three pieces, all here:

* :func:`estimate_unit_throughput` — ``F(b, W_b)`` (§4.2.3)::

      tpt^m = min{ b^m / (sum_{i in b} t_p^i + t_d^m * l_o^m),  rate_m }

  Prefills of the unit's LLMs run one after another (every member's batch
  prefill ``t_p^i`` is in every member's cycle), decodes overlap (only its own
  ``t_d^m``), each decode job on its share of the compute units.
* :func:`llm_parallel_candidates` — Algorithm 2: per LLM and tensor degree,
  the fewest compute units (``share``) that meet its rate alone.
* :func:`muxserve_place` / :func:`muxserve_search` — Algorithm 1: for every
  potential mesh group (a multiset of mesh sizes), place LLMs in decreasing
  computation requirement, each on the mesh with the largest marginal gain
  ``F(mesh + m) - F(mesh)``; keep the mesh group with the highest total.

Choices where the paper is vague (each also noted where it is made):

1. **Time of a job.** ``t_p^i`` = one prefill iteration of ``b^i`` prompts of
   ``round(mean_prompt)`` tokens (:meth:`InstanceCost.prefill_time`, run on
   ``prefill_share`` of the compute, 1.0 by default as MuxServe's prefill jobs
   get ~all SMs); ``t_d^m`` = one decode iteration of ``b^m`` sequences reading
   ``b^m (mean_prompt + mean_output / 2)`` KV tokens (the mean context over a
   request's decode steps); ``l_o^m`` = ``mean_output``. Using the mean prompt
   length undercounts the quadratic attention term a little (E[l^2] >= E[l]^2).
2. **Compute shares ("number of SMs").** A decode job of service ``m`` runs on
   a fraction ``s_m`` of the mesh's compute units (the roofline's ``share``:
   compute stretches by ``1 / s_m``, HBM traffic does not). In a placement,
   ``s_m`` is the service's Algorithm-2 share at that mesh size. Decodes of
   co-located services run concurrently, so when ``sum s_m > 1`` the shares are
   scaled down pro rata to sum to 1 (oversubscribed SMs). Without explicit
   ``decode_shares``, :func:`estimate_unit_throughput` gives every decode
   ``1 / n`` of the compute of an ``n``-member unit.
3. **Memory.** Weights of every member are resident (``ceil(W / tp)`` per GPU);
   the unit's KV bytes are ``tp * (floor(hbm * mem_util) - sum ceil(W_m / tp))``.
   One request of service ``m`` holds ``(mean_prompt + mean_output)`` tokens of
   KV at its peak (``kv_bytes_per_token``, times ``ceil(tp / num_kv_heads)``
   when KV heads are replicated). A unit *fits* when its KV bytes hold one such
   request of every member (:func:`unit_fits`). The KV pool is split into
   per-service quotas (MuxServe's token-block quotas): each member first gets
   one request's worth, the rest is split in proportion to demand
   ``rate_m * bytes_per_request_m`` (equally when every rate is 0). The largest
   batch ``b_max^m`` is what the quota holds, capped at ``max_batch`` (vLLM's
   ``max_num_seqs`` default, 256). These rate-normalized quotas stand in for
   the paper's fairness constraint (Eq. 2, token-block usage normalized by
   rate within ``epsilon``); no separate ``epsilon`` is modelled.
4. **Batch sizes.** For each member the binary search finds the smallest
   ``b^m <= b_max^m`` whose ``tpt^m`` reaches ``rate_m`` (``b_max^m`` if none).
   Members are coupled through ``sum t_p^i``: a larger batch of one lengthens
   everyone's cycle. The batches are found by a monotone fixed point (start at
   1, re-run each member's search against the others' current batches until
   nothing changes); since the needed batch only grows with the others', this
   converges to the least batches meeting every rate it can. A service with
   rate 0 has batch 0 and no prefill. A member's *capacity* is its uncapped
   ``tpt^m`` when every member with a rate runs at its ``b_max`` (a saturated
   unit); ``capacity / rate`` is its headroom.
5. **Parallel candidates (Algorithm 2).** Tensor degrees: powers of two up to
   ``gpus_per_node`` (and the pool) on which the service alone fits. Shares:
   ``share_grid`` (0.1, 0.2, ..., 1.0, as MuxServe's MPS percentages). For each
   degree the candidate is the smallest share meeting the rate alone, else the
   share of highest throughput. The *preferred* candidate is the one meeting
   the rate with the fewest SM-GPUs (``tp * share``), else the fastest.
6. **Mesh groups (Algorithm 1, get_potential_device_mesh_groups).** A mesh
   group is a multiset of mesh sizes (powers of two <= a node); its meshes are
   laid out in nodes afterwards (first-fit decreasing, never spanning nodes).
   Pruning: (a) the group uses as many GPUs of the pool as any surviving
   group can (MuxServe partitions every node); (b) no mesh is smaller than the
   smallest preferred tp of any service; (c) at most one mesh per service, and
   more generally, for every size k, no more meshes of size <= k than services
   whose smallest feasible tp is <= k (otherwise some mesh would stay empty);
   (d) the largest mesh is at least the largest smallest-feasible tp. If more than
   ``max_mesh_groups`` remain, the ones whose GPU split over mesh sizes is
   closest (L1) to the services' preferred degrees are kept. With 19 LLMs on
   32 GPUs this leaves 121 groups; 16 LLMs on 128 GPUs leave one (16 x 8).
   Each service is placed once (no replicas), as in MuxServe, so GPUs beyond
   one full node per service stay unused.
7. **Greedy (Algorithm 1, lines 5-16).** Services sorted by ``rate *
   weight_bytes`` (descending, then name). Only meshes where the unit still
   fits are considered; empty meshes of one size are equivalent, so only the
   first is evaluated. Ties in ``delta`` (e.g. every mesh meets the rate) go to
   the mesh with the lowest resulting computation load per GPU (``sum rate *
   weight_bytes / size``), then the smaller mesh, then the earlier one.
8. **Best mesh group.** Highest total estimated throughput; ties (e.g. every
   group meets all demand) go to the group with the most headroom (the largest
   minimum over services of capacity / rate), then to the earlier group in the
   enumeration order (fewer meshes first).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from fleetserve.costmodel.roofline import CostModel, InstanceCost
from fleetserve.errors import ConfigError
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.spec.memory import group_kv_bytes as unit_kv_bytes
from fleetserve.spec.memory import kv_replication
from fleetserve.spec.types import GpuSpec, ModelSpec
from fleetserve.workload.service import Service

__all__ = [
    "DEFAULT_MAX_BATCH",
    "DEFAULT_SHARE_GRID",
    "MuxServeResult",
    "ParallelCandidate",
    "ServiceEstimate",
    "UnitEstimate",
    "estimate_unit_throughput",
    "llm_parallel_candidates",
    "muxserve_place",
    "muxserve_search",
    "potential_mesh_groups",
    "preferred_candidate",
    "unit_fits",
    "unit_kv_bytes",
]

logger = logging.getLogger(__name__)

DEFAULT_SHARE_GRID: tuple[float, ...] = tuple(i / 10 for i in range(1, 11))
"""Compute shares Algorithm 2 tries (MuxServe's MPS percentages 10 %, ..., 100 %)."""

DEFAULT_MAX_BATCH = 256
"""Largest batch per service (vLLM's default ``max_num_seqs``)."""

DEFAULT_MAX_MESH_GROUPS = 256
_GB = 1e9
_REL_TOL = 1e-9


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class ServiceEstimate:
    """One service's part of a unit estimate.

    Attributes:
        name: service name.
        rate: its demand, req/s.
        batch: ``b^m`` chosen by the binary search (0 when the rate is 0).
        max_batch: the largest batch its KV quota holds (capped at ``max_batch``).
        share: compute share its decode job ran on (after scaling, see module doc).
        prefill_s: ``t_p^m``, one prefill of ``batch`` prompts (0 when batch is 0).
        decode_s: ``t_d^m``, one decode iteration at ``batch``.
        cycle_s: ``sum_i t_p^i + t_d^m * mean_output``, the denominator.
        throughput: ``min(batch / cycle_s, rate)``, req/s.
        capacity: uncapped throughput when every member with a rate runs at its
            ``max_batch`` (the unit saturated).
    """

    name: str
    rate: float
    batch: int
    max_batch: int
    share: float
    prefill_s: float
    decode_s: float
    cycle_s: float
    throughput: float
    capacity: float

    @property
    def meets_rate(self) -> bool:
        """Whether the estimate serves the whole demand."""
        return self.throughput >= self.rate


@dataclass(frozen=True, slots=True)
class UnitEstimate:
    """``F(b, W_b)`` of one LLM unit, with its parts.

    Attributes:
        tp: GPUs of the mesh (tensor-parallel degree of every member).
        kv_bytes: KV-cache bytes of the whole mesh after the weights.
        services: per-member estimates, in the order given.
    """

    tp: int
    kv_bytes: int
    services: tuple[ServiceEstimate, ...]

    @property
    def total(self) -> float:
        """``F``: the sum of the members' throughputs, req/s."""
        return sum(s.throughput for s in self.services)

    @property
    def throughput(self) -> dict[str, float]:
        """Per-service throughput, req/s."""
        return {s.name: s.throughput for s in self.services}

    @property
    def prefill_sum_s(self) -> float:
        """``sum_i t_p^i``: the sequential prefills every member waits for."""
        return sum(s.prefill_s for s in self.services)

    @property
    def headroom(self) -> float:
        """Smallest capacity / rate over members with a rate (inf if none)."""
        ratios = [s.capacity / s.rate for s in self.services if s.rate > 0]
        return min(ratios) if ratios else math.inf


@dataclass(frozen=True, slots=True)
class ParallelCandidate:
    """Algorithm 2's candidate for one service on ``tp`` GPUs.

    Attributes:
        service: service name.
        tp: tensor-parallel degree.
        share: the smallest compute share meeting the rate alone, else the
            share with the highest throughput.
        batch: the batch size at that share.
        throughput: estimated throughput alone, req/s.
        meets_rate: whether ``throughput`` reaches the rate.
    """

    service: str
    tp: int
    share: float
    batch: int
    throughput: float
    meets_rate: bool

    @property
    def sm_gpus(self) -> float:
        """Compute used, in GPUs' worth of SMs (``tp * share``)."""
        return self.tp * self.share


@dataclass(frozen=True, slots=True)
class MuxServeResult:
    """What Algorithm 1 found.

    Attributes:
        plan: the placement (empty meshes dropped).
        units: the estimate of each group of ``plan.groups``, same order.
        total_throughput: sum of the units' ``F``, req/s.
        demand: sum of the services' rates, req/s.
        mesh_sizes: the chosen mesh group, empty meshes included (descending).
        mesh_groups_evaluated: mesh groups the greedy ran on.
    """

    plan: PlacementPlan
    units: tuple[UnitEstimate, ...]
    total_throughput: float
    demand: float
    mesh_sizes: tuple[int, ...]
    mesh_groups_evaluated: int


# ----------------------------------------------------------------------------- memory


def _kv_per_token(spec: ModelSpec, tp: int) -> int:
    """KV bytes one token costs the mesh (KV heads replicated when tp > kv heads)."""
    return spec.kv_bytes_per_token * kv_replication(spec, tp)


def _request_kv_bytes(svc: Service, tp: int) -> int:
    """Peak KV bytes of one request of mean lengths on ``tp`` GPUs."""
    return math.ceil((svc.mean_prompt + svc.mean_output) * _kv_per_token(svc.spec, tp))


def unit_fits(services: Sequence[Service], tp: int, gpu: GpuSpec, mem_util: float = 0.9) -> bool:
    """Whether ``services`` fit together on ``tp`` GPUs: all weights plus one
    mean-length request of KV per service.

    Raises:
        ConfigError: invalid ``tp`` or ``mem_util``.
    """
    kv = unit_kv_bytes([s.spec for s in services], tp, gpu, mem_util)
    return kv > 0 and kv >= sum(_request_kv_bytes(s, tp) for s in services)


# ----------------------------------------------------------------------------- estimator


class _Estimator:
    """Memoizing evaluator of ``F`` for one (GPU type, cost model, settings).

    Placement evaluates the same units and the same (model, tp, batch) jobs many
    times; everything is cached by value.
    """

    __slots__ = (
        "_cost_model",
        "_decode",
        "_inst",
        "_prefill",
        "_units",
        "gpu",
        "max_batch",
        "mem_util",
        "prefill_share",
    )

    def __init__(
        self,
        gpu: GpuSpec,
        cost_model: CostModel,
        mem_util: float,
        prefill_share: float,
        max_batch: int,
    ) -> None:
        if not 0 < mem_util <= 1:
            raise ConfigError(f"mem_util must be in (0, 1], got {mem_util!r}")
        if not 0 < prefill_share <= 1:
            raise ConfigError(f"prefill_share must be in (0, 1], got {prefill_share!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.gpu = gpu
        self._cost_model = cost_model
        self.mem_util = mem_util
        self.prefill_share = prefill_share
        self.max_batch = max_batch
        self._inst: dict[tuple[ModelSpec, int], InstanceCost] = {}
        self._prefill: dict[tuple[ModelSpec, int, int, int], float] = {}
        self._decode: dict[tuple[ModelSpec, int, int, float, float], float] = {}
        self._units: dict[tuple[int, tuple[Service, ...], tuple[float, ...]], UnitEstimate] = {}

    def _bind(self, spec: ModelSpec, tp: int) -> InstanceCost:
        key = (spec, tp)
        inst = self._inst.get(key)
        if inst is None:
            inst = self._inst[key] = self._cost_model.bind(spec, self.gpu, tp)
        return inst

    def prefill(self, svc: Service, tp: int, batch: int) -> float:
        """``t_p``: one prefill iteration of ``batch`` mean-length prompts."""
        if batch <= 0:
            return 0.0
        p = max(1, round(svc.mean_prompt))
        key = (svc.spec, tp, p, batch)
        t = self._prefill.get(key)
        if t is None:
            inst = self._bind(svc.spec, tp)
            t = self._prefill[key] = inst.prefill_time([p] * batch, self.prefill_share)
        return t

    def decode(self, svc: Service, tp: int, batch: int, share: float) -> float:
        """``t_d``: one decode iteration of ``batch`` sequences at the mean context."""
        if batch <= 0:
            return 0.0
        ctx = svc.mean_prompt + svc.mean_output / 2.0
        key = (svc.spec, tp, batch, ctx, share)
        t = self._decode.get(key)
        if t is None:
            inst = self._bind(svc.spec, tp)
            t = self._decode[key] = inst.decode_time_scalar(batch, batch * ctx, share)
        return t

    def unit(self, services: Sequence[Service], tp: int, shares: Sequence[float]) -> UnitEstimate:
        """``F`` of ``services`` on ``tp`` GPUs, decode jobs on ``shares`` (see module doc).

        Raises:
            ConfigError: the unit does not fit (weights + one request each).
        """
        key = (tp, tuple(services), tuple(shares))
        hit = self._units.get(key)
        if hit is None:
            hit = self._units[key] = self._estimate(list(services), tp, list(shares))
        return hit

    def _estimate(self, svcs: list[Service], tp: int, shares: list[float]) -> UnitEstimate:
        n = len(svcs)
        kv = unit_kv_bytes([s.spec for s in svcs], tp, self.gpu, self.mem_util)
        per_req = [_request_kv_bytes(s, tp) for s in svcs]
        if kv <= 0 or kv < sum(per_req):
            names = ", ".join(s.name for s in svcs)
            raise ConfigError(
                f"services {names} do not fit together on {tp} x {self.gpu.name} at mem_util "
                f"{self.mem_util:.2f}: {kv / _GB:.1f} GB left for KV after the weights, "
                f"{sum(per_req) / _GB:.2f} GB needed for one request each"
            )
        # decode shares: scaled down pro rata when the SMs are oversubscribed
        over = max(1.0, sum(shares))
        eff = [s / over for s in shares]
        # KV quotas: one request each, the rest in proportion to demand
        demand = [s.rate * r for s, r in zip(svcs, per_req, strict=True)]
        total_demand = sum(demand)
        spare = kv - sum(per_req)
        bmax: list[int] = []
        for i in range(n):
            frac = demand[i] / total_demand if total_demand > 0 else 1.0 / n
            quota = per_req[i] + spare * frac
            bmax.append(max(1, min(self.max_batch, int(quota // per_req[i]))))

        outs = [s.mean_output for s in svcs]

        def tpt(i: int, b: int, others: float) -> float:
            t_d = self.decode(svcs[i], tp, b, eff[i])
            return b / (others + self.prefill(svcs[i], tp, b) + t_d * outs[i])

        batch = [1 if s.rate > 0 else 0 for s in svcs]
        pre = [self.prefill(svcs[i], tp, batch[i]) for i in range(n)]
        # monotone fixed point: each member's smallest batch meeting its rate
        # given the others' prefills; batches only grow, bounded by bmax
        changed = True
        while changed:
            changed = False
            total_pre = sum(pre)
            for i, svc in enumerate(svcs):
                if batch[i] == 0:
                    continue
                others = total_pre - pre[i]
                lo, hi = batch[i], bmax[i]
                if tpt(i, lo, others) < svc.rate:
                    if tpt(i, hi, others) < svc.rate:
                        lo = hi
                    else:
                        lo += 1  # tpt(lo) < rate <= tpt(hi): smallest b in (lo, hi]
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if tpt(i, mid, others) >= svc.rate:
                                hi = mid
                            else:
                                lo = mid + 1
                if lo != batch[i]:
                    batch[i] = lo
                    new_pre = self.prefill(svc, tp, lo)
                    total_pre += new_pre - pre[i]
                    pre[i] = new_pre
                    changed = True

        total_pre = sum(pre)
        # saturated capacity: every member with requests at its largest batch
        sat_pre = [self.prefill(svcs[i], tp, bmax[i]) if batch[i] else 0.0 for i in range(n)]
        sat_total = sum(sat_pre)
        out: list[ServiceEstimate] = []
        for i, svc in enumerate(svcs):
            cap = tpt(i, bmax[i], sat_total - sat_pre[i])
            if batch[i] == 0:
                out.append(
                    ServiceEstimate(svc.name, svc.rate, 0, bmax[i], eff[i], 0.0, 0.0, 0.0, 0.0, cap)
                )
                continue
            t_d = self.decode(svc, tp, batch[i], eff[i])
            cycle = total_pre + t_d * outs[i]
            out.append(
                ServiceEstimate(
                    name=svc.name,
                    rate=svc.rate,
                    batch=batch[i],
                    max_batch=bmax[i],
                    share=eff[i],
                    prefill_s=pre[i],
                    decode_s=t_d,
                    cycle_s=cycle,
                    throughput=min(batch[i] / cycle, svc.rate),
                    capacity=cap,
                )
            )
        return UnitEstimate(tp=tp, kv_bytes=kv, services=tuple(out))


def estimate_unit_throughput(
    services: Sequence[Service],
    tp: int,
    gpu: GpuSpec,
    cost_model: CostModel,
    mem_util: float = 0.9,
    *,
    decode_shares: Mapping[str, float] | None = None,
    prefill_share: float = 1.0,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> UnitEstimate:
    """Estimate ``F(b, W_b)`` of one LLM unit: ``services`` on a mesh of ``tp`` GPUs.

    ``tpt^m = min(b^m / (sum_i t_p^i + t_d^m * mean_output_m), rate_m)`` with
    ``b^m`` from a binary search (module docstring, choices 1-4).

    Args:
        services: the unit's members (distinct names).
        tp: GPUs of the mesh; every member is tensor-parallel over all of them.
        gpu: the GPU type.
        cost_model: iteration times.
        mem_util: share of each GPU's memory usable for weights and KV.
        decode_shares: compute share of each member's decode job, in (0, 1];
            scaled down pro rata if they sum above 1. Default: ``1 / n`` each.
        prefill_share: compute share of prefill jobs, in (0, 1].
        max_batch: the largest batch of any member.

    Returns:
        The unit estimate (``.total`` is ``F``, ``.throughput`` per service).

    Raises:
        ConfigError: no services, duplicate names, a share outside (0, 1], or
            the unit does not fit (weights plus one mean-length request each).
    """
    svcs = list(services)
    if not svcs:
        raise ConfigError("a unit needs at least one service")
    _check_names(svcs)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor parallel degree must be an integer >= 1, got {tp!r}")
    if decode_shares is None:
        shares = [1.0 / len(svcs)] * len(svcs)
    else:
        missing = [s.name for s in svcs if s.name not in decode_shares]
        if missing:
            raise ConfigError(f"decode_shares has no share for services {missing}")
        shares = [float(decode_shares[s.name]) for s in svcs]
    for s, sh in zip(svcs, shares, strict=True):
        if not 0 < sh <= 1:
            raise ConfigError(f"service {s.name!r}: decode share must be in (0, 1], got {sh!r}")
    est = _Estimator(gpu, cost_model, mem_util, prefill_share, max_batch)
    return est.unit(svcs, tp, shares)


def _check_names(svcs: Sequence[Service]) -> None:
    seen: set[str] = set()
    for s in svcs:
        if s.name in seen:
            raise ConfigError(f"service name {s.name!r} appears twice")
        seen.add(s.name)


# ----------------------------------------------------------------------------- Algorithm 2


def _tp_degrees(max_tp: int) -> list[int]:
    out, t = [], 1
    while t <= max_tp:
        out.append(t)
        t *= 2
    return out


def _candidates_for(
    est: _Estimator,
    svc: Service,
    max_tp: int,
    share_grid: Sequence[float],
    tp_sizes: Collection[int] | None = None,
) -> tuple[ParallelCandidate, ...]:
    out: list[ParallelCandidate] = []
    for tp in _tp_degrees(max_tp):
        if tp_sizes is not None and tp not in tp_sizes:
            continue
        if not unit_fits([svc], tp, est.gpu, est.mem_util):
            continue
        best: ParallelCandidate | None = None
        for share in share_grid:
            s = est.unit([svc], tp, [share]).services[0]
            cand = ParallelCandidate(svc.name, tp, share, s.batch, s.throughput, s.meets_rate)
            if cand.meets_rate:
                best = cand
                break
            if best is None or cand.throughput > best.throughput:
                best = cand
        if best is not None:
            out.append(best)
    return tuple(out)


def _too_large(
    svc: Service,
    gpu: GpuSpec,
    max_tp: int,
    mem_util: float,
    tp_sizes: Collection[int] | None = None,
) -> ConfigError:
    budget = math.floor(gpu.hbm_bytes * mem_util)
    if tp_sizes is not None:
        allowed = ", ".join(str(t) for t in sorted(tp_sizes))
        return ConfigError(
            f"service {svc.name!r}: model {svc.spec.name} fits on no mesh of an allowed "
            f"tensor-parallel size ({allowed}) x {gpu.name} within one node and the pool"
        )
    return ConfigError(
        f"service {svc.name!r}: model {svc.spec.name} ({svc.spec.weight_bytes / _GB:.1f} GB of "
        f"weights, plus KV for one request) fits on no mesh of up to {max_tp} x {gpu.name} "
        f"({max_tp * budget / _GB:.1f} GB at mem_util {mem_util:.2f}); a MuxServe mesh stays "
        f"within one node ({gpu.gpus_per_node} GPUs) and the pool: use a larger --gpu or more GPUs"
    )


def _validate_grid(share_grid: Sequence[float]) -> tuple[float, ...]:
    grid = tuple(sorted(float(s) for s in share_grid))
    if not grid or not all(0 < s <= 1 for s in grid):
        raise ConfigError(f"share_grid must be non-empty with values in (0, 1], got {share_grid}")
    return grid


def llm_parallel_candidates(
    services: Sequence[Service],
    gpu: GpuSpec,
    cost_model: CostModel,
    mem_util: float = 0.9,
    *,
    max_tp: int | None = None,
    share_grid: Sequence[float] = DEFAULT_SHARE_GRID,
    prefill_share: float = 1.0,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> dict[str, tuple[ParallelCandidate, ...]]:
    """Algorithm 2: each service's parallel candidates, one per feasible tensor degree.

    For every power-of-two degree up to ``max_tp`` on which the service alone
    fits, the smallest share of ``share_grid`` whose estimated throughput alone
    meets the rate, else the share with the highest throughput.
    :func:`preferred_candidate` picks one of them.

    Args:
        services: the services (distinct names).
        gpu: the GPU type.
        cost_model: iteration times.
        mem_util: share of each GPU's memory usable.
        max_tp: largest degree (default ``gpu.gpus_per_node``).
        share_grid: compute shares to try, each in (0, 1].
        prefill_share: compute share of prefill jobs.
        max_batch: the largest batch.

    Returns:
        ``{service name: candidates by increasing tp}``, every tuple non-empty.

    Raises:
        ConfigError: a service fits on no degree (names it), or bad arguments.
    """
    svcs = list(services)
    _check_names(svcs)
    limit = gpu.gpus_per_node if max_tp is None else max_tp
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"max_tp must be an integer >= 1, got {limit!r}")
    grid = _validate_grid(share_grid)
    est = _Estimator(gpu, cost_model, mem_util, prefill_share, max_batch)
    return _all_candidates(est, svcs, limit, grid)


def _all_candidates(
    est: _Estimator,
    svcs: Sequence[Service],
    max_tp: int,
    grid: Sequence[float],
    tp_sizes: Collection[int] | None = None,
) -> dict[str, tuple[ParallelCandidate, ...]]:
    out: dict[str, tuple[ParallelCandidate, ...]] = {}
    for svc in svcs:
        cands = _candidates_for(est, svc, max_tp, grid, tp_sizes)
        if not cands:
            raise _too_large(svc, est.gpu, max_tp, est.mem_util, tp_sizes)
        out[svc.name] = cands
    return out


def preferred_candidate(candidates: Sequence[ParallelCandidate]) -> ParallelCandidate:
    """The candidate meeting the rate with the fewest SM-GPUs (``tp * share``; then
    smaller tp), else the one with the highest throughput (then smaller tp).

    Raises:
        ConfigError: no candidates.
    """
    if not candidates:
        raise ConfigError("no parallel candidates to choose from")
    meeting = [c for c in candidates if c.meets_rate]
    if meeting:
        return min(meeting, key=lambda c: (c.sm_gpus, c.tp))
    return min(candidates, key=lambda c: (-c.throughput, c.tp))


# ----------------------------------------------------------------------------- mesh groups


def _node_caps(n_gpus: int, gpus_per_node: int) -> list[int]:
    full, rest = divmod(n_gpus, gpus_per_node)
    return [gpus_per_node] * full + ([rest] if rest else [])


def _pack(sizes: Sequence[int], caps: Sequence[int]) -> list[int] | None:
    """First-fit decreasing of ``sizes`` (descending) into nodes: each mesh's first GPU
    id (node-major, consecutive ids inside a mesh), or None if they do not fit."""
    free = list(caps)
    base = [sum(caps[:i]) for i in range(len(caps))]
    starts: list[int] = []
    for size in sizes:
        for node, left in enumerate(free):
            if left >= size:
                starts.append(base[node] + caps[node] - left)
                free[node] = left - size
                break
        else:
            return None
    return starts


def potential_mesh_groups(
    n_gpus: int,
    gpus_per_node: int,
    min_tps: Sequence[int],
    preferred_tps: Sequence[int] | None = None,
    max_groups: int = DEFAULT_MAX_MESH_GROUPS,
    tp_sizes: Collection[int] | None = None,
) -> list[tuple[int, ...]]:
    """Algorithm 1's ``get_potential_device_mesh_groups``, with pruning.

    Mesh groups are multisets of power-of-two mesh sizes <= a node that pack
    into the pool's nodes (a mesh never spans nodes). Pruning (module doc,
    choice 6): use as many GPUs as any surviving group can; no mesh smaller than
    the smallest preferred degree; for every size k, no more meshes of size <= k
    than services whose smallest feasible degree is <= k; the largest mesh holds
    the largest smallest-degree. Keeps at most ``max_groups``, the closest to the
    preferred degrees' GPU split.

    Args:
        n_gpus: GPUs in the pool.
        gpus_per_node: GPUs per node.
        min_tps: each service's smallest feasible tensor degree.
        preferred_tps: each service's preferred degree (default ``min_tps``).
        max_groups: the most groups returned (>= 1).
        tp_sizes: the mesh sizes allowed (None: every power of two up to a node).

    Returns:
        Mesh groups, each a tuple of sizes in descending order; ordered by
        number of meshes, then sizes descending lexicographically. Empty when
        nothing fits.
    """
    if n_gpus < 1 or gpus_per_node < 1 or max_groups < 1:
        raise ConfigError(
            f"need n_gpus, gpus_per_node, max_groups >= 1, got {n_gpus}, {gpus_per_node}, "
            f"{max_groups}"
        )
    if not min_tps:
        return []
    pref = list(preferred_tps) if preferred_tps is not None else list(min_tps)
    caps = _node_caps(n_gpus, gpus_per_node)
    top = max(caps)
    smallest = min(pref)
    sizes = [t for t in _tp_degrees(top) if t >= smallest and (tp_sizes is None or t in tp_sizes)]
    if not sizes or max(sizes) < max(min_tps):
        return []
    sizes.reverse()  # descending
    # Hall-type bound: meshes of size <= k must each find a service that fits there
    allowed_le = {k: sum(1 for t in min_tps if t <= k) for k in sizes}
    n_services = len(min_tps)

    groups: list[tuple[int, ...]] = []

    def rec(i: int, left: int, chosen: list[int]) -> None:
        if i == len(sizes):
            if left == 0:
                groups.append(tuple(chosen))
            return
        k = sizes[i]
        most = min(left // k, n_services - len(chosen))  # at most one mesh per service
        for c in range(most, -1, -1):
            chosen.extend([k] * c)
            rec(i + 1, left - c * k, chosen)
            del chosen[len(chosen) - c :]

    def valid(group: tuple[int, ...]) -> bool:
        if not group or group[0] < max(min_tps):
            return False
        for k in sizes:
            if sum(1 for g in group if g <= k) > allowed_le[k]:
                return False
        return _pack(group, caps) is not None

    for total in range(min(n_gpus, n_services * sizes[0]), 0, -1):
        groups.clear()
        rec(0, total, [])
        kept = [g for g in groups if valid(g)]
        if kept:
            break
    else:
        return []
    kept.sort(key=lambda g: (len(g), [-x for x in g]))
    if len(kept) > max_groups:
        target = _gpu_split(pref, sizes)
        order = sorted(
            range(len(kept)),
            key=lambda j: (_l1(_gpu_split(kept[j], sizes), target), j),
        )
        kept = [kept[j] for j in sorted(order[:max_groups])]
    return kept


def _gpu_split(tps: Sequence[int], sizes: Sequence[int]) -> list[float]:
    total = sum(tps)
    return [sum(t for t in tps if t == k) / total for k in sizes]


def _l1(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- Algorithm 1


@dataclass(frozen=True, slots=True)
class _GroupOutcome:
    members: list[list[Service]]
    units: list[UnitEstimate | None]
    total: float
    headroom: float


def _greedy(
    est: _Estimator,
    ordered: Sequence[Service],
    sizes: tuple[int, ...],
    share_at: Mapping[str, Mapping[int, float]],
    tol: float,
) -> _GroupOutcome | str:
    """Algorithm 1, lines 5-17, on one mesh group; the unplaceable service's name on failure."""
    n = len(sizes)
    members: list[list[Service]] = [[] for _ in range(n)]
    units: list[UnitEstimate | None] = [None] * n
    current = [0.0] * n
    load = [0.0] * n  # sum rate * weight bytes
    for svc in ordered:
        best_j = -1
        best: tuple[float, float, int] = (0.0, 0.0, 0)
        best_delta = -math.inf
        best_unit: UnitEstimate | None = None
        seen_empty: set[int] = set()
        req = svc.rate * svc.spec.weight_bytes
        for j, size in enumerate(sizes):
            share = share_at[svc.name].get(size)
            if share is None:
                continue
            if not members[j]:
                if size in seen_empty:
                    continue
                seen_empty.add(size)
            cand = [*members[j], svc]
            if not unit_fits(cand, size, est.gpu, est.mem_util):
                continue
            unit = est.unit(cand, size, [share_at[s.name][size] for s in cand])
            delta = unit.total - current[j]
            tie = (load[j] + req) / size, size, j
            if delta > best_delta + tol or (abs(delta - best_delta) <= tol and tie < best):
                best_j, best, best_delta, best_unit = j, tie, delta, unit
        if best_j < 0 or best_unit is None:
            return svc.name
        members[best_j].append(svc)
        units[best_j] = best_unit
        current[best_j] = best_unit.total
        load[best_j] += req
    total = sum(u.total for u in units if u is not None)
    headroom = min((u.headroom for u in units if u is not None), default=math.inf)
    return _GroupOutcome(members, units, total, headroom)


def muxserve_search(
    services: Sequence[Service],
    n_gpus: int,
    gpu: GpuSpec,
    cost_model: CostModel,
    mem_util: float = 0.9,
    *,
    share_grid: Sequence[float] = DEFAULT_SHARE_GRID,
    prefill_share: float = 1.0,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_mesh_groups: int = DEFAULT_MAX_MESH_GROUPS,
    tp_sizes: Collection[int] | None = None,
) -> MuxServeResult:
    """Algorithm 1 (enumeration-based greedy placement), with its estimates.

    Args:
        services: the services to place (distinct names), each placed once.
        n_gpus: GPUs in the pool; nodes of ``gpu.gpus_per_node`` (the last may
            be partial), GPU ids node-major.
        gpu: the GPU type.
        cost_model: iteration times.
        mem_util: share of each GPU's memory usable for weights and KV.
        share_grid: compute shares Algorithm 2 tries.
        prefill_share: compute share of prefill jobs.
        max_batch: the largest batch of any service.
        max_mesh_groups: the most mesh groups evaluated.
        tp_sizes: the mesh sizes (tensor-parallel degrees) allowed; None:
            every power of two up to a node (MuxServe's own enumeration).

    Returns:
        The plan (meshes left empty dropped) and its estimates.

    Raises:
        ConfigError: no services, duplicate names, a service too large for one
            node (or the pool), or no mesh group holds every service (names one).
    """
    svcs = list(services)
    if not svcs:
        raise ConfigError("MuxServe placement needs at least one service")
    _check_names(svcs)
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise ConfigError(f"n_gpus must be an integer >= 1, got {n_gpus!r}")
    grid = _validate_grid(share_grid)
    est = _Estimator(gpu, cost_model, mem_util, prefill_share, max_batch)
    max_tp = min(gpu.gpus_per_node, n_gpus)

    # Algorithm 1, line 1: parallel candidates
    cands = _all_candidates(est, svcs, max_tp, grid, tp_sizes)
    share_at = {name: {c.tp: c.share for c in cs} for name, cs in cands.items()}
    min_tps = [cands[s.name][0].tp for s in svcs]
    pref_tps = [preferred_candidate(cands[s.name]).tp for s in svcs]

    # line 2: potential mesh groups
    groups = potential_mesh_groups(
        n_gpus, gpu.gpus_per_node, min_tps, pref_tps, max_mesh_groups, tp_sizes
    )
    if not groups:
        worst = max(svcs, key=lambda s: (cands[s.name][0].tp, s.name))
        raise ConfigError(
            f"MuxServe placement: no mesh group of {n_gpus} x {gpu.name} can host service "
            f"{worst.name!r} ({worst.spec.name}, needs {cands[worst.name][0].tp} GPUs)"
        )

    # line 5: computation requirement, descending
    ordered = sorted(svcs, key=lambda s: (-s.rate * s.spec.weight_bytes, s.name))
    demand = sum(s.rate for s in svcs)
    tol = _REL_TOL * max(1.0, demand)

    best: _GroupOutcome | None = None
    best_sizes: tuple[int, ...] = ()
    failed: dict[str, int] = {}
    for sizes in groups:
        outcome = _greedy(est, ordered, sizes, share_at, tol)
        if isinstance(outcome, str):
            failed[outcome] = failed.get(outcome, 0) + 1
            continue
        if (
            best is None
            or outcome.total > best.total + tol
            or (abs(outcome.total - best.total) <= tol and outcome.headroom > best.headroom)
        ):
            best, best_sizes = outcome, sizes
    if best is None:
        name = max(failed, key=lambda k: (failed[k], k))
        svc = next(s for s in svcs if s.name == name)
        raise ConfigError(
            f"MuxServe placement: service {name!r} ({svc.spec.name}) fits on no mesh of any of "
            f"{len(groups)} mesh groups of {n_gpus} x {gpu.name} at mem_util {mem_util:.2f}: "
            f"the GPUs cannot hold every model's weights plus one request of KV each"
        )

    starts = _pack(best_sizes, _node_caps(n_gpus, gpu.gpus_per_node))
    if starts is None:  # potential_mesh_groups only returns packable groups
        raise AssertionError(f"mesh group {best_sizes} does not pack")
    placed: list[tuple[int, GroupPlacement, UnitEstimate]] = []
    for j, size in enumerate(best_sizes):
        unit = best.units[j]
        if not best.members[j] or unit is None:
            continue
        gpus = tuple(range(starts[j], starts[j] + size))
        names = tuple(s.name for s in best.members[j])
        placed.append((starts[j], GroupPlacement(gpus=gpus, tp=size, services=names), unit))
    placed.sort(key=lambda x: x[0])
    note = (
        f"muxserve: meshes {list(best_sizes)} ({len(placed)} used) chosen of "
        f"{len(groups)} mesh groups; estimated throughput {best.total:.2f} of "
        f"{demand:.2f} req/s demanded"
    )
    plan = PlacementPlan(groups=tuple(p[1] for p in placed), n_gpus=n_gpus, note=note)
    plan.check([s.name for s in svcs])
    logger.debug("%s", note)
    return MuxServeResult(
        plan=plan,
        units=tuple(p[2] for p in placed),
        total_throughput=best.total,
        demand=demand,
        mesh_sizes=best_sizes,
        mesh_groups_evaluated=len(groups),
    )


def muxserve_place(
    services: Sequence[Service],
    n_gpus: int,
    gpu: GpuSpec,
    cost_model: CostModel,
    mem_util: float = 0.9,
    *,
    share_grid: Sequence[float] = DEFAULT_SHARE_GRID,
    prefill_share: float = 1.0,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_mesh_groups: int = DEFAULT_MAX_MESH_GROUPS,
    tp_sizes: Collection[int] | None = None,
) -> PlacementPlan:
    """MuxServe's placement of ``services`` on ``n_gpus`` GPUs (Algorithm 1).

    See :func:`muxserve_search` (same arguments) for the estimates behind it.

    Raises:
        ConfigError: as :func:`muxserve_search`.
    """
    return muxserve_search(
        services,
        n_gpus,
        gpu,
        cost_model,
        mem_util,
        share_grid=share_grid,
        prefill_share=prefill_share,
        max_batch=max_batch,
        max_mesh_groups=max_mesh_groups,
        tp_sizes=tp_sizes,
    ).plan
