"""Worker reports straight to the controller, over a local socket (not Ray).

A Ray actor call costs milliseconds of CPU on this project's machines (the
caller's and the actor's; measured in ``docs/engine-speed.md``), and the
controller long-polled each worker once per engine step: one Ray round trip
per generated token at low load, on the cores the engines need. Instead, a
worker on the controller's host writes each step's report to a Unix socket
the controller listens on, from its engine thread, the moment the step ends;
the controller's event loop reads it. The Ray long-poll stays, for what is
not a step's (a timeout's snapshot, the events of calls) and to notice a
dead worker.

Reports carry sequence numbers (:attr:`~fleetserve.runtime.worker.Report.seq`)
and the controller applies each worker's reports in that order whichever
way they came, so a token never overtakes an earlier one.

Frames are ``4-byte big-endian length + pickle``. The socket lives in a
private directory (mode 0700) and a connection is read only after it sent
the 32-byte token the controller gave that worker (over Ray): nothing but
the controller's own workers can write to it. A worker on another node
cannot reach the socket and keeps the Ray path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
_LEN = struct.Struct(">I")
SEND_TIMEOUT_S = 30.0
"""A write the controller does not drain in this long breaks the channel
(the worker falls back to the Ray long-poll)."""

Receive = Callable[[int, int, Any, float], None]
"""``(worker id, generation, report, when it was read)``."""


class ReportServer:
    """The controller's end: a Unix socket in a private directory.

    ``receive`` gets every report read, with the worker id and generation
    its connection's token was issued for (:meth:`token`).
    """

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.path: str | None = None
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tokens: dict[bytes, tuple[int, int]] = {}
        self._conns: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}

    async def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="fleetserve-")  # mode 0700
        self.path = os.path.join(self._dir, "reports.sock")
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    def token(self, worker_id: int, generation: int) -> bytes:
        """A fresh token for one worker actor (a restarted one gets another)."""
        tok = secrets.token_bytes(TOKEN_BYTES)
        self._tokens[tok] = (worker_id, generation)
        return tok

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[writer] = task
        try:
            tok = await reader.readexactly(TOKEN_BYTES)
            who = self._tokens.pop(tok, None)
            if who is None:
                logger.warning("report channel: a connection without a valid token; closed")
                return
            wid, gen = who
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                data = await reader.readexactly(n)
                got = time.monotonic()
                try:
                    self.receive(wid, gen, pickle.loads(data), got)
                except Exception:  # a bug applying one report must not drop the rest
                    logger.exception("report channel: a report of worker %d failed", wid)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away (its Ray poll tells the controller)
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            conns = list(self._conns.items())
            for w, _task in conns:
                w.close()
            # the readers end (EOF) before the loop could cancel them: a cancelled
            # connection callback is logged as an error by Python 3.11's asyncio
            if conns:
                await asyncio.wait([t for _w, t in conns], timeout=5)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class ReportSink:
    """The worker's end: writes reports (from the engine thread)."""

    def __init__(self, path: str, token: bytes) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(SEND_TIMEOUT_S)
            s.connect(path)
            s.sendall(token)
        except BaseException:
            s.close()
            raise
        self._sock = s

    def send(self, report: Any) -> None:
        """Write one report; raises ``OSError`` when the channel is broken."""
        data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
        self._sock.sendall(_LEN.pack(len(data)) + data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
