"""Shared test setup.

Engine tests run PyTorch with one thread: the models are tiny, and on a
loaded 2-core machine two OpenMP threads waiting on each other made small
ops 10-80x slower (measured while other jobs ran). Tests that import no
torch are unaffected (torch is imported here only if installed).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("torch") is not None:
    import torch

    torch.set_num_threads(1)


# Modules that start Ray clusters, HTTP servers or subprocesses, or whose
# assertions depend on real work finishing in time: `make test` runs them on
# their own, after the rest ran in parallel (pytest-xdist), so they never
# share the cores with other tests (marker ``serial``).
SERIAL_MODULES = frozenset(
    {
        "test_bench_client",
        "test_cli",
        "test_fidelity_sim",
        "test_parity",
        "test_runtime_fault",
        "test_runtime_kun",
        "test_runtime_live_migration",
        "test_runtime_replace",
        "test_runtime_sharing",
        "test_server",
        "test_server_drain",
        "test_server_hardening",
    }
)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Mark every test of :data:`SERIAL_MODULES` ``serial``."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rsplit(".", 1)[-1] in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
