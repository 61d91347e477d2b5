"""``fleetserve serve`` as systemd, Docker and Kubernetes run it: a real
process, stopped with SIGTERM while requests are in flight; and what it
exposes on the network while it runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_util import listening_sockets, metric_value

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KEY = "drain-key"
HDR = {"Authorization": f"Bearer {KEY}"}


def free_ports(n: int) -> list[int]:
    """``n`` different free ports (each held until all are found: a port just
    released may be the next one handed out)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def serve_processes(
    tmp: Path, sets: dict[str, tuple[str, ...]]
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    """One ``fleetserve serve configs/serve-tiny.yaml --api-key`` on a free port
    per entry of ``sets`` (its ``--set`` overrides; its log in ``tmp/NAME``),
    all started at once and ready (``/ready`` 200); killed at the end if still
    running. Much of a start is waiting for Ray's processes and the workers to
    come up: two started together took 1.0-1.5 times one start on 2 cores."""
    exe = Path(sys.executable).parent / "fleetserve"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    logs = []
    try:
        for (name, overrides), port in zip(sets.items(), free_ports(len(sets)), strict=True):
            cmd = [str(exe), "serve", str(ROOT / "configs/serve-tiny.yaml"), "--port", str(port)]
            cmd += ["--api-key", KEY]
            for s in overrides:
                cmd += ["--set", s]
            (tmp / name).mkdir()
            log = open(tmp / name / "serve.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp / name, env=env
            )
            procs[name] = (proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 180
        waiting = set(procs)
        while waiting:
            for name in sorted(waiting):
                proc, url = procs[name]
                assert proc.poll() is None, (tmp / name / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"the server {name!r} did not become ready"
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        waiting.discard(name)
                except httpx.HTTPError:
                    pass
            if waiting:
                time.sleep(0.3)
        yield procs
    finally:
        for proc, _url in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for log in logs:
            log.close()


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    """Each test's own server (each test stops its server), both started together."""
    sets = {"finish": ("serve.drain_timeout_s=120",), "deadline": ("serve.drain_timeout_s=1",)}
    with serve_processes(tmp_path_factory.mktemp("drain"), sets) as procs:
        yield procs


def _send(url: str, i: int, max_tokens: int, out: dict[int, Any]) -> None:
    stream = i % 2 == 0
    body = {
        "model": "tiny-llama-a" if i % 3 else "tiny-llama-b",
        "prompt": f"request {i}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    try:
        with httpx.Client(timeout=300, headers=HDR) as c:
            if not stream:
                r = c.post(url + "/v1/completions", json=body)
                out[i] = ("plain", r.status_code, r.json())
                return
            events = []
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            out[i] = ("stream", r.status_code, events)
    except Exception as e:  # recorded, asserted on below
        out[i] = ("exception", 0, repr(e))


def _start(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], dict[int, Any]]:
    out: dict[int, Any] = {}
    threads = [threading.Thread(target=_send, args=(url, i, max_tokens, out)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while True:  # every request admitted and producing tokens
        m = httpx.get(url + "/metrics", headers=HDR).text
        if metric_value(m, "fleetserve_requests_in_flight") >= n:
            break
        assert time.monotonic() < deadline, "the requests did not all get in flight"
        time.sleep(0.05)
    return threads, out


def test_sigterm_finishes_every_request_in_flight_and_exits_0(
    servers: dict[str, tuple[subprocess.Popen[bytes], str]],
) -> None:
    proc, url = servers["finish"]
    # nothing of the server or of Ray listens beyond loopback (with --api-key)
    socks = listening_sockets(proc.pid)
    assert len({pid for _a, _p, pid in socks}) >= 4, socks  # server, GCS, raylet, workers
    assert not [s for s in socks if not s[0].is_loopback], socks
    threads, out = _start(url, 16, 120)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = httpx.post(
        url + "/v1/completions", headers=HDR, json={"model": "tiny-llama-a", "prompt": "x"}
    )
    assert late.status_code == 503
    assert int(late.headers["retry-after"]) >= 1
    assert late.json()["error"]["code"] == "shutting_down"
    assert httpx.get(url + "/ready").status_code == 503
    assert httpx.get(url + "/health").status_code == 200
    for t in threads:
        t.join(240)
    assert proc.wait(60) == 0
    assert len(out) == 16
    for i, (kind, status, got) in sorted(out.items()):
        assert status == 200, (i, kind, got)
        if kind == "plain":
            assert got["usage"]["completion_tokens"] == 120
            assert got["choices"][0]["finish_reason"] == "length"
        else:
            assert kind == "stream", got
            assert got[-1] == "[DONE]"
            assert not any('"error"' in e for e in got)
            assert json.loads(got[-2])["choices"][0]["finish_reason"] == "length"


def test_drain_deadline_ends_what_is_left_with_an_error_and_exits_0(
    servers: dict[str, tuple[subprocess.Popen[bytes], str]],
) -> None:
    proc, url = servers["deadline"]
    threads, out = _start(url, 4, 4000)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert proc.wait(60) == 0
    for _i, (kind, status, got) in sorted(out.items()):
        if kind == "plain":
            assert status == 503 and got["error"]["type"] == "service_unavailable", got
        else:
            assert kind == "stream" and status == 200, got
            assert got[-1] == "[DONE]" and '"error"' in got[-2], got[-3:]
