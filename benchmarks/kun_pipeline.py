"""Why a KunServe buddy group decodes slower than replicas here (issue 24).

A decode step of ``B`` running requests, timed three ways for the same tiny
model (``tiny-llama-a``) and the same batch:

* ``replica``: one worker holding every layer steps the whole batch (the
  engine alone, in this process);
* ``group, in process``: a ``k``-stage buddy group (each member keeps
  ``L / k`` layers) steps it as the runtime's ``GroupRunner`` does
  (micro-batches in flight), the stage calls made in this process: the
  pipeline's compute and bookkeeping, no transport;
* ``group, Ray``: the same group of worker actors through Ray, as
  ``fleetserve serve`` runs it: hidden states cross between the actors.
  The replica through Ray is timed the same way (its actor's steps).

Through Ray a step is timed by the workers' own step counters over a wall
window while they run back to back, so both include what the actor loop
adds. Prints one table (ms per step, and per token).

    .venv/bin/python benchmarks/kun_pipeline.py --batch 8 --ctx 256 --stages 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from fleetserve.runtime.buddy import StageRole, StageWork
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.worker import Worker, WorkerCore, WorkerSpec

MODEL = "tiny-llama-a"
LAYERS = 4
MB = 2**20
ARENA = 64 * MB


def _prompts(b: int, ctx: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 5 for j in range(ctx)] for i in range(b)]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _roles(k: int) -> list[StageRole]:
    cuts = [round(i * LAYERS / k) for i in range(k + 1)]
    layout = tuple((i, (cuts[i], cuts[i + 1])) for i in range(k))
    return [StageRole(1, MODEL, i, layout) for i in range(k)]


def replica_inproc(b: int, ctx: int, steps: int) -> float:
    core = WorkerCore(WorkerSpec(0, (MODEL,), (MODEL,), ARENA, max_running=b))
    for i, p in enumerate(_prompts(b, ctx)):
        core.submit(i, MODEL, p, _params(steps + 50))
    core.step()  # the prefill
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def group_inproc(b: int, ctx: int, steps: int, k: int) -> float:
    roles = _roles(k)
    cores = [WorkerCore(WorkerSpec(i, (MODEL,), (MODEL,), ARENA)) for i in range(k)]
    for c, r in zip(cores, roles, strict=True):
        c.become_stage(r)
    pages = [c.stage_pages() for c in cores]
    cores[0].lead(roles[0], [f for f, _ in pages], [t for _, t in pages])
    g = cores[0].group
    assert g is not None
    g.max_running = b
    for i, p in enumerate(_prompts(b, ctx)):
        g.add(i, p, _params(steps + 50), float(i))

    async def call(j: int, work: StageWork) -> Any:
        await asyncio.sleep(0)
        return cores[j].stage_forward(work)

    async def run() -> float:
        await g.step(call)  # the prefill
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            await g.step(call)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return asyncio.run(run())


async def _window(handle: Any, field: str, seconds: float) -> float:
    """Seconds per step of a worker actor stepping back to back."""
    s0 = await handle.snapshot.remote()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    s1 = await handle.snapshot.remote()
    n = getattr(s1, field) - getattr(s0, field)
    return (time.perf_counter() - t0) / max(1, n)


async def replica_ray(b: int, ctx: int, window_s: float) -> float:
    import ray

    actor: Any = ray.remote(Worker)
    h = actor.remote(WorkerSpec(0, (MODEL,), (MODEL,), ARENA, max_running=b))
    await h.start.remote()
    for i, p in enumerate(_prompts(b, ctx)):
        await h.submit.remote(i, MODEL, p, _params(3000), 0.0)
    await asyncio.sleep(0.5)  # prefilled
    out = await _window(h, "decode_steps", window_s)
    await h.stop.remote()
    ray.kill(h)
    return out


async def group_ray(b: int, ctx: int, window_s: float, k: int) -> float:
    import ray

    roles = _roles(k)
    actor: Any = ray.remote(Worker)
    hs = [actor.remote(WorkerSpec(i, (MODEL,), (MODEL,), ARENA)) for i in range(k)]
    await asyncio.gather(*(h.start.remote() for h in hs))
    await asyncio.gather(*(h.become_stage.remote(r) for h, r in zip(hs, roles, strict=True)))
    pages = await asyncio.gather(*(h.stage_pages.remote() for h in hs))
    await hs[0].lead.remote(roles[0], hs, [f for f, _ in pages], [t for _, t in pages])
    for i, p in enumerate(_prompts(b, ctx)):
        await hs[0].submit.remote(i, MODEL, p, _params(3000), 0.0)
    await asyncio.sleep(0.5)
    out = await _window(hs[0], "group_steps", window_s)
    for h in hs:
        await h.stop.remote()
        ray.kill(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    if not args.no_ray:
        import ray

        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    k = args.stages
    print(f"tiny-llama-a, context {args.ctx}, {k}-stage group vs one replica; ms per step")
    print("| batch | replica | group, in process | replica, Ray | group, Ray |")
    print("|---|---|---|---|---|")
    for b in args.batch:
        r = replica_inproc(b, args.ctx, args.steps) * 1e3
        g = group_inproc(b, args.ctx, args.steps, k) * 1e3
        if args.no_ray:
            rr = gr = float("nan")
        else:
            rr = asyncio.run(replica_ray(b, args.ctx, args.window)) * 1e3
            gr = asyncio.run(group_ray(b, args.ctx, args.window, k)) * 1e3
        print(f"| {b} | {r:.2f} | {g:.2f} | {rr:.2f} | {gr:.2f} |")


if __name__ == "__main__":
    main()
