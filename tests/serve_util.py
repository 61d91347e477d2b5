"""Test helpers: a real runtime (Ray workers + controller + FastAPI) on a free port.

Ray is started once per test session (module fixtures call
:func:`ensure_ray`); each server runs uvicorn in a background thread with
its own event loop, which also runs the controller.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fleetserve.cli.serve import runtime_replanner, serve_config_dict
from fleetserve.config import config_from_dict
from fleetserve.runtime import cluster
from fleetserve.runtime.controller import Controller
from fleetserve.runtime.server import build_server
from fleetserve.sim.multi_build import history_placement


def ensure_ray() -> None:
    cluster.init_ray(None, num_cpus=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    url: str
    controller: Controller


@contextmanager
def running_server(data: dict[str, Any], api_key: str | None = None) -> Iterator[Running]:
    """Start a runtime for config ``data``; yield its base URL and controller."""
    ensure_ray()
    cfg = config_from_dict(serve_config_dict(data))
    holder: dict[str, Controller] = {}

    async def launch() -> Controller:
        holder["ctl"] = await cluster.launch(
            cfg, placer=history_placement, replanner=runtime_replanner
        )
        return holder["ctl"]

    port = free_port()
    server = build_server(
        launch, cluster.shutdown, cfg.serve, host="127.0.0.1", port=port, api_key=api_key
    )
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield Running(f"http://127.0.0.1:{port}", holder["ctl"])
    finally:
        server.should_exit = True
        th.join(timeout=30)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        got = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        got = {k: v.strip('"') for k, v in got.items()}
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def reference_text(model: str, prompt: str | list[int], n: int, arena_mb: float = 48) -> str:
    """What the engine itself generates greedily for ``prompt`` (``n`` tokens,
    EOS ignored), with the same built-in weights the workers load."""
    from fleetserve.runtime.engine.engine import Engine
    from fleetserve.runtime.engine.sampling import SamplingParams

    eng = Engine([model], int(arena_mb * 2**20))
    rid = eng.add_request(model, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return eng.requests[rid].text


def _descendants(root: int) -> set[int]:
    """``root`` and every process under it (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def _listen_inodes() -> dict[int, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """Listening TCP sockets of the machine by inode: (address, port)."""
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A":  # LISTEN
                continue
            hexip, hexport = parts[1].split(":")
            raw = bytes.fromhex(hexip)
            # /proc stores each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(words)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                addr = addr.ipv4_mapped
            out[int(parts[9])] = (addr, int(hexport, 16))
    return out


def listening_sockets(
    root: int,
) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]]:
    """(address, port, pid) of every TCP socket listened on by ``root`` or a
    process under it (Ray's GCS, raylet and workers descend from the process
    that started Ray)."""
    inodes = _listen_inodes()
    found = []
    for pid in _descendants(root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                ino = int(link[8:-1])
                if ino in inodes:
                    found.append((*inodes[ino], pid))
    return found
