"""The first prefill of a new prompt length on CUDA, against the same length again.

PyTorch's cuDNN attention builds an execution plan per sequence length (bf16 on
an H100: 49-61 ms for a first-time 1-token run of the engine, 5-6 ms again;
docs/gpu.md). The engine avoids that kernel (``model.sdpa``); HF's ``generate``
keeps PyTorch's default. Times both, on prompts of new lengths (round 1) and the
same prompts again (round 2). ``--no-cudnn`` turns cuDNN attention off for the
whole process, for comparison. For a lent GPU; prints a table only.

Run: ``PYTHONPATH=src python3 benchmarks/cuda_new_lengths.py [--dtype bfloat16] [--no-cudnn]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_decode as ed

from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.weights import load_weight_source, save_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(ed.DTYPES))
    ap.add_argument("--model", default="tiny-llama-b")
    ap.add_argument(
        "--no-cudnn", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dt, dev = ed.DTYPES[args.dtype], torch.device("cuda")
    torch.set_num_threads(1)
    print(f"{args.dtype}, cuDNN attention {'off' if args.no_cudnn else 'as PyTorch defaults'}")
    with tempfile.TemporaryDirectory() as tmp:
        src = load_weight_source(args.model)
        hf = ed.load_hf(save_checkpoint(Path(tmp) / "m", src), dev, dt)
        eng = Engine([src], ed.ARENA_BYTES, device=dev, dtype=dt, decode_graphs="off")
        warm = ed.make_prompts(2, 8, 32, seed=999)
        ed.run_engine(eng, args.model, warm, 4)
        ed.run_hf(hf, warm, 4)
        prompts = ed.make_prompts(4, 100, 500, seed=5)
        head = ("round", "length", "engine 32 tok ms", "engine 1 tok ms", "HF 32 tok ms")
        print(f"{head[0]:>5}{head[1]:>8}{head[2]:>18}{head[3]:>17}{head[4]:>14}")
        for rnd in (1, 2):
            for p in prompts:
                e, _ = ed.run_engine(eng, args.model, [p], 32)
                e1, _ = ed.run_engine(eng, args.model, [[*p, 1]], 1)
                h, _ = ed.run_hf(hf, [p], 32)
                print(f"{rnd:>5}{len(p):>8}{e * 1e3:>18.0f}{e1 * 1e3:>17.0f}{h * 1e3:>14.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
