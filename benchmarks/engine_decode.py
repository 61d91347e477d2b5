"""Decode throughput: the fleetserve engine next to HuggingFace ``generate``.

For ``tiny-llama-a`` and ``tiny-llama-b`` (seeded random weights) and batch
sizes 1, 8 and 32, both systems run the same requests: prompts of mixed
lengths (uniform in [16, 512] tokens by default, random byte tokens), greedy
decoding, exactly ``--max-new-tokens`` new tokens per request (EOS never stops
or changes a request: ``ignore_eos`` in the engine, no EOS id in HF's
generation config), fp32, the same ``torch.set_num_threads``.

* **engine**: every request added at once, then ``step()`` until all finish
  (continuous batching over the paged KV arena; the prefills are split over
  steps by the engine's ``max_batch_tokens``).
* **HF**: ``LlamaForCausalLM.from_pretrained`` on a checkpoint written by
  ``weights.save_checkpoint`` from the same weights, one batched
  ``generate`` call with left padding and an attention mask (SDPA attention,
  dynamic KV cache).

Two rates per system (the same definitions for both):

* ``e2e tok/s``: generated tokens / wall time of the whole generation
  (prefill included) -- the primary figure;
* ``decode tok/s``: ``B * (N - 1)`` / (time of the N-token run - time of a
  1-token run on the same prompts), i.e. the decode phase with prefill removed.

The target (issue 4) is engine >= 2x HF at batch 32, on the e2e figure. The
greedy outputs are compared request by request: padding changes fp32
numerics slightly, so the match rate is reported rather than asserted.

Run: ``.venv/bin/python benchmarks/engine_decode.py`` (``--help`` for options);
writes ``results/bench/engine_decode.json`` as well.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fleetserve.runtime.engine import engine as engine_module
from fleetserve.runtime.engine.engine import DECODE_GRAPH_MODES, Engine
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.engine.weights import load_weight_source, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "results" / "bench" / "engine_decode.json"
MODELS = ("tiny-llama-a", "tiny-llama-b")
BATCHES = (1, 8, 32)
TARGET = 2.0
PAD_ID = 258  # the byte tokenizer's PAD
ARENA_BYTES = 512 * 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random byte tokens, lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(
    eng: Engine, model: str, prompts: list[list[int]], n_new: int
) -> tuple[float, list[list[int]]]:
    """Add every request, ``step()`` until done; (wall seconds, outputs)."""
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.add_request(model, p, params) for p in prompts]
    while eng.has_work():
        eng.step()
    wall = time.perf_counter() - t0
    outs = [eng.pop_finished(r).output_ids for r in rids]
    return wall, outs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf(folder: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    m = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    gc = m.generation_config
    gc.eos_token_id = None  # ignore_eos: never stop, never suppress EOS
    gc.pad_token_id = PAD_ID
    gc.do_sample = False
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    return m


def run_hf(model: Any, prompts: list[list[int]], n_new: int) -> tuple[float, list[list[int]]]:
    """One batched, left-padded greedy ``generate``; (wall seconds, outputs)."""
    width = max(len(p) for p in prompts)
    device = model.device
    sync(device)
    t0 = time.perf_counter()
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
        )
    res = out[:, width:].tolist()  # on the host: a CUDA run has finished
    wall = time.perf_counter() - t0
    return wall, res


Run = tuple[float, list[list[int]]]


def best_pair(
    runs: int, eng: Engine, name: str, hf: Any, prompts: list[list[int]], n_new: int
) -> tuple[Run, Run]:
    """Fastest of ``runs`` (engine, HF) runs, alternating so both see the same load."""
    e_runs: list[Run] = []
    h_runs: list[Run] = []
    for _ in range(runs):
        e_runs.append(run_engine(eng, name, prompts, n_new))
        h_runs.append(run_hf(hf, prompts, n_new))
    return (
        (min(r[0] for r in e_runs), e_runs[0][1]),
        (min(r[0] for r in h_runs), h_runs[0][1]),
    )


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests with identical outputs, mean common-prefix fraction)."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    pref = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        pref.append(k / max(len(x), 1))
    return same / len(a), sum(pref) / len(pref)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both systems (default 1: stable on a shared machine)",
    )
    ap.add_argument("--runs", type=int, default=3, help="best of N runs per point (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-decode-split", action="store_true", help="skip the 1-token runs")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "paged", "gather", "flex"],
        help="engine attention (default auto, the engine's own default: the paged "
        "kernel on the CPU in float32, gather elsewhere)",
    )
    ap.add_argument(
        "--decode-graphs",
        default="auto",
        choices=DECODE_GRAPH_MODES,
        help="engine decode steps: CUDA graphs (capture), eager (off); auto: capture on CUDA",
    )
    ap.add_argument("--out", help=f"JSON to write (default {OUT_JSON.relative_to(ROOT)})")
    ap.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPES), help="both systems' weights and KV"
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    n_new = args.max_new_tokens
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(
        f"engine vs HF generate: prompts uniform in [{args.min_prompt}, {args.max_prompt}] "
        f"tokens, {n_new} new tokens, greedy {args.dtype} on {device} (engine attention "
        f"{args.attention}, decode graphs {args.decode_graphs}), {args.threads} thread(s), "
        f"best of {args.runs}"
    )
    engine_file = Path(engine_module.__file__ or "")
    engine_sha = hashlib.sha256(engine_file.read_bytes()).hexdigest()[:12]
    print(f"engine: {engine_file} (sha256 {engine_sha})")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            src = load_weight_source(name)
            folder = save_checkpoint(Path(tmp) / name, src)
            hf = load_hf(folder, device, dtype)
            eng = Engine(
                [src],
                ARENA_BYTES,
                device=device,
                dtype=dtype,
                attention=args.attention,
                decode_graphs=args.decode_graphs,
            )
            resolved = eng.attention
            print(f"  {name}: engine attention {resolved}")
            warm = make_prompts(2, 8, 32, seed=999)
            run_engine(eng, name, warm, 4)
            run_hf(hf, warm, 4)
            for b in batches:
                prompts = make_prompts(b, args.min_prompt, args.max_prompt, args.seed + b)
                (e_s, e_out), (h_s, h_out) = best_pair(args.runs, eng, name, hf, prompts, n_new)
                row: dict[str, Any] = {
                    "model": name,
                    "attention": resolved,
                    "batch": b,
                    "prompt_tokens": sum(len(p) for p in prompts),
                    "new_tokens": b * n_new,
                    "engine_s": e_s,
                    "hf_s": h_s,
                    "engine_tok_s": b * n_new / e_s,
                    "hf_tok_s": b * n_new / h_s,
                }
                row["ratio"] = row["engine_tok_s"] / row["hf_tok_s"]
                if not args.no_decode_split and n_new > 1:
                    (e1, _), (h1, _) = best_pair(args.runs, eng, name, hf, prompts, 1)
                    dn = b * (n_new - 1)
                    row["engine_decode_tok_s"] = dn / max(e_s - e1, 1e-9)
                    row["hf_decode_tok_s"] = dn / max(h_s - h1, 1e-9)
                    row["decode_ratio"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
                row["match_requests"], row["match_prefix"] = agreement(e_out, h_out)
                rows.append(row)
                print(
                    f"  {name} b={b}: engine {row['engine_tok_s']:.0f} tok/s, "
                    f"HF {row['hf_tok_s']:.0f} tok/s ({row['ratio']:.2f}x)",
                    flush=True,
                )
    print()
    head = (
        f"{'model':<14}{'batch':>6}{'engine tok/s':>14}{'HF tok/s':>10}{'ratio':>7}"
        f"{'eng decode':>12}{'HF decode':>11}{'ratio':>7}{'same req':>10}{'prefix':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        dec = (
            f"{r['engine_decode_tok_s']:>12.0f}{r['hf_decode_tok_s']:>11.0f}"
            f"{r['decode_ratio']:>6.2f}x"
            if "decode_ratio" in r
            else f"{'-':>12}{'-':>11}{'-':>7}"
        )
        print(
            f"{r['model']:<14}{r['batch']:>6}{r['engine_tok_s']:>14.0f}{r['hf_tok_s']:>10.0f}"
            f"{r['ratio']:>6.2f}x{dec}{r['match_requests']:>10.0%}{r['match_prefix']:>8.0%}"
        )
    print(
        "\ntok/s = generated tokens / wall time of the whole generation (prefill included); "
        "decode = B*(N-1) / (t(N tokens) - t(1 token)).\n"
        "same req = requests whose greedy tokens are identical; prefix = mean matching prefix."
    )
    at32 = [r for r in rows if r["batch"] == 32]
    for r in at32:
        verdict = "meets" if r["ratio"] >= TARGET else "misses"
        print(
            f"target >= {TARGET:.0f}x HF at batch 32, {r['model']}: {r['ratio']:.2f}x ({verdict})"
        )
    out_json = Path(args.out) if args.out else OUT_JSON
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "torch": torch.__version__,
                "engine_file": str(engine_file),
                "engine_sha256": engine_sha,
                "threads": args.threads,
                "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
                "dtype": args.dtype,
                "attention": args.attention,
                "decode_graphs": args.decode_graphs,
                "max_new_tokens": n_new,
                "prompt_range": [args.min_prompt, args.max_prompt],
                "rows": rows,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
