"""Shared test setup.

Engine tests run PyTorch with one thread: the models are tiny, and on a
loaded 2-core machine two OpenMP threads waiting on each other made small
ops 10-80x slower (measured while other jobs ran). Tests that import no
torch are unaffected (torch is imported here only if installed).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torch") is not None:
    import torch

    torch.set_num_threads(1)
