"""Live KV migration between two workers, the steps the controller drives
(``Controller._move_live``): copy stages while the request decodes on the
source, a pre-commit on the destination, the stop-and-copy of the tail, and
the abort paths. Fast: two in-process worker cores (no Ray), a tiny model;
``tests/test_runtime_fault.py`` runs the same protocol through Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import ray.exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.worker import WorkerCore, WorkerSpec

MODEL = "tiny-llama-a"
MB = 2**20


def core(wid: int, mb: int = 16) -> WorkerCore:
    return WorkerCore(WorkerSpec(wid, (MODEL,), (MODEL,), mb * MB))


def params(n: int, greedy: bool = False) -> SamplingParams:
    # sampled, not greedy: the generator's state must travel too
    temperature = 0.0 if greedy else 0.8
    return SamplingParams(max_tokens=n, temperature=temperature, seed=7, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return [(31 * i + 5) % 250 + 3 for i in range(n)]


def run_alone(p: list[int], n: int, greedy: bool = False) -> list[int]:
    c = core(9)
    c.submit(1, MODEL, p, params(n, greedy))
    while c.has_work():
        c.step()
    return [tok for _i, tok, _piece in c.take_report().tokens[1]]


def tokens_of(c: WorkerCore, rid: int) -> dict[int, int]:
    return {i: tok for i, tok, _p in c.take_report().tokens.get(rid, [])}


def migrate(
    src: WorkerCore, dst: WorkerCore, rid: int, final_blocks: int, steps_between: int
) -> tuple[bool, int, dict[int, int]]:
    """The controller's protocol, with ``steps_between`` source steps between
    calls (the source decodes on meanwhile). Returns (moved, copy stages,
    the tokens the source streamed)."""
    copied, stages, pre = 0, 0, False
    preempted = None
    for _ in range(8):
        stage = src.live_stage(rid, copied, final_blocks)
        assert stage is not None
        preempted = stage.preemptions if preempted is None else preempted
        if stage.chunk is None:
            break
        assert (stage.state is not None) == (not pre)  # the state rides on the first only
        if not dst.live_receive(rid, stage.chunk, None if pre else stage.state):
            return False, stages, {}
        pre, copied, stages = True, stage.full_blocks, stages + 1
        for _ in range(steps_between):
            src.step()
        src.check_integrity()
        dst.check_integrity()
    fin = src.live_final(rid, copied)
    assert fin is not None
    state, tail = fin
    ok = dst.live_finish(rid, state, tail) if pre else dst.import_request(state, tail)
    if not ok:
        src.unpause(rid)
        return False, stages, {}
    streamed = tokens_of(src, rid)  # (the controller's record; release drops the rest)
    src.release(rid)
    return True, stages, streamed


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plen=st.integers(1, 90),
    before=st.integers(0, 40),
    final_blocks=st.integers(1, 3),
    steps_between=st.integers(0, 20),
)
def test_a_live_move_continues_exactly_where_it_was(
    plen: int, before: int, final_blocks: int, steps_between: int
) -> None:
    n = before + steps_between * 8 + 30
    p = prompt(plen)
    want = run_alone(p, n)
    src, dst = core(0), core(1)
    src.submit(1, MODEL, p, params(n))
    for _ in range(before + 1):
        src.step()
    moved, stages, got = migrate(src, dst, 1, final_blocks, steps_between)
    assert moved
    while dst.has_work():
        dst.step()
    got |= tokens_of(dst, 1)
    assert [got[i] for i in sorted(got)] == want
    assert sorted(got) == list(range(1, n + 1))  # each token once
    # a prompt of at least final_blocks + 1 full blocks is copied in stages
    if plen >= 16 * (final_blocks + 1):
        assert stages >= 1
    for c in (src, dst):
        c.check_integrity()
        assert not c.engine.requests or 1 not in c.engine.requests
    assert src.engine.pool.kv_pages == 0 and dst.engine.pool.kv_pages == 0


def test_a_full_destination_leaves_nothing_and_the_request_goes_on() -> None:
    p, n = prompt(120), 40
    want = run_alone(p, n)
    src, dst = core(0), core(1, mb=12)
    hog = prompt(200)  # fills most of the destination first
    dst.submit(5, MODEL, hog, SamplingParams(max_tokens=400, ignore_eos=True))
    dst.step()
    free_before = dst.engine.pool.num_available
    src.submit(1, MODEL, p, params(n))
    src.step()
    need = -(-120 // 16) * dst.engine.pool.pages_per_token_block(MODEL)
    assert need > free_before  # the import cannot fit
    moved, _, _ = migrate(src, dst, 1, 1, 2)
    assert not moved
    assert 1 not in dst.engine.requests and dst.engine.pool.num_available == free_before
    dst.check_integrity()
    while src.has_work():
        src.step()
    got = tokens_of(src, 1)
    assert [got[i] for i in sorted(got)] == want


def test_the_move_is_off_when_the_request_leaves_the_source() -> None:
    src, dst = core(0), core(1)
    src.submit(1, MODEL, prompt(70), params(3))
    src.step()
    stage = src.live_stage(1, 0, 1)
    assert stage is not None and stage.chunk is not None and stage.state is not None
    free_before = dst.engine.pool.num_available
    assert dst.live_receive(1, stage.chunk, stage.state)
    assert dst.engine.requests[1].status == "paused"  # pre-committed: held, not run
    assert dst.engine.pool.num_available < free_before
    while src.has_work():  # it finishes at the source meanwhile
        src.step()
    assert src.live_stage(1, stage.full_blocks, 1) is None
    assert src.live_final(1, stage.full_blocks) is None
    assert dst.live_abort(1)  # the controller undoes the pre-commit
    assert 1 not in dst.engine.requests and dst.engine.pool.num_available == free_before
    assert not dst.live_abort(1)
    dst.check_integrity()


def test_a_preemption_on_the_source_is_seen_between_stages() -> None:
    src = core(0)
    src.submit(1, MODEL, prompt(40), params(5))
    src.step()
    first = src.live_stage(1, 0, 1)
    assert first is not None
    req = src.engine.requests[1]
    src.engine._preempt(req)  # what memory pressure does
    assert src.live_stage(1, first.full_blocks, 1) is None  # queued: not running
    src.step()  # recomputed and running again
    again = src.live_stage(1, first.full_blocks, 1)
    assert again is not None and again.preemptions == first.preemptions + 1


# ------------------------------------------------- the controller's driver
class Handle:
    """An actor handle over an in-process core: ``h.method.remote(*args)``
    runs the call (after ``steps`` engine steps: the engine decodes between
    calls), then hands the core's report to the controller. ``die_on``: the
    call that finds the worker dead (the controller learns it as from its
    poll loop)."""

    def __init__(self, ctl_box: dict[str, Any], wid: int, c: WorkerCore, steps: int = 0) -> None:
        self.box, self.wid, self.core, self.steps = ctl_box, wid, c, steps
        self.die_on: str | None = None
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=lambda *a: self._call(name, *a))

    async def _call(self, name: str, *args: Any) -> Any:
        ctl = self.box["ctl"]
        self.calls.append(name)
        if self.die_on == name or not ctl.workers[self.wid].alive:
            ctl._on_worker_dead(self.wid)
            raise ray.exceptions.RayActorError()
        for _ in range(self.steps):
            if self.core.has_work():
                self.core.step()
        out = getattr(self.core, name)(*args)
        pump(ctl, self.wid, self.core, 0)
        return out


def pump(ctl: Any, wid: int, c: WorkerCore, steps: int) -> None:
    """``steps`` engine steps (all its work with -1), reports applied."""
    while steps != 0 and c.has_work():
        c.step()
        steps -= 1
    ctl._apply_report(ctl.workers[wid], c.take_report())


def controller(src_steps: int, dst_mb: int = 16) -> tuple[Any, list[WorkerCore], list[Handle]]:
    from fleetserve.cli.serve import serve_config_dict
    from fleetserve.config import config_from_dict
    from fleetserve.runtime.cluster import model_info
    from fleetserve.runtime.controller import Controller

    data = {
        "serve": {"workers": 2, "models": [MODEL], "gpu_memory_mb": 16},
        "policy": {"stack": "llumnix", "dispatch": "worst_fit"},
        "migration": {"max_stages": 6, "final_blocks": 1},
    }
    cfg = config_from_dict(serve_config_dict(data))
    cores = [core(0), core(1, dst_mb)]
    box: dict[str, Any] = {}
    handles = [Handle(box, 0, cores[0], src_steps), Handle(box, 1, cores[1])]
    workers = {i: (c.spec, h) for i, (c, h) in enumerate(zip(cores, handles, strict=True))}
    snaps = {i: c.snapshot() for i, c in enumerate(cores)}
    ctl = box["ctl"] = Controller(cfg, workers, snaps, {MODEL: model_info(MODEL)})
    ctl.active.update(ctl.inst_of)
    return ctl, cores, handles


def run_controller_case(
    src_steps: int,
    dst_mb: int = 16,
    die_on: str | None = None,
    hog: bool = False,
    greedy: bool = False,
) -> tuple[Any, Any, list[WorkerCore], list[Handle]]:
    p, n = prompt(70), 60

    async def main() -> tuple[Any, Any, list[WorkerCore], list[Handle]]:
        ctl, cores, handles = controller(src_steps, dst_mb)
        if hog:  # the destination's memory is mostly taken
            cores[1].submit(99, MODEL, prompt(200), SamplingParams(max_tokens=500, ignore_eos=True))
            pump(ctl, 1, cores[1], 1)
        t = ctl.submit(MODEL, p, params(n, greedy))
        await asyncio.sleep(0)  # the submit call runs
        src = ctl.inst_of[t.instance][0]
        assert src == 0  # worst fit: the first (or the emptier) worker
        pump(ctl, 0, cores[0], 5)
        handles[0].die_on = die_on
        dst_iid = next(i for i, (w, _m) in ctl.inst_of.items() if w == 1)
        t.moving = "export"  # as _start_moves hands it over
        await ctl._move_live(t, t.instance, dst_iid, "kv")
        await asyncio.sleep(0)
        for _ in range(400):
            if t.done:
                break
            for wid, c in enumerate(cores):
                if ctl.workers[wid].alive:
                    pump(ctl, wid, c, 1)
            await asyncio.sleep(0)
        assert t.done and t.finish_reason == "length"
        return ctl, t, cores, handles

    return asyncio.run(main())


def test_the_controller_moves_a_request_live_and_it_continues_exactly() -> None:
    p, n = prompt(70), 60
    want = run_alone(p, n)
    ctl, t, cores, handles = run_controller_case(src_steps=2)
    assert t.output_ids == want
    assert t.instance == next(i for i, (w, _m) in ctl.inst_of.items() if w == 1)
    assert t.migrations == 1 and t.moving is None
    m = ctl.metrics
    assert m.migrations.labels("kv", "done")._value.get() == 1
    assert m.migration_stages._value.get() >= 1
    assert "live_final" in handles[0].calls and "live_finish" in handles[1].calls
    assert ctl.transfer_bw()[1]  # measured
    assert cores[0].engine.pool.kv_pages == 0  # released at the source
    for c in cores:
        c.check_integrity()


def test_a_full_destination_calls_the_move_off_and_it_goes_on_at_the_source() -> None:
    p, n = prompt(70), 60
    want = run_alone(p, n)
    ctl, t, cores, handles = run_controller_case(src_steps=1, dst_mb=12, hog=True)
    assert t.output_ids == want
    assert ctl.inst_of[t.instance][0] == 0 and t.migrations == 0
    assert ctl.metrics.migrations.labels("kv", "aborted")._value.get() == 1
    assert "live_final" not in handles[0].calls  # never stopped
    assert 0 not in [r for r in cores[1].engine.requests if r != 99]
    for c in cores:
        c.check_integrity()


def test_a_source_dying_during_the_stages_resumes_the_request_once() -> None:
    p, n = prompt(70), 60
    want = run_alone(p, n, greedy=True)
    ctl, t, cores, handles = run_controller_case(src_steps=1, die_on="live_final", greedy=True)
    # re-prefilled from the controller's record on the destination (which
    # dropped the pre-commit first); every token once, the same ones (greedy:
    # a resumed request's sampler restarts from a derived seed)
    assert t.output_ids == want and t.resumes == 1
    assert ctl.inst_of[t.instance][0] == 1
    assert ctl.metrics.migrations.labels("kv", "aborted")._value.get() == 1
    assert "live_abort" in handles[1].calls
    cores[1].check_integrity()


def test_moves_stay_exact_after_a_worker_slept_and_woke() -> None:
    """An elastic worker gives its arena back when it sleeps and gets a new
    one when it wakes: KV copied into it, or out of it, afterwards must land in
    (and come from) the new arena, not a view of the old one (a defect the
    Mell test through Ray found: a move into a re-woken worker continued on
    wrong KV)."""
    n = 40
    a, b = core(0), core(1)
    for rid in (1, 2, 3):
        # a -> b, then b sleeps and wakes, then b -> a, then a sleeps and wakes;
        # each request its own prompt: the old arena holds other KV
        p = prompt(70 + 9 * rid)[rid:]
        want = run_alone(p, n)
        src, dst = (a, b) if rid % 2 else (b, a)
        src.submit(rid, MODEL, p, params(n))
        for _ in range(4):
            src.step()
        moved, _stages, got = migrate(src, dst, rid, 1, 2)
        assert moved
        while dst.has_work():
            dst.step()
        got |= tokens_of(dst, rid)
        assert [got[i] for i in sorted(got)] == want, rid
        assert dst.deactivate() and dst.engine.asleep  # idle: it sleeps
        assert dst.activate() > 0 and not dst.engine.asleep
        for c in (a, b):
            c.check_integrity()
