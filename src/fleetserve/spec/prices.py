"""Default hourly prices of catalog GPUs, USD per GPU-hour, on-demand, with sources.

Prices move and differ 2-4x between providers; these defaults only make a plan
runnable out of the box. A plan should give its own (``gpus[i].price_per_hour``
in ``fleetserve plan``'s input), and a GPU without a default here must be given
one.

Sources (read 2026-11-26):

* ``a100-80gb``, ``h100-80gb``, ``h200-141gb``: Mercatus, "Cloud GPU pricing"
  (https://www.mercatus-ai.com/blog/cloud-gpu-pricing), May 2026, the
  "specialty provider" tier's on-demand ranges: A100 80GB $1.10-1.50, H100
  SXM5 $2.50-3.50, H200 SXM5 $3.50-4.50; the midpoints are used.
* ``rtx4090-24gb``: DeployBase, "RTX 4090 cloud pricing"
  (https://deploybase.ai/articles/rtx-4090-cloud), March 2026: RunPod
  on-demand $0.34.
* ``l4-24gb``: DeployBase, "NVIDIA L4 price"
  (https://deploybase.ai/articles/nvidia-l4-price): RunPod on-demand $0.44.

RunPod is one of Mercatus' specialty providers, so the two sources price the
same tier. No comparable source was found for ``a100-40gb`` (offers rarely say
which A100), ``a800-80gb`` (sold in China only) or ``v100-32gb``; they have no
default.
"""

from __future__ import annotations

from fleetserve.errors import ConfigError

__all__ = ["GPU_PRICES", "gpu_price"]

GPU_PRICES: dict[str, float] = {
    "a100-80gb": 1.30,
    "h100-80gb": 3.00,
    "h200-141gb": 4.00,
    "rtx4090-24gb": 0.34,
    "l4-24gb": 0.44,
}
"""USD per GPU-hour, on-demand (module docstring for the sources)."""


def gpu_price(gpu: str, given: float | None = None) -> float:
    """The hourly price of ``gpu``: ``given`` when set, else the catalog default.

    Raises:
        ConfigError: no price given and no default for this GPU.
    """
    if given is not None:
        if not given > 0:
            raise ConfigError(f"price_per_hour of {gpu} must be > 0, got {given}")
        return float(given)
    try:
        return GPU_PRICES[gpu]
    except KeyError:
        known = ", ".join(f"{k} ${v:.2f}" for k, v in GPU_PRICES.items())
        raise ConfigError(
            f"no default price for GPU {gpu!r}: give its price_per_hour (defaults exist for "
            f"{known}; sources in fleetserve.spec.prices)"
        ) from None
