"""Probe FlexAttention over a paged arena on this machine's GPU (a debugging aid
for ``paged_flex.py``): for each layout of the keys -- batch 1 broadcast (the
engine's) and batch expanded with a zero stride -- compile, check against a
gather reference and time one decode step of B requests against the gather
path. Run: ``python3 benchmarks/flex_probe.py`` (needs CUDA)."""

# ruff: noqa: B023  (closures called within their loop iteration)
from __future__ import annotations

import sys
import time
import traceback

import torch

from fleetserve.runtime.engine.paged_flex import PagedFlex


def main() -> int:
    dev = torch.device("cuda")
    bs, d, heads, kvh, layers = 16, 128, 32, 8, 1
    for dtype in (torch.bfloat16,):
        for b, ctx in ((8, 512), (64, 2048)):
            ntb = -(-ctx // bs)
            pages_needed = b * ntb * kvh * layers
            num_pages = pages_needed + 64
            gen = torch.Generator(device=dev).manual_seed(0)
            arena = torch.randn(num_pages, 2 * bs * d, device=dev, dtype=dtype, generator=gen)
            perm = torch.randperm(num_pages, device="cpu")[:pages_needed]
            tables = perm.view(b, ntb, layers, kvh).to(torch.int64)
            starts, lens = [ctx - 1] * b, [1] * b
            q = torch.randn(b, heads, d, device=dev, dtype=dtype, generator=gen)
            tab = tables.to(dev)
            # gather reference (the engine's decode path)
            kv = arena.view(num_pages, 2, bs, d)
            flat = tab[:, :, 0].transpose(1, 2).reshape(-1)

            def gather() -> torch.Tensor:
                keys = kv[:, 0].index_select(0, flat).view(b, kvh, ntb * bs, d)[:, :, :ctx]
                vals = kv[:, 1].index_select(0, flat).view(b, kvh, ntb * bs, d)[:, :, :ctx]
                qg = q.view(b, kvh, heads // kvh, d)
                sc = torch.matmul(qg, keys.transpose(-1, -2)).mul_(d**-0.5)
                return torch.matmul(torch.softmax(sc.float(), -1).to(dtype), vals).reshape(b, -1)

            ref = gather()
            for expand in (False, True):
                name = f"{dtype} b={b} ctx={ctx} {'expanded' if expand else 'broadcast'} K"
                try:
                    pf = PagedFlex(arena, bs, compiled=True)
                    if expand:
                        pf._expand_kv = True  # type: ignore[attr-defined]
                    pf.mark(tables, layers)
                    fs = pf.step(list(range(b)), starts, lens, list(range(b)), kvh, layers)
                    t0 = time.perf_counter()
                    out = pf.attend(fs, tab[:, :, 0], 0, q, heads, kvh, d)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    err = (out.float() - ref.float()).abs().max().item()

                    def timed(fn) -> float:  # type: ignore[no-untyped-def]
                        for _ in range(3):
                            fn()
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        for _ in range(20):
                            fn()
                        torch.cuda.synchronize()
                        return (time.perf_counter() - t) / 20 * 1e6

                    tf = timed(lambda: pf.attend(fs, tab[:, :, 0], 0, q, heads, kvh, d))
                    tg = timed(gather)
                    print(
                        f"{name}: max err {err:.3g}, first call {first:.1f} s, "
                        f"flex {tf:.0f} us, gather {tg:.0f} us ({tg / tf:.2f}x)",
                        flush=True,
                    )
                except Exception as exc:  # report and go on: this is a probe
                    print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    traceback.print_exc(limit=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
