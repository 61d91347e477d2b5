"""A buddy group's pipelined step (``runtime/buddy.GroupRunner``): the
batch is split into micro-batches, all in flight at once, and every output
is still the engine's own. Fast: two in-process worker cores, a tiny model,
the stage call awaited in the same loop."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.runtime.buddy import GroupRunner, StageRole, StageWork
from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.pipeline import PipelineRequest
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.worker import WorkerCore, WorkerSpec

MODEL = "tiny-llama-a"
MB = 2**20


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 5 for j in range(length + i % 5)] for i in range(n)]


def _reference(prompts: list[list[int]], n: int) -> list[list[int]]:
    eng = Engine([MODEL], 64 * MB)
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    rids = [eng.add_request(MODEL, ids, p) for ids in prompts]
    while eng.has_work():
        eng.step()
    return [list(eng.requests[r].output_ids) for r in rids]


def _group(stages: int) -> tuple[list[WorkerCore], GroupRunner]:
    n_layers = 4  # tiny-llama-a
    cuts = [round(i * n_layers / stages) for i in range(stages + 1)]
    layout = tuple((i, (cuts[i], cuts[i + 1])) for i in range(stages))
    cores = [WorkerCore(WorkerSpec(i, (MODEL,), (MODEL,), 24 * MB)) for i in range(stages)]
    for i, c in enumerate(cores):
        c.become_stage(StageRole(1, MODEL, i, layout))
    pages = [c.stage_pages() for c in cores]
    cores[0].lead(StageRole(1, MODEL, 0, layout), [f for f, _ in pages], [t for _, t in pages])
    assert cores[0].group is not None
    return cores, cores[0].group


def test_micro_batches_are_in_flight_together_and_outputs_are_exact() -> None:
    prompts, n = _prompts(12, 40), 24
    want = _reference(prompts, n)
    cores, g = _group(3)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    g._emit = lambda rid, idx, tok, piece: got[rid].append(tok)
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    for i, ids in enumerate(prompts):
        g.add(i, ids, p, float(i))
    in_flight = 0
    most = 0
    sizes: list[int] = []

    async def call(j: int, work: StageWork) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        if j == 1:
            sizes.append(len(work.keys))
        await asyncio.sleep(0)  # the actor's answer comes later
        try:
            return cores[j].stage_forward(work)
        finally:
            in_flight -= 1

    async def main() -> None:
        while g.has_work():
            await g.step(call)

    asyncio.run(main())
    assert [got[i] for i in range(len(prompts))] == want
    # while one micro-batch was on a later stage, the next ones were on theirs
    assert most >= 2
    assert max(sizes) < len(prompts)  # the batch went in parts, not whole
    for c in cores:
        c.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    stages=st.integers(1, 6),
)
def test_split_is_contiguous_balanced_and_never_empty(lens: list[int], stages: int) -> None:
    g: Any = GroupRunner.__new__(GroupRunner)
    g.role = StageRole(0, MODEL, 0, tuple((i, (i, i + 1)) for i in range(stages)))
    batch = [
        PipelineRequest(
            id=i,
            key=i,
            tokens=[1] * n,
            prompt_len=n,
            params=SamplingParams(),
            generator=None,  # type: ignore[arg-type]
            detok=None,  # type: ignore[arg-type]
        )
        for i, n in enumerate(lens)
    ]
    parts = GroupRunner.split(g, batch)
    assert [r for p in parts for r in p] == batch  # contiguous, in order, all
    assert all(parts)
    assert len(parts) == min(stages, len(batch))
    total = sum(lens)
    k = len(parts)
    for p in parts[:-1]:  # a part closes once it holds its share: at most one more
        assert sum(len(r.tokens) for r in p) <= total / k + max(lens)
