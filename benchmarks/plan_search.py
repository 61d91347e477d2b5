"""Issue 23's acceptance: ``fleetserve plan`` on the example, and bisection vs brute force.

1. ``configs/plan-example.yaml`` (4 services, 3 GPU types, the default stacks):
   wall time against the 5-minute target on this machine.
2. The same plan reduced (3 stacks, 12 GPUs, TP {1, 2}), searched by
   bisection with pruning and by brute force: the chosen point and every
   stack's cheapest point must agree; both wall times are printed.

Usage: ``python benchmarks/plan_search.py [--skip-full] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from fleetserve.experiments.plan.report import write_plan
from fleetserve.experiments.plan.run import PlanResult, run_plan
from fleetserve.experiments.plan.spec import load_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "plan-example.yaml"
REDUCED = (
    "search.stacks=[vllm,alpaserve,muxserve]",
    "search.max_gpus=12",
    "search.tp=[1,2]",
)
TARGET_S = 300.0


def _timed(overrides: tuple[str, ...], out: Path, *, brute: bool) -> tuple[PlanResult, float]:
    spec, base = load_plan(EXAMPLE, overrides)
    if brute:
        spec = dataclasses.replace(spec, search=dataclasses.replace(spec.search, brute_force=True))
    t0 = time.perf_counter()
    res = run_plan(spec, base)
    write_plan(res, out)
    return res, time.perf_counter() - t0


def _best(res: PlanResult) -> dict[str, object]:
    return {n: (s.best if s is not None else "cut") for n, s in res.searches.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skip-full", action="store_true", help="only the reduced comparison")
    ap.add_argument("--out", default="results/bench-plan")
    args = ap.parse_args()
    out = Path(args.out)
    ok = True
    if not args.skip_full:
        res, wall = _timed((), out / "example", brute=False)
        c = res.chosen
        print(
            f"example: {wall:.0f} s (target {TARGET_S:.0f} s), {len(res.outcomes)} points; "
            f"chosen {c.n_gpus} x {c.gpu} {c.stack} ${c.cost_per_hour:.2f}/h"
            if c is not None
            else f"example: {wall:.0f} s, no feasible point"
        )
        ok &= wall < TARGET_S
    fast, t_fast = _timed(REDUCED, out / "reduced-bisect", brute=False)
    brute, t_brute = _timed(REDUCED, out / "reduced-brute", brute=True)
    same = fast.chosen == brute.chosen and _best(fast) == _best(brute)
    print(
        f"reduced: bisection {t_fast:.1f} s ({len(fast.outcomes)} points), brute force "
        f"{t_brute:.1f} s ({len(brute.outcomes)} points); same answer: {same}"
    )
    ok &= same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
