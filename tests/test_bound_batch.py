"""The growth of a bound batch's decode segment (sim/batch.BoundBatch.growth)
against its definition, counted iteration by iteration."""

from __future__ import annotations

import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.metrics.records import RequestRecord
from fleetserve.sim.batch import BoundBatch
from fleetserve.sim.seq import Seq
from fleetserve.workload.request import Request


def _batch(bases: list[int], steps: int, bs: int) -> BoundBatch:
    b = BoundBatch(bs)
    b.steps = steps
    for i, base in enumerate(bases):
        req = Request(i, "m", 0.0, 1, 10**9)
        s = Seq(req, RequestRecord(i, "m", 0.0, 1, 10**9))
        b.run(s, base + steps)  # joins holding base + steps tokens
    return b


@settings(max_examples=300, deadline=None)
@given(
    bases=st.lists(st.integers(1, 200), max_size=40),
    steps=st.integers(0, 300),
    bs=st.sampled_from([1, 2, 3, 16]),
    free=st.integers(0, 120),
)
def test_growth_is_the_blocks_each_iteration_opens(
    bases: list[int], steps: int, bs: int, free: int
) -> None:
    """``C[r]``: blocks iterations 0..r open (a request's token landing on a
    block's first slot opens one); ``n``: the first iteration that finds no
    block free (``sys.maxsize`` for an empty batch)."""
    b = _batch(bases, steps, bs)
    C, n = b.growth(free)

    def opened(j: int) -> int:  # blocks iterations 0..j open, one by one
        return sum(1 for t in range(j + 1) for x in bases if (x + steps + t) % bs == 0)

    assert [opened(r) for r in range(bs)] == C
    if not bases:
        assert n == sys.maxsize
        return
    first = next(j for j in range(10**6) if opened(j) > free)
    assert n == first
    k = min(n, 3 * bs)
    if k:
        b.begin([float(i) for i in range(1, k + 1)], k, C)  # a segment of k iterations
        for j in range(k):  # the blocks of any iteration, from C
            assert b.grown(j) == opened(j)


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 300),
    ctx0=st.integers(0, 500_000),
    k=st.integers(1, 60),
    start=st.floats(0.0, 1e6, allow_nan=False),
    gpu=st.sampled_from(["a100-40gb", "h100-80gb", "l4-24gb"]),
    model=st.sampled_from(["llama-2-7b", "llama-2-70b"]),
    form=st.sampled_from(["default", "scaled", "roofline"]),
)
def test_decode_ends_are_the_running_sum_of_the_iterations(
    batch: int, ctx0: int, k: int, start: float, gpu: str, model: str, form: str
) -> None:
    """A decode segment's end times (short ones summed in Python floats,
    long ones in arrays) are bit for bit the running sum of its iterations'
    times, each as one iteration computes it (``decode_time_scalar``): for
    the per-operation model, with a decode batch scale, and the plain roofline."""
    from dataclasses import replace

    from fleetserve.costmodel import CostModel
    from fleetserve.costmodel.params import EfficiencyParams, gpu_defaults
    from fleetserve.spec import get_gpu, get_model

    g = get_gpu(gpu)
    params = gpu_defaults(gpu)
    if form == "scaled":
        params = replace(params, decode_batch_scale=((1, 1.3), (64, 0.9), (256, 1.1)))
    elif form == "roofline":  # the plain roofline form (no per-operation terms)
        params = EfficiencyParams()
    cost = CostModel(params).bind(get_model(model), g, 1)
    ends = cost.decode_ends(batch, ctx0, k, start)
    t = start
    want = []
    for i in range(1, k + 1):
        t += cost.decode_time_scalar(batch, float(ctx0 + batch * i))
        want.append(t)
    assert list(ends) == want


@settings(max_examples=200, deadline=None)
@given(
    bases=st.lists(st.integers(1, 200), min_size=1, max_size=30),
    steps=st.integers(0, 100),
    bs=st.sampled_from([1, 3, 16]),
    n=st.integers(1, 70),
    now=st.floats(0.0, 80.0, allow_nan=False),
)
def test_ahead_is_the_growth_past_the_iteration_in_flight(
    bases: list[int], steps: int, bs: int, n: int, now: float
) -> None:
    """The blocks a segment of ``n`` iterations (ending at 1, 2, ... s) holds
    ahead of ``now``: those its iterations after the one in flight open."""
    b = _batch(bases, steps, bs)
    C, _ = b.growth(10**9)
    b.begin([float(i) for i in range(1, n + 1)], n, C)
    in_flight = min(int(np.searchsorted(b.ends, now, side="right")), n - 1)
    assert b.ahead(now) == b.grown(n - 1) - b.grown(in_flight)
    # at several times at once (the usage totals' grid), as one array: the same
    times = np.array([now, now / 2, now + 0.5, 0.0])
    assert b.ahead_at(times).tolist() == [b.ahead(float(t)) for t in times]
    b.cut(max(1, n // 2))  # a segment cut short: its first iterations only
    assert b.ahead_at(times).tolist() == [b.ahead(float(t)) for t in times]
