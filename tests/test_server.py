"""The OpenAI-compatible server on a real runtime (Ray workers on the CPU).

Tested as a user would: with the official ``openai`` client, plus raw HTTP
for what the client hides (status codes, headers, SSE framing).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serve_util import Running, metric_value, reference_text, running_server

A, B = "tiny-llama-a", "tiny-llama-b"
KEY = "test-key-123"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def step_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("steps") / "steps.jsonl"


@pytest.fixture(scope="module")
def hop_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hops") / "hops.jsonl"


@pytest.fixture(scope="module")
def srv(step_log: Path, hop_log: Path) -> Iterator[Running]:
    cfg = {
        "serve": {
            "workers": 3,
            "gpu_memory_mb": 48,
            "models": [A, B],
            "max_queue": 64,
            "step_log": str(step_log),
            "hop_log": str(hop_log),  # every token's hops measured (runtime.hops)
        },
        "policy": {"stack": "wf"},
    }
    with running_server(cfg, api_key=KEY) as r:
        yield r


@pytest.fixture(scope="module")
def client(srv: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_both_served_models(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert ids == {A, B}


def test_completion_matches_the_engine_and_reports_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=A, prompt="Hello there", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == reference_text(A, "Hello there", 12)
    assert r.usage is not None
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len("Hello there") + 1  # bytes + BOS


def test_streaming_completion_equals_the_non_streaming_one(client: openai.OpenAI) -> None:
    kw = {"model": B, "prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 0}
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_chat_streaming_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=A, messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model=A,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


def test_continuous_usage_stats_gives_every_token_a_chunk(srv: Running) -> None:
    """vLLM's ``continuous_usage_stats``: one chunk per token, counting; the
    plain stream has one chunk per token too (an empty text while a character's
    bytes are incomplete), and the same text."""
    body = {
        "model": A,
        "prompt": [200, 201, 202],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }

    def chunks(b: dict[str, object]) -> list[dict[str, object]]:
        url = srv.url + "/v1/completions"
        with httpx.stream("POST", url, json=b, headers=_auth(), timeout=60) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(ln[6:]) for ln in lines[:-1]]

    every = chunks(body)
    tokens = [c for c in every if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert [c["usage"]["completion_tokens"] for c in tokens] == list(range(1, 25))
    final = [c for c in every if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["usage"]["completion_tokens"] == 24
    assert every[-1]["choices"] == [] and every[-1]["usage"]["completion_tokens"] == 24
    plain = chunks({**body, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["text"] for c in every if c["choices"])
    assert text == "".join(c["choices"][0]["text"] for c in plain if c["choices"])
    assert text == reference_text(A, [200, 201, 202], 24)
    plain_tokens = [c for c in plain if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(plain_tokens) == 24  # a chunk per token, as vLLM streams
    assert any(c["choices"][0]["text"] == "" for c in plain_tokens)  # bytes held back


def test_sse_framing_ends_with_done(srv: Running) -> None:
    body = {"model": A, "prompt": "x", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", srv.url + "/v1/completions", json=body, headers=_auth(), timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert sum(1 for ln in lines[:-1] if json.loads(ln[6:])["choices"][0]["text"]) >= 1


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _error(r: httpx.Response) -> dict[str, object]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


def test_errors_have_openai_bodies_and_statuses(srv: Running, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    url = srv.url + "/v1/completions"
    r = httpx.post(url, content=b"{not json", headers=_auth())
    assert r.status_code == 400 and "not valid JSON" in str(_error(r)["message"])
    r = httpx.post(url, json={"prompt": "x"}, headers=_auth())
    assert r.status_code == 400 and _error(r)["param"] == "model"
    r = httpx.post(url, json={"model": A, "prompt": "x", "max_tokens": 0}, headers=_auth())
    assert r.status_code == 400
    r = httpx.post(url, json={"model": A, "prompt": "x", "n": 2}, headers=_auth())
    assert r.status_code == 400 and _error(r)["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
        client.completions.create(model=A, prompt="y" * 4090, max_tokens=16)
    big = {"model": A, "prompt": "z" * 2_000_000}
    r = httpx.post(url, json=big, headers=_auth())
    assert r.status_code == 413
    r = httpx.get(srv.url + "/v1/nothing", headers=_auth())
    assert r.status_code == 404 and "no such endpoint" in str(_error(r)["message"])


def test_api_key_is_required_except_on_health(srv: Running) -> None:
    r = httpx.get(srv.url + "/v1/models")
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json()["workers_alive"] == 3


def test_cluster_and_metrics_endpoints(srv: Running, client: openai.OpenAI) -> None:
    client.completions.create(model=B, prompt="abc", max_tokens=4, temperature=0)
    c = httpx.get(srv.url + "/v1/cluster", headers=_auth()).json()
    assert len(c["workers"]) == 3
    assert {m for w in c["workers"] for m in w["models"]} == {A, B}
    for w in c["workers"]:
        assert w["memory"]["within_budget"]
        assert w["memory"]["budget_bytes"] <= 48 * 2**20
    text = httpx.get(srv.url + "/metrics", headers=_auth()).text
    assert metric_value(text, "fleetserve_ttft_seconds_count", model=B) >= 1
    assert metric_value(text, "fleetserve_requests_total", model=B, outcome="finished") >= 1
    assert "fleetserve_kv_utilization" in text and "fleetserve_queue_length" in text


def test_step_log_records_every_engine_step(client: openai.OpenAI, step_log: Path) -> None:
    before = step_log.read_text().count("\n") if step_log.exists() else 0
    r = client.completions.create(model=A, prompt="step log", max_tokens=5, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 5
    lines = [json.loads(x) for x in step_log.read_text().splitlines()]
    assert len(lines) >= before + 5  # one prefill and four decodes at least
    for st in lines:
        assert st["duration_s"] > 0 and st["forwards"] and isinstance(st["more"], bool)
        for f in st["forwards"]:
            assert f["model"] in (A, B)
            assert f["decode_ctx"] >= f["decode_batch"] >= 0
            assert f["chunks"] or f["decode_batch"]
    mine = [f for st in lines[before:] for f in st["forwards"] if f["model"] == A]
    assert any(f["chunks"] for f in mine) and any(f["decode_batch"] for f in mine)


def test_hops_of_every_streamed_token_in_metrics_and_log(srv: Running, hop_log: Path) -> None:
    """``serve.hop_log``: each token of a stream has its hops in
    ``fleetserve_hop_seconds`` and a line in the log, the first token's hops
    from the HTTP server to the SSE chunk; the stamps come in path order."""
    from fleetserve.runtime.hops import FIRST_HOPS, NEXT_HOPS

    def counts() -> dict[tuple[str, str], float]:
        text = httpx.get(srv.url + "/metrics", headers=_auth()).text
        names = [(h, "first") for h in FIRST_HOPS] + [(h, "next") for h in NEXT_HOPS]
        return {
            (h, k): metric_value(text, "fleetserve_hop_seconds_count", hop=h, token=k)
            for h, k in names
        }

    before, start = counts(), hop_log.stat().st_size
    body = {"model": B, "prompt": [9, 8, 7], "max_tokens": 6, "stream": True, "ignore_eos": True}
    url = srv.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200
        assert [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"
    after = counts()
    for (h, k), n in after.items():
        assert n - before[(h, k)] == (1 if k == "first" else 5), (h, k)
    with hop_log.open() as f:
        f.seek(start)
        recs = [json.loads(x) for x in f.read().splitlines()]
    assert [r["index"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert [r["first"] for r in recs] == [True] + [False] * 5
    assert set(recs[0]["hops"]) == set(FIRST_HOPS)
    assert all(set(r["hops"]) == set(NEXT_HOPS) for r in recs[1:])
    assert all(v >= 0 for r in recs for v in r["hops"].values())  # one clock, path order


def test_disconnect_mid_stream_frees_the_kv_at_once(srv: Running) -> None:
    body = {"model": A, "prompt": "p" * 200, "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True
    before = metric_value(
        httpx.get(srv.url + "/metrics", headers=_auth()).text,
        "fleetserve_requests_total",
        outcome="aborted",
    )
    with httpx.stream(
        "POST", srv.url + "/v1/completions", json=body, headers=_auth(), timeout=60
    ) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 3:
                break
    # the KV of the aborted request is freed: every worker's KV use drops to zero
    deadline = time.monotonic() + 20
    while True:
        c = httpx.get(srv.url + "/v1/cluster", headers=_auth()).json()
        used = sum(w["memory"]["kv_pages_used"] for w in c["workers"])
        if used == 0 and c["requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"KV not freed after the disconnect: {c}"
        time.sleep(0.1)
    after = metric_value(
        httpx.get(srv.url + "/metrics", headers=_auth()).text,
        "fleetserve_requests_total",
        outcome="aborted",
    )
    assert after == before + 1


def test_overload_gives_429_with_retry_after_and_counters_agree() -> None:
    cfg = {
        "serve": {"workers": 1, "gpu_memory_mb": 32, "models": [A], "max_queue": 2},
        "policy": {"stack": "wf"},
    }
    with running_server(cfg) as srv:
        results: list[tuple[int, dict[str, str], int]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            body = {"model": A, "prompt": f"req {i}", "max_tokens": 40, "ignore_eos": True}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
            toks = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            with lock:
                results.append((r.status_code, dict(r.headers), toks))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = [c for c, _h, _n in results]
        assert len(results) == 16 and set(codes) <= {200, 429}
        assert codes.count(429) >= 1 and codes.count(200) >= 2
        for c, h, n in results:
            if c == 429:
                assert int(h["retry-after"]) >= 1
            else:
                assert n == 40
        text = httpx.get(srv.url + "/metrics").text
        assert metric_value(text, "fleetserve_requests_total", outcome="finished") == codes.count(
            200
        )
        assert metric_value(text, "fleetserve_requests_total", outcome="rejected") == codes.count(
            429
        )
        assert metric_value(
            text, "fleetserve_http_responses_total", endpoint="/v1/completions", status="429"
        ) == codes.count(429)
