"""The parity report: what each mechanism did on the runtime and in the simulator.

``fleetserve parity`` (:mod:`fleetserve.cli.parity`) replays one trace
against ``fleetserve serve`` and simulates the same requests on the same
emulated cluster (:mod:`fleetserve.experiments.parity_sim`). This module
turns what the two sides recorded into one row per mechanism::

    /metrics before ─┐
                     ├─ metrics_delta ──► MetricsSnapshot ─┐
    /metrics after ──┘                                      ├─ mechanism_rows ─► markdown
    simulated summary.json (+ its "mechanisms" section) ────┘

The runtime's column is the delta of its Prometheus counters over the
replay (:func:`parse_metrics`, :func:`metrics_delta`); the simulator's comes
from its ``summary.json``. A cell is None where that side has no such
mechanism for this config (or where a mean has nothing to average), with
the reason as a footnote: a missing mechanism never reads as a measured 0.

Where the two sides count differently (``docs/parity-report.md``):

* **Migrations.** The runtime counts finished moves by mode
  (``fleetserve_migrations_total{mode,outcome=done}``), the simulator its
  completed ones (``migrations.by_mode``); both count a queued request moved
  by tokens as a token move. Aborted: the runtime's ``outcome=aborted``, the
  simulator's planned or started moves that were aborted.
* **Stall.** The runtime times the pause of live KV migrations only
  (``fleetserve_migration_stall_seconds``); the simulator's records add the
  stall of token moves (detach to the next token) to that of KV moves, so
  its mean is shown only when it made no token move.
* **Activations** (elastic pool): the runtime's count of timed worker wakes
  (``fleetserve_worker_activation_seconds_count``) against the simulator's
  GPU activity intervals; releases: workers put back to sleep
  (``fleetserve_worker_sleeps_total``, only those idle when released)
  against intervals that ended before the run did.
* **KunServe.** The runtime counts the policy's decisions
  (``fleetserve_kun_actions_total{action}``) and the layers dropped and
  restored; the simulator counts the merges and restores it carried out
  (``memory.drops``, ``memory.restores``) and the requests whose KV it
  exchanged (``kunserve.victims.count``; the runtime's
  ``fleetserve_kun_exchanged_requests_total`` with ``how`` ``kv``, a blocking
  exchange, plus ``remote``, a live one's victims).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fleetserve.config import SimConfig
from fleetserve.errors import InputError
from fleetserve.experiments.fidelity import summary_value
from fleetserve.experiments.parity_sim import KUN_W, SHARING_W, SINGLE_W, ParityContext
from fleetserve.experiments.report_common import md_table

__all__ = [
    "MetricsSnapshot",
    "activation_line",
    "activation_mean",
    "mechanism_rows",
    "metrics_delta",
    "parity_markdown",
    "parse_metrics",
    "summary_markdown",
    "summary_rows",
    "with_measured_activation",
]

Sample = tuple[str, tuple[tuple[str, str], ...]]
"""A sample's name and its labels, sorted."""

_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Prometheus samples of one ``/metrics`` page (or the difference of two).

    Attributes:
        families: the metric families the page declares, with or without
            samples (a labelled counter nothing has incremented yet has none).
        samples: every sample's value, ``_created`` timestamps left out.
    """

    families: frozenset[str]
    samples: Mapping[Sample, float]

    def declares(self, name: str) -> bool:
        """Whether the sample ``name`` belongs to a declared family."""
        if name in self.families:
            return True
        return any(name.endswith(s) and name[: -len(s)] in self.families for s in _SUFFIXES)

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the samples ``name`` whose labels include ``labels``:
        0 when the family is declared without such a sample, None when the
        page does not declare it (a server without that metric)."""
        if not self.declares(name):
            return None
        want = set(labels.items())
        return float(
            sum(v for (n, lab), v in self.samples.items() if n == name and want <= set(lab))
        )


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse a Prometheus text page (``GET /metrics``).

    Raises:
        InputError: the text is not in the Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    families: set[str] = set()
    samples: dict[Sample, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):
                continue
            families.add(fam.name)
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = samples.get(key, 0.0) + float(s.value)
    except ValueError as exc:
        raise InputError(f"not a Prometheus metrics page: {exc}") from None
    return MetricsSnapshot(frozenset(families), samples)


def metrics_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> MetricsSnapshot:
    """``after - before`` for every sample of ``after`` (a sample new in
    ``after`` counts from 0); the families of ``after``. Meant for counters
    and histograms: a gauge's difference means little."""
    return MetricsSnapshot(
        after.families,
        {k: v - before.samples.get(k, 0.0) for k, v in after.samples.items()},
    )


def activation_mean(delta: MetricsSnapshot) -> tuple[float, int] | None:
    """The mean time of the elastic pool's worker activations
    (``fleetserve_worker_activation_seconds``: sum / count) in ``delta`` and
    their number; None without an activation."""
    return _hist_mean(delta, "fleetserve_worker_activation_seconds")


def _hist_mean(delta: MetricsSnapshot, name: str) -> tuple[float, int] | None:
    n = delta.value(name + "_count")
    total = delta.value(name + "_sum")
    if not n or total is None:
        return None
    return total / n, round(n)


# ---------------------------------------------------------------------- mechanisms


FIXED_POOL = (
    "a fixed pool: every worker serves from the start on both sides, none is activated or released"
)
NOT_KUN = "not a KunServe stack: no buddy groups on either side"
SIM_LAYERS = "the simulator counts the merges and restores it carried out, not layers"
SIM_SPARE = (
    "no spare instance on either side (the runtime has none); the simulator does not count "
    "the policy's decisions"
)
SIM_FAILURES = "the simulator models no worker failure: nothing resumes"
PREFIX_OFF = "engine.prefix_caching is off"
SIM_PREFIX = (
    "the simulator keys its prefix cache by the trace's block ids, which the replayed "
    "requests (requests.csv) do not carry"
)
SIM_PREFIX_WORLD = "only the single-model simulator models prefix caching"
NO_REPLACE = "the stack has no re-placement"
NOT_SHARING = "not a sharing stack: no placement of groups to redo"
NO_STALL = "no live KV migration timed: no mean"
SIM_STALL_MIXED = "the simulator's records add token moves' stall to KV moves': no KV-only mean"
SIM_STALL_SHARING = "the multi-LLM simulator records no stall per move"
NO_MIGRATION = "no migration: no mean"
NO_ACTIVATION = "no activation: no mean"
SIM_ACTIVATION_INPUT = (
    "an input of the simulation (cluster.activation_s), set from the runtime's mean"
)


def _get(summary: Mapping[str, Any], *path: str) -> float | None:
    return summary_value(summary, path)


def _row(
    key: str,
    label: str,
    unit: str,
    runtime: float | None,
    simulated: float | None,
    runtime_note: str | None = None,
    sim_note: str | None = None,
) -> dict[str, Any]:
    """One mechanism row; a side's value is None exactly when its note says why."""
    if runtime_note is not None:
        runtime = None
    if sim_note is not None:
        simulated = None
    return {
        "key": key,
        "mechanism": label,
        "unit": unit,
        "runtime": runtime,
        "simulated": simulated,
        "runtime_note": runtime_note if runtime is None else None,
        "sim_note": sim_note if simulated is None else None,
    }


def _missing(metric: str) -> str:
    return f"the server does not export {metric}"


def _rt(delta: MetricsSnapshot, name: str, **labels: str) -> tuple[float | None, str | None]:
    v = delta.value(name, **labels)
    return v, (None if v is not None else _missing(name))


def _rt_sum(
    delta: MetricsSnapshot, name: str, label: str, values: tuple[str, ...]
) -> tuple[float | None, str | None]:
    """:func:`_rt` summed over ``label`` taking ``values`` (those present)."""
    got = [v for v in (delta.value(name, **{label: x}) for x in values) if v is not None]
    return (sum(got), None) if got else (None, _missing(name))


def mechanism_rows(
    delta: MetricsSnapshot, sim: Mapping[str, Any], ctx: ParityContext
) -> list[dict[str, Any]]:
    """One row per mechanism: the runtime's count over the replay (``delta``)
    and the simulator's (``sim``, its ``summary.json``), or None with the
    reason (module docstring).

    Each row: ``key``, ``mechanism``, ``unit`` (``count``, ``bytes``,
    ``seconds``, ``tokens``), ``runtime``, ``simulated``, ``runtime_note``,
    ``sim_note``.
    """
    mech = sim.get("mechanisms") or {}
    rows: list[dict[str, Any]] = []

    def add(
        key: str,
        label: str,
        unit: str,
        rt: tuple[float | None, str | None],
        sm: tuple[float | None, str | None],
    ) -> None:
        rows.append(_row(key, label, unit, rt[0], sm[0], rt[1], sm[1]))

    add(
        "requests_finished",
        "requests finished",
        "count",
        _rt(delta, "fleetserve_requests_total", outcome="finished"),
        _sim_or(sim, "requests", "finished"),
    )
    # -- migrations
    add(
        "migrations_kv",
        "migrations, KV transfer (done)",
        "count",
        _rt(delta, "fleetserve_migrations_total", mode="kv", outcome="done"),
        _sim_or(sim, "migrations", "by_mode", "kv", "count"),
    )
    add(
        "migrations_token",
        "migrations, token re-prefill (done)",
        "count",
        _rt(delta, "fleetserve_migrations_total", mode="token", outcome="done"),
        _sim_or(sim, "migrations", "by_mode", "token", "count"),
    )
    add(
        "migrations_aborted",
        "migrations aborted",
        "count",
        _rt(delta, "fleetserve_migrations_total", outcome="aborted"),
        _sim_or(sim, "mechanisms", "migrations_aborted"),
    )
    add(
        "migration_bytes",
        "KV bytes migrated",
        "bytes",
        _rt(delta, "fleetserve_migration_bytes_total"),
        _sim_or(sim, "migrations", "by_mode", "kv", "bytes"),
    )
    add(
        "migration_stages",
        "live migration: copy stages before stop-and-copy",
        "count",
        _rt(delta, "fleetserve_migration_stages_total"),
        _sim_or(sim, "mechanisms", "migration_stages"),
    )
    rows.append(_stall_row(delta, sim, mech, ctx))
    # -- memory: preemption, elastic pool
    add(
        "preemptions",
        "preemptions (recompute)",
        "count",
        _rt(delta, "fleetserve_preemptions_total"),
        _sim_or(sim, "requests", "preemptions"),
    )
    rows += _elastic_rows(delta, sim, ctx)
    rows += _kun_rows(delta, sim, ctx)
    rows += _sharing_rows(delta, sim, ctx)
    rows += _prefix_rows(delta, sim, ctx)
    add(
        "resumed",
        "requests resumed after a worker failure",
        "count",
        _rt(delta, "fleetserve_resumed_requests_total"),
        (None, SIM_FAILURES),
    )
    return rows


def _stall_row(
    delta: MetricsSnapshot, sim: Mapping[str, Any], mech: Mapping[str, Any], ctx: ParityContext
) -> dict[str, Any]:
    name = "fleetserve_migration_stall_seconds"
    got = _hist_mean(delta, name)
    rt_note = None if got is not None else (NO_STALL if delta.declares(name) else _missing(name))
    n_kv = _get(sim, "migrations", "by_mode", "kv", "count") or 0.0
    n_tok = _get(sim, "migrations", "by_mode", "token", "count") or 0.0
    stall = _get(mech, "migration_stall_s")
    sim_v: float | None = None
    sim_note: str | None = None
    if ctx.world == SHARING_W:
        sim_note = SIM_STALL_SHARING
    elif n_tok:
        sim_note = SIM_STALL_MIXED
    elif not n_kv:
        sim_note = NO_MIGRATION
    elif stall is None:
        sim_note = "no mechanisms.migration_stall_s in the simulated summary"
    else:
        sim_v = stall / n_kv
    return _row(
        "migration_stall_mean",
        "live KV migration: stall per migration, mean",
        "seconds",
        None if got is None else got[0],
        sim_v,
        rt_note,
        sim_note,
    )


def _elastic_rows(
    delta: MetricsSnapshot, sim: Mapping[str, Any], ctx: ParityContext
) -> list[dict[str, Any]]:
    keys = (
        ("activations", "elastic pool: worker activations", "count"),
        (
            "activation_mean",
            "elastic pool: activation time, mean (simulator: its cluster.activation_s)",
            "seconds",
        ),
        ("releases", "elastic pool: workers released (put to sleep)", "count"),
    )
    if not ctx.elastic:
        return [_row(k, lab, u, None, None, FIXED_POOL, FIXED_POOL) for k, lab, u in keys]
    name = "fleetserve_worker_activation_seconds"
    got = _hist_mean(delta, name)
    n = delta.value(name + "_count")
    act_s = _get(sim, "config", "cluster", "activation_s")
    sleeps = delta.value("fleetserve_worker_sleeps_total")
    mech = sim.get("mechanisms") or {}
    return [
        _row(
            "activations",
            keys[0][1],
            "count",
            n,
            _get(mech, "activations"),
            None if n is not None else _missing(name),
            None if "activations" in mech else "no mechanisms.activations in the summary",
        ),
        _row(
            "activation_mean",
            keys[1][1],
            "seconds",
            None if got is None else got[0],
            act_s,
            None if got is not None else NO_ACTIVATION,
            None if act_s is not None else "no cluster.activation_s in the summary's config",
        ),
        _row(
            "releases",
            keys[2][1],
            "count",
            sleeps,
            _get(mech, "releases"),
            None if sleeps is not None else _missing("fleetserve_worker_sleeps_total"),
            None if "releases" in mech else "no mechanisms.releases in the summary",
        ),
    ]


def _kun_rows(
    delta: MetricsSnapshot, sim: Mapping[str, Any], ctx: ParityContext
) -> list[dict[str, Any]]:
    keys = (
        ("kun_merges", "KunServe: buddy-group merges (DropLayers)", "count"),
        ("kun_restores", "KunServe: group restores (Restore)", "count"),
        ("layers_dropped", "KunServe: layers dropped", "count"),
        ("layers_restored", "KunServe: layers restored", "count"),
        ("kv_exchanged", "KunServe: requests whose KV was exchanged at a merge", "count"),
        ("activate_spare", "KunServe: ActivateSpare decisions", "count"),
    )
    if ctx.world != KUN_W:
        return [_row(k, lab, u, None, None, NOT_KUN, NOT_KUN) for k, lab, u in keys]
    kun = "fleetserve_kun_actions_total"
    values: list[tuple[tuple[float | None, str | None], tuple[float | None, str | None]]] = [
        (_rt(delta, kun, action="DropLayers"), _sim_or(sim, "memory", "drops")),
        (_rt(delta, kun, action="Restore"), _sim_or(sim, "memory", "restores")),
        (_rt(delta, "fleetserve_layer_drops_total"), (None, SIM_LAYERS)),
        (_rt(delta, "fleetserve_layer_restores_total"), (None, SIM_LAYERS)),
        (
            _rt_sum(delta, "fleetserve_kun_exchanged_requests_total", "how", ("kv", "remote")),
            _sim_or(sim, "kunserve", "victims", "count"),
        ),
        (_rt(delta, kun, action="ActivateSpare"), (None, SIM_SPARE)),
    ]
    return [
        _row(k, lab, u, rt[0], sm[0], rt[1], sm[1])
        for (k, lab, u), (rt, sm) in zip(keys, values, strict=True)
    ]


def _sim_or(sim: Mapping[str, Any], *path: str) -> tuple[float | None, str | None]:
    v = _get(sim, *path)
    return v, (None if v is not None else f"no {'.'.join(path)} in the simulated summary")


def _sharing_rows(
    delta: MetricsSnapshot, sim: Mapping[str, Any], ctx: ParityContext
) -> list[dict[str, Any]]:
    keys = (
        ("replacement_searches", "SeaLLM: re-placement searches", "replacements"),
        ("replacements", "SeaLLM: re-placements that switched the plan", "switches"),
    )
    if ctx.world != SHARING_W or not ctx.replacement:
        why = NOT_SHARING if ctx.world != SHARING_W else NO_REPLACE
        return [_row(k, lab, "count", None, None, why, why) for k, lab, _ in keys]
    out = []
    for (k, lab, field), labels in zip(keys, ({}, {"outcome": "switched"}), strict=True):
        rt, rt_note = _rt(delta, "fleetserve_replacements_total", **labels)
        sm, sm_note = _sim_or(sim, "replacement", field)
        out.append(_row(k, lab, "count", rt, sm, rt_note, sm_note))
    return out


def _prefix_rows(
    delta: MetricsSnapshot, sim: Mapping[str, Any], ctx: ParityContext
) -> list[dict[str, Any]]:
    keys = (
        ("prefix_prompt_tokens", "prefix caching: prompt tokens admitted", "tokens"),
        ("prefix_hit_tokens", "prefix caching: prompt tokens read from the cache", "tokens"),
    )
    if not ctx.prefix_caching:
        return [_row(k, lab, u, None, None, PREFIX_OFF, PREFIX_OFF) for k, lab, u in keys]
    sim_note = SIM_PREFIX if ctx.world == SINGLE_W else SIM_PREFIX_WORLD
    out = []
    for (k, lab, u), kind in zip(keys, ("prompt", "hit"), strict=True):
        v, note = _rt(delta, "fleetserve_prefix_cache_tokens_total", kind=kind)
        out.append(_row(k, lab, u, v, None, note, sim_note))
    return out


# ------------------------------------------------------------------------ tables


def fmt_value(v: float | None, unit: str) -> str:
    """A cell: ``—`` for None, counts as integers, seconds to 4 significant digits."""
    if v is None:
        return "—"
    if unit == "seconds":
        return f"{v:.4g}"
    if math.isfinite(v) and v == int(v):
        return f"{int(v):,}"
    return f"{v:,.1f}"


def footnoted(rows: Sequence[Mapping[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """The rows' cells (mechanism, runtime, simulator) with footnote marks,
    and the footnotes (each reason once, numbered in order of use)."""
    notes: list[str] = []

    def cell(v: float | None, note: str | None, unit: str) -> str:
        text = fmt_value(v, unit)
        if note is None:
            return text
        if note not in notes:
            notes.append(note)
        return f"{text} [{notes.index(note) + 1}]"

    body = [
        [
            r["mechanism"] + ("" if r["unit"] in ("count",) else f" ({r['unit']})"),
            cell(r["runtime"], r["runtime_note"], r["unit"]),
            cell(r["simulated"], r["sim_note"], r["unit"]),
        ]
        for r in rows
    ]
    return body, notes


def parity_markdown(stack: Mapping[str, Any], latency_md: str) -> str:
    """One stack's section of ``parity.md``: its mechanisms table with
    footnotes, then the latency table (``latency_md``, fidelity's)."""
    body, notes = footnoted(stack["rows"])
    lines = [f"## Stack `{stack['stack']}` ({stack['world']} world)", ""]
    lines += [f"- {x}" for x in stack["about"]]
    lines += [
        "",
        *md_table(("mechanism", "runtime (/metrics delta)", "simulator (summary.json)"), body),
        "",
    ]
    lines += [f"[{i}] {n}" + "  " for i, n in enumerate(notes, 1)]
    lines += ["", latency_md.replace("## ", "### ", 1), ""]
    return "\n".join(lines)


_SUMMARY_KEYS = (
    ("requests_finished", "finished"),
    ("migrations_kv", "KV migrations"),
    ("migrations_token", "token migrations"),
    ("preemptions", "preemptions"),
    ("activations", "activations"),
    ("kun_merges", "KunServe merges"),
    ("kun_restores", "KunServe restores"),
)
_SUMMARY_LATENCY = (("TTFT mean", "TTFT mean (s)"), ("TPOT mean", "TPOT mean (s)"))


def summary_rows(stacks: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The table over stacks: per stack, ``runtime / simulator`` of the main
    mechanisms and ``measured / simulated`` mean TTFT and TPOT."""
    header = ["stack", "world"] + [h for _, h in _SUMMARY_KEYS] + [h for _, h in _SUMMARY_LATENCY]
    body = []
    for st in stacks:
        by_key = {r["key"]: r for r in st.get("rows") or ()}
        lat = {r["metric"]: r for r in st.get("latency") or ()}
        cells = [st["stack"], st["world"]]
        for key, _ in _SUMMARY_KEYS:
            r = by_key.get(key)
            cells.append(
                "—"
                if r is None
                else f"{fmt_value(r['runtime'], r['unit'])} / "
                f"{fmt_value(r['simulated'], r['unit'])}"
            )
        for metric, _ in _SUMMARY_LATENCY:
            lr = lat.get(metric)
            cells.append(
                "—"
                if lr is None
                else f"{fmt_value(lr['measured'], 'seconds')} / "
                f"{fmt_value(lr['simulated'], 'seconds')}"
            )
        body.append(cells)
    return header, body


def summary_markdown(stacks: Sequence[Mapping[str, Any]]) -> str:
    """``parity.md``'s table over stacks (:func:`summary_rows`)."""
    header, body = summary_rows(stacks)
    return "\n".join(
        [
            "## Summary over stacks",
            "",
            "Each cell: runtime / simulator (mechanisms), measured / simulated (latency). "
            "`—`: that side has no such mechanism here (see the stack's footnotes).",
            "",
            *md_table(header, body),
            "",
        ]
    )


def with_measured_activation(
    cfg: SimConfig, delta: MetricsSnapshot | None
) -> tuple[SimConfig, dict[str, Any]]:
    """``cfg`` with ``cluster.activation_s`` set to the runtime's mean worker
    activation over ``delta`` (:func:`activation_mean`) when its pool is
    elastic, and what was used, for the report: ``activation_s``,
    ``activations`` (how many the mean is over) and ``source``.

    A fixed pool activates nothing (the config is returned as it is); an
    elastic pool without a measured activation keeps the config's value.
    """
    cl = cfg.cluster
    if not cl.elastic:
        return cfg, {"activation_s": cl.activation_s, "activations": 0, "source": "fixed pool"}
    got = None if delta is None else activation_mean(delta)
    if got is None:
        why = "no /metrics scrapes" if delta is None else "no activation during the replay"
        return cfg, {
            "activation_s": cl.activation_s,
            "activations": 0,
            "source": f"the config's ({why})",
        }
    mean, n = got
    return replace(cfg, cluster=replace(cl, activation_s=mean)), {
        "activation_s": mean,
        "activations": n,
        "source": "the runtime's mean (fleetserve_worker_activation_seconds over the replay)",
    }


def activation_line(info: Mapping[str, Any]) -> str:
    """One sentence on the ``cluster.activation_s`` a simulation used."""
    if info["source"] == "fixed pool":
        return "cluster.activation_s: not used (a fixed pool activates nothing)."
    return (
        f"cluster.activation_s = {info['activation_s']:.4g} s: {info['source']}"
        + (f", {info['activations']} activation(s)" if info["activations"] else "")
        + "."
    )
