"""The controller's ``ClusterState``: instance views built from worker snapshots.

A worker hosts one or more models; each (worker, model) pair is one
*instance* in the policies' ``ClusterState`` (several models on one worker
share its arena, as in the multi-LLM sharing groups). A view answers from
the worker's last :class:`~fleetserve.runtime.worker.WorkerSnap`, corrected
for what the controller did since that snapshot:

* requests submitted to the worker but not yet in a snapshot count as
  waiting, and their prompts as reserved blocks — otherwise a dispatch policy
  would send every arrival between two polls to the same worker;
* requests the controller is moving away count as migrating.

Blocks are counted in the instance's model's token-blocks: a token-block of
a model takes ``pages_per_block`` arena pages (its layers × KV heads), so a
worker's free pages are ``free_pages // pages_per_block`` blocks of that model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetserve.cluster.state import blocks_for
from fleetserve.runtime.worker import SeqSnap, WorkerSnap


@dataclass(slots=True)
class Pending:
    """A request the controller sent to a worker that no snapshot shows yet."""

    id: int
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    generated: int = 0

    @property
    def kv_tokens(self) -> int:
        return 0

    @property
    def demand_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def migrating(self) -> bool:
        return False

    @property
    def decoding(self) -> bool:
        return False


@dataclass(slots=True)
class _Moving:
    """A snapshot's request seen through the controller's knowledge that it is moving."""

    s: SeqSnap

    def __getattr__(self, name: str) -> object:
        return getattr(self.s, name)

    @property
    def migrating(self) -> bool:
        return True


@dataclass(slots=True)
class LiveInstance:
    """One (worker, model) instance as the policies see it (an ``InstanceView``)."""

    id: int
    worker_id: int
    model: str
    snap: WorkerSnap
    pending: list[Pending] = field(default_factory=list)
    moving: frozenset[int] = frozenset()
    tp: int = 1

    @property
    def gpus(self) -> tuple[int, ...]:
        return (self.worker_id,)

    @property
    def block_size(self) -> int:
        return self.snap.block_size

    def _blocks(self, pages: int) -> int:
        return pages // max(1, self.snap.pages_per_block[self.model])

    @property
    def total_blocks(self) -> int:
        return self._blocks(self.snap.total_blocks)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def free_blocks(self) -> int:
        return self._blocks(self.snap.free_blocks)

    @property
    def reserved_blocks(self) -> int:
        bs = self.block_size
        waiting = sum(blocks_for(s.demand_tokens + 1, bs) for s in self._snap_seqs() if _queued(s))
        return waiting + sum(blocks_for(p.demand_tokens + 1, bs) for p in self.pending)

    @property
    def available_blocks(self) -> int:
        """Free, less the queued prompts' and the admission watermark's blocks
        (as the simulated instance counts them)."""
        return self.free_blocks - self.reserved_blocks - self._blocks(self.snap.watermark_blocks)

    def _snap_seqs(self) -> list[SeqSnap]:
        return [s for s in self.snap.seqs if s.model == self.model]

    @property
    def num_running(self) -> int:
        return sum(1 for s in self._snap_seqs() if s.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self._snap_seqs() if _queued(s)) + len(self.pending)

    @property
    def decode_steps(self) -> int:
        return self.snap.decode_steps

    @property
    def idle(self) -> bool:
        return not self._snap_seqs() and not self.pending and not self.moving

    def seqs(self) -> list[object]:
        out: list[object] = []
        for s in self._snap_seqs():
            out.append(_Moving(s) if s.id in self.moving else s)
        out.extend(self.pending)
        return out


def _queued(s: SeqSnap) -> bool:
    return not s.running and not s.migrating
