"""Worker reports on their way to the controller: the report channel (a local
socket), report numbers and the controller's in-order apply. Fast: no Ray, a
tiny model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from fleetserve.runtime.channel import ReportServer, ReportSink
from fleetserve.runtime.controller import Controller, _Worker
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.worker import Report, WorkerCore, WorkerSpec

MODEL = "tiny-llama-a"


def _core() -> WorkerCore:
    return WorkerCore(WorkerSpec(0, (MODEL,), (MODEL,), 16 * 2**20))


def test_channel_delivers_reports_of_a_token_holder_only() -> None:
    async def main() -> list[tuple[int, int, Any]]:
        got: list[tuple[int, int, Any]] = []
        srv = ReportServer(lambda wid, gen, rep, _t: got.append((wid, gen, rep)))
        await srv.start()
        assert srv.path is not None
        stranger = ReportSink(srv.path, b"x" * 32)  # no valid token: never read
        stranger.send(Report(9))
        sink = ReportSink(srv.path, srv.token(3, 1))
        for seq in range(3):
            sink.send(Report(3, tokens={7: [(seq + 1, 40 + seq, "a")]}, seq=seq, seq_end=seq + 1))
        for _ in range(200):
            if len(got) == 3:
                break
            await asyncio.sleep(0.01)
        sink.close()
        stranger.close()
        await srv.stop()
        return got

    got = asyncio.run(main())
    assert [(w, g) for w, g, _r in got] == [(3, 1)] * 3
    assert [r.tokens[7][0][1] for _w, _g, r in got] == [40, 41, 42]


def test_reports_are_numbered_and_merged_in_order() -> None:
    core = _core()
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    core.submit(1, MODEL, [5, 6, 7], p)
    sealed = []
    core.run_steps(lambda: True, lambda: sealed.append(1))
    assert len(sealed) == 4  # no channel: every step's report waits for the poll
    rep = core.take_report()  # the sealed ones, merged, then what came after
    assert (rep.seq, rep.seq_end) == (0, 5)
    assert [i for i, _tok, _p in rep.tokens[1]] == [1, 2, 3, 4]
    assert [i for i, _s, _t in rep.t_tokens[1]] == [1, 2, 3, 4]
    assert [s for _i, s, _t in rep.t_tokens[1]] == [0, 1, 2, 3]  # index into t_steps
    assert len(rep.t_steps) == 4 and rep.finished == {1: "length"}
    nxt = core.take_report()
    assert (nxt.seq, nxt.seq_end) == (5, 6) and not nxt.tokens


def test_controller_applies_a_workers_reports_in_their_order() -> None:
    applied: list[int] = []
    fake: Any = SimpleNamespace(
        _apply_report=lambda w, rep, t: applied.append(rep.seq), MAX_HELD_REPORTS=3
    )
    w = _Worker(spec=SimpleNamespace(worker_id=0), handle=None, snap=None)  # type: ignore[arg-type]

    def receive(seq: int, end: int | None = None) -> None:
        Controller._receive(fake, w, Report(0, seq=seq, seq_end=end or seq + 1), 0.0)

    receive(0)
    receive(2)  # came by the channel before 1 came with a poll: held
    assert applied == [0]
    receive(3, 5)
    receive(1)
    assert applied == [0, 1, 2, 3] and w.next_seq == 5 and not w.held
    receive(4)  # inside a range already applied
    assert applied == [0, 1, 2, 3]
    for seq in (6, 7, 8):  # 5 never comes
        receive(seq)
    assert applied == [0, 1, 2, 3] and len(w.held) == 3
    receive(9)  # more held than MAX_HELD_REPORTS: go on without 5
    assert applied == [0, 1, 2, 3, 6, 7, 8, 9] and w.next_seq == 10 and not w.held
