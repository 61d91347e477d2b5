"""Where a token's time goes on the serving path: one timestamp per hop.

A streamed token passes, in order: the HTTP handler, the controller (which
sends the request to a worker actor over Ray), the worker actor's event
loop, its engine thread (the engine step that makes the token, after which
the thread sends the step's report: over the report channel,
:mod:`fleetserve.runtime.channel`, or as the answer to the controller's Ray
long-poll), the controller (which queues the token for the request) and the
handler that writes its SSE chunk. Each of those places stamps
``time.monotonic()``. Every process of a local ``fleetserve serve`` — the
server, Ray's worker actors — runs on one host, where ``time.monotonic``
reads ``CLOCK_MONOTONIC``: one clock for all of them, so a worker's stamp
and the server's compare directly. (On a
multi-node Ray cluster a worker on another node has another clock: the hops
that cross processes are then meaningless, and negative ones are dropped.)

The hops (``fleetserve_hop_seconds{hop, token}``; ``token`` is ``first``
for a request's first token and ``next`` for the others):

=============  ===========================================================
``http``       the request reaches the app (its headers are in) → the
               controller sends the submit (body read and parsed,
               tokenized, dispatch policy)
``to_worker``  submit sent → the worker actor runs it (Ray)
``admit``      the actor has it → the engine has it (engine-thread lock
               and thread hand-off; waits for a step in progress)
``queue``      the engine has it → the engine step that prefills it starts
``gap``        (``next``) the end of the step that made the request's
               previous token → the start of the step that makes this one
``step``       that engine step, start → end (prefill or decode)
``handoff``    step end → the worker sends the step's report (to the report
               channel, or the poll hands it to Ray)
``to_ctl``     report sent → the controller has read it
``stream``     the controller queued it → its SSE chunk is written (without
               streaming: the handler read it)
``ttft``       (``first``) the request reaches the app → first chunk written
``itl``        (``next``) previous chunk written → this chunk written
=============  ===========================================================

A request's first token is always measured (a few stamps per request). The
tokens after it are measured with ``serve.hop_trace`` (or ``serve.hop_log``,
which also writes every measured token's hops to a JSON-lines file:
``benchmarks/serve_hops.py`` reads it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from fleetserve.errors import FleetserveError

if TYPE_CHECKING:
    from fleetserve.runtime.controller import Tracked
    from fleetserve.runtime.metrics import RuntimeMetrics
    from fleetserve.runtime.worker import Report

FIRST_HOPS = (
    "http",
    "to_worker",
    "admit",
    "queue",
    "step",
    "handoff",
    "to_ctl",
    "stream",
    "ttft",
)
NEXT_HOPS = ("gap", "step", "handoff", "to_ctl", "stream", "itl")


@dataclass(slots=True)
class TokenStamps:
    """The stamps of one token from the worker's report and the controller."""

    index: int  # the request's generated count after this token
    first: bool  # the first token the controller passed on for the request
    step_start: float
    step_end: float
    buffered: float  # the engine emitted it (inside the step)
    sent: float  # the worker's poll handed its report to Ray
    received: float  # the controller's poll loop got the report


def token_stamps(
    rep: Report, rid: int, index: int, first: bool, received: float
) -> TokenStamps | None:
    """Stamps of token ``index`` of ``rid`` in ``rep``; None when the worker has
    none for it (a buddy group's pipelined step makes its tokens)."""
    marks = rep.t_tokens.get(rid)
    if not marks:
        return None
    for idx, step, buffered in marks:
        if idx == index and step < len(rep.t_steps):
            start, end = rep.t_steps[step]
            return TokenStamps(index, first, start, end, buffered, rep.t_sent, received)
    return None


class HopRecorder:
    """Turns stamps into ``fleetserve_hop_seconds`` observations (and log lines).

    Args:
        metrics: the controller's metrics (the histogram lives there).
        trace: measure every token, not only each request's first.
        log_path: also append each measured token's hops to this JSON-lines
            file (one object per token: request, index, first, hops in seconds).
    """

    def __init__(self, metrics: RuntimeMetrics, trace: bool, log_path: str | None) -> None:
        self.trace = trace or log_path is not None
        h = metrics.hops
        self._first = {name: h.labels(name, "first") for name in FIRST_HOPS}
        self._next = {name: h.labels(name, "next") for name in NEXT_HOPS}
        self._log: IO[str] | None = None
        if log_path is not None:
            try:
                self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as e:
                msg = f"serve.hop_log: cannot write {e.filename}: {e.strerror}"
                raise FleetserveError(msg) from None

    def wanted(self, first: bool) -> bool:
        """Whether a token is measured (every first token; the rest when tracing)."""
        return first or self.trace

    def written(self, t: Tracked, s: TokenStamps, written: float) -> None:
        """Token ``s`` of ``t`` reached the client at ``written``: observe its hops."""
        hops: dict[str, float] = {}
        if s.first:
            if t.t_http is not None and t.t_sent is not None:
                hops["http"] = t.t_sent - t.t_http
            if t.t_admit is not None:
                got, added = t.t_admit
                if t.t_sent is not None:
                    hops["to_worker"] = got - t.t_sent
                hops["admit"] = added - got
                hops["queue"] = s.step_start - added
            if t.t_http is not None:
                hops["ttft"] = written - t.t_http
        elif t.last_step_end is not None:
            hops["gap"] = s.step_start - t.last_step_end
        hops["step"] = s.step_end - s.step_start
        hops["handoff"] = s.sent - s.step_end
        hops["to_ctl"] = s.received - s.sent
        hops["stream"] = written - s.received
        if not s.first and t.last_written is not None:
            hops["itl"] = written - t.last_written
        t.last_step_end = s.step_end
        t.last_written = written
        hist = self._first if s.first else self._next
        for name, v in hops.items():
            if v >= 0:  # a negative hop: clocks of two hosts (see the module docstring)
                hist[name].observe(v)
        if self._log is not None:
            rec: dict[str, Any] = {
                "request": t.id,
                "index": s.index,
                "first": s.first,
                "hops": {k: round(v, 7) for k, v in hops.items()},
            }
            self._log.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self._log is not None:
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
