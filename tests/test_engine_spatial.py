"""Spatial sharing inside one engine (issue 24): the jobs a spatial scheduler
(ADBS) starts at one scheduling point run at once, each on its share of the
engine's threads; greedy outputs equal the one-after-another run's (CPU)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_engine_group import WORK, A, B, MiB, run, stats, weights_bytes  # noqa: E402

from fleetserve.policy.sharing import BATCHING, DECODE, PREFILL, Job  # noqa: E402
from fleetserve.runtime.engine.engine import Engine  # noqa: E402


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The engine's thread has two intra-op threads (conftest sets one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class _Recorder:
    """ADBS, recording each job's end as the engine reports it."""

    def __init__(self) -> None:
        self.sched = BATCHING.get("adbs")()
        self.ends: list[tuple[Job, float]] = []
        orig = self.sched.on_job_end

        def on_job_end(job: Job, seqs: Any, duration_s: float, now: float) -> None:
            self.ends.append((job, duration_s))
            orig(job, seqs, duration_s, now)

        self.sched.on_job_end = on_job_end  # type: ignore[method-assign]


def _engine(spatial: bool, kv_mib: float = 8.0) -> tuple[Engine, _Recorder]:
    rec = _Recorder()
    eng = Engine(
        [A, B],
        weights_bytes(A, B) + int(kv_mib * MiB),
        batching=rec.sched,
        services=stats(),
        spatial_shares=spatial,
    )
    return eng, rec


@pytest.mark.parametrize("kv_mib", [8.0, 0.25])
def test_jobs_of_one_point_run_at_once_with_the_same_tokens(
    two_threads: None, kv_mib: float
) -> None:
    """Both models' jobs at one point run in two threads at once (one thread
    each: ADBS's 0.6 / 0.4 shares of two), and every request's greedy tokens
    equal those of the same scheduler running the jobs one after another;
    every job's end is reported once, with its own measured duration. The
    small arena makes the decode jobs preempt before the jobs start."""
    seen: set[str] = set()
    orig_forward = Engine.forward

    def forward(self: Engine, *a: Any, **k: Any) -> Any:
        seen.add(threading.current_thread().name)
        return orig_forward(self, *a, **k)

    base, _ = _engine(spatial=False, kv_mib=kv_mib)
    ref = run(base, WORK, stagger=False)
    eng, rec = _engine(spatial=True, kv_mib=kv_mib)
    Engine.forward = forward  # type: ignore[method-assign]
    try:
        done = run(eng, WORK, stagger=False)
    finally:
        Engine.forward = orig_forward  # type: ignore[method-assign]
    assert [done[r].output_ids for r in sorted(done)] == [ref[r].output_ids for r in sorted(ref)]
    assert eng.group_jobs_at_once > 0, "no two jobs ran at once"
    assert base.group_jobs_at_once == 0 and base.group_jobs_alone > 0
    assert any(name.startswith("engine0-job") for name in seen)
    assert eng.group_jobs_alone + eng.group_jobs_at_once == len(rec.ends)
    assert all(d >= 0 for _, d in rec.ends)
    assert all(j.phase in (PREFILL, DECODE) for j, _ in rec.ends)
    assert eng.pool.kv_pages == 0 and not eng.has_work()


def test_one_thread_or_a_temporal_scheduler_runs_jobs_one_after_another() -> None:
    """With one thread there is no share to give (conftest's setting), and a
    temporal scheduler names one job at a time: nothing runs at once."""
    eng, _ = _engine(spatial=True)
    run(eng, WORK, stagger=False)
    assert not Engine([A], 64 * MiB).spatial_shares  # off unless asked for
    assert eng.group_jobs_at_once == 0 and eng.group_jobs_alone > 0
    fcfs = Engine(
        [A, B],
        weights_bytes(A, B) + 8 * MiB,
        batching=BATCHING.get("fcfs")(),
        services=stats(),
    )
    torch.set_num_threads(2)
    try:
        run(fcfs, WORK, stagger=False)
    finally:
        torch.set_num_threads(1)
    assert fcfs.group_jobs_at_once == 0 and fcfs.group_jobs_alone > 0
