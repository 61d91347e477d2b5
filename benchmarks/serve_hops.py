"""Where a streamed token's time goes on ``fleetserve serve``'s path, hop by hop.

Issue 25, item 3. The server stamps each hop of a token's path (HTTP ->
controller -> Ray worker -> engine step -> report -> controller -> SSE chunk;
:mod:`fleetserve.runtime.hops`) and, with ``serve.hop_log``, writes each
token's hops to a JSON-lines file. This script:

1. starts ``fleetserve serve`` (its own process group, output in
   ``OUT/server-<tree>.log``) on a free port with ``serve.hop_log`` set: by
   default one worker of ``--model`` (``small-llama``) on the ``vllm`` stack;
   ``--config`` serves a config file instead (``--set`` overrides either);
2. sends a few unmeasured warm-up requests, then, streaming (vLLM's
   ``continuous_usage_stats``, so each token is timed, text or not; greedy,
   ``ignore_eos``, ``--prompt-tokens`` random token ids), two scenarios:
   ``seq``, ``--requests`` requests of ``--output-tokens`` tokens one at a
   time, and ``conc``, ``--requests`` requests over ``--concurrency``
   closed-loop streams (output lengths 0.5-1.5x ``--output-tokens``, so the
   streams do not stay in step: a request arrives while others decode);
3. reads the hop log: per scenario, P50 and P90 (ms) of each hop of the
   first tokens (TTFT) and of the later tokens (TPOT), next to the client's
   own TTFT and inter-token gaps.

``--tree NAME=SRC`` (repeatable) serves from other source trees
(``PYTHONPATH=SRC``; e.g. a ``git worktree`` of another commit's ``src``) to
compare code A vs B: every tree's server is up at once and each scenario runs
``--rounds`` rounds, in each of which every server in turn (the order
rotates) serves the same requests, so A and B run seconds apart. The report
has the median over rounds of each figure per tree and its ratio to the
first tree's. On a shared machine timings are noisy: read the ratios.

All processes run on this host, so the server's and the workers' stamps are
on one clock (``CLOCK_MONOTONIC``). Writes ``OUT/report.md`` and
``OUT/results.json`` (``--from-results`` renders a report again). Not part of
``make test``; ``make bench-hops`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import free_port, stop_server, wait_ready

from fleetserve.runtime.bench_serve import completion_body, stream_completion
from fleetserve.runtime.hops import FIRST_HOPS, NEXT_HOPS

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("seq", "conc")


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linear between ranks; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def has_hop_log(src: Path | None) -> bool:
    """Whether the tree's server knows ``serve.hop_log`` (older trees: client figures only)."""
    config = (src if src is not None else ROOT / "src") / "fleetserve" / "config.py"
    return "hop_log" in config.read_text()


def server_config(
    args: argparse.Namespace, src: Path | None, hop_log: Path, out: Path, tag: str
) -> Path:
    if args.config is not None:
        data = yaml.safe_load(Path(args.config).read_text()) or {}
    else:
        data = {
            "serve": {
                "workers": 1,
                "gpu_memory_mb": 512,
                "models": [args.model],
                "threads_per_worker": args.threads,
                "max_queue": 1024,
                "max_running": 64,
            },
            "policy": {"stack": "vllm"},
        }
    if not args.plain and has_hop_log(src):
        data.setdefault("serve", {})["hop_log"] = str(hop_log)
    path = out / f"serve-{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_server(
    args: argparse.Namespace, src: Path | None, cfg: Path, port: int, log: Path
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "fleetserve.cli.main", "serve", str(cfg), "--port", str(port)]
    for s in args.set:
        cmd += ["--set", s]
    return subprocess.Popen(
        cmd,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
        env=env,
    )


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], n: int) -> dict[str, Any]:
    out, _ = await stream_completion(client, completion_body(model, prompt, n), 600.0)
    if out.status != "finished" or out.first_token is None:
        raise SystemExit(f"a request did not finish: {out.status} {out.reason}")
    return {"ttft": out.first_token - out.send, "gaps": list(out.gaps)}


async def scenario(
    args: argparse.Namespace, base: str, models: list[str], conc: int, rng: random.Random
) -> list[dict[str, Any]]:
    """``args.requests`` requests over ``conc`` closed-loop streams; each
    request's client-side TTFT and gaps."""
    todo = list(range(args.requests))
    done: list[dict[str, Any]] = []

    def prompt() -> list[int]:
        return [rng.randrange(5, 250) for _ in range(args.prompt_tokens)]

    async with httpx.AsyncClient(base_url=base, timeout=None) as client:

        async def stream() -> None:
            while todo:
                k = todo.pop()
                n = args.output_tokens
                if conc > 1:  # lengths 0.5-1.5x: the streams do not stay in step
                    n = rng.randrange(max(1, n // 2), n + n // 2 + 1)
                done.append(await one(client, models[k % len(models)], prompt(), n))

        await asyncio.gather(*(stream() for _ in range(conc)))
    return done


def read_hops(path: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    """The hop records appended to ``path`` after byte ``start``; the new end."""
    with path.open("rb") as f:
        f.seek(start)
        raw = f.read()
    recs = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return recs, start + len(raw)


def summarize(recs: list[dict[str, Any]], client: list[dict[str, Any]]) -> dict[str, Any]:
    """P50/P90 (ms) of every hop (first tokens, later tokens) and the client's view."""
    out: dict[str, Any] = {"first": {}, "next": {}}
    for kind, names in (("first", FIRST_HOPS), ("next", NEXT_HOPS)):
        rows = [r["hops"] for r in recs if r["first"] == (kind == "first")]
        for name in names:
            xs = [1e3 * h[name] for h in rows if name in h]
            out[kind][name] = {"p50": pct(xs, 0.5), "p90": pct(xs, 0.9), "n": len(xs)}
    ttft = [1e3 * c["ttft"] for c in client]
    gaps = [1e3 * g for c in client for g in c["gaps"]]
    out["client"] = {
        "ttft": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9), "n": len(ttft)},
        "itl": {"p50": pct(gaps, 0.5), "p90": pct(gaps, 0.9), "n": len(gaps)},
        "tpot_mean": statistics.fmean(gaps) if gaps else float("nan"),
    }
    return out


class Server:
    """One tree's ``fleetserve serve`` and its hop log."""

    def __init__(self, args: argparse.Namespace, tree: str, src: Path | None, out: Path) -> None:
        self.tree = tree
        self.hop_log = out / f"hops-{tree}.jsonl"
        self.hop_log.write_text("")
        cfg = server_config(args, src, self.hop_log, out, tree)
        self.log = out / f"server-{tree}.log"
        self.base = f"http://127.0.0.1:{free_port()}"
        self.proc = start_server(args, src, cfg, int(self.base.rsplit(":", 1)[1]), self.log)
        self.pos = 0
        self.models: list[str] = []

    def ready(self, timeout: float) -> None:
        self.models = wait_ready(self.proc, self.base, "", timeout, self.log)

    def new_hops(self) -> list[dict[str, Any]]:
        recs, self.pos = read_hops(self.hop_log, self.pos)
        return recs

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of the server's processes (it and every process
        under it, Ray's included): the server itself, the worker actors, the
        rest of Ray."""
        procs: dict[int, tuple[int, float, bytes]] = {}  # pid -> (ppid, cpu s, cmdline)
        tick = os.sysconf("SC_CLK_TCK")
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            f = stat.rsplit(")", 1)[1].split()
            procs[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick, cmd)
        out = {"server": 0.0, "workers": 0.0, "ray": 0.0}
        mine, todo = set(), [self.proc.pid]
        while todo:
            p = todo.pop()
            if p in mine or p not in procs:
                continue
            mine.add(p)
            todo.extend(c for c, (pp, _cpu, _cmd) in procs.items() if pp == p)
        for p in mine:
            _pp, cpu, cmd = procs[p]
            who = "server" if p == self.proc.pid else "ray"
            if cmd.startswith(b"ray::Worker"):
                who = "workers"
            out[who] += cpu
        return out


def run_all(
    args: argparse.Namespace, trees: list[tuple[str, Path | None]], out: Path
) -> list[dict[str, Any]]:
    """Every tree's server up at once; each scenario runs ``args.rounds``
    rounds, and in each round every server in turn (the order rotates) serves
    the scenario's requests (the same prompts): A and B run seconds apart."""
    servers: list[Server] = []
    runs = {(t, r): {"tree": t, "round": r} for t, _ in trees for r in range(args.rounds)}
    try:
        for name, src in trees:
            servers.append(Server(args, name, src, out))
        for s in servers:
            s.ready(args.ready_timeout)
            warm = argparse.Namespace(**{**vars(args), "requests": args.warmup})
            asyncio.run(scenario(warm, s.base, s.models, 1, random.Random(-1)))
        time.sleep(0.5)
        for s in servers:
            s.new_hops()
        for name in args.scenarios:
            conc = 1 if name == "seq" else args.concurrency
            for rnd in range(args.rounds):
                k = rnd % len(servers)
                for s in servers[k:] + servers[:k]:
                    rng = random.Random(args.seed * 1000 + rnd)
                    cpu0 = s.cpu_s()
                    client = asyncio.run(scenario(args, s.base, s.models, conc, rng))
                    cpu1 = s.cpu_s()
                    time.sleep(0.3)  # a request's hop lines are flushed when its stream ends
                    res = runs[(s.tree, rnd)][name] = summarize(s.new_hops(), client)
                    n_tok = sum(len(c["gaps"]) + 1 for c in client)
                    res["cpu_ms_per_token"] = {k: 1e3 * (cpu1[k] - cpu0[k]) / n_tok for k in cpu1}
                    c = res["client"]
                    print(
                        f"  {name} round {rnd + 1}/{args.rounds} {s.tree}: client TTFT P50 "
                        f"{c['ttft']['p50']:.1f} ms, ITL P50 {c['itl']['p50']:.2f} ms, "
                        f"mean TPOT {c['tpot_mean']:.2f} ms",
                        flush=True,
                    )
                (out / "results.json").write_text(json.dumps(list(runs.values()), indent=1))
    finally:
        for s in servers:
            print(f"  server {s.tree} {stop_server(s.proc, 30)}", flush=True)
    return list(runs.values())


def median_of(runs: list[dict[str, Any]], *keys: str) -> float:
    vals = []
    for r in runs:
        x: Any = r
        for k in keys:
            x = x.get(k, {}) if isinstance(x, dict) else {}
        if isinstance(x, float | int) and x == x:
            vals.append(float(x))
    return statistics.median(vals) if vals else float("nan")


def report(args: argparse.Namespace, runs: list[dict[str, Any]], trees: list[str]) -> str:
    by = {t: [r for r in runs if r["tree"] == t] for t in trees}
    base, others = trees[0], trees[1:]
    lines = [
        "# Serving-path hops",
        "",
        f"`{' '.join(sys.argv)}`",
        "",
        f"{args.requests} requests per scenario, prompts of {args.prompt_tokens} tokens, "
        f"{args.output_tokens} output tokens (greedy, ignore_eos), streamed; "
        f"`seq` one at a time, `conc` {args.concurrency} streams. Medians over "
        f"{args.rounds} round(s) of each run's P50 / P90, in ms"
        + ("".join(f"; {t}/{base}: ratio of the P50s" for t in others) + "."),
        "",
    ]
    for sc in [x for x in SCENARIOS if any(x in r for r in runs)]:
        head = "| hop | " + " | ".join(f"{t} P50 | {t} P90" for t in trees)
        head += "".join(f" | {t}/{base}" for t in others) + " |"
        sep = "|---|" + "---:|---:|" * len(trees) + "---:|" * len(others)
        for kind, names, title in (
            ("first", FIRST_HOPS, "first token (TTFT)"),
            ("next", NEXT_HOPS, "later tokens (TPOT)"),
        ):
            lines += [f"## `{sc}`: {title}", "", head, sep]
            rows = [(n, (kind, n)) for n in names]
            client = ("ttft", ("client", "ttft")) if kind == "first" else ("itl", ("client", "itl"))
            rows.append((f"client {client[0]}", client[1]))
            for label, (a, b) in rows:
                cells = []
                p50s = []
                for t in trees:
                    p50 = median_of(by[t], sc, a, b, "p50")
                    p90 = median_of(by[t], sc, a, b, "p90")
                    p50s.append(p50)
                    cells.append(f"{p50:.3f} | {p90:.3f}")
                row = f"| {label} | " + " | ".join(cells)
                for p50 in p50s[1:]:
                    row += f" | {p50 / p50s[0]:.2f}" if p50s[0] > 0 else " | -"
                lines.append(row + " |")
            if kind == "next":
                means = [f"{t} {median_of(by[t], sc, 'client', 'tpot_mean'):.3f}" for t in trees]
                lines.append(f"\nclient mean TPOT (ms): {', '.join(means)}")
                for who in ("server", "workers", "ray"):
                    cpu = [
                        f"{t} {median_of(by[t], sc, 'cpu_ms_per_token', who):.2f}" for t in trees
                    ]
                    lines.append(f"CPU ms per generated token, {who}: {', '.join(cpu)}")
            lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="serve this config file (default: one worker of --model)")
    p.add_argument("--model", default="small-llama", help="built-in model or checkpoint folder")
    p.add_argument("--threads", type=int, default=1, help="threads_per_worker (default config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--requests", type=int, default=16, help="requests per scenario")
    p.add_argument("--concurrency", type=int, default=4, help="streams of the conc scenario")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--scenarios",
        type=lambda x: [s for s in x.split(",") if s],
        default=list(SCENARIOS),
        help="which of seq,conc to run (default both)",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plain",
        action="store_true",
        help="no serve.hop_log: only the client's figures (a tree without it gets none anyway)",
    )
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="run the server from this source tree (repeat to compare; default: this one)",
    )
    p.add_argument("--out", default="results/serve-hops")
    p.add_argument(
        "--from-results",
        metavar="JSON",
        help="only write the report of an earlier run's results.json (its --tree names)",
    )
    args = p.parse_args()
    if args.from_results is not None:
        runs = json.loads(Path(args.from_results).read_text())
        names = list(dict.fromkeys(r["tree"] for r in runs))
        args.rounds = max(r["round"] for r in runs) + 1
        print(report(args, runs, names))
        return 0
    trees: list[tuple[str, Path | None]] = []
    for spec in args.tree:
        name, _, src = spec.partition("=")
        if not src or not (Path(src) / "fleetserve").is_dir():
            raise SystemExit(f"--tree {spec!r}: expected NAME=SRC with SRC/fleetserve/")
        trees.append((name, Path(src).resolve()))
    if not trees:
        trees = [("this", None)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = run_all(args, trees, out)
    text = report(args, runs, [t for t, _ in trees])
    (out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
