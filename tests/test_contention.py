"""Memory-bandwidth contention between jobs a spatial scheduler runs at once
(issue 22 item 2, :mod:`fleetserve.sim.contention`): the limiting cases — a
job alone takes today's time; k equal memory-bound jobs take about k times
as long as one — and the fairness of the bandwidth split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetserve.costmodel import CostModel
from fleetserve.metrics.records import RequestRecord, RunResult
from fleetserve.policy.groups import GroupPlacement, PlacementPlan
from fleetserve.sim.contention import BandwidthSharing, bandwidth_shares
from fleetserve.sim.multi import MultiConfig, MultiSimulator
from fleetserve.spec import get_gpu, get_model
from fleetserve.workload.request import Request
from fleetserve.workload.service import Service

EPS = 1e-9


@given(
    demands=st.lists(st.floats(0.0, 1.0, allow_nan=False), max_size=12),
    capacity=st.floats(0.0, 2.0, allow_nan=False),
)
def test_bandwidth_is_split_max_min_fairly(demands: list[float], capacity: float) -> None:
    got = bandwidth_shares(demands, capacity)
    assert len(got) == len(demands)
    assert sum(got) <= max(capacity, sum(demands)) + EPS
    for b, d in zip(got, demands, strict=True):
        assert -EPS <= b <= d + EPS
    if sum(demands) <= capacity:
        assert got == demands
    else:
        assert sum(got) == pytest.approx(capacity)
        # a job short of its demand gets at least as much as any other job
        for b, d in zip(got, demands, strict=True):
            if b < d - 1e-9:
                assert all(b >= other - 1e-9 for other in got)


def test_bad_demands_are_errors() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        bandwidth_shares([-0.1])


def test_a_job_alone_takes_its_time_and_k_memory_bound_jobs_take_k_times() -> None:
    bw = BandwidthSharing()
    bw.add(0, 2.0, 0.3, 0.29)
    assert bw.retime(2.0) == {}  # alone: not re-timed, ends at exactly 2.0 + 0.3
    assert bw.end_of(0) == 2.0 + 0.3
    bw.remove(0)
    for k in (2, 3, 5):
        bw = BandwidthSharing()
        for j in range(k):
            bw.add(j, 0.0, 1.0, 1.0)
        ends = bw.retime(0.0)
        assert ends == {j: pytest.approx(k) for j in range(k)}
    # one ends early: the other speeds up for the rest
    bw = BandwidthSharing()
    bw.add(0, 0.0, 1.0, 1.0)
    bw.add(1, 0.0, 0.5, 0.5)
    ends = bw.retime(0.0)
    assert ends[1] == pytest.approx(1.0)  # 0.5 s of work at half speed
    bw.remove(1)
    assert bw.retime(1.0) == {0: pytest.approx(1.5)}  # half done at 1.0, alone after
    # a compute-bound job beside a memory-bound one: nobody waits
    bw = BandwidthSharing()
    bw.add(0, 0.0, 1.0, 0.9)
    bw.add(1, 0.0, 1.0, 0.05)
    assert bw.retime(0.0) == {}


# --------------------------------------------------------- in a sharing group
MODEL = get_model("llama-2-7b")


def _services(k: int) -> dict[str, Service]:
    return {f"s{i}": Service(f"s{i}", MODEL, 1.0, 64, 200) for i in range(k)}


def _run(k: int, contention: bool, scheduler: str = "adbs") -> RunResult:
    """``k`` services on one GPU, one long decode each, started together."""
    services = _services(k)
    plan = PlacementPlan((GroupPlacement((0,), 1, tuple(services)),), 1)
    reqs = [Request(i, f"s{i}", 0.0, 64, 200) for i in range(k)]
    cfg = MultiConfig(
        gpu="a100-80gb",
        n_gpus=1,
        scheduler=scheduler,
        layout="headwise",
        contention=contention,
        check_integrity=True,
    )
    return MultiSimulator(cfg, services, plan, reqs).run()


def _tpot_of(r: RequestRecord) -> float:
    assert r.finish_s is not None and r.first_token_s is not None
    return (r.finish_s - r.first_token_s) / (r.output_tokens - 1)


def _tpot(res: RunResult) -> float:
    return _tpot_of(res.records[0])


def test_one_service_alone_is_unchanged_by_contention() -> None:
    on, off = _run(1, True), _run(1, False)
    assert [(r.first_token_s, r.finish_s) for r in on.records] == [
        (r.first_token_s, r.finish_s) for r in off.records
    ]


@pytest.mark.parametrize("k", [2, 3])
def test_concurrent_decodes_share_the_memory_bandwidth(k: int) -> None:
    """ADBS runs the k services' decodes at once; without contention each
    streams the weights at full bandwidth (as fast as alone), with it they
    take about k times as long (a decode is memory-bound)."""
    alone = _tpot(_run(1, False))
    off = _run(k, False)
    on = _run(k, True)
    assert all(r.status == "finished" for r in on.records)
    cm = CostModel().bind(MODEL, get_gpu("a100-80gb"), 1)
    use = cm.decode_memory_s(1, 200.0) / cm.decode_time_scalar(1, 200.0)
    # the premise: a batch-1 decode is mostly HBM traffic (the rest: the step
    # overhead and the kernels' fixed latencies, ~30 % on the calibrated A100)
    assert use > 0.6
    for r_off, r_on in zip(off.records, on.records, strict=True):
        assert r_on.finish_s is not None and r_off.finish_s is not None
        assert r_on.finish_s > r_off.finish_s
    ratio = sum(_tpot_of(r) for r in on.records) / sum(_tpot_of(r) for r in off.records)
    assert 0.8 * k * use <= ratio <= 1.05 * k
    assert _tpot(off) <= 1.3 * alone  # the old model: hardly slower than alone


def test_temporal_schedulers_are_not_affected() -> None:
    """One job at a time: nothing to contend."""
    on, off = _run(3, True, "fcfs"), _run(3, False, "fcfs")
    assert [r.finish_s for r in on.records] == [r.finish_s for r in off.records]


def test_weighted_shares_divide_by_weight_and_equal_weights_are_plain_max_min() -> None:
    from fleetserve.sim.contention import bandwidth_shares

    # equal weights: the plain division
    assert bandwidth_shares([0.5, 0.5, 1.0], 1.0, [1.0, 1.0, 1.0]) == bandwidth_shares(
        [0.5, 0.5, 1.0], 1.0
    )
    # a job of weight 3 beside one of weight 1, both wanting everything: 3/4 and 1/4
    got = bandwidth_shares([1.0, 1.0], 1.0, [3.0, 1.0])
    assert got == pytest.approx([0.75, 0.25])
    # a small demand is met in full whatever its weight; the rest by weight
    got = bandwidth_shares([0.1, 1.0, 1.0], 1.0, [1.0, 2.0, 1.0])
    assert got == pytest.approx([0.1, 0.6, 0.3])
    assert sum(got) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bandwidth_shares([1.0, 1.0], 1.0, [1.0, 0.0])
