"""Probe FlexAttention over a paged arena on this machine's GPU (a debugging aid
for ``paged_flex.py``): for block sizes 16 (with and without full blocks) and
64 and three batch shapes, compile, check one decode step of B requests
against the gather path (the engine's default) and time both, the block
mask's construction apart from the kernel.
Run: ``python3 benchmarks/flex_probe.py`` (needs CUDA)."""

# ruff: noqa: B023  (closures called within their loop iteration)
from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

import torch

from fleetserve.runtime.engine.paged_flex import PagedFlex


def timed(fn: Callable[[], object], n: int = 20) -> float:
    """Mean microseconds of ``fn`` after 3 warm-ups, synchronised."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> int:
    dev = torch.device("cuda")
    d, heads, kvh, layers, dtype = 128, 32, 8, 1, torch.bfloat16
    print("one decode step, Llama-2-7B heads (32 q, 8 kv, d 128), bf16; times in us")
    for bs, full in ((16, False), (16, True), (64, False)):
        for b, ctx in ((1, 2048), (8, 512), (64, 2048)):
            name = f"bs={bs}{' full blocks' if full else ''} b={b} ctx={ctx}"
            try:
                ntb = -(-ctx // bs)
                need = b * ntb * kvh * layers
                num_pages = need + 64
                gen = torch.Generator(device=dev).manual_seed(0)
                arena = torch.randn(num_pages, 2 * bs * d, device=dev, dtype=dtype, generator=gen)
                perm = torch.randperm(num_pages)[:need]
                tables = perm.view(b, ntb, layers, kvh).to(torch.int64)
                q = torch.randn(b, heads, d, device=dev, dtype=dtype, generator=gen)
                tab = tables.to(dev)
                kv = arena.view(num_pages, 2, bs, d)
                flat = tab[:, :, 0].transpose(1, 2).reshape(-1)

                def gather() -> torch.Tensor:
                    keys = kv[:, 0].index_select(0, flat).view(b, kvh, ntb * bs, d)[:, :, :ctx]
                    vals = kv[:, 1].index_select(0, flat).view(b, kvh, ntb * bs, d)[:, :, :ctx]
                    qg = q.view(b, kvh, heads // kvh, d)
                    sc = torch.matmul(qg, keys.transpose(-1, -2)).mul_(d**-0.5)
                    return torch.matmul(torch.softmax(sc, -1), vals).reshape(b, -1)

                pf = PagedFlex(arena, bs, compiled=True, full_blocks=full)
                pf.mark(tables, layers)
                fs = pf.step(list(range(b)), [ctx - 1] * b, [1] * b, list(range(b)), kvh, layers)
                t0 = time.perf_counter()
                out = pf.attend(fs, tab[:, :, 0], 0, q, heads, kvh, d)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                err = (out.float() - gather().float()).abs().max().item()
                mask = pf.block_mask(fs, tab[:, :, 0], 0, d)
                t_all = timed(lambda: pf.attend(fs, tab[:, :, 0], 0, q, heads, kvh, d))
                t_mask = timed(lambda: pf.block_mask(fs, tab[:, :, 0], 0, d))
                t_kern = timed(lambda: pf.run(fs, mask, q, heads, kvh, d))
                t_g = timed(gather)
                gb = 2 * b * kvh * ctx * d * arena.element_size() / 1e9
                print(
                    f"{name}: err {err:.3g}, compile {first:.1f} s | flex {t_all:.0f} "
                    f"(mask {t_mask:.0f}, kernel {t_kern:.0f}) | gather {t_g:.0f} | "
                    f"gather/flex {t_g / t_all:.2f}x, gather/kernel {t_g / t_kern:.2f}x | "
                    f"KV {gb * 1e3:.0f} MB: kernel {gb / t_kern * 1e6:.0f} GB/s, "
                    f"gather {gb / t_g * 1e6:.0f} GB/s",
                    flush=True,
                )
            except Exception as exc:  # report and go on: this is a probe
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                traceback.print_exc(limit=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
