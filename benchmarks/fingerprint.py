"""Fingerprints of what the simulator produces: the regression guard of a refactor.

Runs every experiment's ``reproduce --quick`` grid and a few single runs
(``compare`` on ``configs/default.yaml``), then records, for every
``summary.json`` under the output folder, a SHA-256 of its *results* (the
summary without ``config`` and without wall-clock fields: ``sim.wall_s``,
anything named ``*wall*``, ``placement_search_s``) and the headline metrics in plain view::

    python benchmarks/fingerprint.py --out results/fp-new \\
        --check benchmarks/fingerprints/baseline.json.gz

The committed baselines: ``baseline.json.gz``, the simulator before the "One
system" refactor (commit 23c82c3; 141 runs, 3 min 20 s on this 2-core
machine); ``session13.json.gz``, after session 13's refactor; and
``session14.json.gz``, what ``make fingerprint`` checks: memory-bandwidth
contention in MuxServe's groups (issue 22; the 4 ADBS runs differ), each
group's ``busy_fraction`` over its own life (the 8 SeaLLM runs with
re-placements differ in that field only), and the ``fleet`` experiment's quick
grid added (155 runs). Two runs of the same code give identical
fingerprints (checked when each baseline was recorded).

``--check`` lists every run whose results changed, and for each the fields
that differ (old -> new), so a refactor's differences can be explained one by
one; runs only in one of the two files are listed too. Exit status 1 when
anything differs. ``--from-runs DIR`` fingerprints an existing output folder
without simulating.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ("mell", "seallm", "muxserve", "kunserve", "fleet")
SINGLE = [
    ["compare", "configs/default.yaml", "--stacks", "bf,wf,vllm,llumnix,mell"],
]
WALL = frozenset({"placement_search_s"})
HEADLINE = (
    "requests",
    "throughput_rps",
    "gpus",
    "normalized_latency",
    "migrations",
)


def results_of(summary: dict[str, Any]) -> Any:
    """The summary without its config and without wall-clock fields (any key
    with ``wall`` in it, and ``placement_search_s``, the placement search's
    wall time: the only fields two runs of the same code differ in)."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in WALL and "wall" not in k}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip({k: v for k, v in summary.items() if k != "config"})


def fingerprint(folder: Path) -> dict[str, Any]:
    """Per ``summary.json`` below ``folder`` (by relative path): the hash of
    its results and its headline metrics."""
    out: dict[str, Any] = {}
    for f in sorted(folder.rglob("summary.json")):
        data = json.loads(f.read_text())
        res = results_of(data)
        blob = json.dumps(res, sort_keys=True, separators=(",", ":"))
        out[str(f.relative_to(folder).parent)] = {
            "sha256": hashlib.sha256(blob.encode()).hexdigest(),
            "headline": {k: res[k] for k in HEADLINE if k in res},
            "results": res,
        }
    return out


def diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Every leaf that differs between two result trees, as ``path: old -> new``."""
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for k in sorted(set(old) | set(new)):
            p = f"{path}.{k}" if path else str(k)
            if k not in old:
                lines.append(f"{p}: (absent) -> {json.dumps(new[k])[:80]}")
            elif k not in new:
                lines.append(f"{p}: {json.dumps(old[k])[:80]} -> (absent)")
            else:
                lines += diff(old[k], new[k], p)
        return lines
    if old != new:
        return [f"{path}: {json.dumps(old)[:80]} -> {json.dumps(new)[:80]}"]
    return []


INPUTS = (("workload", "source"), ("kunserve", "stack"))
"""Inputs echoed in a summary, left out of a check: ``workload.source`` names
the trace by its path, which depends on where the checkout is (so a check from
another clone or worktree compares the rest); ``kunserve.stack`` is the
stack's name, which ``--rename`` maps."""


def portable(results: Any) -> Any:
    """``results`` without the :data:`INPUTS` fields."""
    if not isinstance(results, dict):
        return results
    out = dict(results)
    for section, key in INPUTS:
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k != key}
    return out


def check(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed from ``base`` to ``new`` (empty: identical results)."""
    report = []
    for run in sorted(set(base) | set(new)):
        if run not in new:
            report.append(f"{run}: only in the baseline")
        elif run not in base:
            report.append(f"{run}: new run, not in the baseline")
        elif (b := portable(base[run]["results"])) != (n := portable(new[run]["results"])):
            fields = diff(b, n)
            report.append(f"{run}: {len(fields)} field(s) differ")
            report += [f"    {x}" for x in fields[:40]]
    return report


def rename(fp: dict[str, Any], renames: list[tuple[re.Pattern[str], str]]) -> dict[str, Any]:
    """``fp`` with each run name rewritten by the first pattern that matches it."""
    out = {}
    for run, v in fp.items():
        for pat, repl in renames:
            if pat.search(run):
                run = pat.sub(repl, run)
                break
        out[run] = v
    return out


def load(path: Path) -> dict[str, Any]:
    """A fingerprint file (``.json``, or gzipped ``.json.gz``)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return dict(json.loads(raw))


def save(fp: dict[str, Any], path: Path) -> None:
    """Write fingerprints (gzipped when ``path`` ends in ``.gz``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = (json.dumps(fp, indent=1, sort_keys=True) + "\n").encode()
    path.write_bytes(gzip.compress(blob, 9, mtime=0) if path.suffix == ".gz" else blob)


def simulate(out: Path, jobs: int, only: tuple[str, ...] = ()) -> None:
    """Run every grid (or only the ``only`` experiments') into ``out``."""
    exe = Path(sys.executable).with_name("fleetserve")
    for exp in EXPERIMENTS:
        if only and exp not in only:
            continue
        cmd = [str(exe), "reproduce", exp, "--quick", "--out", str(out / exp)]
        cmd += ["--jobs", str(jobs), "--no-progress"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    for i, args in enumerate(SINGLE):
        if only and "single" not in only:
            continue
        cmd = [str(exe), *args, "--out", str(out / f"single-{i}"), "--no-progress"]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="simulate every grid into this folder")
    p.add_argument("--from-runs", type=Path, help="fingerprint this folder, do not simulate")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--only",
        action="append",
        choices=[*EXPERIMENTS, "single"],
        help="simulate and compare only this experiment's runs (repeatable; default: all)",
    )
    p.add_argument("--write", type=Path, help="write the fingerprints here")
    p.add_argument("--check", type=Path, help="baseline fingerprints to compare with")
    p.add_argument("--against", type=Path, help="fingerprints to compare (with --check)")
    p.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="REGEX=REPLACEMENT",
        help="rename the baseline's runs before comparing (a stack renamed since the "
        "baseline was recorded); repeatable",
    )
    a = p.parse_args()
    renames = []
    for r in a.rename:
        pat, sep, repl = r.partition("=")
        if not sep:
            p.error(f"--rename {r!r}: expected REGEX=REPLACEMENT")
        renames.append((re.compile(pat), repl))

    only = tuple(a.only or ())

    def picked(fp: dict[str, Any]) -> dict[str, Any]:
        """The runs of the ``--only`` experiments (all without it)."""
        if not only:
            return fp
        return {run: v for run, v in fp.items() if run.split("/", 1)[0].split("-", 1)[0] in only}

    def baseline() -> dict[str, Any]:
        return picked(rename(load(a.check), renames))

    if a.check is not None and a.against is not None:
        report = check(baseline(), load(a.against))
        print("\n".join(report) if report else "identical results")
        return 1 if report else 0
    folder = a.from_runs
    if folder is None:
        if a.out is None:
            p.error("give --out (simulate), --from-runs, or --check with --against")
        simulate(a.out, a.jobs, only)
        folder = a.out
    fp = picked(fingerprint(folder))
    print(f"{len(fp)} runs fingerprinted under {folder}")
    if a.write is not None:
        save(fp, a.write)
    if a.check is not None:
        report = check(baseline(), fp)
        print("\n".join(report) if report else "identical results")
        return 1 if report else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
