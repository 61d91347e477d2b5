"""The HTTP layer under the OpenAI app: what a deployment needs before any endpoint runs.

* :class:`GuardMiddleware` (pure ASGI): the API key (compared as bytes, so a
  non-ASCII key is a 401, not a crash), the body limit enforced *while* the
  body is read (a chunked upload is cut at ``max_body_bytes``, not read whole
  first), a deadline for the whole body (408), 503 with ``Retry-After`` for
  new work while the server drains, a count of every response by endpoint
  and status, and an OpenAI-shaped 500 for any exception an endpoint lets
  through (the detail is logged, never sent).
* :func:`guarded_protocol`: uvicorn's h11 protocol with a deadline for a
  request's headers (slow clients trickling headers are answered 408 and
  closed) and a cap on open connections (one more is answered 503).
* :class:`DrainingServer`: uvicorn's server whose SIGTERM and SIGINT drain
  (stop admitting, let in-flight requests finish for up to
  ``serve.drain_timeout_s``, end the rest, exit 0) instead of exiting at
  once; a second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Endpoints that admit work: refused while draining, counted as in flight."""

RECEIVED_KEY = "fleetserve.received"
"""The ASGI scope key of when the request reached the app (``time.monotonic``)."""

OPEN_PATHS = frozenset({"/health", "/ready"})
"""Probes answered without an API key (they reveal only whether the server is up)."""


def error_body(status: int, message: str, type_: str, code: str | None = None) -> bytes:
    """An OpenAI error body, ``{"error": {"message", "type", "param", "code"}}``."""
    err = {"message": message, "type": type_, "param": None, "code": code}
    return json.dumps({"error": err}).encode()


def raw_response(status: int, reason: str, body: bytes, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response (JSON body, connection closed) as bytes."""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


# ------------------------------------------------------------------- drain
@dataclass
class ServeGate:
    """Whether the server admits work, and how much is in flight.

    Attributes:
        drain_timeout_s: how long a drain lets in-flight requests run.
        draining: set by the first SIGTERM/SIGINT (:meth:`start_drain`).
        in_flight: inference requests whose response is not fully sent.
        on_deadline: called once when the drain's grace period ends with
            requests still in flight (the controller ends them with an error).
    """

    drain_timeout_s: float = 30.0
    draining: bool = False
    in_flight: int = 0
    drain_deadline: float = math.inf
    on_deadline: Callable[[], None] | None = None
    _deadline_fired: bool = field(default=False, repr=False)

    def start_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            logger.warning(
                "draining: no new requests; %d in flight get up to %.0f s",
                self.in_flight,
                self.drain_timeout_s,
            )

    def retry_after_s(self) -> int:
        """``Retry-After`` for a request refused while draining: the grace left."""
        left = self.drain_deadline - time.monotonic()
        return max(1, math.ceil(left)) if math.isfinite(left) else 1

    def drained(self) -> bool:
        """True once nothing is in flight or the grace period is over (then
        ``on_deadline`` has been called)."""
        if not self.draining:
            return False
        if self.in_flight == 0:
            return True
        if time.monotonic() >= self.drain_deadline:
            if not self._deadline_fired:
                self._deadline_fired = True
                logger.warning("drain deadline: ending %d request(s) in flight", self.in_flight)
                if self.on_deadline is not None:
                    self.on_deadline()
            return True
        return False


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful drain on SIGTERM and SIGINT (module docstring).

    The process exits 0 after a drain: the signal is not raised again after
    shutdown, as plain uvicorn does (a SIGTERM'd container would otherwise
    report exit 143 for a clean stop).
    """

    def __init__(self, config: uvicorn.Config, gate: ServeGate) -> None:
        super().__init__(config)
        self.gate = gate

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gate.draining or self.should_exit:
            self.should_exit = True
            self.force_exit = True  # a second signal: stop now
            return
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.gate.start_drain()
        else:  # pragma: no cover - uvicorn handles only SIGINT/SIGTERM (and SIGBREAK)
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.gate.drained():
            self.should_exit = True  # then uvicorn closes the sockets and waits for tasks
            return True
        return False


# ---------------------------------------------------------------- protocol
def guarded_protocol(
    header_timeout_s: float, max_connections: int, count: Callable[[str, int], None]
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a connection cap.

    The deadline runs from the connection's opening, and for each later
    request on a kept-alive connection from its first byte, until its
    headers are complete; a connection past it gets 408 and is closed. A
    connection opened while ``max_connections`` are open gets 503 and is
    closed. A request h11 cannot parse gets an OpenAI-shaped 400 (uvicorn's
    is plain text). ``count(endpoint, status)`` records all three (endpoint
    ``"connection"``).
    """

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(503, "Service Unavailable", "too many open connections; retry later")
                return
            self._arm()

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first byte of a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are in

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._refuse(
                    408,
                    "Request Timeout",
                    f"the request's headers did not arrive within {header_timeout_s:g} s",
                )

        def send_400_response(self, msg: str) -> None:
            # an unparsable request line or headers (or headers over h11's size
            # limit): the same OpenAI-shaped body as every other error
            self._refuse(400, "Bad Request", f"malformed HTTP request: {msg}")

        def _refuse(self, status: int, reason: str, message: str) -> None:
            type_ = {400: "invalid_request_error", 408: "timeout_error"}.get(
                status, "service_unavailable"
            )
            body = error_body(status, message, type_)
            extra = "retry-after: 1\r\n" if status == 503 else ""
            if not self.transport.is_closing():
                self.transport.write(raw_response(status, reason, body, extra))
                self.transport.close()
            count("connection", status)

    return GuardedH11Protocol


# -------------------------------------------------------------- middleware
class _Refused(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.code = code
        self.headers = dict(headers or {})


class _Disconnected(Exception):
    pass


def endpoint_label(path: str, known: frozenset[str]) -> str:
    """The ``endpoint`` label of a path (unknown paths share ``other``)."""
    if path in known:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


class GuardMiddleware:
    """Authentication, bounded bodies, draining, counting and the last-resort
    500 (see the module docstring).

    Args:
        app: the ASGI app inside.
        api_key: required as ``Authorization: Bearer KEY`` on every path but
            :data:`OPEN_PATHS`; None: no key.
        max_body_bytes: request bodies larger than this get 413.
        body_timeout_s: a body must arrive whole within this many seconds.
        gate: the drain state.
        count: ``count(endpoint, status)`` for every response.
        known: the paths counted under their own name.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout_s: float,
        gate: ServeGate,
        count: Callable[[str, int], None],
        known: frozenset[str],
    ) -> None:
        self.app = app
        self.key = b"bearer " + api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.gate = gate
        self.count = count
        self.known = known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_KEY] = time.monotonic()  # a hop stamp (fleetserve.runtime.hops)
        path = scope["path"]
        status: list[int] = []

        async def counted_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status.append(int(msg["status"]))
            await send(msg)

        inference = path in INFERENCE_PATHS
        entered = False
        try:
            self._check_key(scope, path)
            if inference and self.gate.draining:
                raise _Refused(
                    503,
                    "the server is shutting down; retry on another replica or later",
                    "service_unavailable",
                    "shutting_down",
                    {"Retry-After": str(self.gate.retry_after_s())},
                )
            if inference:
                self.gate.in_flight += 1
                entered = True
            if scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
                receive = _replay(body, receive)
            await self.app(scope, receive, counted_send)
        except _Refused as r:
            await self._send_error(counted_send, r, close=r.status in (408, 413))
        except _Disconnected:
            status.append(499)
        except Exception:
            logger.exception("unhandled error on %s %s", scope["method"], path)
            if not status:
                err = _Refused(500, "internal server error (logged)", "internal_error")
                await self._send_error(counted_send, err, close=False)
        finally:
            if entered:
                self.gate.in_flight -= 1
            self.count(endpoint_label(path, self.known), status[0] if status else 500)

    def _check_key(self, scope: Scope, path: str) -> None:
        if self.key is None or path in OPEN_PATHS:
            return
        got = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                got = bytes(value)
                break
        scheme, _, token = got.partition(b" ")
        given = scheme.lower() + b" " + token.strip()
        if not hmac.compare_digest(given, self.key):
            raise _Refused(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                "invalid_api_key",
            )

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise self._too_large(int(value))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        parts: list[bytes] = []
        total = 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _Refused(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                    "timeout_error",
                ) from None
            if msg["type"] == "http.disconnect":
                raise _Disconnected
            chunk = msg.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise self._too_large(None)
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)

    def _too_large(self, length: int | None) -> _Refused:
        size = f"of {length} bytes " if length is not None else ""
        return _Refused(
            413,
            f"request body {size}is over the limit of {self.max_body_bytes} bytes",
            "invalid_request_error",
            "request_too_large",
        )

    @staticmethod
    async def _send_error(send: Send, r: _Refused, close: bool) -> None:
        body = error_body(r.status, r.message, r.type_, r.code)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += [(k.lower().encode(), v.encode()) for k, v in r.headers.items()]
        if close:  # the rest of the body is never read: the connection cannot be reused
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": r.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the already-read body, then the client's
    next message (a disconnect)."""
    done = False

    async def replay() -> Message:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
