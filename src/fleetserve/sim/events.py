"""Every simulation event kind, and its place in the event order.

Event order is defined here and only here. Handlers return the events they
cause as ``(time, kind, payload)``; the kernel (:mod:`fleetserve.sim.kernel`)
gives each its kind's priority and a sequence number. At equal times, lower
priority values run first, and events of equal priority in the order they
were caused:

0. ``ITER_END``, ``GROUP_READY``, ``KV_ARRIVED``: an instance's iteration (or
   a sharing group's job) ends, a group (or an instance an elastic pool
   activated, ``cluster.activation_s``) finishes loading its weights, a moved
   request's KV lands on its new group. An instance's state at an instant is
   the one after every iteration ending then; the lazy "as of now" views count
   such an iteration as complete, so both agree.
1. ``TRANSFER``, ``ATTACH``: a migration stage, a final KV copy, token ids or
   a link transfer ends; a request attaches after its stall. They see the
   instances after their iteration ends, as the lazy views do, and an arrival
   at the same instant sees their effect.
2. arrivals (:data:`P_ARRIVAL`; they come from the sorted request list, not
   the heap, and are merged by the kernel): an arrival at the instant an
   iteration ends sees the batch that starts then.
3. ``EPOCH``, ``IDLE_CHECK``: a periodic policy decision (a migration
   epoch, KunServe's monitor), and the check whether a sharing group idle for
   its keep-alive may release its GPUs (elastic memory). The plan sees every
   arrival of its instant (Mell allocates the requests that arrived up to the
   epoch boundary) and every iteration end and transfer.
4. ``SAMPLE``, ``REPLACE``: time-series samples (they see the state after
   everything at that instant, a plan included) and SeaLLM's re-placement
   checks. At one instant these two run in the order they were caused.
"""

from __future__ import annotations

from typing import Any

P_ITER_END = 0
P_TRANSFER = 1
P_ARRIVAL = 2
P_EPOCH = 3
P_SAMPLE = 4

# event kinds (indexes into PRIORITY and NAMES)
ITER_END = 0
GROUP_READY = 1
KV_ARRIVED = 2
TRANSFER = 3
ATTACH = 4
EPOCH = 5
SAMPLE = 6
REPLACE = 7
IDLE_CHECK = 8

PRIORITY: tuple[int, ...] = (
    P_ITER_END,  # ITER_END
    P_ITER_END,  # GROUP_READY
    P_ITER_END,  # KV_ARRIVED
    P_TRANSFER,  # TRANSFER
    P_TRANSFER,  # ATTACH
    P_EPOCH,  # EPOCH
    P_SAMPLE,  # SAMPLE
    P_SAMPLE,  # REPLACE
    P_EPOCH,  # IDLE_CHECK
)
"""Each kind's priority, by kind."""

NAMES: tuple[str, ...] = (
    "iter_end",
    "group_ready",
    "kv_arrived",
    "transfer",
    "attach",
    "epoch",
    "sample",
    "replace",
    "idle_check",
)
"""Each kind's name, by kind (for messages and tests)."""

Event = tuple[float, int, Any]
"""``(time, kind, payload)``, as handlers return them."""
