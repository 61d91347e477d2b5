"""Time to move bytes over a link: ``latency + nbytes / bandwidth``.

Links used by the simulator (all bandwidths per direction, bytes/s):

==================  ==========================================  ===============
helper              bandwidth                                   latency
==================  ==========================================  ===============
intra_node_link     ``gpu.intra_node_bw`` (NVLink or PCIe P2P)  10 µs
network_link        ``gpu.network_bw`` (per-GPU NIC, RDMA)      30 µs
host_link           PCIe x16 to host memory, achieved rate:     10 µs
                    Gen5 (H100/H200) 50e9, Gen4 (A100, A800,
                    L4, RTX 4090) 25e9, Gen3 (V100) 12e9
==================  ==========================================  ===============

The host-link rates are achieved ``cudaMemcpy`` rates with pinned memory, about
80 % of the theoretical 64 / 32 / 16 GB/s of PCIe Gen5 / Gen4 / Gen3 x16. The
latencies are typical one-way software + wire latencies for a bulk copy
(NCCL P2P over NVLink, GPUDirect RDMA over InfiniBand/RoCE, and a DMA copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleetserve.errors import ConfigError
from fleetserve.spec.types import GpuSpec

__all__ = [
    "HOST_LINK_LATENCY_S",
    "INTRA_NODE_LATENCY_S",
    "NETWORK_LATENCY_S",
    "Link",
    "host_link",
    "intra_node_link",
    "network_link",
    "transfer_time",
]

INTRA_NODE_LATENCY_S = 10e-6
"""One-way latency of a GPU-to-GPU copy inside a node."""
NETWORK_LATENCY_S = 30e-6
"""One-way latency of a GPU-to-GPU copy between nodes (RDMA)."""
HOST_LINK_LATENCY_S = 10e-6
"""Latency of a host <-> GPU DMA copy."""

_PCIE_GEN5_BPS = 50e9
_PCIE_GEN4_BPS = 25e9
_PCIE_GEN3_BPS = 12e9


@dataclass(frozen=True, slots=True)
class Link:
    """A point-to-point link.

    Attributes:
        bandwidth_Bps: bytes per second in one direction.
        latency_s: fixed cost of one transfer in seconds.
    """

    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ConfigError(f"Link.bandwidth_Bps must be positive, got {self.bandwidth_Bps!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ConfigError(f"Link.latency_s must be >= 0, got {self.latency_s!r}")


def transfer_time(nbytes: float, link: Link) -> float:
    """Seconds to send ``nbytes`` over ``link``: ``latency + nbytes / bandwidth``.

    A transfer of zero bytes costs nothing (no message is sent).

    Raises:
        ValueError: if ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if nbytes == 0:
        return 0.0
    return link.latency_s + nbytes / link.bandwidth_Bps


def intra_node_link(gpu: GpuSpec) -> Link:
    """GPU-to-GPU link inside one node (NVLink or PCIe peer-to-peer)."""
    return Link(gpu.intra_node_bw, INTRA_NODE_LATENCY_S)


def network_link(gpu: GpuSpec) -> Link:
    """GPU-to-GPU link between nodes (the GPU's share of the node's NICs)."""
    return Link(gpu.network_bw, NETWORK_LATENCY_S)


def host_link(gpu: GpuSpec) -> Link:
    """GPU <-> host memory over PCIe x16 (generation chosen from the GPU name).

    Hopper parts (``h100*``, ``h200*``) use PCIe Gen5 (50e9 B/s achieved), Volta
    (``v100*``) Gen3 (12e9 B/s), everything else Gen4 (25e9 B/s).
    """
    name = gpu.name.lower()
    if name.startswith(("h100", "h200", "gh200")):
        bw = _PCIE_GEN5_BPS
    elif name.startswith("v100"):
        bw = _PCIE_GEN3_BPS
    else:
        bw = _PCIE_GEN4_BPS
    return Link(bw, HOST_LINK_LATENCY_S)
