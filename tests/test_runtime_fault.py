"""Worker failure and live migration on the real runtime.

A worker actor is killed mid-generation: its requests resume on the other
worker by re-prefill from the controller's record, and a streaming client
sees every token exactly once and a normal finish. Llumnix's migration plan
moves a request's real KV tensors between workers, live (copy stages while it
decodes, then a short stop-and-copy).
"""

from __future__ import annotations

import json

import httpx
import pytest
import ray
from serve_util import metric_value, reference_text, running_server

A = "tiny-llama-a"
pytestmark = pytest.mark.slow


def test_killed_worker_requests_resume_elsewhere_every_token_once() -> None:
    # the resume path alone: no respawn (test_server_hardening checks restarts)
    cfg = {
        "serve": {"workers": 2, "gpu_memory_mb": 32, "models": [A], "restart_workers": False},
        "policy": {"stack": "vllm"},
    }
    n = 400
    prompt = "The quick brown fox"
    with running_server(cfg) as srv:
        ctl = srv.controller
        body = {"model": A, "prompt": prompt, "max_tokens": n, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
        texts: list[str] = []
        finish = None
        usage = None
        killed = None
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                if not obj["choices"]:
                    continue
                texts.append(obj["choices"][0]["text"])
                finish = obj["choices"][0]["finish_reason"] or finish
                if killed is None and len(texts) == 20:
                    (t,) = [x for x in ctl.requests.values() if not x.done]
                    assert t.instance is not None
                    killed = ctl.inst_of[t.instance][0]
                    ray.kill(ctl.workers[killed].handle)
        assert killed is not None
        assert finish == "length"
        assert usage is not None and usage["completion_tokens"] == n
        # greedy decoding continues exactly after the re-prefill
        assert "".join(texts) == reference_text(A, prompt, n)
        metrics = httpx.get(srv.url + "/metrics").text
        assert metric_value(metrics, "fleetserve_worker_failures_total") == 1
        assert metric_value(metrics, "fleetserve_resumed_requests_total") == 1
        assert httpx.get(srv.url + "/health").json()["workers_alive"] == 1
        # new requests go to the surviving worker only
        r2 = httpx.post(
            srv.url + "/v1/completions",
            json={"model": A, "prompt": "again", "max_tokens": 5},
            timeout=60,
        )
        assert r2.status_code == 200


def test_llumnix_plan_moves_real_kv_between_workers() -> None:
    # Best-Fit dispatch packs every request onto worker 0 (the other stays
    # empty); as their KV grows, worker 0's freeness falls below Llumnix's
    # threshold and the plan moves a request, with its KV, to worker 1
    cfg = {
        "serve": {"workers": 2, "gpu_memory_mb": 13, "models": [A], "max_running": 8},
        "policy": {"stack": "llumnix", "dispatch": "best_fit"},
        "migration": {"epoch_s": 0.2},
    }
    n = 300
    with running_server(cfg) as srv:
        ctl = srv.controller
        url = srv.url + "/v1/completions"
        client = httpx.Client(timeout=120)
        streams = []
        for i in range(4):
            body = {"model": A, "prompt": f"request {i:02d} " + "w" * 8, "max_tokens": n}
            body |= {"ignore_eos": True, "stream": True, "temperature": 0}
            streams.append(client.send(client.build_request("POST", url, json=body), stream=True))
        texts = []
        for s in streams:
            text = ""
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    if obj.get("choices"):
                        text += obj["choices"][0]["text"]
            s.close()
            texts.append(text)
        client.close()
        metrics = httpx.get(srv.url + "/metrics").text
        moved = metric_value(metrics, "fleetserve_migrations_total", mode="kv", outcome="done")
        assert moved >= 1, ctl.migration_log
        assert metric_value(metrics, "fleetserve_migration_bytes_total") > 0
        # live: copy stages while it decoded, then one short stop per move
        assert metric_value(metrics, "fleetserve_migration_stages_total") >= 1
        stalls = metric_value(metrics, "fleetserve_migration_stall_seconds_count")
        assert stalls == moved
        # the budgets the adaptive mechanism would get are measured now
        bw, measured = ctl.transfer_bw()
        assert measured and bw > 0
        # a preempted (waiting) request moves by tokens; a running one with its KV
        kv = [x for x in ctl.migration_log if x["mode"] == "kv"]
        assert kv and (kv[0]["src"], kv[0]["dst"]) == (0, 1) and kv[0]["bytes"] > 0
        assert metric_value(metrics, "fleetserve_requests_total", outcome="finished") == 4
    # every request's greedy text is what the engine generates without moving
    for i, text in enumerate(texts):
        assert text == reference_text(A, f"request {i:02d} " + "w" * 8, n)
