"""``serve.pin_cores``: the engines' cores and the server's (torch, no Ray)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest
from test_cli import run_cli

pytest.importorskip("torch")

from fleetserve.cli.serve import serve_config_dict
from fleetserve.config import SimConfig, config_from_dict
from fleetserve.errors import ConfigError
from fleetserve.runtime import cluster
from fleetserve.runtime.worker import Worker

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity"
)


def _cfg(**serve: object) -> SimConfig:
    data = {"serve": {"workers": 2, "gpu_memory_mb": 48, "models": ["tiny-llama-a"], **serve}}
    return config_from_dict(serve_config_dict(data))


def test_core_plan_gives_each_engine_its_own_cores() -> None:
    cfg = _cfg(pin_cores=True, threads_per_worker=2)
    plan = cluster.core_plan(cfg, available=[3, 0, 1, 2, 7, 6, 5, 4])
    assert plan is not None
    assert plan.engines == ((4, 5), (6, 7)) and plan.server == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match=r"need 4 cores plus one for the server.*may use 4"):
        cluster.core_plan(cfg, available=[0, 1, 2, 3])
    assert cluster.core_plan(_cfg(), available=range(8)) is None
    assert cluster.core_plan(_cfg(pin_cores=True, device="cuda"), available=[0]) is None
    specs = cluster.worker_specs(cfg, cluster.served_models(cfg), plan)
    assert [s.cpus for s in specs] == [(4, 5), (6, 7)]
    assert all(s.cpus is None for s in cluster.worker_specs(cfg, cluster.served_models(cfg)))


@linux_only
def test_the_engine_thread_runs_on_its_cores_only() -> None:
    mine = sorted(os.sched_getaffinity(0))
    cfg = _cfg(workers=1)
    spec = cluster.worker_specs(cfg, cluster.served_models(cfg))[0]
    w = Worker(replace(spec, cpus=(mine[-1],)))

    async def go() -> tuple[set[int], set[int]]:
        await w.start()
        try:
            return await w._call(os.sched_getaffinity, 0), os.sched_getaffinity(0)
        finally:
            await w.stop()

    engine, here = asyncio.run(go())
    assert engine == {mine[-1]}
    assert here == set(mine)  # the caller's thread is left alone


@linux_only
def test_serve_pin_cores_with_an_address_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    path = tmp_path / "s.yaml"
    path.write_text("serve: {workers: 1, gpu_memory_mb: 48, models: [tiny-llama-a]}\n")
    rc, _, err = run_cli(
        capsys, "serve", path, "--address", "127.0.0.1:1", "--set", "serve.pin_cores=true"
    )
    assert rc != 0 and "leave out --address" in err
    assert len(os.sched_getaffinity(0)) >= 2  # nothing was pinned
