"""One request's state in the simulator, the same class in every world.

The single-model world (:class:`~fleetserve.sim.group_instance.GroupInstance`), the
multi-LLM world (:class:`~fleetserve.sim.group.SharingGroup`) and the KunServe
world (:class:`~fleetserve.sim.kun.Executor`) keep a request's state in one
:class:`Seq`. It implements :class:`~fleetserve.cluster.state.SeqView` (what
batching, dispatch, migration and memory policies read) and
:class:`~fleetserve.policy.sharing.GroupSeq` (what group schedulers read).

Phases (``state``; every world uses the subset its mechanisms have)::

    new       created, not yet queued anywhere
    waiting   queued on ``inst``, holds no KV
    prefill   admitted: its (re)prefill of prompt + generated tokens is in
              flight and their KV allocated
    running   holds KV and decodes
    stalled   holds KV on ``inst`` but does not decode (KunServe: a
              blocking-exchange victim, a swap-out in flight)
    transit   its KV is on the way to ``inst`` (a migration's last copy, a
              swap-in)
    host      its KV is swapped out to host memory
    done      finished (its record holds the outcome)

Token counts, two ways:

* **bound** (``bound`` true): the request runs in a batch that steps together
  (:class:`~fleetserve.sim.batch.BoundBatch`: a sharing group's service under
  FCFS or RR, a KunServe executor's), and holds ``base + batch.kv_steps()`` tokens of KV with
  ``base + batch.decode_steps - prompt + 1`` generated. A
  decode iteration moves the instance's step counter, not every request: this
  is what keeps the single-model world at tens of thousands of requests per
  wall-second (see :mod:`fleetserve.sim.batch`, "Macro-steps").
* **explicit** (``bound`` false): ``kv_saved`` tokens of KV and ``gen_saved``
  generated. A sharing group keeps every running request this way when its
  scheduler steps a subset of a service's requests (DB, MLFQ) or jobs run at
  once (ADBS, pipelined groups); every world keeps a request this way while
  it does not decode (waiting, prefilling, stalled, in transit, swapped out).

The fields of one mechanism are unused in the worlds without it: prefix
caching (``hashes``, ``refs``, ``shared``, ``pub``, ``hash_tokens``) in the
single-model world, KV pieces and token-gap tracking in the KunServe world,
``in_job`` in sharing groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.metrics.records import RequestRecord
    from fleetserve.sim.prefix_cache import Entry
    from fleetserve.workload.request import Request

NEW = "new"
WAITING = "waiting"
PREFILLING = "prefill"
RUNNING = "running"
STALLED = "stalled"
TRANSIT = "transit"
HOST = "host"
DONE = "done"


class Seq:
    """A request's state (see the module docstring)."""

    __slots__ = (
        "arrival_s",
        "base",
        "batch",
        "bound",
        "finish_step",
        "gen_saved",
        "hash_tokens",
        "hashes",
        "id",
        "in_job",
        "inst",
        "kv_saved",
        "last_tok_s",
        "max_gap_s",
        "mig",
        "model",
        "n_gaps",
        "output_tokens",
        "pieces",
        "prefilled",
        "prompt_tokens",
        "pub",
        "record",
        "refs",
        "shared",
        "stall_from",
        "state",
        "sum_gap_s",
        "track_kind",
        "tracked_since",
    )

    def __init__(self, req: Request, record: RequestRecord) -> None:
        self.id = req.id
        self.model = req.model
        self.arrival_s = req.arrival_s
        self.prompt_tokens = req.prompt_tokens
        self.output_tokens = req.output_tokens
        self.record = record
        self.inst: Any = None  # the instance / group / executor that holds or queues it
        self.state = NEW
        self.bound = False
        self.base = 0  # bound: kv = base + batch.kv_steps()
        self.batch: Any = None  # bound: the BoundBatch (sim/batch.py) it runs in
        self.finish_step = 0  # bound: the inst step at which it finishes
        self.gen_saved = 0  # explicit: tokens generated
        self.kv_saved = 0  # explicit: KV tokens held
        self.mig: Any = None  # a migration in flight, if any
        self.in_job = False  # sharing group: in a job in flight
        self.prefilled = 0  # tokens of the current (re)prefill done (chunked prefill)
        self.stall_from: float | None = None  # token move: detach time, until next token
        # prefix caching (single-model world, sim/prefix_cache.py): the prompt's
        # block ids, the cache entries referenced (None: the plain accounting),
        # the KV blocks they hold, the next prompt block to publish
        self.hashes = req.prefix_blocks
        self.hash_tokens = req.prefix_block_tokens or 0
        self.refs: list[Entry] | None = None
        self.shared = 0
        self.pub = 0
        # KunServe world: KV pieces still to cross (exchange / restore), the
        # gaps between its tokens, and when its exchange or restore began
        self.pieces: list[Any] = []
        self.last_tok_s = 0.0
        self.max_gap_s = 0.0
        self.sum_gap_s = 0.0
        self.n_gaps = 0
        self.tracked_since: float | None = None
        self.track_kind = ""  # "exchange" or "restore"

    @property
    def generated(self) -> int:
        """Output tokens generated so far (as of the holder's ``now``)."""
        if self.bound:
            return self.base + self.batch.decode_steps - self.prompt_tokens + 1
        return self.gen_saved

    @property
    def kv_tokens(self) -> int:
        """KV tokens held now (bound: counting the in-flight iteration's token,
        the count the holder's blocks are allocated for)."""
        if self.bound:
            return self.base + self.batch.kv_steps()
        return self.kv_saved

    @property
    def demand_tokens(self) -> int:
        """``max(kv_tokens, prompt + generated)`` (Mell's request size)."""
        if self.bound:
            # both terms from one lookup: with d = decode_steps - kv steps,
            # prompt + generated = base + decode_steps + 1 and kv_tokens is the
            # same while an iteration is in flight, one less between iterations
            return self.base + self.batch.decode_steps + 1
        return max(self.kv_saved, self.prompt_tokens + self.gen_saved)

    @property
    def migrating(self) -> bool:
        """Whether a migration of this request is in flight."""
        return self.mig is not None

    @property
    def decoding(self) -> bool:
        """Whether it holds KV past its (re)prefill and decodes."""
        return self.state == RUNNING

    @property
    def prefill_tokens(self) -> int:
        """Tokens a (re)prefill processes and allocates: prompt + generated."""
        return self.prompt_tokens + self.gen_saved
