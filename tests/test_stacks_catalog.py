"""The one stack catalog (issue 21, item 4): every stack once, every family
name known to its registry, each world reading what its old table said, and
``fleetserve stacks``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetserve.cli.main import main
from fleetserve.config import SimConfig, config_from_dict
from fleetserve.errors import ConfigError, UnknownNameError
from fleetserve.policy import BATCHING, DISPATCH, MECHANISM, MEMORY, MIGRATION, PLACEMENT
from fleetserve.policy.catalog import (
    FAMILIES,
    KUNSERVE,
    MULTI,
    SINGLE,
    STACKS,
    WORLDS,
    Stack,
    check_world,
    get_stack,
    kun_only,
    resolve_policies,
    stack_for,
    stacks_in,
    world_of,
)
from fleetserve.policy.group_placement import GROUP_PLACEMENTS
from fleetserve.policy.pressure import PRESSURES, KunSettings
from fleetserve.sim.kvlayout import LAYOUTS

# The three tables before the catalog, copied from policy/stacks.py,
# policy/multi_stacks.py and sim/kun_parts.py at 4a3d92e.
OLD_SINGLE: dict[str, dict[str, Any]] = {
    # dispatch, batching, migration, placement, memory, mechanism
    "vllm": dict(dispatch="round_robin"),
    "bf": dict(dispatch="best_fit"),
    "wf": dict(dispatch="worst_fit"),
    "ll": dict(dispatch="least_loaded"),
    "llumnix": dict(dispatch="worst_fit", migration="llumnix", mechanism="kv"),
    "mell": dict(dispatch="mell", migration="mell", memory="planned", mechanism="adaptive"),
}
OLD_SINGLE_DEFAULTS = dict(
    batching="fcfs", migration="none", placement="dedicated", memory=None, mechanism="kv"
)
OLD_MULTI: dict[str, tuple[str, str, str, bool, str]] = {
    # placement, scheduler, layout, replacement, description (it is in summary.json)
    "vllm": (
        "dedicated",
        "fcfs",
        "partitioned",
        False,
        "vLLM: GPUs split among services by rate, FCFS",
    ),
    "alpaserve": (
        "muxserve",
        "fcfs",
        "merged",
        False,
        "AlpaServe: MuxServe's placement, temporal FCFS, unified KV cache",
    ),
    "muxserve": (
        "muxserve",
        "adbs",
        "headwise",
        False,
        "MuxServe: enumeration greedy placement, ADBS, head-wise KV blocks",
    ),
    "seallm": (
        "seallm",
        "db",
        "merged",
        True,
        "SeaLLM: search placement, DB scheduling, merged KV, adaptive replacement",
    ),
    "seallm-fcfs": ("seallm", "fcfs", "merged", True, "SeaLLM-F: SeaLLM with FCFS"),
    "seallm-mlfq": ("seallm", "mlfq", "merged", True, "SeaLLM-M: SeaLLM with skip-join MLFQ"),
    "seallm-noplace": (
        "dedicated",
        "db",
        "merged",
        False,
        "SeaLLM-P: no placement algorithm (dedicated GPUs), DB scheduling",
    ),
    "seallm-norepl": (
        "seallm",
        "db",
        "merged",
        False,
        "SeaLLM-A: placement found once, no adaptive replacement",
    ),
    "muxserve-fcfs": ("muxserve", "fcfs", "headwise", False, "MuxServe's placement with FCFS"),
    "muxserve-rr": ("muxserve", "rr", "headwise", False, "MuxServe's placement with round-robin"),
}
OLD_KUN: dict[str, KunSettings] = {
    "vllm": KunSettings(pressure="queue"),
    "kv-drop": KunSettings(pressure="kv-drop"),
    "kv-swap": KunSettings(pressure="kv-swap"),
    "llumnix": KunSettings(pressure="llumnix"),
    "pipeline": KunSettings(pressure="queue", static_stages=2),
    "kunserve": KunSettings(pressure="kunserve"),
    "kunserve-blocking": KunSettings(pressure="kunserve", exchange="blocking"),
    "kunserve-norestore": KunSettings(pressure="kunserve", live_restore=False),
    "kunserve-memgreedy": KunSettings(pressure="kunserve", strategy="memory"),
}


def _cfg(stack: str, **extra: Any) -> SimConfig:
    return config_from_dict({"policy": {"stack": stack}, **extra})


# ------------------------------------------------------------------------- the table
def test_every_name_of_the_three_old_tables_is_one_stack() -> None:
    old = [*OLD_SINGLE, *OLD_MULTI, *OLD_KUN]
    # stacks composed from several papers since
    composed = {"seallm-adaptive", "seallm-mell", "muxserve-mell", "fleet"}
    assert set(STACKS) == set(old) | composed
    assert len(STACKS) == len(set(old)) + len(composed) == 26
    assert all(name == s.name for name, s in STACKS.items())
    # the names in several tables are one entry each, in every world they were in
    assert get_stack("vllm").worlds == (SINGLE, MULTI, KUNSERVE)
    assert get_stack("llumnix").worlds == (SINGLE, KUNSERVE)
    assert set(stacks_in(SINGLE)) == set(OLD_SINGLE)
    assert set(stacks_in(MULTI)) == set(OLD_MULTI) | composed
    # the KunServe world also runs wf: its old "vllm" (Llumnix (replication)) was
    # Worst-Fit dispatch with pressure queue, which is wf; vllm there now
    # dispatches round-robin, as everywhere
    assert set(stacks_in(KUNSERVE)) == set(OLD_KUN) | {"wf"}
    wf = get_stack("wf")
    assert wf.dispatch == "worst_fit" and wf.burst == OLD_KUN["vllm"]
    assert get_stack("vllm").dispatch == "round_robin"
    assert all(s.dispatch == "worst_fit" for n, s in stacks_in(KUNSERVE).items() if n != "vllm")


def test_a_name_twice_or_an_unknown_world_is_refused() -> None:
    from fleetserve.policy import catalog

    s = Stack("x", "x", (SINGLE,))
    with pytest.raises(ValueError, match="twice"):
        catalog._by_name(s, s)
    with pytest.raises(ValueError, match="worlds"):
        Stack("y", "y", ("elsewhere",))
    with pytest.raises(ValueError, match="worlds"):
        Stack("z", "z", ())


@pytest.mark.parametrize("name", list(STACKS))
def test_every_family_name_resolves_in_its_registry(name: str) -> None:
    s = STACKS[name]
    assert set(s.families()) == set(FAMILIES)
    assert s.placement in (*PLACEMENT.names(), *GROUP_PLACEMENTS)
    DISPATCH.get(s.dispatch)
    BATCHING.get(s.batching)  # one registry for every world
    assert s.layout in LAYOUTS
    MIGRATION.get(s.migration)
    MECHANISM.get(s.mechanism)
    assert s.memory is None or s.memory in MEMORY.names()
    assert s.pressure in PRESSURES and s.pressure == s.burst.pressure
    # and in the registries of the worlds that run it
    if s.runs_in(SINGLE):
        names = resolve_policies(_cfg(name))
        assert {k: names[k] for k in ("dispatch", "batching", "migration", "placement")} == {
            "dispatch": s.dispatch,
            "batching": s.batching,
            "migration": s.migration,
            "placement": s.placement,
        }
    if s.runs_in(MULTI):
        assert s.placement in GROUP_PLACEMENTS
    if s.runs_in(SINGLE) or s.runs_in(KUNSERVE):
        assert BATCHING.get(s.batching).one_model
    for w in s.worlds:
        assert set(WORLDS[w].reads) | set(WORLDS[w].fixed) == set(FAMILIES), w


# ------------------------------------------------------- the old settings, reproduced
@pytest.mark.parametrize("name", list(OLD_SINGLE))
def test_single_model_settings_are_the_old_tables(name: str) -> None:
    s = stack_for(name, SINGLE)
    want = {**OLD_SINGLE_DEFAULTS, **OLD_SINGLE[name]}
    assert {k: getattr(s, k) for k in want} == want
    for elastic, pool in ((True, "elastic"), (False, "static")):
        cluster = {"elastic": elastic} if elastic else {"elastic": False, "gpus": 4}
        names = resolve_policies(_cfg(name, cluster=cluster))
        assert names == {
            "stack": name,
            **{k: v for k, v in want.items() if k != "memory"},
            "memory": want["memory"] or pool,
        }


@pytest.mark.parametrize("name", list(OLD_MULTI))
def test_multi_llm_settings_are_the_old_tables(name: str) -> None:
    from fleetserve.sim.multi_run import MultiRunSettings

    s = stack_for(name, MULTI)
    old = OLD_MULTI[name]
    assert (s.placement, s.batching, s.layout, s.replacement) == old[:4]
    # descriptions are the old ones, but vllm's, which now says what it is in every world
    assert s.description == old[4] or name == "vllm"
    mc = MultiRunSettings().multi_config(s)
    assert (mc.scheduler, mc.layout) == (s.batching, s.layout)


@pytest.mark.parametrize("name", list(OLD_KUN))
def test_kunserve_settings_are_the_old_tables(name: str) -> None:
    from fleetserve.sim.kun_run import kun_settings

    assert stack_for(name, KUNSERVE).burst == OLD_KUN[name]
    cfg = _cfg(name, cluster={"elastic": False, "gpus": 4}, kunserve={"generator": "bursty"})
    assert world_of(cfg) == KUNSERVE
    assert kun_settings(cfg) == OLD_KUN[name]


# ----------------------------------------------------------------- worlds and errors
def test_the_world_of_a_config() -> None:
    assert world_of(_cfg("vllm")) == SINGLE
    assert world_of(_cfg("llumnix")) == SINGLE
    assert world_of(_cfg("kunserve", cluster={"gpus": 4})) == KUNSERVE
    assert world_of(_cfg("vllm", kunserve={"generator": "bursty"})) == KUNSERVE
    multi = _cfg("vllm", cluster={"gpus": 4}, services=[{"name": "a", "model": "llama-2-7b"}])
    assert world_of(multi) == MULTI
    assert [n for n in STACKS if kun_only(n)] == [
        n for n in OLD_KUN if n not in OLD_SINGLE and n not in OLD_MULTI
    ]
    assert not kun_only("nosuch")


def test_unknown_stack_suggests_close_names() -> None:
    with pytest.raises(
        UnknownNameError, match=r"unknown stack 'kunserv'.*Did you mean.*'kunserve'"
    ):
        get_stack("kunserv")
    with pytest.raises(UnknownNameError, match=r"Did you mean.*'seallm'"):
        stack_for("sealm", MULTI)
    # a stack of another world: the world's names, and where it does run
    with pytest.raises(UnknownNameError, match=r"single-model stack 'muxserve'.*multi-LLM"):
        resolve_policies(_cfg("muxserve"))
    with pytest.raises(UnknownNameError, match=r"multi-LLM stack 'bf'.*single-model"):
        stack_for("bf", MULTI)
    with pytest.raises(UnknownNameError, match="kunserve stack 'mell'"):
        stack_for("mell", KUNSERVE)


def test_simulate_unknown_stack_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    from test_cli import assert_one_line_error, run_cli

    rc, out, err = run_cli(capsys, "simulate", "--stack", "vlm", "--out", tmp_path / "o")
    assert_one_line_error(rc, out, err, "'vlm'", "Did you mean 'vllm'")


# ------------------------------------------------------------------ fleetserve stacks
@pytest.mark.parametrize("columns", ["80", "250"])
def test_fleetserve_stacks_lists_every_stack(
    columns: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    capsys.readouterr()
    assert main(["stacks"]) == 0
    out = capsys.readouterr().out
    for name, s in STACKS.items():
        assert name in out and s.dispatch in out
    for world in WORLDS:
        assert world in out
    assert "exchange=blocking" in out and "static_stages=2" in out
    if columns == "250":  # a column per family
        assert all(f in out for f in FAMILIES)


def test_fleetserve_stacks_json(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["stacks", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in data["stacks"]] == list(STACKS)
    assert data["families"] == list(FAMILIES)
    assert {w["name"] for w in data["worlds"]} == set(WORLDS)
    for rec in data["stacks"]:
        s = STACKS[rec["name"]]
        assert {f: rec[f] for f in FAMILIES} == s.families()
        assert rec["worlds"] == list(s.worlds)
        assert KunSettings(**rec["burst"]) == s.burst


@pytest.mark.parametrize(
    ("extra", "family"),
    [
        ({"policy": {"stack": "kunserve", "migration": "llumnix"}}, "migration"),
        ({"policy": {"stack": "kunserve", "placement": "dedicated"}}, "placement"),
        (
            {"policy": {"stack": "seallm", "migration": "mell"}, "multi": {"generator": "seallm"}},
            "migration",
        ),
    ],
)
def test_an_override_a_world_does_not_read_is_an_error_not_ignored(
    extra: dict[str, Any], family: str
) -> None:
    cfg = config_from_dict({"cluster": {"gpus": 4}, **extra})
    with pytest.raises(ConfigError, match=f"policy.{family}"):
        check_world(cfg)


def test_overrides_a_world_reads_pass() -> None:
    cfg = config_from_dict(
        {"cluster": {"gpus": 4}, "policy": {"stack": "kunserve", "dispatch": "round_robin"}}
    )
    assert check_world(cfg) == KUNSERVE
    cfg = config_from_dict(
        {
            "cluster": {"gpus": 4},
            "policy": {"stack": "seallm", "dispatch": "round_robin"},
            "multi": {"generator": "seallm"},
        }
    )
    assert check_world(cfg) == MULTI
