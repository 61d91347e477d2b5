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
        b.begin(np.arange(1.0, k + 1), k, C)  # a segment of k iterations
        for j in range(k):  # the blocks of any iteration, from C
            assert b.grown(j) == opened(j)
