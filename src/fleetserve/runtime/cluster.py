"""Start the runtime: Ray, one worker actor per (emulated) GPU, the controller.

``launch`` starts a local Ray instance when none is running and no address
is given, or joins the cluster at ``address`` (``ray://...`` or
``HOST:PORT``, as ``ray.init`` takes it) — that is how a deployment grows
past one machine: start Ray on each node (``ray start --head`` on one,
``ray start --address HEAD:6379`` on the others) and give ``serve`` the
head's address. Workers then ask Ray for ``serve.threads_per_worker`` CPUs
(or one GPU each on ``cuda``), so Ray spreads them over the nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.config import SimConfig
from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.policy.catalog import kun_only
from fleetserve.policy.sharing import BATCHING, ServiceStats
from fleetserve.runtime.controller import Controller, ModelInfo
from fleetserve.runtime.plan import (
    ReplannerFactory,
    SharingPlacer,
    placed_workers,
    runtime_policy_config,
    runtime_policy_names,
    sharing_placement,
    sharing_stack,
)
from fleetserve.runtime.replace import Replacer
from fleetserve.runtime.worker import Worker, WorkerSnap, WorkerSpec

logger = logging.getLogger(__name__)


def model_info(name: str) -> ModelInfo:
    """Name, context window, vocabulary and tokenizer of a served model
    (built-in name or checkpoint folder); the served name is the config's."""
    from fleetserve.runtime.engine.tokenizer import load_tokenizer
    from fleetserve.runtime.engine.weights import load_weight_source

    src = load_weight_source(name)
    cfg = src.cfg
    folder = name if Path(name).is_dir() else None
    return ModelInfo(
        name=cfg.name,
        max_context=cfg.spec.max_context,
        vocab_size=cfg.spec.vocab_size,
        tokenizer=load_tokenizer(folder, cfg),
    )


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join ``address``, or start a local Ray instance (no dashboard).

    A local instance (no ``address``) is reachable from this machine only:
    Ray's node address is the loopback one, so the GCS, the raylet, the
    object manager and every worker bind 127.0.0.1 (Ray treats the node as it
    treats a single-machine cluster on macOS), and Ray's token authentication
    is on with a random token of this process (its children inherit it; it
    is never written to disk). Joining a cluster (``address``) is an explicit
    choice: Ray's token authentication is on (``RAY_AUTH_MODE=token``; the
    token comes from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``, as ``ray start`` wrote it) unless the environment
    says ``RAY_AUTH_MODE=disabled`` and ``FLEETSERVE_ALLOW_INSECURE_RAY=1``.

    Raises:
        FleetserveError: Ray could not start or join, or a local instance
            did not come up on the loopback address.
    """
    import ray

    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    with _keep_sigterm_handler():
        if address is None:
            _local_ray_env()
            kw["num_cpus"] = num_cpus
            try:
                ray.init(**kw)
            except Exception as e:  # pragma: no cover - environment problems
                raise FleetserveError(f"could not start a local Ray instance: {e}") from None
            ip = ray.util.get_node_ip_address()
            if not ipaddress.ip_address(ip).is_loopback:
                ray.shutdown()
                raise FleetserveError(
                    f"the local Ray instance came up on {ip}, not on the loopback address; "
                    "refusing to serve with Ray reachable from the network"
                )
        else:
            _cluster_ray_env()
            try:
                ray.init(address=address, **kw)
            except Exception as e:
                raise FleetserveError(
                    f"could not join the Ray cluster at {address!r}: {_first_line(e)} (Ray's "
                    "token authentication is on: give the cluster's token in RAY_AUTH_TOKEN or "
                    "RAY_AUTH_TOKEN_PATH; see the README's 'Security' section)"
                ) from None


RAY_INSECURE_ENV = "FLEETSERVE_ALLOW_INSECURE_RAY"
"""Set to 1 to join a Ray cluster whose token authentication is off."""


def _local_ray_env() -> None:
    """Environment of a local, loopback-only Ray instance with token auth."""
    import ray._private.ray_constants as rc

    # Ray resolves a loopback ``_node_ip_address`` back to the machine's
    # address unless single-machine mode is on (read at import, so set both).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    rc.ENABLE_RAY_CLUSTER = False
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _set_ray_auth_mode("token")


def _set_ray_auth_mode(mode: str) -> None:
    """``RAY_AUTH_MODE`` for this process and its children. Ray reads its
    config when first imported; reload it (and the token cache) so a mode set
    after ``import ray`` takes effect here too."""
    from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader
    from ray._raylet import Config  # type: ignore[attr-defined]

    os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _cluster_ray_env() -> None:
    """Environment for joining a cluster: Ray's token authentication on."""
    mode = os.environ.get("RAY_AUTH_MODE", "token").lower()
    if mode != "token" and os.environ.get(RAY_INSECURE_ENV) != "1":
        raise FleetserveError(
            f"RAY_AUTH_MODE={mode}: joining a Ray cluster without its token authentication "
            "lets anyone who reaches it run code on every node; start the cluster with "
            f"RAY_AUTH_MODE=token, or set {RAY_INSECURE_ENV}=1 to accept the risk"
        )
    _set_ray_auth_mode(mode)


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """``ray.init`` installs a SIGTERM handler that exits at once; the
    server's own (graceful drain) must stay."""
    main = threading.current_thread() is threading.main_thread()
    prev = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and prev is not None:
            signal.signal(signal.SIGTERM, prev)


def served_models(config: SimConfig) -> dict[str, ModelInfo]:
    """Each entry of ``serve.models`` (built-in name or folder) and its model info."""
    names = [str(n) for n in config.serve.model_names(config.model)]
    served = {n: model_info(n) for n in names}
    seen = [i.name for i in served.values()]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ConfigError(f"serve.models: {dup} named twice")
    return served


@dataclass(frozen=True, slots=True)
class CorePlan:
    """``serve.pin_cores``: the cores of each worker's engine and the rest."""

    engines: tuple[tuple[int, ...], ...]
    server: tuple[int, ...]


def core_plan(config: SimConfig, available: Sequence[int] | None = None) -> CorePlan | None:
    """Which cores each CPU worker's engine gets (``serve.pin_cores``): the last
    ``workers x threads_per_worker`` of ``available`` (default: this
    process's, ``os.sched_getaffinity``), ``threads_per_worker`` per worker in
    order; the server, Ray and the rest keep the others. None when the config
    does not pin (or serves on CUDA).

    Raises:
        ConfigError: too few cores, or no CPU affinity on this system.
    """
    sv = config.serve
    if not sv.pin_cores or sv.device != "cpu":
        return None
    if available is None:
        if not hasattr(os, "sched_getaffinity"):
            raise ConfigError("serve.pin_cores needs Linux CPU affinity (sched_setaffinity)")
        available = sorted(os.sched_getaffinity(0))
    cores = sorted(available)
    n = sv.workers * sv.threads_per_worker
    if len(cores) < n + 1:
        raise ConfigError(
            f"serve.pin_cores: {sv.workers} worker(s) x {sv.threads_per_worker} thread(s) need "
            f"{n} cores plus one for the server; this process may use {len(cores)} "
            f"({cores})"
        )
    eng = cores[len(cores) - n :]
    t = sv.threads_per_worker
    return CorePlan(
        engines=tuple(tuple(eng[i * t : (i + 1) * t]) for i in range(sv.workers)),
        server=tuple(cores[: len(cores) - n]),
    )


def worker_specs(
    config: SimConfig,
    served: dict[str, ModelInfo],
    cores: CorePlan | None = None,
    placer: SharingPlacer | None = None,
    placed: tuple[Sequence[tuple[str, ...]], Mapping[str, ServiceStats]] | None = None,
) -> list[WorkerSpec]:
    """One spec per worker: its models (placement policy; a multi-LLM stack's
    sharing groups put several on one worker, placed by ``placer``, see
    :func:`~fleetserve.runtime.plan.placed_workers`), the statistics its
    group scheduler reads, memory budget, limits, and its engine's cores when
    ``cores`` pins them.

    The engines read ``engine.chunked_prefill``, ``engine.prefix_caching``
    and ``engine.watermark`` (the simulator's keys). The workers of an elastic pool start asleep: an
    inactive GPU holds no weights and no arena; the controller wakes a
    worker when it activates it and puts it back to sleep when it releases it.

    Raises:
        ConfigError: prefix caching with a KunServe stack (its layer drops
            cannot drop shared KV blocks); chunked prefill with a group
            scheduler other than FCFS and RR (whole prefill jobs).
    """
    sv = config.serve
    source_of = {info.name: src for src, info in served.items()}
    batching = runtime_policy_names(config)["batching"]
    # a scheduler that reads statistics (MLFQ, DB, ADBS) is refused outside the
    # multi-LLM world when the config is loaded; a sharing placement computes them
    if placed is None:
        placed = placed_workers(config, list(source_of), source_of, placer=placer)
    hosts, stats = placed
    eng = config.engine
    if eng.prefix_caching and kun_only(config.policy.stack):
        raise ConfigError(
            f"engine.prefix_caching with stack {config.policy.stack!r}: KunServe's buddy "
            "groups move and drop KV by layer, which shared cached blocks cannot follow"
        )
    if eng.chunked_prefill and sharing_stack(config) is not None:
        sched = BATCHING.get(batching)
        if sched.spatial or not sched.one_model:
            raise ConfigError(
                f"engine.chunked_prefill with batching {batching!r} (stack "
                f"{config.policy.stack!r}): it runs whole prefill jobs, as the simulated "
                "group does; chunked prefill is for FCFS and RR"
            )
    return [
        WorkerSpec(
            worker_id=wid,
            models=tuple(source_of[m] for m in hosted),
            served=hosted,
            arena_bytes=int(sv.gpu_memory_mb * 2**20),
            device=sv.device,
            dtype=sv.dtype,
            threads=sv.threads_per_worker,
            spatial_shares=sv.spatial_shares,
            cuda_graphs=sv.cuda_graphs,
            max_running=sv.max_running,
            max_batch_tokens=sv.max_batch_tokens,
            batching=batching,
            services=tuple((m, stats[m]) for m in hosted if m in stats),
            chunked_prefill=eng.chunked_prefill,
            prefix_caching=eng.prefix_caching,
            watermark=eng.watermark,
            asleep=config.cluster.elastic,
            block_size=config.cluster.block_size,
            step_log=sv.step_log is not None,
            cpus=cores.engines[wid] if cores is not None else None,
        )
        for wid, hosted in enumerate(hosts)
    ]


async def launch(
    config: SimConfig,
    address: str | None = None,
    cores: CorePlan | None = None,
    placer: SharingPlacer | None = None,
    replanner: ReplannerFactory | None = None,
) -> Controller:
    """Start the workers and the controller (call from the server's event loop).

    ``cores`` pins each worker's engine thread to its cores
    (:func:`core_plan`; ``fleetserve serve`` has pinned itself, and so the
    Ray processes it starts, to ``cores.server`` before calling this).
    ``placer``: the simulator's sharing placement (multi-LLM stacks;
    :data:`~fleetserve.runtime.plan.SharingPlacer`)."""
    import ray

    sv = config.serve
    served = served_models(config)
    source_of = {info.name: src for src, info in served.items()}
    sharing = None
    stack = sharing_stack(config)
    if replanner is not None and stack is not None and stack.replacement:
        sharing = sharing_placement(config, list(source_of), source_of, placer=placer)
        placed = (sharing.workers, sharing.stats)
        specs = worker_specs(config, served, cores, placer, placed)
    else:
        specs = worker_specs(config, served, cores, placer)
    init_ray(address, num_cpus=max(os.cpu_count() or 1, len(specs) * sv.threads_per_worker + 1))
    opts: dict[str, Any] = {"max_restarts": 0}
    if sv.device.startswith("cuda"):
        opts["num_gpus"] = 1
        opts["num_cpus"] = 0
    else:
        opts["num_cpus"] = 0 if address is None else sv.threads_per_worker
    actor_cls: Any = ray.remote(Worker)
    handles = [actor_cls.options(**opts).remote(s) for s in specs]
    snaps: dict[int, WorkerSnap] = {}
    for s, h in zip(specs, handles, strict=True):
        try:
            snaps[s.worker_id] = await h.start.remote()
        except Exception as e:
            for x in handles:
                ray.kill(x)
            cause = getattr(e, "cause", None) or e
            raise ConfigError(
                f"worker {s.worker_id} ({', '.join(s.models)}, "
                f"{sv.gpu_memory_mb:g} MiB) failed to start: {_first_line(cause)}"
            ) from None
    ctl = Controller(
        runtime_policy_config(config),
        {s.worker_id: (s, h) for s, h in zip(specs, handles, strict=True)},
        snaps,
        {info.name: info for info in served.values()},
    )
    # a multi-LLM stack: report its own name and placement (plan.py)
    ctl.policy_names.update(runtime_policy_names(config))
    if sharing is not None and replanner is not None:  # SeaLLM's adaptive replacement
        ctl.replacer = Replacer(ctl, sharing, replanner(sharing, len(specs)), source_of)

    async def respawn(spec: WorkerSpec) -> tuple[Any, WorkerSnap]:
        h = actor_cls.options(**opts).remote(spec)
        try:
            return h, await h.start.remote()
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(h)
            raise

    ctl.respawn = respawn
    await ctl.start()
    return ctl


async def shutdown(ctl: Controller) -> None:
    """Stop the controller and kill its workers (Ray itself keeps running)."""
    import ray

    await ctl.stop()
    for w in ctl.workers.values():
        with contextlib.suppress(Exception):  # already dead
            ray.kill(w.handle)
    await asyncio.sleep(0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    for line in reversed(text):
        if "Error" in line or "error" in line:
            return line.strip()
    return text[-1].strip() if text else type(e).__name__
