"""The simulation kernel: event order, arrivals merged, stale events, horizon, checks."""

from __future__ import annotations

import ast
import gc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.sim import events as ev
from fleetserve.sim import kernel as kernel_mod
from fleetserve.sim.kernel import Kernel
from fleetserve.workload.request import Request

SIM = Path(__file__).resolve().parents[1] / "src" / "fleetserve" / "sim"


def _req(i: int, t: float) -> Request:
    return Request(i, "llama-2-7b", t, 8, 4)


class _Model:
    """Records what ran; each handler may cause more events."""

    def __init__(self, then: dict[Any, list[ev.Event]] | None = None) -> None:
        self.log: list[tuple[float, str, Any]] = []
        self.n_done = 0
        self.checks: list[int] = []
        self.then = then or {}

    def handler(self, kind: int) -> Any:
        def h(payload: Any, now: float) -> list[ev.Event] | None:
            if payload == "stale":
                return None
            self.log.append((now, ev.NAMES[kind], payload))
            return list(self.then.get(payload, []))

        return h

    def on_arrival(self, req: Request, now: float) -> list[ev.Event]:
        self.log.append((now, "arrival", req.id))
        return list(self.then.get(("arrival", req.id), []))

    def check_integrity(self, arrived: int) -> None:
        self.checks.append(arrived)


def _kernel(model: _Model, reqs: list[Request], **kw: Any) -> Kernel:
    return Kernel(reqs, {k: model.handler(k) for k in range(len(ev.PRIORITY))}, **kw)


def test_every_kind_has_one_priority_and_name() -> None:
    kinds = [v for k, v in vars(ev).items() if k.isupper() and not k.startswith("P_")]
    kinds = [v for v in kinds if isinstance(v, int)]
    assert sorted(kinds) == list(range(len(ev.PRIORITY)))
    assert len(ev.NAMES) == len(ev.PRIORITY) == len(set(ev.NAMES))
    assert ev.P_ITER_END < ev.P_TRANSFER < ev.P_ARRIVAL < ev.P_EPOCH < ev.P_SAMPLE


def test_same_instant_runs_by_priority_then_cause_order_with_arrivals_merged() -> None:
    m = _Model()
    k = _kernel(m, [_req(0, 1.0)])
    k.push(
        [
            (1.0, ev.SAMPLE, "s"),
            (1.0, ev.EPOCH, "e"),
            (1.0, ev.TRANSFER, "t"),
            (1.0, ev.ITER_END, "i1"),
            (1.0, ev.REPLACE, "r"),
            (1.0, ev.ITER_END, "i2"),
            (0.5, ev.ATTACH, "a"),
        ]
    )
    end = k.run(m)
    assert [x[2] for x in m.log] == ["a", "i1", "i2", "t", 0, "e", "s", "r"]
    assert end == 1.0 and k.n_events == 8


def test_caused_events_are_pushed_and_stale_ones_not_counted() -> None:
    m = _Model(
        {
            "i": [(2.0, ev.ITER_END, "j"), (2.0, ev.TRANSFER, "stale")],
            ("arrival", 0): [(1.5, ev.SAMPLE, "x")],
        }
    )
    k = _kernel(m, [_req(0, 1.0)])
    k.push([(0.5, ev.ITER_END, "i")])
    end = k.run(m)
    assert [x[2] for x in m.log] == ["i", 0, "x", "j"]
    assert k.n_events == 4  # the stale transfer is not counted
    assert end == 2.0


def test_horizon_stops_and_reports_it_when_work_is_left() -> None:
    m = _Model()
    k = _kernel(m, [_req(0, 1.0), _req(1, 9.0)], max_time_s=5.0)
    k.push([(0.5, ev.SAMPLE, "a"), (6.0, ev.SAMPLE, "b")])
    assert k.run(m) == 5.0
    assert [x[2] for x in m.log] == ["a", 0]
    assert k.arrived == 1 and k.arrivals_left


def test_integrity_checked_after_every_event_with_the_arrived_count() -> None:
    m = _Model()
    k = _kernel(m, [_req(0, 1.0), _req(1, 2.0)], check=True)
    k.push([(1.5, ev.SAMPLE, "a")])
    k.run(m)
    assert m.checks == [1, 1, 2]


def test_missing_handler_is_an_error() -> None:
    m = _Model()
    k = Kernel([], {}, check=False)
    k.push([(0.0, ev.SAMPLE, None)])
    try:
        k.run(m)
    except RuntimeError as e:
        assert "no handler" in str(e)
    else:  # pragma: no cover
        raise AssertionError("expected RuntimeError")


def test_collector_off_during_a_run_and_restored_after_it_returns_or_raises() -> None:
    seen: list[bool] = []

    class Boom(_Model):
        def on_arrival(self, req: Request, now: float) -> list[ev.Event]:
            seen.append(gc.isenabled())
            if req.id == 1:
                raise ValueError("boom")
            return []

    was = gc.isenabled()
    try:
        gc.enable()
        m = Boom()
        _kernel(m, [_req(0, 1.0)]).run(m)
        assert seen == [False] and gc.isenabled()
        with pytest.raises(ValueError, match="boom"):
            _kernel(m, [_req(1, 1.0)]).run(m)
        assert seen == [False, False] and gc.isenabled()
        gc.disable()  # a caller that had it off keeps it off
        _kernel(m, [_req(0, 1.0)]).run(m)
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_loop_collects_the_young_generations_every_gc_every_events(monkeypatch: Any) -> None:
    calls: list[int] = []
    monkeypatch.setattr(kernel_mod, "GC_EVERY", 3)
    monkeypatch.setattr(kernel_mod.gc, "collect", lambda gen=2: calls.append(gen) or 0)
    m = _Model()
    k = _kernel(m, [_req(i, float(i)) for i in range(7)])
    k.run(m)
    assert k.n_events == 7 and calls == [1, 1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 20), st.sampled_from(range(len(ev.PRIORITY)))), max_size=40),
    st.lists(st.integers(0, 20), max_size=15),
)
def test_order_is_time_priority_then_cause(
    pushed: list[tuple[int, int]], arrivals: list[int]
) -> None:
    m = _Model()
    reqs = [_req(i, float(t)) for i, t in enumerate(sorted(arrivals))]
    k = _kernel(m, reqs)
    k.push([(float(t), kind, ("e", i)) for i, (t, kind) in enumerate(pushed)])
    k.run(m)
    key: list[tuple[float, int, int]] = []
    for now, name, payload in m.log:
        if name == "arrival":
            key.append((now, ev.P_ARRIVAL, payload))
        else:
            key.append((now, ev.PRIORITY[ev.NAMES.index(name)], payload[1]))
    assert key == sorted(key)
    assert len(m.log) == len(pushed) + len(reqs)


def test_one_event_loop_in_the_simulator() -> None:
    """Only the kernel pops events: no other module of sim/ imports heapq to
    pop, except the per-instance finish-step queue (not an event loop)."""
    poppers = []
    for p in sorted(SIM.glob("*.py")):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "heappop":
                poppers.append(p.name)
    assert sorted(set(poppers)) == ["finish.py", "kernel.py"]


class _S:
    __slots__ = ("finish_step", "id")

    def __init__(self, rid: int, step: int) -> None:
        self.id = rid
        self.finish_step = step


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(1, 30), st.booleans()), max_size=40),
    st.integers(0, 40),
)
def test_finish_queue_yields_exactly_the_running_requests_due(
    ops: list[tuple[int, int, bool]], steps: int
) -> None:
    """Requests join (possibly again, with another finish step) or leave the
    batch; ``due`` yields the running ones finishing by ``steps``, in
    ``(step, id)`` order, and ``earliest`` is the smallest running step."""
    from fleetserve.sim.finish import FinishQueue

    q = FinishQueue()
    running: dict[int, _S] = {}
    for rid, step, leave in ops:
        if leave:
            running.pop(rid, None)
        else:
            running[rid] = _S(rid, step)
            q.add(step, rid)
    if running:
        assert q.earliest(running) == min(s.finish_step for s in running.values())
    want = sorted((s.finish_step, s.id) for s in running.values() if s.finish_step <= steps)
    got = []
    for s in q.due(steps, running):
        got.append((s.finish_step, s.id))
        del running[s.id]
    assert got == want
