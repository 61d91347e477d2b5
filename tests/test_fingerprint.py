"""The refactor's regression guard (benchmarks/fingerprint.py): what counts as
a result, and how a difference is reported."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fingerprint", ROOT / "benchmarks/fingerprint.py")
assert spec is not None and spec.loader is not None
fp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fp)


def _write(folder: Path, run: str, summary: dict[str, object]) -> None:
    (folder / run).mkdir(parents=True)
    (folder / run / "summary.json").write_text(json.dumps(summary))


def test_wall_clock_and_config_do_not_count_results_do(tmp_path: Path) -> None:
    base = {"requests": {"total": 3}, "sim": {"events": 9, "wall_s": 0.5}, "config": {"a": 1}}
    _write(tmp_path / "a", "x", base)
    _write(tmp_path / "b", "x", {**base, "sim": {"events": 9, "wall_s": 7.0}, "config": {}})
    _write(tmp_path / "c", "x", {**base, "requests": {"total": 4}, "placement_search_s": 3})
    a, b, c = (fp.fingerprint(tmp_path / k) for k in "abc")
    assert fp.check(a, b) == []
    report = fp.check(a, c)
    assert report == ["x: 1 field(s) differ", "    requests.total: 3 -> 4"]
    _write(tmp_path / "c", "y", base)
    assert "y: new run, not in the baseline" in fp.check(a, fp.fingerprint(tmp_path / "c"))
    fp.save(a, tmp_path / "fp.json.gz")
    assert fp.load(tmp_path / "fp.json.gz") == a


@pytest.mark.parametrize("name", ["baseline.json.gz", "session13.json.gz"])
def test_the_committed_baseline_is_readable(name: str) -> None:
    base = fp.load(ROOT / "benchmarks/fingerprints" / name)
    assert len(base) == 141
    assert all(len(v["sha256"]) == 64 for v in base.values())
