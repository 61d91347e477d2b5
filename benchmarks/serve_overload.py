"""Sustained overload: the server at 2x its capacity for 60 s.

Acceptance (cluster-runtime issue): under sustained load at twice capacity
the server stays up, memory stays within budget, every request gets a
response (a completion, or 429/503), and the Prometheus counters agree with
the client's count.

Method.

1. Start ``fleetserve serve CONFIG`` (default ``configs/serve-tiny.yaml``,
   overridable with ``--set``) as a subprocess on a free port; wait for
   ``/health``.
2. **Capacity.** Send ``--probe`` requests of the fixed shape
   (``--prompt-tokens`` token ids, ``--output-tokens`` tokens with
   ``ignore_eos``) all at once, spread over the served models, and time
   them: capacity = requests / wall time at saturation (the server batches
   all of them, so this is its throughput, not a latency).
3. **Overload.** Open-loop Poisson arrivals at ``--factor`` x capacity
   (default 2) for ``--duration`` seconds (default 60), same shape. Every
   response is classified: 200 with the full ``completion_tokens``, 429
   (with ``Retry-After``), 503, other status, or a transport error. While it
   runs, ``/v1/cluster`` is read every second: every worker alive, and
   weights + KV within each worker's budget.
4. **Counters.** After the load drains, ``/metrics`` must agree with the
   client: ``fleetserve_requests_total{outcome="finished"}`` = 200s,
   ``{outcome="rejected"}`` = 429s + 503s, and the HTTP counter of
   ``/v1/completions`` per status equals the client's per status.

Writes ``--out`` (default ``results/serve_overload.json``) and prints a
summary; exit status 1 when a check fails. Run: ``make serve-overload``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric_name, _, rest = head.partition("{")
        if metric_name != name:
            continue
        got = {}
        for part in rest.rstrip("}").split(","):
            if "=" in part:
                k, v = part.split("=", 1)
                got[k] = v.strip('"')
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], n_out: int
) -> tuple[str, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True}
    body["temperature"] = 0
    try:
        r = await client.post(url, json=body)
    except httpx.HTTPError as e:
        return f"transport:{type(e).__name__}", 0
    if r.status_code == 200:
        return "200", int(r.json()["usage"]["completion_tokens"])
    if r.status_code == 429 and "retry-after" not in r.headers:
        return "429-no-retry-after", 0
    return str(r.status_code), 0


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    rnd = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        models = [m["id"] for m in (await client.get(base + "/v1/models")).json()["data"]]
        url = base + "/v1/completions"

        def prompt() -> list[int]:
            return [rnd.randrange(0, 256) for _ in range(args.prompt_tokens)]

        # 2. capacity at saturation
        t0 = time.perf_counter()
        probe = await asyncio.gather(
            *(
                one(client, url, models[i % len(models)], prompt(), args.output_tokens)
                for i in range(args.probe)
            )
        )
        wall = time.perf_counter() - t0
        ok = sum(1 for s, _n in probe if s == "200")
        capacity = ok / wall
        rate = args.factor * capacity
        print(f"capacity: {ok}/{args.probe} probe requests in {wall:.2f} s = {capacity:.2f} req/s")
        print(f"overload: {rate:.2f} req/s for {args.duration:g} s")
        before = (await client.get(base + "/metrics")).text

        # 3. open-loop overload, with a memory/liveness monitor
        violations: list[str] = []
        samples = 0
        stop = asyncio.Event()

        async def monitor() -> None:
            nonlocal samples
            while not stop.is_set():
                try:
                    c = (await client.get(base + "/v1/cluster")).json()
                except httpx.HTTPError as e:
                    violations.append(f"/v1/cluster unreachable: {e!r}")
                else:
                    samples += 1
                    for w in c["workers"]:
                        m = w["memory"]
                        if not w["alive"]:
                            violations.append(f"worker {w['worker']} died")
                        if m["weight_bytes"] + m["kv_bytes_used"] > m["budget_bytes"]:
                            violations.append(f"worker {w['worker']} over budget: {m}")
                await asyncio.sleep(1.0)

        mon = asyncio.create_task(monitor())
        tasks = []
        t = 0.0
        i = 0
        start = time.perf_counter()
        while t < args.duration:
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            model = models[i % len(models)]
            tasks.append(asyncio.create_task(one(client, url, model, prompt(), args.output_tokens)))
            i += 1
            t += rnd.expovariate(rate)
        sent_wall = time.perf_counter() - start
        results = await asyncio.gather(*tasks)
        drain_wall = time.perf_counter() - start
        stop.set()
        await mon
        after = (await client.get(base + "/metrics")).text
        health = (await client.get(base + "/health")).status_code

    status = Counter(s for s, _n in results)
    short = sum(1 for s, n in results if s == "200" and n != args.output_tokens)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    finished_c = delta("fleetserve_requests_total", outcome="finished")
    rejected_c = delta("fleetserve_requests_total", outcome="rejected")
    http_c = {
        code: delta("fleetserve_http_responses_total", endpoint="/v1/completions", status=code)
        for code in status
        if code.isdigit()
    }
    checks = {
        "server_up": health == 200,
        "every_request_answered": all(s in ("200", "429", "503") for s in status),
        "full_completions": short == 0,
        "memory_within_budget_and_workers_alive": not violations and samples > 0,
        "finished_counter_matches": finished_c == status["200"],
        "rejected_counter_matches": rejected_c == status["429"] + status["503"],
        "http_counters_match": all(http_c[c] == status[c] for c in http_c),
        "overload_reached": status["429"] + status["503"] > 0,
    }
    return {
        "capacity_rps": capacity,
        "offered_rps": rate,
        "factor": args.factor,
        "duration_s": args.duration,
        "sent": len(results),
        "send_wall_s": sent_wall,
        "drain_wall_s": drain_wall,
        "responses": dict(status),
        "short_completions": short,
        "goodput_rps": status["200"] / drain_wall,
        "counters": {"finished": finished_c, "rejected": rejected_c, "http": http_c},
        "cluster_samples": samples,
        "violations": violations[:20],
        "checks": checks,
        "ok": all(checks.values()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "serve-tiny.yaml"))
    p.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--probe", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "results" / "serve_overload.json"))
    args = p.parse_args()
    port = free_port()
    exe = Path(sys.executable).with_name("fleetserve")
    cmd = [str(exe), "serve", args.config, "--port", str(port)]
    for s in args.set:
        cmd += ["--set", s]
    env = dict(os.environ)
    env.pop("FLEETSERVE_API_KEY", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                print(f"the server exited with {proc.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("the server did not come up in 180 s", file=sys.stderr)
                return 1
            time.sleep(0.5)
        res = asyncio.run(run(args, base))
        res["server_alive_after"] = proc.poll() is None
        res["checks"]["server_process_alive"] = res["server_alive_after"]
        res["ok"] = all(res["checks"].values())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("responses", "counters", "checks")}, indent=2))
    print(
        f"capacity {res['capacity_rps']:.2f} req/s, offered {res['offered_rps']:.2f} req/s, "
        f"goodput {res['goodput_rps']:.2f} req/s; {'OK' if res['ok'] else 'FAILED'}; {out}"
    )
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
