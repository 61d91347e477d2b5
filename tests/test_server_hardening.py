# ruff: noqa: E501  (the table of malformed inputs reads best one case per line)
"""The server as an attacker and a demanding operator try it: malformed input,
slow clients, oversized bodies, internals in errors, readiness, restarts,
the fields benchmark clients send, vLLM's extra endpoints.

One runtime (two tiny models, API key, short header/body deadlines, a small
connection cap) serves the module; the tests that kill workers start their own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_util import Running, listening_sockets, metric_value, running_server

from fleetserve.runtime.controller import retry_after_s, worker_error
from fleetserve.runtime.engine.tokenizer import ByteTokenizer

A, B = "tiny-llama-a", "tiny-llama-b"
KEY = "k-\u00e9t\u00e9"  # a non-ASCII key must work too (compared as UTF-8 bytes)
AUTH = {"Authorization": f"Bearer {KEY}".encode()}

pytestmark = pytest.mark.slow

LEAKS = ("Traceback", 'File "', "/work", "site-packages", ".py", "\x1b[", "pid=", "actor", "ip=")


@pytest.fixture(scope="module")
def srv() -> Iterator[Running]:
    cfg = {
        "serve": {
            "workers": 2,
            "gpu_memory_mb": 48,
            "models": [A, B],
            "header_timeout_s": 1.5,
            "body_timeout_s": 1.5,
            "max_connections": 24,
            "max_body_bytes": 200_000,
        },
        "policy": {"stack": "wf"},
    }
    with running_server(cfg, api_key=KEY) as r:
        yield r


@pytest.fixture(scope="module")
def http(srv: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, headers=AUTH) as c:
        yield c


def raw(srv: Running, data: bytes, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; return status, headers and body of the response."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while True:
            try:
                got = s.recv(65536)
            except TimeoutError:
                break
            if not got:
                break
            buf += got
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                hdrs = _headers(head)
                n = int(hdrs.get("content-length", -1))
                if 0 <= n <= len(body):
                    break
    head, _, body = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return status, _headers(head), body


def read_head(s: socket.socket, buf: bytes, timeout: float) -> bytes:
    """Read from ``s`` until a response's headers are complete (or it closes)."""
    s.settimeout(timeout)
    while b"\r\n\r\n" not in buf:
        more = s.recv(65536)
        if not more:
            break
        buf += more
    return buf


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        out[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return out


def post_raw(srv: Running, path: str, body: bytes, key: bytes | None = None) -> Any:
    k = key if key is not None else f"Bearer {KEY}".encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
    ).encode()
    return raw(srv, head + b"Authorization: " + k + b"\r\n\r\n" + body)


def assert_openai_error(status: int, body: bytes, expect: int | tuple[int, ...]) -> dict[str, Any]:
    want = (expect,) if isinstance(expect, int) else expect
    assert status in want, (status, body[:300])
    text = body.decode("utf-8")
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and isinstance(err["message"], str)
    for leak in LEAKS:
        assert leak not in text, (leak, text)
    return dict(err)


def ok_completion(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": A, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------ malformed input
C = "/v1/completions"
BASE = {"model": A, "prompt": "hello", "max_tokens": 2}


def _with(**kw: Any) -> bytes:
    return json.dumps({**BASE, **kw}).encode()


MALFORMED: list[tuple[str, str, bytes, int]] = [
    ("empty body", C, b"", 400),
    ("truncated", C, b'{"model": "tiny-llama-a"', 400),
    ("array", C, b"[]", 400),
    ("null", C, b"null", 400),
    ("number", C, b"1", 400),
    ("string", C, b'"x"', 400),
    ("single quotes", C, b"{'model': 1}", 400),
    ("trailing comma", C, b'{"model": "tiny-llama-a", "prompt": "x",}', 400),
    ("NaN", C, b'{"model": "tiny-llama-a", "prompt": "x", "temperature": NaN}', 400),
    ("Infinity", C, b'{"model": "tiny-llama-a", "prompt": "x", "top_p": Infinity}', 400),
    ("invalid utf-8", C, b'{"model": "tiny-llama-a", "prompt": "\xff\xfe"}', 400),
    ("utf-16 body", C, json.dumps(BASE).encode("utf-16"), 400),
    ("lone surrogate prompt", C, b'{"model": "tiny-llama-a", "prompt": "\\ud800"}', 400),
    ("lone surrogate model", C, b'{"model": "\\udfff", "prompt": "x"}', 400),
    ("lone surrogate key", C, b'{"model": "tiny-llama-a", "prompt": "x", "\\ud800": 1}', 400),
    ("lone surrogate stop", C, b'{"model": "tiny-llama-a", "prompt": "x", "stop": ["\\ud83d"]}', 400),
    ("5000-digit int", C, b'{"model": "tiny-llama-a", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("5000-digit token", C, b'{"model": "tiny-llama-a", "prompt": [' + b"1" * 5000 + b"]}", 400),
    ("nested 50000", C, b'{"model": "tiny-llama-a", "prompt": "x", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400),
    ("nested 40", C, b'{"model": "tiny-llama-a", "prompt": "x", "x": ' + b"[" * 40 + b"]" * 40 + b"}", 400),
    ("huge float", C, b'{"model": "tiny-llama-a", "prompt": "x", "temperature": 1e400}', 400),
    ("no model", C, json.dumps({"prompt": "x"}).encode(), 400),
    ("model not a string", C, _with(model=3), 400),
    ("unknown model", C, _with(model="gpt-4"), 404),
    ("no prompt", C, json.dumps({"model": A}).encode(), 400),
    ("empty token prompt", C, _with(prompt=[]), 400),
    ("batched prompts", C, _with(prompt=["a", "b"]), 400),
    ("negative token", C, _with(prompt=[-1]), 400),
    ("token out of vocab", C, _with(prompt=[10**6]), 400),
    ("prompt object", C, _with(prompt={"a": 1}), 400),
    ("max_tokens 0", C, _with(max_tokens=0), 400),
    ("max_tokens -1", C, _with(max_tokens=-1), 400),
    ("max_tokens string", C, _with(max_tokens="many"), 400),
    ("max_tokens fraction", C, _with(max_tokens=1.5), 400),
    ("max_tokens past context", C, _with(max_tokens=10**12), 400),
    ("temperature -1", C, _with(temperature=-1), 400),
    ("temperature 3", C, _with(temperature=3), 400),
    ("temperature string", C, _with(temperature="hot"), 400),
    ("top_p 0", C, _with(top_p=0), 400),
    ("top_p 1.5", C, _with(top_p=1.5), 400),
    ("top_k -2", C, _with(top_k=-2), 400),
    ("n 2", C, _with(n=2), 400),
    ("seed 2^64", C, _with(seed=2**64), 400),
    ("seed -2^64", C, _with(seed=-(2**64)), 400),
    ("seed string", C, _with(seed="s"), 400),
    ("empty stop", C, _with(stop=""), 400),
    ("empty stop in list", C, _with(stop=["a", ""]), 400),
    ("17 stop strings", C, _with(stop=[f"s{i}" for i in range(17)]), 400),
    ("stop over the size limit", C, _with(stop="x" * 20_000), 400),
    ("stop not text", C, _with(stop=[1]), 400),
    ("stream not bool", C, _with(stream="maybe"), 400),
    ("stream_options without stream", C, _with(stream_options={"include_usage": True}), 400),
    ("stream_options not an object", C, _with(stream=True, stream_options="x"), 400),
    ("logprobs", C, _with(logprobs=5), 400),
    ("echo", C, _with(echo=True), 400),
    ("best_of", C, _with(best_of=3), 400),
    ("suffix", C, _with(suffix="x"), 400),
    ("presence_penalty", C, _with(presence_penalty=1.0), 400),
    ("frequency_penalty", C, _with(frequency_penalty=1.0), 400),
    ("repetition_penalty 0", C, _with(repetition_penalty=0), 400),
    ("logit_bias key", C, _with(logit_bias={"x": 1}), 400),
    ("logit_bias value", C, _with(logit_bias={"1": 200}), 400),
    ("logit_bias vocab", C, _with(logit_bias={"99999": 1}), 400),
    ("min_tokens -1", C, _with(min_tokens=-1), 400),
    ("min_tokens over max_tokens", C, _with(min_tokens=5, max_tokens=2), 400),
    ("stop_token_ids vocab", C, _with(stop_token_ids=[99999]), 400),
    ("stop_token_ids text", C, _with(stop_token_ids=["a"]), 400),
    ("response_format json", C, _with(response_format={"type": "json_object"}), 400),
    ("tools", C, _with(tools=[{"type": "function"}]), 400),
    ("tool_choice", C, _with(tool_choice="required"), 400),
    ("min_p", C, _with(min_p=0.5), 400),
    ("beam search", C, _with(use_beam_search=True), 400),
    ("guided_json", C, _with(guided_json={"type": "object"}), 400),
    ("skip_special_tokens false", C, _with(skip_special_tokens=False), 400),
    ("chat: no messages", "/v1/chat/completions", json.dumps({"model": A}).encode(), 400),
    ("chat: empty messages", "/v1/chat/completions", json.dumps({"model": A, "messages": []}).encode(), 400),
    ("chat: bad role", "/v1/chat/completions", json.dumps({"model": A, "messages": [{"role": "x", "content": "a"}]}).encode(), 400),
    ("chat: content number", "/v1/chat/completions", json.dumps({"model": A, "messages": [{"role": "user", "content": 5}]}).encode(), 400),
    ("chat: image part", "/v1/chat/completions", json.dumps({"model": A, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400),
    ("chat: messages string", "/v1/chat/completions", json.dumps({"model": A, "messages": "hi"}).encode(), 400),
    ("tokenize: which model", "/tokenize", json.dumps({"prompt": "x"}).encode(), 400),
    ("tokenize: prompt and messages", "/tokenize", json.dumps({"model": A, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}).encode(), 400),
    ("tokenize: unknown field", "/tokenize", json.dumps({"model": A, "prompt": "x", "foo": 1}).encode(), 400),
    ("detokenize: out of vocab", "/detokenize", json.dumps({"model": A, "tokens": [1, 5000]}).encode(), 400),
    ("detokenize: not ids", "/detokenize", json.dumps({"model": A, "tokens": "ab"}).encode(), 400),
    ("unknown path", "/v1/nothing", b"{}", 404),
    ("over the body limit", C, b'{"x": "' + b"a" * 300_000 + b'"}', 413),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_input_gets_an_openai_error_and_leaks_nothing(
    srv: Running, path: str, body: bytes, status: int
) -> None:
    got, _h, resp = post_raw(srv, path, body)
    assert_openai_error(got, resp, status)


def test_the_server_is_healthy_after_the_malformed_inputs(srv: Running, http: httpx.Client) -> None:
    for _name, path, body, _status in MALFORMED[:20]:
        post_raw(srv, path, body)
    ok_completion(http)
    assert http.get("/ready").status_code == 200
    text = http.get("/metrics").text
    assert metric_value(text, "fleetserve_http_responses_total", status="400") >= 20
    assert metric_value(text, "fleetserve_http_responses_total", status="500") == 0


def test_keep_alive_survives_a_lone_surrogate(srv: Running) -> None:
    bad = b'{"model": "tiny-llama-a", "prompt": "\\ud800"}'
    good = json.dumps(BASE).encode()
    with httpx.Client(base_url=srv.url, headers=AUTH) as c:
        r1 = c.post(C, content=bad, headers={"content-type": "application/json"})
        r2 = c.post(C, content=good, headers={"content-type": "application/json"})
    assert r1.status_code == 400 and r2.status_code == 200


@pytest.mark.parametrize(
    "auth",
    [b"", b"Bearer wrong", b"Bearer \xff\xfe\xfd", "Bearer k-\u00e9t\u00e9x".encode(), b"Basic abc", b"Bearer"],
)  # fmt: skip
def test_wrong_or_non_ascii_api_keys_get_401(srv: Running, auth: bytes) -> None:
    status, _h, body = post_raw(srv, C, json.dumps(BASE).encode(), key=auth)
    assert_openai_error(status, body, 401)


def test_methods_and_probes(srv: Running, http: httpx.Client) -> None:
    r = http.get(C)
    assert_openai_error(r.status_code, r.content, 405)
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
    assert httpx.get(srv.url + "/ready").status_code == 200
    assert httpx.get(srv.url + "/v1/models").status_code == 401


# --------------------------------------------------------- bodies and clients
def test_chunked_upload_is_cut_at_the_limit_while_reading(srv: Running) -> None:
    host, port = srv.url.removeprefix("http://").split(":")
    head = (
        f"POST {C} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ".encode()
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"a" * 16384
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + b'5\r\n{"x":\r\n')
        reply = b""
        try:
            while sent < 50_000_000:  # far more than the 200 kB limit
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent += len(chunk)
                s.settimeout(0.001 if sent < 400_000 else 0.05)
                try:
                    reply = s.recv(65536)
                    if reply:
                        break
                except TimeoutError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_head(s, reply, 10)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 5_000_000  # refused while reading, not after reading all of it


@pytest.mark.parametrize(
    "data",
    [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
     b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n"],
    ids=["request line", "header line", "headers over the size limit"],
)  # fmt: skip
def test_unparsable_http_gets_an_openai_400(srv: Running, data: bytes) -> None:
    status, _h, body = raw(srv, data, timeout=10)
    assert_openai_error(status, body, 400)


def test_slow_headers_get_408_and_the_connection_closes(srv: Running) -> None:
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        buf = b""
        for ch in b"X-Slow: " + b"a" * 20:  # a byte every 0.25 s: 7 s, past the 1.5 s deadline
            try:
                s.sendall(bytes([ch]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.25)
            s.settimeout(0.01)
            try:
                got = s.recv(4096)
                buf += got
                if not got or b"\r\n\r\n" in buf:
                    break
            except TimeoutError:
                pass
        buf = read_head(s, buf, 5)
    assert buf.startswith(b"HTTP/1.1 408"), buf[:200]
    assert_openai_error(408, buf.partition(b"\r\n\r\n")[2], 408)


def test_slow_body_gets_408(srv: Running) -> None:
    head = (
        f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: 100\r\nAuthorization: Bearer "
    ).encode()
    status, _h, body = raw(srv, head + KEY.encode() + b"\r\n\r\n" + b'{"model": ', timeout=10)
    assert_openai_error(status, body, 408)


def test_connection_cap_answers_503_then_recovers(srv: Running, http: httpx.Client) -> None:
    host, port = srv.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(30)]
    try:
        refused = 0
        for s in idle:
            s.settimeout(0.3)
            try:
                if s.recv(4096).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except TimeoutError:
                pass
        assert refused >= 30 - 24 + 1 - 2  # those past the cap (the client's own may hold a slot)
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    ok_completion(http)
    text = http.get("/metrics").text
    assert (
        metric_value(text, "fleetserve_http_responses_total", endpoint="connection", status="503")
        >= 1
    )


# ------------------------------------------------------------ internals, stop
def test_worker_exceptions_are_mapped_without_internals() -> None:
    import ray
    from serve_util import ensure_ray

    from fleetserve.errors import ConfigError

    ensure_ray()

    @ray.remote
    def boom(kind: str) -> None:
        if kind == "config":
            raise ConfigError("min_tokens must be an integer")
        raise RuntimeError("engine state broken at /work/secret/path.py")

    for kind, status in (("config", 400), ("other", 500)):
        with pytest.raises(Exception) as info:
            ray.get(boom.remote(kind))
        assert 'File "' in str(info.value)  # what used to reach the client
        got, message = worker_error(info.value, "test")
        assert got == status
        assert not any(leak in message for leak in LEAKS), message
    assert worker_error(RuntimeError("x\ny"), "t")[1].startswith("internal error")


def test_seed_range_and_a_900kb_stop_string_is_refused_at_once(http: httpx.Client) -> None:
    r = http.post(C, json={**BASE, "seed": 2**64 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text
    r = http.post(C, json={**BASE, "stop": "z" * 900_000})
    assert r.status_code in (400, 413)
    # within the limit a long stop string works (the engine's check is linear)
    r = http.post(C, json={**BASE, "max_tokens": 8, "stop": ["q" * 16_000]})
    assert r.status_code == 200, r.text


def test_non_streaming_request_is_aborted_when_its_client_leaves(srv: Running) -> None:
    body = json.dumps({**BASE, "max_tokens": 3000, "ignore_eos": True}).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    ctl = srv.controller
    before = sum(1 for t in ctl.requests.values() if not t.done)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAuthorization: Bearer ".encode()
            + KEY.encode()
            + b"\r\n\r\n"
            + body
        )
        deadline = time.monotonic() + 20
        while not any(t.output_ids for t in ctl.requests.values() if not t.done):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while sum(1 for t in ctl.requests.values() if not t.done) > before:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.1)
    aborted = metric_value(
        ctl.metrics.render().decode(), "fleetserve_requests_total", outcome="aborted"
    )
    assert aborted >= 1


# ------------------------------------------------------------------- fields
def test_fields_min_tokens_stop_token_ids_logit_bias_repetition_penalty(http: httpx.Client) -> None:
    def go(**kw: Any) -> dict[str, Any]:
        r = http.post(C, json={**BASE, "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return dict(r.json())

    eos = str(ByteTokenizer.EOS)
    r = go(max_tokens=10, logit_bias={eos: 100}, min_tokens=4)
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] >= 4
    r = go(max_tokens=6, logit_bias={"65": 100})
    assert r["choices"][0]["text"] == "A" * 6
    r = go(max_tokens=6, logit_bias={"65": 100}, stop_token_ids=[65])
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == ""
    plain = go(max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    pen = go(max_tokens=24, ignore_eos=True, repetition_penalty=5.0)["choices"][0]["text"]
    assert pen != plain
    assert go(max_tokens=3, top_k=-1, temperature=0.7)["usage"]["completion_tokens"] <= 3


def test_without_max_tokens_a_request_gets_the_rest_of_the_window(http: httpx.Client) -> None:
    r = http.post(C, json={"model": A, "prompt": [65] * 4090, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    full = http.post(C, json={"model": A, "prompt": [65] * 4096})
    assert_openai_error(full.status_code, full.content, 400)


def test_unknown_fields_are_named_in_a_header(http: httpx.Client) -> None:
    r = http.post(C, json={**BASE, "frobnicate": 1, "zz_extra": {}})
    assert r.status_code == 200
    assert r.headers["x-fleetserve-ignored-fields"] == "frobnicate,zz_extra"


def test_streamed_text_never_ends_in_an_incomplete_character(http: httpx.Client) -> None:
    # byte 0xE2 starts a 3-byte character: alone it is incomplete, never U+FFFD
    body = {**BASE, "max_tokens": 1, "logit_bias": {"226": 100}, "stream": True}
    text = ""
    with http.stream("POST", C, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += (
                    json.loads(line[6:])["choices"][0].get("text", "")
                    if json.loads(line[6:])["choices"]
                    else ""
                )
    assert "\ufffd" not in text


# -------------------------------------------------------- vLLM's endpoints
def test_tokenize_detokenize_model_card_and_version(http: httpx.Client) -> None:
    tok = ByteTokenizer()
    r = http.post("/tokenize", json={"model": A, "prompt": "héllo"})
    assert r.status_code == 200
    assert r.json() == {"count": 7, "max_model_len": 4096, "tokens": tok.encode("héllo")}
    r = http.post("/tokenize", json={"model": A, "prompt": "hé", "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode("hé", add_bos=False)
    r = http.post("/tokenize", json={"model": A, "messages": [{"role": "user", "content": "x"}]})
    assert r.json()["count"] == len(tok.encode("<|user|>\nx\n<|assistant|>\n"))
    r = http.post("/detokenize", json={"model": B, "tokens": tok.encode("héllo")})
    assert r.json() == {"prompt": "héllo"}
    card = http.get(f"/v1/models/{A}").json()
    assert card["id"] == A and card["max_model_len"] == 4096 and card["ready"] is True
    r = http.get("/v1/models/nope")
    assert_openai_error(r.status_code, r.content, 404)
    assert http.get("/version").json()["version"]


# -------------------------------------------------------------- Ray exposure
def test_ray_and_the_server_listen_on_loopback_only(srv: Running) -> None:
    socks = listening_sockets(os.getpid())
    assert socks, "found no listening socket of this process tree"
    assert any(port == int(srv.url.rsplit(":", 1)[1]) for _a, port, _p in socks)
    public = [(a, p, pid) for a, p, pid in socks if not a.is_loopback]
    assert not public, public


def test_ray_refuses_a_client_without_the_token(srv: Running) -> None:
    import ray

    gcs = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_gcs_server_port_wait_time_s"] = "2"  # give up after 2 tries, not 20
    code = f"import ray; ray.init(address={gcs!r}, log_to_driver=False); print('JOINED')"

    def join(**extra: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-c", code]
        out = subprocess.PIPE
        return subprocess.Popen(cmd, env=env | extra, stdout=out, stderr=out, text=True)

    def result(p: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
        stdout, stderr = p.communicate(timeout=120)
        return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)

    # the three clients at once: a refused one spends most of its time waiting
    procs = [
        join(RAY_AUTH_MODE="disabled"),
        join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
        join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ["RAY_AUTH_TOKEN"]),
    ]
    try:
        without, wrong, right = [result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "JOINED" not in without.stdout and without.returncode != 0
    assert "InvalidAuthToken" in without.stderr
    assert "JOINED" not in wrong.stdout and "InvalidAuthToken" in wrong.stderr
    assert "JOINED" in right.stdout, right.stderr[-2000:]  # the control: the token is the key


# ------------------------------------------------------------------ helpers
def test_retry_after_follows_the_measured_drain_rate() -> None:
    done: deque[float] = deque([50.0, *[80.0 + i for i in range(10)]])
    # 10 requests left in the last 30 s (the one at 50 s is out of the window)
    assert retry_after_s(9, done, 100.0, 5.0) == 30  # (9 + 1) requests at 1 per 3 s
    assert len(done) == 10
    assert retry_after_s(0, done, 100.0, 5.0) == 3
    assert retry_after_s(4, deque(), 100.0, 7.2) == 8  # nothing left yet: the oldest wait
    assert retry_after_s(10**6, done, 100.0, 0) == 600
    assert retry_after_s(0, deque([99.9] * 100), 100.0, 0) == 1


def test_an_unhandled_exception_is_an_openai_500_and_counted() -> None:
    import asyncio

    from fleetserve.runtime.http import GuardMiddleware, ServeGate

    counted: list[tuple[str, int]] = []

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("secret at /work/main/src/x.py")

    app = GuardMiddleware(
        broken,
        api_key=None,
        max_body_bytes=100,
        body_timeout_s=1,
        gate=ServeGate(),
        count=lambda e, s: counted.append((e, s)),
        known=frozenset({"/v1/completions"}),
    )

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json={"a": 1})

    r = asyncio.run(go())
    err = assert_openai_error(r.status_code, r.content, 500)
    assert err["type"] == "internal_error"
    assert counted == [("/v1/completions", 500)]


def test_a_dead_worker_makes_its_model_unready_until_it_is_respawned(
    srv: Running, http: httpx.Client
) -> None:
    """On this module's server (two workers, one per model, WF; no other test
    kills a worker of it), last in the file: it kills one of its workers."""
    import ray

    ctl = srv.controller
    wid = next(w for w, x in ctl.workers.items() if A in x.spec.served)
    assert B not in ctl.workers[wid].spec.served
    ray.kill(ctl.workers[wid].handle)
    deadline = time.monotonic() + 30
    while True:
        ready = http.get("/ready")
        if ready.status_code == 503:
            break
        assert time.monotonic() < deadline, "the dead worker's model stayed ready"
        time.sleep(0.02)
    assert ready.json()["models"] == {A: False, B: True}
    assert any(A in reason for reason in ready.json()["reasons"])
    assert http.get("/health").status_code == 200  # alive, not ready
    cards = {m["id"]: m["ready"] for m in http.get("/v1/models").json()["data"]}
    assert cards[B] is True  # A is False, or already back
    deadline = time.monotonic() + 120
    while http.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the worker was not respawned"
        time.sleep(0.1)
    text = http.get("/metrics").text
    assert metric_value(text, "fleetserve_worker_failures_total") == 1
    assert metric_value(text, "fleetserve_worker_restarts_total", outcome="done") == 1
    body = {"model": A, "prompt": "back", "max_tokens": 3}
    assert http.post("/v1/completions", json=body, timeout=60).status_code == 200
