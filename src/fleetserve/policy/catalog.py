"""The stack catalog: every named system, one choice per policy family.

A :class:`Stack` names one choice of each family:

==============  ==============================================================
family          choices (registry)
==============  ==============================================================
placement       ``dedicated`` (:data:`~fleetserve.policy.base.PLACEMENT`),
                ``muxserve``, ``seallm`` (sharing groups,
                :data:`~fleetserve.policy.group_placement.GROUP_PLACEMENTS`)
dispatch        :data:`~fleetserve.policy.base.DISPATCH`
batching        ``fcfs``, ``rr``, ``mlfq``, ``db``, ``adbs``: one registry
                (:data:`~fleetserve.policy.sharing.BATCHING`); a one-model
                instance runs ``fcfs`` and ``rr``
                (:mod:`fleetserve.policy.batching`)
layout          KV layout: ``partitioned``, ``merged``, ``headwise``
                (:data:`~fleetserve.sim.kvlayout.LAYOUTS`)
migration       :data:`~fleetserve.policy.base.MIGRATION`
mechanism       :data:`~fleetserve.policy.mechanism.MECHANISM`
memory          :data:`~fleetserve.policy.base.MEMORY`; None: from the pool
                (``elastic`` on an elastic pool, ``static`` on a fixed one)
replacement     SeaLLM's adaptive re-placement (bool)
pressure        what replicas do when KV memory runs short
                (:data:`~fleetserve.policy.pressure.PRESSURES`), with the
                KunServe knobs: the stack's ``burst``
                (:class:`~fleetserve.policy.pressure.KunSettings`)
==============  ==============================================================

:data:`STACKS` is the one table of every stack. A name means one system:
``vllm`` is dedicated placement, round-robin dispatch, FCFS, a partitioned KV
layout, no migration and queueing under memory pressure, whichever simulator
runs it.

Worlds. Three simulators run stacks today, each on its own kind of run
(:data:`WORLDS`); a stack lists the worlds it runs in, and each world reads
only some of its families (:attr:`World.reads`). What a world's simulator
does for the families it does not read is fixed in its code today
(:attr:`World.fixed`): e.g. the multi-LLM simulator always sends a request
to the hosting group with the fewest outstanding requests, and the KunServe
simulator always dispatches Worst-Fit, whatever the stack's ``dispatch``.
Which world a run is in follows from its config (:func:`world_of`).

:func:`resolve_policies` gives the single-model simulator's (and the
runtime controller's) families of a config: the stack's choices with the
config's per-family overrides, each checked against its registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.policy.base import DISPATCH, MEMORY, MIGRATION, PLACEMENT
from fleetserve.policy.batching import instance_batching
from fleetserve.policy.mechanism import MECHANISM
from fleetserve.policy.pressure import KunSettings
from fleetserve.policy.sharing import BATCHING

if TYPE_CHECKING:
    from fleetserve.config import SimConfig

__all__ = [
    "FAMILIES",
    "KUNSERVE",
    "MULTI",
    "SINGLE",
    "STACKS",
    "WORLDS",
    "Stack",
    "World",
    "get_stack",
    "kun_only",
    "resolve_policies",
    "stack_for",
    "stacks_in",
    "world_of",
]

SINGLE = "single"
"""The single-model world: :class:`~fleetserve.sim.simulator.Simulator`."""
MULTI = "multi"
"""The multi-LLM services world: :class:`~fleetserve.sim.multi.MultiSimulator`."""
KUNSERVE = "kunserve"
"""The KunServe burst world: :class:`~fleetserve.sim.kun.KunSimulator`."""

FAMILIES: tuple[str, ...] = (
    "placement",
    "dispatch",
    "batching",
    "layout",
    "migration",
    "mechanism",
    "memory",
    "replacement",
    "pressure",
)
"""The policy families a stack chooses, in display order."""


@dataclass(frozen=True, slots=True)
class World:
    """A kind of run one of today's simulators handles.

    Attributes:
        name: :data:`SINGLE`, :data:`MULTI` or :data:`KUNSERVE`.
        label: for messages (``single-model``, ...).
        simulator: the module that runs it.
        selected_by: which configs run in it.
        reads: the families of a stack this world's simulator uses.
        fixed: what it does instead for each family it does not read
            (fixed in its code today, whatever the stack says).
    """

    name: str
    label: str
    simulator: str
    selected_by: str
    reads: tuple[str, ...]
    fixed: Mapping[str, str] = field(default_factory=dict)


WORLDS: dict[str, World] = {
    w.name: w
    for w in (
        World(
            SINGLE,
            "single-model",
            "fleetserve.sim.simulator",
            "every config the other two worlds do not take",
            ("placement", "dispatch", "batching", "migration", "mechanism", "memory"),
            {
                "layout": "one model per instance (the one-model case of partitioned)",
                "replacement": "none",
                "pressure": "the batching policy preempts the newest request (recompute)",
            },
        ),
        World(
            MULTI,
            "multi-LLM",
            "fleetserve.sim.multi",
            "a config with services, multi.generator or fleet.generator",
            (
                "placement",
                "dispatch",
                "batching",
                "layout",
                "replacement",
                "mechanism",
                "memory",
                "pressure",
            ),
            {
                "migration": "requests move only when a re-placement retires a group",
            },
        ),
        World(
            KUNSERVE,
            "kunserve",
            "fleetserve.sim.kun",
            "a stack only this world has, or a config with kunserve.generator",
            ("dispatch", "batching", "pressure"),
            {
                "placement": "replicas of one model (static pipeline groups: burst.static_stages)",
                "layout": "per-instance token-layers",
                "migration": "none (pressure llumnix migrates KV, kunserve exchanges it)",
                "mechanism": "kv",
                "memory": "static (kunserve may start a spare instance)",
                "replacement": "none",
            },
        ),
    )
}
"""Every world, by name."""


@dataclass(frozen=True, slots=True)
class Stack:
    """One system: a registry name per policy family, and the worlds it runs in.

    The defaults are vLLM's choices.

    Attributes:
        name: the stack's name (``policy.stack``).
        description: one line on what it is.
        worlds: the worlds (:data:`WORLDS`) whose simulator runs it today.
        placement: where models go: ``dedicated``, ``muxserve``, ``seallm``.
        dispatch: which instance a request goes to.
        batching: the batching policy / group scheduler.
        layout: the KV layout of a GPU group.
        migration: the migration policy (``none``: no migration).
        mechanism: how a request migrates (``kv``, ``token``, ``adaptive``).
        memory: GPU-pool management; None resolves from the pool.
        replacement: SeaLLM's adaptive re-placement.
        burst: memory-pressure handling and its KunServe knobs.
    """

    name: str
    description: str
    worlds: tuple[str, ...]
    placement: str = "dedicated"
    dispatch: str = "round_robin"
    batching: str = "fcfs"
    layout: str = "partitioned"
    migration: str = "none"
    mechanism: str = "kv"
    memory: str | None = None
    replacement: bool = False
    burst: KunSettings = field(default_factory=KunSettings)

    def __post_init__(self) -> None:
        if not self.worlds or set(self.worlds) - set(WORLDS):
            raise ValueError(f"stack {self.name!r}: worlds must be among {sorted(WORLDS)}")

    @property
    def pressure(self) -> str:
        """The memory-pressure reaction (``burst.pressure``)."""
        return self.burst.pressure

    def families(self) -> dict[str, str | bool | None]:
        """The stack's choice per family (:data:`FAMILIES`), by family name."""
        return {f: getattr(self, f) for f in FAMILIES}

    def runs_in(self, world: str) -> bool:
        """Whether the simulator of ``world`` runs this stack today."""
        return world in self.worlds


_WS = (SINGLE,)
_WM = (MULTI,)
_WK = (KUNSERVE,)
_WF = "worst_fit"
_LL = "least_loaded"
_FR = "fewest_requests"


def _by_name(*stacks: Stack) -> dict[str, Stack]:
    """The stacks by name; a name given twice is a bug of this module."""
    out: dict[str, Stack] = {}
    for s in stacks:
        if s.name in out:
            raise ValueError(f"stack {s.name!r} defined twice")
        out[s.name] = s
    return out


STACKS: dict[str, Stack] = _by_name(
    # --- in several worlds: one meaning, every family -----------------------------
    Stack(
        "vllm",
        "vLLM: one model per GPU (group), round-robin dispatch, FCFS; several services "
        "split the GPUs by rate; under memory pressure new requests queue",
        (SINGLE, MULTI, KUNSERVE),
    ),
    Stack(
        "llumnix",
        "Llumnix: Worst-Fit dispatch, load balancing by live KV migration (Mell's LB); "
        "under memory pressure, live KV migration to spare instances",
        (SINGLE, KUNSERVE),
        dispatch=_WF,
        migration="llumnix",
        burst=KunSettings(pressure="llumnix"),
    ),
    # --- single-model (Mell's comparison) -----------------------------------------
    Stack(
        "bf",
        "Best-Fit dispatch on free KV memory, no migration (Mell §VIII)",
        _WS,
        dispatch="best_fit",
    ),
    Stack(
        "wf",
        "Worst-Fit dispatch on free KV memory, no migration (Mell §VIII); in the "
        "KunServe comparison, Llumnix's global load balancing: Llumnix (replication)",
        (SINGLE, KUNSERVE),
        dispatch=_WF,
    ),
    Stack("ll", "least-loaded dispatch (fewest requests), no migration", _WS, dispatch=_LL),
    Stack(
        "mell",
        "Mell: epoch-batched Fig. 10 packing with adaptive KV/token migration (Mell §V-VI)",
        _WS,
        dispatch="mell",
        migration="mell",
        mechanism="adaptive",
        memory="planned",
    ),
    # --- multi-LLM services (SeaLLM's and MuxServe's comparisons) -----------------
    Stack(
        "alpaserve",
        "AlpaServe: MuxServe's placement, temporal FCFS, unified KV cache",
        _WM,
        placement="muxserve",
        dispatch=_FR,
        layout="merged",
    ),
    Stack(
        "muxserve",
        "MuxServe: enumeration greedy placement, ADBS, head-wise KV blocks",
        _WM,
        placement="muxserve",
        dispatch=_FR,
        batching="adbs",
        layout="headwise",
    ),
    Stack(
        "muxserve-fcfs",
        "MuxServe's placement with FCFS",
        _WM,
        placement="muxserve",
        dispatch=_FR,
        layout="headwise",
    ),
    Stack(
        "muxserve-rr",
        "MuxServe's placement with round-robin",
        _WM,
        placement="muxserve",
        dispatch=_FR,
        batching="rr",
        layout="headwise",
    ),
    Stack(
        "seallm",
        "SeaLLM: search placement, DB scheduling, merged KV, adaptive replacement",
        _WM,
        placement="seallm",
        dispatch=_FR,
        batching="db",
        layout="merged",
        replacement=True,
    ),
    Stack(
        "seallm-fcfs",
        "SeaLLM-F: SeaLLM with FCFS",
        _WM,
        placement="seallm",
        dispatch=_FR,
        layout="merged",
        replacement=True,
    ),
    Stack(
        "seallm-mlfq",
        "SeaLLM-M: SeaLLM with skip-join MLFQ",
        _WM,
        placement="seallm",
        dispatch=_FR,
        batching="mlfq",
        layout="merged",
        replacement=True,
    ),
    Stack(
        "seallm-noplace",
        "SeaLLM-P: no placement algorithm (dedicated GPUs), DB scheduling",
        _WM,
        dispatch=_FR,
        batching="db",
        layout="merged",
    ),
    Stack(
        "seallm-norepl",
        "SeaLLM-A: placement found once, no adaptive replacement",
        _WM,
        placement="seallm",
        dispatch=_FR,
        batching="db",
        layout="merged",
    ),
    # --- composed: designs of several papers in one cluster -----------------------
    Stack(
        "seallm-adaptive",
        "SeaLLM whose re-placements move running requests with Mell's adaptive "
        "KV/token migration (Mell §V) instead of KV copies only",
        _WM,
        placement="seallm",
        dispatch=_FR,
        batching="db",
        layout="merged",
        replacement=True,
        mechanism="adaptive",
    ),
    Stack(
        "seallm-mell",
        "SeaLLM (search placement, DB, adaptive replacement) on Mell's elastic pool: "
        "idle sharing groups release their GPUs and reload when needed; re-placements "
        "move requests with Mell's adaptive KV/token migration",
        _WM,
        placement="seallm",
        dispatch=_FR,
        batching="db",
        layout="merged",
        replacement=True,
        mechanism="adaptive",
        memory="elastic",
    ),
    Stack(
        "muxserve-mell",
        "MuxServe (enumeration placement, ADBS, head-wise KV) on Mell's elastic pool: "
        "idle sharing groups release their GPUs and reload when needed",
        _WM,
        placement="muxserve",
        dispatch=_FR,
        batching="adbs",
        layout="headwise",
        memory="elastic",
    ),
    Stack(
        "fleet",
        "every design at once: SeaLLM's placement, DB scheduler and adaptive "
        "replacement, on Mell's elastic pool with its adaptive KV/token migration, "
        "and KunServe's parameter drop/restore among buddy groups under bursts "
        "(live KV exchange)",
        _WM,
        placement="seallm",
        dispatch=_FR,
        batching="db",
        layout="merged",
        replacement=True,
        mechanism="adaptive",
        memory="elastic",
        burst=KunSettings(pressure="kunserve"),
    ),
    # --- KunServe burst (KunServe's comparison) -----------------------------------
    Stack(
        "kv-drop",
        "replicas; drop running requests' KV (newest first) to admit queued ones, recompute",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="kv-drop"),
    ),
    Stack(
        "kv-swap",
        "replicas; swap running requests' KV to host one at a time over PCIe (vLLM swap)",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="kv-swap"),
    ),
    Stack(
        "pipeline",
        "static pipeline groups from the start (Llumnix (pipeline)); stages: static_stages",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="queue", static_stages=2),
    ),
    Stack(
        "kunserve",
        "KunServe: drop replicated layers into buddy groups, live KV exchange, live restore",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="kunserve"),
    ),
    Stack(
        "kunserve-blocking",
        "KunServe with blocking KV exchange (ablation)",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="kunserve", exchange="blocking"),
    ),
    Stack(
        "kunserve-norestore",
        "KunServe without live restore (ablation)",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="kunserve", live_restore=False),
    ),
    Stack(
        "kunserve-memgreedy",
        "KunServe with the memory-greedy planner (ablation)",
        _WK,
        dispatch=_WF,
        burst=KunSettings(pressure="kunserve", strategy="memory"),
    ),
)
"""Every stack, by name: the one catalog."""


def get_stack(name: str) -> Stack:
    """The stack called ``name``; a clear error suggesting close names."""
    try:
        return STACKS[name]
    except KeyError:
        raise UnknownNameError("stack", name, STACKS) from None


def stacks_in(world: str) -> dict[str, Stack]:
    """The stacks the simulator of ``world`` runs, by name (catalog order)."""
    return {n: s for n, s in STACKS.items() if world in s.worlds}


def stack_for(name: str, world: str) -> Stack:
    """The stack called ``name``, which must run in ``world``.

    Raises:
        UnknownNameError: not a stack (as :func:`get_stack`), or a stack of
            other worlds only (naming the stacks of ``world``, and the worlds
            the stack runs in).
    """
    stack = get_stack(name)
    if world in stack.worlds:
        return stack
    labels = " or ".join(WORLDS[w].label for w in stack.worlds)
    note = f"{name!r} is a {labels} stack; " + "; ".join(
        f"{WORLDS[w].label} runs: {WORLDS[w].selected_by}" for w in stack.worlds
    )
    raise UnknownNameError(f"{WORLDS[world].label} stack", name, stacks_in(world), note)


def kun_only(name: str) -> bool:
    """Whether ``name`` is a stack only the KunServe world runs (it selects that world)."""
    stack = STACKS.get(name)
    return stack is not None and stack.worlds == (KUNSERVE,)


def world_of(config: SimConfig) -> str:
    """The world a config runs in: :data:`MULTI` with ``services`` or
    ``multi.generator``; :data:`KUNSERVE` with a stack only that world has
    (``kunserve`` and its ablations, ``kv-drop``, ``kv-swap``, ``pipeline``)
    or with ``kunserve.generator`` (then ``vllm`` and ``llumnix`` run there
    too); :data:`SINGLE` otherwise."""
    if config.is_multi:
        return MULTI
    if kun_only(config.policy.stack) or config.kunserve.generator is not None:
        return KUNSERVE
    return SINGLE


_SINGLE_ONLY: dict[str, tuple[str, ...]] = {
    "migration": (
        "max_stages",
        "final_blocks",
        "copy_contention",
        "link_contention",
        "wait_for_room_s",
    ),
    "mell": (),  # every field
}
"""Config fields only the single-model simulator reads (() = the whole section)."""
_SINGLE_ONLY_WHY = {
    "migration": "its staged live KV migrations between instances",
    "mell": "Mell's online scheduler of one-model instances",
}


_KUN_OVERRIDES: tuple[str, ...] = tuple(f.name for f in fields(KunSettings))
"""``kunserve`` fields the multi-LLM world reads: those overriding a stack's
:class:`KunSettings` (KunServe's drop among sharing groups)."""
_WORLD_SECTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    SINGLE: {"multi": (), "fleet": (), "kunserve": ()},
    MULTI: {"kunserve": _KUN_OVERRIDES},
    KUNSERVE: {"multi": (), "fleet": ()},
}
"""Per world, the config sections it reads only part of: the fields it reads
(the others must keep their defaults, or the run would ignore them)."""


def _unread(config: SimConfig, world: str) -> str | None:
    """The first ``section.field`` set away from its default that ``world``
    does not read, or None."""
    for section, reads in _WORLD_SECTIONS[world].items():
        sec = getattr(config, section)
        base = type(sec)()
        for f in fields(sec):
            if f.name not in reads and getattr(sec, f.name) != getattr(base, f.name):
                return f"{section}.{f.name}"
    return None


def check_world(config: SimConfig) -> str:
    """:func:`world_of`, after checking the config can run in that world.

    Raises:
        ConfigError: a KunServe run without a fixed pool (``cluster.gpus``),
            prefix caching (``engine.prefix_caching``) outside the
            single-model world, chunked prefill (``engine.chunked_prefill``)
            in the KunServe world, ``cluster.tp`` in the multi-LLM world,
            the single-model world's migration stages and contention and
            ``mell.*`` settings elsewhere,
            or a per-family override (``policy.<family>``) of a family the
            world's simulator does not read (it would be ignored).
    """
    world = world_of(config)
    if world != SINGLE and config.cluster.links_overridden:
        raise ConfigError(
            "cluster.intra_node_bw / cluster.network_bw: only the single-model simulator "
            f"reads them (KV migrations); the {WORLDS[world].label} simulator would ignore them"
        )
    if world != SINGLE and config.cluster.activation_s:
        raise ConfigError(
            "cluster.activation_s: only the single-model simulator reads it; the "
            f"{WORLDS[world].label} simulator loads weights over the host link"
        )
    if world != SINGLE and config.engine.prefix_caching:
        raise ConfigError(
            "engine.prefix_caching: only the single-model simulator models prefix caching; "
            f"the {WORLDS[world].label} simulator would ignore it"
        )
    if world != SINGLE:
        for section, names in _SINGLE_ONLY.items():
            sec = getattr(config, section)
            base = type(sec)()
            for f in fields(sec):
                if names and f.name not in names:
                    continue
                if getattr(sec, f.name) != getattr(base, f.name):
                    raise ConfigError(
                        f"{section}.{f.name}: only the single-model simulator reads it "
                        f"({_SINGLE_ONLY_WHY[section]}); the {WORLDS[world].label} simulator "
                        "would ignore it"
                    )
    unread = _unread(config, world)
    if unread is not None:
        raise ConfigError(
            f"{unread}: the {WORLDS[world].label} simulator does not read it (the "
            f"{unread.split('.')[0]} section is for "
            + {"multi": "multi-LLM runs", "fleet": "fleet workloads (multi-LLM runs)"}.get(
                unread.split(".")[0], "KunServe runs"
            )
            + "); it would be ignored"
        )
    if world == MULTI and config.cluster.tp != 1:
        raise ConfigError(
            f"cluster.tp={config.cluster.tp}: the multi-LLM simulator's placement gives each "
            "group its tensor-parallel degree; restrict it with multi.tp_sizes (e.g. "
            f"[{config.cluster.tp}]) instead (cluster.tp would be ignored)"
        )
    if world == KUNSERVE and config.engine.chunked_prefill:
        raise ConfigError(
            "engine.chunked_prefill: the KunServe simulator does not model chunked prefill "
            "(its replicas and pipelines prefill whole prompts); it would ignore it"
        )
    if world == KUNSERVE and config.cluster.gpus is None:
        raise ConfigError(
            f"stack {config.policy.stack!r} runs a fixed pool of replicas: set cluster.gpus "
            "(or --gpus N)"
        )
    pol = config.policy
    w = WORLDS[world]
    for family in ("dispatch", "batching", "migration", "placement", "memory"):
        if getattr(pol, family) is not None and family not in w.reads:
            raise ConfigError(
                f"policy.{family}: the {w.label} simulator does not use this family "
                f"({w.fixed.get(family, 'fixed by its code')}); it reads "
                f"{', '.join(w.reads)}"
            )
    return world


def with_family_overrides(
    stack: Stack, *, batching: str | None = None, placement: str | None = None
) -> Stack:
    """A multi-LLM ``stack`` with the config's per-family overrides of its
    group scheduler (``policy.batching``) and placement (``policy.placement``)
    applied and checked, as :func:`resolve_policies` applies the single-model
    world's: the simulator and the runtime both read it.

    Raises:
        UnknownNameError: an unknown scheduler or placement (with suggestions).
    """
    from fleetserve.policy.group_placement import GROUP_PLACEMENTS

    b = batching or stack.batching
    p = placement or stack.placement
    BATCHING.get(b)
    if p not in GROUP_PLACEMENTS:
        raise UnknownNameError("placement", p, GROUP_PLACEMENTS)
    if (b, p) == (stack.batching, stack.placement):
        return stack
    return replace(stack, batching=b, placement=p)


def resolve_policies(config: SimConfig, *, groups: bool = False) -> dict[str, str]:
    """The policy name of every family (stack choices, then per-family overrides),
    each checked against its registry, plus the migration ``mechanism``
    (``migration.mechanism``, else the stack's).

    These are the single-model simulator's families (and the runtime
    controller's): the stack must run in the single-model world. Its batching
    policy must have a one-model case (FCFS, RR), or, with ``groups`` (the
    single-model simulator, which then runs one-model sharing groups), be a
    temporal group scheduler (MLFQ, DB).

    Raises:
        UnknownNameError: an unknown stack, policy or mechanism name (with suggestions).
        ConfigError: a batching policy the world cannot run.
    """
    pol = config.policy
    stack = stack_for(pol.stack, SINGLE)
    names = {
        "stack": stack.name,
        "dispatch": pol.dispatch or stack.dispatch,
        "batching": pol.batching or stack.batching,
        "migration": pol.migration or stack.migration,
        "placement": pol.placement or stack.placement,
        "memory": pol.memory or stack.memory or ("elastic" if config.cluster.elastic else "static"),
        "mechanism": config.migration.mechanism or stack.mechanism,
    }
    for fam, registry in (
        ("dispatch", DISPATCH),
        ("batching", BATCHING),
        ("migration", MIGRATION),
        ("placement", PLACEMENT),
        ("memory", MEMORY),
    ):
        registry.get(names[fam])
    sched = BATCHING.get(names["batching"])
    if groups and sched.spatial:
        temporal = [n for n in BATCHING.names() if not BATCHING.get(n).spatial]
        raise ConfigError(
            f"batching {names['batching']!r} runs prefill and decode jobs at once "
            "(spatial sharing, a multi-LLM stack's); the single-model world runs "
            f"{', '.join(temporal)}"
        )
    if not (groups and not sched.one_model):
        # a one-model instance must be able to run it; the single-model
        # simulator (``groups``) runs the temporal rest on one-model groups
        instance_batching(names["batching"])
    MECHANISM.get(names["mechanism"])
    return names
