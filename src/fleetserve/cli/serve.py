"""``fleetserve serve CONFIG.yaml``: start the cluster runtime and its HTTP server."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console

from fleetserve.config import SimConfig, apply_override, config_from_dict, load_config
from fleetserve.errors import FleetserveError, require_modules


def serve_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict made ready for the runtime: unless the file asks for an
    elastic pool (``cluster.elastic: true``), the pool is fixed at
    ``serve.workers`` GPUs; ``cluster.gpus`` follows ``serve.workers``."""
    cl = data.setdefault("cluster", {})
    sv = data.setdefault("serve", {})
    workers = sv.get("workers", 2)
    if not cl.get("elastic", False):
        cl["elastic"] = False
        cl["gpus"] = workers
    else:
        cl.setdefault("max_gpus", workers)
    if "model" not in data and sv.get("models"):
        data["model"] = sv["models"][0]
    return data


def load_serve_config(path: str | None, overrides: list[str]) -> SimConfig:
    """Read ``path`` (and ``--set`` overrides) as a runtime config."""
    data = load_config(path)
    for s in overrides:
        apply_override(data, s)
    data = serve_config_dict(data)
    return config_from_dict(data, src=path)


def runtime_replanner(placement: Any, n_workers: int) -> Any:
    """SeaLLM's re-placement search for the runtime: the simulator's
    (:class:`fleetserve.sim.multi_build.RuntimeReplanner`) over the served
    placement (a :class:`~fleetserve.runtime.plan.SharingPlacement`)."""
    from fleetserve.sim.multi_build import RuntimeReplanner

    p = placement
    return RuntimeReplanner(p.stack, p.config, p.gpu, p.services, n_workers)


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
    require_modules("serve", "runtime", "torch", "ray", "fastapi", "uvicorn")
    from fleetserve.runtime import cluster
    from fleetserve.runtime.server import API_KEY_ENV, build_server
    from fleetserve.sim.multi_build import history_placement

    cfg = load_serve_config(args.config, args.set)
    if args.port is not None and not 0 < args.port < 65536:
        raise FleetserveError(f"--port must be in 1..65535, got {args.port}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    # names and placement checked before Ray starts
    cluster.worker_specs(cfg, cluster.served_models(cfg), placer=history_placement)
    cores = cluster.core_plan(cfg)
    if cores is not None:
        if args.address is not None:
            raise FleetserveError("serve.pin_cores pins a local serve; leave out --address")
        # this process, and the Ray processes it starts, keep off the engines' cores
        os.sched_setaffinity(0, cores.server)
        console.print(
            f"engines pinned to cores {', '.join(str(list(c)) for c in cores.engines)}; "
            f"server and Ray on {list(cores.server)}",
            highlight=False,
        )

    async def launch() -> Any:
        ctl = await cluster.launch(cfg, args.address, cores, history_placement, runtime_replanner)
        sv = cfg.serve
        models = ", ".join(ctl.models)
        console.print(
            f"serving [bold]{models}[/] on {sv.workers} worker(s) of {sv.gpu_memory_mb:g} MiB "
            f"({ctl.policy_names['stack']} stack) at http://{args.host}:{args.port}"
            + (" (API key required)" if api_key else ""),
            highlight=False,
        )
        return ctl

    server = build_server(
        launch, cluster.shutdown, cfg.serve, host=args.host, port=args.port, api_key=api_key
    )
    server.run()
    if not server.started:
        raise FleetserveError(f"the server did not start on {args.host}:{args.port} (see above)")
    console.print("stopped", highlight=False)
    return 0


def add_serve_parser(sub: Any) -> None:
    """The ``serve`` subcommand."""
    p = sub.add_parser(
        "serve",
        help="serve the config's models over an OpenAI-compatible HTTP API",
        description="Start Ray workers (one per emulated GPU) and the OpenAI-compatible server.",
    )
    p.add_argument("config", help="YAML config with a serve: section")
    p.add_argument(
        "--address",
        help="join this Ray cluster (default: start a local Ray instance)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' (default: $FLEETSERVE_API_KEY if set)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    p.set_defaults(func=cmd_serve)
