"""Where the shared trace files of the reproduction experiments live.

The traces are not shipped with the package; they sit in a ``shared/data``
folder next to the repository (see ``../shared/data/README.md``). The folder is
looked up, first match wins:

1. ``$FLEETSERVE_DATA`` when set (then it must exist: no silent fallback);
2. ``../shared/data`` relative to the working directory;
3. ``../shared/data`` relative to the repository root (found from this file).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from fleetserve.errors import InputError

DATA_ENV = "FLEETSERVE_DATA"
"""Environment variable naming the shared data folder."""

_REPO_ROOT = Path(__file__).resolve().parents[3]


def data_candidates() -> list[Path]:
    """Folders searched for the shared traces, in order (see the module docstring)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return [Path(env)]
    return [Path.cwd().parent / "shared" / "data", _REPO_ROOT.parent / "shared" / "data"]


def find_data_dir(required: Sequence[str]) -> Path:
    """The shared data folder holding every file in ``required``.

    Args:
        required: file names that must be present in the folder.

    Raises:
        InputError: no candidate folder holds all of them (one line naming the
            folders searched, the missing files and ``$FLEETSERVE_DATA``).
    """
    candidates = data_candidates()
    for d in candidates:
        if d.is_dir() and all((d / f).is_file() for f in required):
            return d.resolve()
    first = candidates[0]
    missing = [f for f in required if not (first / f).is_file()]
    searched = ", ".join(str(c) for c in candidates)
    raise InputError(
        f"shared trace data not found (needs {', '.join(missing or required)}; searched "
        f"{searched}); set {DATA_ENV} to the folder holding them"
    )
