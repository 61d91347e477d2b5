"""KunServe at runtime: real layer drops, pipelined buddy groups across workers,
restores, and a group that loses a member.

The controller and workers run in one event loop here (``LocalHandle``
stands in for a Ray actor handle: ``handle.method.remote(...)`` gives an
awaitable), so the merge, the pipeline and the recovery run exactly as in a
deployment without Ray's start-up cost; one server test runs through Ray.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest
from local_handle import LocalHandle

from fleetserve.cli.serve import serve_config_dict
from fleetserve.config import config_from_dict
from fleetserve.errors import ConfigError
from fleetserve.runtime import cluster
from fleetserve.runtime.controller import Controller
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.kun_control import SERVING
from fleetserve.runtime.worker import Worker

pytest.importorskip("ray")

MODEL = "tiny-llama-a"


def _config(serve: dict[str, Any] | None = None, **kun: Any) -> Any:
    """Two 15 MiB workers of the tiny model under ``kunserve`` (``serve`` and
    ``kun`` override keys of the ``serve:`` and ``kunserve:`` sections)."""
    data = {
        "serve": {
            "workers": 2,
            "gpu_memory_mb": 15,
            "models": [MODEL],
            "max_queue": 256,
            "max_running": 64,
            **(serve or {}),
        },
        "policy": {"stack": "kunserve"},
        "kunserve": {
            "monitor_interval_s": 0.05,
            "horizon_s": 0.5,
            "window_s": 0.5,
            "restore_min_s": 600,
            **kun,
        },
    }
    return config_from_dict(serve_config_dict(data))


async def _start(cfg: Any) -> tuple[Controller, list[LocalHandle]]:
    served = cluster.served_models(cfg)
    specs = cluster.worker_specs(cfg, served)
    handles = [LocalHandle(Worker(s)) for s in specs]
    snaps = {s.worker_id: await h.worker.start() for s, h in zip(specs, handles, strict=True)}
    ctl = Controller(
        cfg,
        {s.worker_id: (s, h) for s, h in zip(specs, handles, strict=True)},
        snaps,
        {i.name: i for i in served.values()},
    )
    await ctl.start()
    return ctl, handles


def _reference(prompts: list[list[int]], n: int, text: bool = False) -> list[Any]:
    """The engine's own greedy outputs (token ids, or texts) for ``prompts``."""
    got = _reference_once(tuple(tuple(ids) for ids in prompts), n, text)
    return [x if text else list(x) for x in got]


@functools.cache
def _reference_once(prompts: tuple[tuple[int, ...], ...], n: int, text: bool) -> tuple[Any, ...]:
    """:func:`_reference`, computed once per arguments (three tests compare
    with the same burst's outputs)."""
    from fleetserve.runtime.engine.engine import Engine

    eng = Engine([MODEL], 64 * 2**20)
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    rids = [eng.add_request(MODEL, list(ids), p) for ids in prompts]
    while eng.has_work():
        eng.step()
    return tuple(eng.requests[r].text if text else tuple(eng.requests[r].output_ids) for r in rids)


async def _collect(t: Any) -> tuple[list[int], str]:
    toks: list[int] = []
    while True:
        ev = await t.events.get()
        if ev[0] == "token":
            toks.append(ev[2])
        elif ev[0] == "done":
            return toks, ev[1]
        else:
            raise AssertionError(f"request {t.id} failed: {ev}")


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 5 for j in range(length)] for i in range(n)]


async def _burst(ctl: Controller, prompts: list[list[int]], n: int) -> list[Any]:
    p = SamplingParams(max_tokens=n, ignore_eos=True)
    return [ctl.submit(MODEL, ids, p) for ids in prompts]


def _groups(ctl: Controller) -> list[Any]:
    assert ctl.kun is not None
    return [e for e in ctl.kun.execs.values() if e.is_group]


async def _wait(cond: Any, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("exchange", ["live", "blocking"])
def test_burst_drops_layers_and_pipelines_exactly(
    exchange: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst larger than both replicas' KV: the policy merges them into a
    2-stage group, the workers really drop layers (pages join the KV pool),
    and every output equals the engine's greedy reference — the activations
    crossed between the two workers. Blocking: the running requests' KV is
    exchanged while they wait. Live: it stays on their origin worker, and
    the other stage's layers run their attention there (remote attention
    through the actors), so no request waits for a copy."""
    prompts = _prompts(24, 120)
    ref = _reference(prompts, 96)
    remote_calls = 0
    orig = Worker.stage_remote_attention

    async def counted(self: Worker, *a: Any) -> Any:
        nonlocal remote_calls
        remote_calls += 1
        return await orig(self, *a)

    async def main() -> None:
        ctl, handles = await _start(_config(exchange=exchange))
        try:
            cap0 = sum([(await h.worker.stage_pages())[1] for h in handles])
            ts = await _burst(ctl, prompts, 96)
            outs = await asyncio.gather(*(_collect(t) for t in ts))
            assert [o[0] for o in outs] == ref
            assert all(o[1] == "length" for o in outs)
            assert ctl.metrics.drops._value.get() >= 2
            groups = _groups(ctl)
            assert len(groups) == 1 and groups[0].phase == SERVING
            g = groups[0]
            # one complete copy of the parameters across the group's members
            held = [h.worker.core.engine.held_layers(MODEL) for h in handles]
            assert sorted(li for x in held for li in x) == list(range(4))
            assert [tuple(range(a, b)) for a, b in g.keep] == [tuple(x) for x in held]
            cap1 = sum([(await h.worker.stage_pages())[1] for h in handles])
            assert cap1 > cap0  # dropped weight pages became KV pages
            assert handles[0].worker.core.group is not None
            assert handles[0].worker.core.group.steps > 0
            assert ctl.kun is not None
            ev = [x for x in ctl.kun.log if x["event"] == "drop"]
            assert ev and ev[0]["layers_dropped"] == 4
            assert ev[0]["stall_s"] > 0  # the merge's pause, timed
            if exchange == "live":
                assert ev[0]["remote_attention"] >= 1 and ev[0]["kv_exchanged"] == 0
                assert remote_calls > 0
                # the victims' KV crossed while they decoded, then they flipped
                lead = handles[0].worker.core.group
                assert lead is not None and lead.flips >= 1, lead.flips if lead else None
            else:
                assert ev[0]["kv_exchanged"] >= 1 and ev[0]["remote_attention"] == 0
                assert remote_calls == 0
            for h in handles:  # through the actor: its engine thread may be stepping
                await h.worker.check_integrity()
            await _wait(lambda: all(not h.worker.core.stage_keys for h in handles))
        finally:
            await ctl.stop()

    monkeypatch.setattr(Worker, "stage_remote_attention", counted)
    asyncio.run(main())


def test_group_restores_when_demand_falls() -> None:
    """After the burst, demand stays low for ``restore_min_s``: the members
    reload their layers from the host copy and serve as replicas again."""
    prompts = _prompts(24, 120)

    async def main() -> None:
        ctl, handles = await _start(_config(restore_min_s=0.3))
        try:
            ts = await _burst(ctl, prompts, 96)
            await asyncio.gather(*(_collect(t) for t in ts))
            assert ctl.metrics.drops._value.get() >= 2
            await _wait(lambda: not _groups(ctl))
            assert ctl.metrics.restores._value.get() == ctl.metrics.drops._value.get()
            for h in handles:
                assert h.worker.core.engine.held_layers(MODEL) == [0, 1, 2, 3]
                assert h.worker.core.role is None
            # replicas serve again, with the engines' own steps
            small = _prompts(2, 10)
            ts = await _burst(ctl, small, 8)
            outs = await asyncio.gather(*(_collect(t) for t in ts))
            assert [o[0] for o in outs] == _reference(small, 8)
        finally:
            await ctl.stop()

    asyncio.run(main())


def test_live_restore_moves_running_requests_to_the_members() -> None:
    """A restore while the group still runs requests (live restore, the
    kunserve stack's default): once every member holds every layer again and
    each running request fits a member, the group stops at a step boundary;
    each request's KV is gathered from the stages on one member, and it
    decodes on there. Every output equals the greedy reference, each token
    once, and no page is left over."""
    prompts = _prompts(24, 120)
    lens = [40 + 13 * (i % 7) * 3 for i in range(len(prompts))]  # finishes spread out
    longest = _reference(prompts, max(lens))
    ref = [r[:n] for r, n in zip(longest, lens, strict=True)]

    async def main() -> None:
        ctl, handles = await _start(_config())
        try:
            ts = [
                ctl.submit(MODEL, ids, SamplingParams(max_tokens=n, ignore_eos=True))
                for ids, n in zip(prompts, lens, strict=True)
            ]
            tasks = [asyncio.ensure_future(_collect(t)) for t in ts]
            await _wait(lambda: bool(_groups(ctl)) and _groups(ctl)[0].phase == SERVING)
            await _wait(lambda: handles[0].worker.core.group.steps > 3)  # type: ignore[union-attr]
            g = _groups(ctl)[0]
            g.phase = "restoring"  # as a Restore action does (the policy would wait longer)
            outs = list(await asyncio.gather(*tasks))
            assert [o[0] for o in outs] == ref
            assert all(o[1] == "length" for o in outs)
            await _wait(lambda: not _groups(ctl))
            assert ctl.kun is not None
            ev = [x for x in ctl.kun.log if x["event"] == "restored"]
            assert ev and ev[0]["requests"] >= 1 and ev[0]["kv_moved"] >= 1, ctl.kun.log
            for h in handles:
                assert h.worker.core.engine.held_layers(MODEL) == [0, 1, 2, 3]
                assert h.worker.core.role is None and not h.worker.core.stage_keys
                await h.worker.check_integrity()
            await _wait(lambda: all(h.worker.core.engine.pool.kv_pages == 0 for h in handles))
        finally:
            await ctl.stop()

    asyncio.run(main())


async def _lose_member(
    ctl: Controller, handles: list[LocalHandle], prompts: list[list[int]], n: int
) -> tuple[Any, int, list[tuple[list[int], str]]]:
    """Burst ``prompts`` until a buddy group serves, kill its second stage
    mid-generation; return the group, the killed worker and every output."""
    ts = await _burst(ctl, prompts, n)
    tasks = [asyncio.ensure_future(_collect(t)) for t in ts]
    await _wait(lambda: bool(_groups(ctl)) and _groups(ctl)[0].phase == SERVING)
    await _wait(lambda: handles[0].worker.core.group.steps > 3)  # type: ignore[union-attr]
    g = _groups(ctl)[0]
    assert ctl.kun is not None
    victim = ctl.kun.wid_of[g.members[1]]
    await handles[victim].worker.stop()
    handles[victim].dead = True
    return g, victim, list(await asyncio.gather(*tasks))


def test_member_loss_recovers_from_host_copy() -> None:
    """A group's second stage dies mid-generation: the survivor leaves the
    group, reloads its dropped layers from the host copy, and every request
    finishes with the greedy reference's tokens, each exactly once."""
    prompts = _prompts(24, 120)
    ref = _reference(prompts, 96)

    async def main() -> None:
        ctl, handles = await _start(_config())
        try:
            g, _victim, outs = await _lose_member(ctl, handles, prompts, 96)
            assert [o[0] for o in outs] == ref
            survivor = handles[ctl.kun.wid_of[g.members[0]]]  # type: ignore[union-attr]
            assert survivor.worker.core.engine.held_layers(MODEL) == [0, 1, 2, 3]
            assert survivor.worker.core.role is None
            assert not _groups(ctl)
            assert ctl.metrics.restores._value.get() >= 2
            assert ctl.metrics.resumed._value.get() >= 1
            ev = [x for x in ctl.kun.log if x["event"] == "recovered"]  # type: ignore[union-attr]
            assert ev and ev[0]["dead"] == [g.members[1]]
        finally:
            await ctl.stop()

    asyncio.run(main())


def test_group_member_respawned_serves_again_as_a_replica() -> None:
    """A group's member dies and the controller respawns it (a fresh worker
    with every layer): every request finishes exactly as the greedy reference,
    and the respawned worker serves again (a replica after the group's
    recovery, or a member of a group the policy forms anew)."""
    prompts = _prompts(24, 120)
    ref = _reference(prompts, 96)

    async def main() -> None:
        ctl, handles = await _start(_config())
        respawned: list[int] = []

        async def respawn(spec: Any) -> tuple[Any, Any]:
            h = LocalHandle(Worker(spec))
            respawned.append(spec.worker_id)
            return h, await h.worker.start()

        ctl.respawn = respawn
        try:
            g, victim, outs = await _lose_member(ctl, handles, prompts, 96)
            assert [o[0] for o in outs] == ref
            assert ctl.kun is not None
            # back as a replica, or (the burst's requests resumed) in a new group
            vi = g.members[1]
            await _wait(lambda: ctl.workers[victim].alive and ctl.kun.exec_of(vi) is not None)
            assert respawned == [victim]
            assert ctl.metrics.worker_restarts.labels("done")._value.get() == 1
            assert ctl.kun.exec_of(vi).phase != "recovering"  # type: ignore[union-attr]
            assert any(x["event"] == "recovered" for x in ctl.kun.log)
            assert ctl.models_ready() == {MODEL: True}
        finally:
            await ctl.stop()

    asyncio.run(main())


def test_kun_baseline_stacks_are_refused() -> None:
    from dataclasses import replace

    from fleetserve.runtime.kun_control import kun_settings

    cfg = _config()
    bad = replace(cfg, policy=replace(cfg.policy, stack="kv-swap"))
    with pytest.raises(ConfigError, match="KunServe-simulator baseline"):
        kun_settings(bad)
    settings = kun_settings(cfg)
    assert settings is not None and settings.monitor_interval_s == 0.05


def test_kunserve_serves_one_model() -> None:
    data = {
        "serve": {"workers": 2, "gpu_memory_mb": 15, "models": [MODEL, "tiny-llama-b"]},
        "policy": {"stack": "kunserve"},
    }
    cfg = config_from_dict(serve_config_dict(data))
    with pytest.raises(ConfigError, match="one replicated model"):
        cluster.worker_specs(cfg, cluster.served_models(cfg))


def test_server_drops_are_in_metrics_and_texts_exact() -> None:
    """Through Ray and HTTP: a burst makes the policy drop layers (seen in
    /metrics and /v1/cluster), the running requests keep decoding with remote
    attention on their origin actor (the stack's live exchange), the
    activations cross between worker actors; once demand is low again the
    group restores while a few long requests still run (live restore: they
    move to the members), and every completion equals the engine's greedy
    text."""
    import httpx
    from serve_util import metric_value, running_server

    prompts = _prompts(24, 120)
    ref = _reference(prompts, 64, text=True)
    tail = _prompts(2, 40)
    ref_tail = _reference(tail, 600, text=True)
    data = {
        "serve": {"workers": 2, "gpu_memory_mb": 15, "models": [MODEL], "max_queue": 256},
        "policy": {"stack": "kunserve"},
        "kunserve": {
            "monitor_interval_s": 0.05,
            "horizon_s": 0.5,
            "window_s": 0.5,
            "restore_min_s": 0.3,
        },
    }

    def body(ids: list[int], n: int) -> dict[str, Any]:
        return {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": n,
            "ignore_eos": True,
            "temperature": 0,
        }

    with running_server(data) as srv:

        async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                burst = [c.post("/v1/completions", json=body(ids, 64)) for ids in prompts]
                # long requests that outlive the burst: still running at the restore
                late = [c.post("/v1/completions", json=body(ids, 600)) for ids in tail]
                rs = await asyncio.gather(*burst, *late)
                return [r.json() for r in rs[: len(burst)]], [r.json() for r in rs[len(burst) :]]

        bodies, long_bodies = asyncio.run(main())
        assert [b["choices"][0]["text"] for b in bodies] == ref
        assert [b["choices"][0]["text"] for b in long_bodies] == ref_tail
        metrics = httpx.get(srv.url + "/metrics").text
        assert metric_value(metrics, "fleetserve_layer_drops_total") >= 2
        assert metric_value(metrics, "fleetserve_kun_actions_total", action="DropLayers") >= 1
        assert metric_value(metrics, "fleetserve_kun_exchanged_requests_total", how="remote") >= 1
        assert metric_value(metrics, "fleetserve_kun_exchange_flips_total") >= 1
        assert metric_value(metrics, "fleetserve_kun_exchange_stall_seconds_count") >= 1
        cl = httpx.get(srv.url + "/v1/cluster").json()
        assert cl["policies"]["pressure"] == "kunserve"
        events = cl["kunserve"]["events"]
        assert any(ev["event"] == "drop" for ev in events)
        restored = [ev for ev in events if ev["event"] == "restored"]
        assert restored, events
        # the long requests were running: their KV moved to the members
        assert sum(ev.get("kv_moved", 0) for ev in restored) >= 1, restored
        assert metric_value(metrics, "fleetserve_layer_restores_total") >= 2
