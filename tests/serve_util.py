"""Test helpers: a real runtime (Ray workers + controller + FastAPI) on a free port.

Ray is started once per test session (module fixtures call
:func:`ensure_ray`); each server runs uvicorn in a background thread with
its own event loop, which also runs the controller.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fleetserve.cli.serve import serve_config_dict
from fleetserve.config import config_from_dict
from fleetserve.runtime import cluster
from fleetserve.runtime.controller import Controller
from fleetserve.runtime.server import create_app


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
    import uvicorn

    ensure_ray()
    cfg = config_from_dict(serve_config_dict(data))
    holder: dict[str, Controller] = {}

    async def launch() -> Controller:
        holder["ctl"] = await cluster.launch(cfg)
        return holder["ctl"]

    app = create_app(
        launch, cluster.shutdown, api_key=api_key, max_body_bytes=cfg.serve.max_body_bytes
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
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
