"""GPU pool of the simulator: ids grouped into nodes, activation intervals."""

from __future__ import annotations

from fleetserve.errors import ConfigError
from fleetserve.metrics.records import GpuInterval


class GpuPool:
    """GPUs ``0 .. limit-1``; node of GPU ``g`` is ``g // gpus_per_node``.

    A tensor-parallel group is allocated inside one node (lowest node with
    enough free GPUs, lowest ids first), so activation is deterministic.

    Args:
        limit: number of GPUs the pool may ever use.
        gpus_per_node: GPUs per node.
    """

    def __init__(self, limit: int, gpus_per_node: int) -> None:
        self.limit = limit
        self.per_node = gpus_per_node
        self._busy: set[int] = set()
        self._node_used: dict[int, int] = {}
        self._since: dict[int, float] = {}
        self.intervals: list[GpuInterval] = []

    @property
    def active(self) -> int:
        """GPUs currently active."""
        return len(self._busy)

    def allocate(self, n: int, now: float) -> tuple[int, ...]:
        """Activate ``n`` GPUs of one node at ``now``."""
        if n > self.per_node:
            raise ConfigError(f"a group of {n} GPUs does not fit in a node of {self.per_node} GPUs")
        n_nodes = -(-self.limit // self.per_node)
        for node in range(n_nodes):
            lo = node * self.per_node
            hi = min(lo + self.per_node, self.limit)
            if hi - lo - self._node_used.get(node, 0) < n:
                continue
            ids = tuple(g for g in range(lo, hi) if g not in self._busy)[:n]
            for g in ids:
                self._busy.add(g)
                self._since[g] = now
            self._node_used[node] = self._node_used.get(node, 0) + n
            return ids
        raise ConfigError(f"GPU pool exhausted: {n} more GPUs requested, limit {self.limit}")

    def release(self, ids: tuple[int, ...], now: float) -> None:
        """Return GPUs to the idle pool at ``now``."""
        for g in ids:
            self._busy.remove(g)
            self._node_used[g // self.per_node] -= 1
            self.intervals.append(GpuInterval(g, self._since.pop(g), now))

    def close(self, now: float) -> list[GpuInterval]:
        """All activity intervals, open ones ended at ``now``."""
        open_ = [GpuInterval(g, t, now) for g, t in sorted(self._since.items())]
        return sorted(self.intervals + open_, key=lambda iv: (iv.start_s, iv.gpu))
