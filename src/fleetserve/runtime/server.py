"""The OpenAI-compatible HTTP server (FastAPI).

Endpoints: ``GET /v1/models`` and ``GET /v1/models/{id}``, ``POST
/v1/completions``, ``POST /v1/chat/completions`` (streaming over SSE ending
with ``data: [DONE]``, or one JSON body), vLLM's ``POST /tokenize`` and
``POST /detokenize``, ``GET /version``, ``GET /health`` (liveness), ``GET
/ready`` (readiness), ``GET /metrics`` (Prometheus), ``GET /v1/cluster``
(placement and memory state).

Behaviour an operator can rely on:

* every error, whatever raised it, has OpenAI's body ``{"error": {"message",
  "type", "param", "code"}}`` and no traceback or internal path (worker-side
  exceptions are logged with an id and mapped): 400 for a malformed body
  (invalid JSON or UTF-8, a lone surrogate, nesting deeper than 32, a field
  out of range, a field the engine cannot honour) or a prompt past the
  context window (the message says the limit), 401 for a missing or wrong
  API key, 404 for an unknown model or path, 408 for headers or a body that
  do not arrive in time, 413 for a body over ``serve.max_body_bytes``
  (enforced while reading), 429 with ``Retry-After`` (from the measured
  drain rate) when the admission queue is full, 503 when no worker can
  serve the model or the server drains; any 500 left is counted in
  ``/metrics`` like every response;
* with an API key (``--api-key`` or ``FLEETSERVE_API_KEY``) every endpoint
  but ``/health`` and ``/ready`` needs ``Authorization: Bearer KEY``;
* a client that disconnects — mid-stream or while waiting for a
  non-streaming answer — has its request aborted at once, which frees its KV
  on the worker;
* ``/health`` answers 200 while the server runs; ``/ready`` answers 200 only
  while every served model has a live worker and the server is not
  draining (``/v1/models`` marks each model ``ready`` or not);
* SIGTERM and SIGINT drain (:mod:`fleetserve.runtime.http`).

Request fields: ``model``, ``prompt`` (a string, a list of token ids, or a
one-element list of either), ``messages`` (chat), ``max_tokens`` (chat also
``max_completion_tokens``; default: the rest of the context window, as
vLLM, or ``serve.max_tokens_default``), ``temperature`` (default 1.0, as
OpenAI), ``top_p``, ``top_k`` (0 or -1: off), ``seed``, ``stop`` (at most
``serve.max_stop_strings`` strings of ``serve.max_stop_chars`` characters
in all), ``n`` (only 1), ``stream``, ``stream_options.include_usage``,
OpenAI's ``logit_bias``, and vLLM's ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``repetition_penalty`` and
``stream_options.continuous_usage_stats`` (every streamed token gets a chunk
carrying ``usage``, even a token whose text the detokenizer holds back, so
a client can time tokens rather than text). Fields the engine does not
implement with a non-default value (``n > 1``, ``echo``, ``logprobs``,
``best_of``, presence/frequency penalties, ``response_format`` other than
text, ``tools``, ``stream_options`` without ``stream``, vLLM's ``min_p``,
beam search, guided decoding, ...) get a 400 naming the field. Any other
field is ignored, as vLLM does, and named in the response header
``x-fleetserve-ignored-fields`` so nothing is dropped silently.

Chat prompts use a plain template (``<|system|>``, ``<|user|>``,
``<|assistant|>`` lines, ending with ``<|assistant|>``), documented here
because the built-in tiny models and most checkpoint folders carry no chat
template the engine's tokenizer can apply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetserve import __version__
from fleetserve.config import ServeConfigSection
from fleetserve.errors import ConfigError
from fleetserve.runtime.controller import Controller, ServeError, Tracked
from fleetserve.runtime.engine.sampling import SamplingParams
from fleetserve.runtime.http import (
    RECEIVED_KEY,
    DrainingServer,
    GuardMiddleware,
    ServeGate,
    guarded_protocol,
)

API_KEY_ENV = "FLEETSERVE_API_KEY"
MAX_JSON_DEPTH = 32
"""Deepest nesting of a request body (the API's own bodies need 4)."""

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- schemas
class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    n: int = 1
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    user: str | None = None
    # vLLM's extras that would change the output; not implemented (400 when set)
    min_p: float = 0.0
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionBody(_Base):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None


class ChatBody(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages (the chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    """vLLM's ``/detokenize``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def chat_prompt(messages: list[ChatMessage], generation_prompt: bool = True) -> str:
    """The plain chat template (see the module docstring); ``generation_prompt``
    ends it with the assistant's line."""
    parts = []
    for m in messages:
        c = m.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        role = "system" if m.role == "developer" else m.role
        parts.append(f"<|{role}|>\n{text}\n")
    if generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


# ----------------------------------------------------------------- errors
def error_response(e: ServeError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _bad(message: str, param: str | None = None) -> ServeError:
    return ServeError(400, message, param=param)


def _validation_error(e: ValidationError) -> ServeError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return _bad(f"{loc}: {err.get('msg', 'invalid value')}", param=loc or None)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 :class:`ServeError` saying
    what is wrong: not UTF-8, not JSON (NaN and Infinity included), an
    integer too long to convert, nesting deeper than :data:`MAX_JSON_DEPTH`,
    a string with a lone UTF-16 surrogate (not Unicode text; it could not be
    tokenized or echoed back)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"the body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise _bad(f"the body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:
        msg = str(e)
        if "integer string conversion" in msg:
            msg = "an integer in the body has too many digits"
        raise _bad(f"the body is not valid JSON: {msg}") from None
    if not isinstance(data, dict):
        raise _bad("the body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data: Any) -> None:
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        x, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _bad(f"the body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(x, dict):
            for k, v in x.items():
                path = f"{where}.{k}" if where else str(k)
                _check_text(k, where or "(body)")
                stack.append((v, path, depth + 1))
        elif isinstance(x, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x))
        elif isinstance(x, str):
            _check_text(x, where)


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        raise _bad(
            f"{where}: contains a lone UTF-16 surrogate (\\u{ord(bad):04x}); "
            "text must be valid Unicode",
            param=where or None,
        ) from None


# ------------------------------------------------------------------ app
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "echo": False,
    "best_of": (None, 1),
    "suffix": None,
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "min_p": 0.0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "prompt_logprobs": (None, 0),
    "bad_words": (None, []),
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
}
"""Fields the engine cannot honour, with the values that ask nothing of it."""


def create_app(
    launch: Callable[[], Awaitable[Controller]],
    shutdown: Callable[[Controller], Awaitable[None]] | None = None,
    *,
    api_key: str | None = None,
    serve: ServeConfigSection | None = None,
    gate: ServeGate | None = None,
) -> FastAPI:
    """The FastAPI app; ``launch`` starts the runtime in the server's event loop.

    ``serve`` gives the limits (body size and time, ``stop``); ``gate`` the
    drain state shared with :class:`~fleetserve.runtime.http.DrainingServer`
    (None: a gate of the app's own, which never drains)."""
    sv = serve if serve is not None else ServeConfigSection()
    gate = gate if gate is not None else ServeGate(sv.drain_timeout_s)
    holder: dict[str, Controller] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        c = holder["ctl"] = await launch()
        app.state.controller = c

        def end_all() -> None:
            c.end_in_flight("the server shut down before the request finished")

        gate.on_deadline = end_all
        try:
            yield
        finally:
            if shutdown is not None:
                await shutdown(c)
            else:
                await c.stop()

    app = FastAPI(title="fleetserve", lifespan=lifespan, docs_url=None, redoc_url=None)

    def ctl() -> Controller:
        return holder["ctl"]

    def count(endpoint: str, status: int) -> None:
        c = holder.get("ctl")
        if c is not None:
            c.metrics.http.labels(endpoint, str(status)).inc()

    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=sv.max_body_bytes,
        body_timeout_s=sv.body_timeout_s,
        gate=gate,
        count=count,
        known=ENDPOINTS,
    )
    app.state.count = count

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServeError)
        return error_response(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            ServeError(404, f"no such endpoint: {request.method} {request.url.path}")
        )

    @app.exception_handler(405)
    async def bad_method(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            ServeError(405, f"method {request.method} not allowed on {request.url.path}")
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the server runs (a dead worker is respawned, not
        a reason to restart the server); the body says what readiness says."""
        c = ctl()
        ready = c.models_ready()
        body = {
            "status": "ok",
            "ready": all(ready.values()) and not gate.draining,
            "draining": gate.draining,
            "workers_alive": sum(w.alive for w in c.workers.values()),
            "workers": len(c.workers),
        }
        return JSONResponse(body)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 only while every served model has a live worker and
        the server is not draining; else 503 saying why."""
        models = ctl().models_ready()
        reasons = [f"no live worker serves {m}" for m, ok in models.items() if not ok]
        if gate.draining:
            reasons.insert(0, "the server is draining")
        body: dict[str, Any] = {"status": "not_ready" if reasons else "ready", "models": models}
        if reasons:
            body["reasons"] = reasons
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctl().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cluster")
    async def cluster() -> JSONResponse:
        return JSONResponse(ctl().cluster_json())

    def model_card(c: Controller, name: str, ready: bool) -> dict[str, Any]:
        info = c.models[name]
        return {
            "id": name,
            "object": "model",
            "created": int(time.time() - c.now()),
            "owned_by": "fleetserve",
            "root": name,
            "parent": None,
            "max_model_len": info.max_context,
            "ready": ready,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        c = ctl()
        ready = c.models_ready()
        data = [model_card(c, name, ready[name]) for name in c.models]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        c = ctl()
        c.model_info(model_id)  # a 404 naming the served models
        return JSONResponse(model_card(c, model_id, c.models_ready()[model_id]))

    async def read_body(request: Request, cls: type[BaseModel]) -> tuple[Any, list[str]]:
        data = parse_json_body(await request.body())
        try:
            body = cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        ignored = sorted(set(data) - set(cls.model_fields))
        return body, ignored

    def check_supported(body: _Base) -> None:
        for name, ok in _UNSUPPORTED_DEFAULTS.items():
            if not hasattr(body, name):
                continue
            value = getattr(body, name)
            allowed = ok if isinstance(ok, tuple) else (ok,)
            if value not in allowed:
                raise _bad(f"{name} is not supported by this server", param=name)
        if body.stream_options is not None and not body.stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")

    def params_of(
        c: Controller, body: _Base, max_tokens: int | None, prompt_len: int
    ) -> SamplingParams:
        info = c.model_info(body.model)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        stop_ids = tuple(body.stop_token_ids or ())
        if len(stop) > sv.max_stop_strings or len(stop_ids) > sv.max_stop_strings:
            what = "stop" if len(stop) > sv.max_stop_strings else "stop_token_ids"
            raise _bad(f"{what}: at most {sv.max_stop_strings} entries", what)
        chars = sum(len(x) for x in stop)
        if chars > sv.max_stop_chars:
            raise _bad(
                f"stop: {chars} characters in all, over the limit of {sv.max_stop_chars}", "stop"
            )
        bias: list[tuple[int, float]] = []
        for k, v in (body.logit_bias or {}).items():
            if not k.strip().lstrip("-").isdigit():
                raise _bad(f"logit_bias: key {k!r} is not a token id", "logit_bias")
            if not -100 <= v <= 100:
                raise _bad(
                    f"logit_bias: bias {v} of token {k} is outside [-100, 100]", "logit_bias"
                )
            bias.append((int(k), float(v)))
        if max_tokens is None:
            rest = info.max_context - prompt_len
            max_tokens = min(rest, sv.max_tokens_default or rest)
            if max_tokens < 1:
                raise _bad(
                    f"This model's maximum context length is {info.max_context} tokens and the "
                    f"prompt has {prompt_len}: no room is left for the completion",
                    "prompt",
                )
        try:
            p = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),  # -1: off, as vLLM
                seed=body.seed,
                stop=stop,
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                stop_token_ids=stop_ids,
                repetition_penalty=body.repetition_penalty,
                logit_bias=tuple(bias),
            )
            p.check_vocab(info.vocab_size)
        except ConfigError as e:
            raise _bad(str(e)) from None
        return p

    def model_of(c: Controller, model: str | None) -> str:
        if model is not None:
            c.model_info(model)
            return model
        if len(c.models) == 1:
            return next(iter(c.models))
        raise _bad(f"model: name one of the served models ({', '.join(c.models)})", "model")

    def tokens_of(c: Controller, model: str, prompt: Any) -> list[int]:
        info = c.model_info(model)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise _bad("batched prompts are not supported: send one prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(info.tokenizer.encode(prompt))
        return list(prompt)

    async def run(
        request: Request,
        body: _Base,
        prompt_ids: list[int],
        max_tokens: int | None,
        chat: bool,
        ignored: list[str],
        received: float,
    ) -> Response:
        c = ctl()
        check_supported(body)
        params = params_of(c, body, max_tokens, len(prompt_ids))
        t = c.submit(body.model, prompt_ids, params, received)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        headers = {"x-fleetserve-ignored-fields": ",".join(ignored)} if ignored else None
        if body.stream:
            opts = body.stream_options or {}
            usage = bool(opts.get("include_usage"))
            per_token = bool(opts.get("continuous_usage_stats"))
            gen = _stream(c, t, rid, created, body.model, chat, usage, per_token)
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        resp = await _complete(c, request, t, rid, created, body.model, chat)
        if headers:
            resp.headers.update(headers)
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = _received(request)
        body, ignored = await read_body(request, CompletionBody)
        c = ctl()
        ids = tokens_of(c, body.model, body.prompt)
        return await run(request, body, ids, body.max_tokens, False, ignored, received)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        received = _received(request)
        body, ignored = await read_body(request, ChatBody)
        c = ctl()
        ids = tokens_of(c, body.model, chat_prompt(body.messages))
        mt = body.max_completion_tokens or body.max_tokens
        return await run(request, body, ids, mt, True, ignored, received)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body, _ = await read_body(request, TokenizeBody)
        c = ctl()
        model = model_of(c, body.model)
        info = c.models[model]
        if (body.prompt is None) == (body.messages is None):
            raise _bad("give either prompt or messages", "prompt")
        text = (
            body.prompt
            if body.prompt is not None
            else chat_prompt(body.messages or [], body.add_generation_prompt)
        )
        ids = list(info.tokenizer.encode(text, add_bos=body.add_special_tokens))
        return JSONResponse({"count": len(ids), "max_model_len": info.max_context, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body, _ = await read_body(request, DetokenizeBody)
        c = ctl()
        info = c.models[model_of(c, body.model)]
        if any(not 0 <= i < info.vocab_size for i in body.tokens):
            raise _bad(f"tokens: ids must be in [0, {info.vocab_size})", "tokens")
        return JSONResponse({"prompt": info.tokenizer.decode(body.tokens)})

    return app


ENDPOINTS = frozenset(
    {
        "/health",
        "/ready",
        "/version",
        "/metrics",
        "/v1/cluster",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    }
)


def _received(request: Request) -> float:
    """When the request reached the app: the first hop stamp (runtime.hops)."""
    t = request.scope.get(RECEIVED_KEY)
    return float(t) if t is not None else time.monotonic()


def _usage(t: Tracked) -> dict[str, int]:
    return _usage_of(len(t.prompt_ids), len(t.output_ids))


def _usage_of(n_in: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def _chunk(rid: str, created: int, model: str, chat: bool, **choice: Any) -> dict[str, Any]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(
    c: Controller,
    t: Tracked,
    rid: str,
    created: int,
    model: str,
    chat: bool,
    usage: bool,
    per_token: bool = False,
) -> AsyncIterator[str]:
    """SSE events until the request ends; a disconnect aborts it (``finally``).

    A chunk for every token, as vLLM streams: a token whose bytes do not yet
    complete a character sends an empty text delta (the held-back bytes go out
    with the token that completes them; never a U+FFFD), so a client times
    tokens, not characters. ``per_token`` (vLLM's ``continuous_usage_stats``)
    adds to each chunk the ``usage`` so far (``completion_tokens`` counts the
    tokens streamed up to it), and ``usage`` on the finishing chunk too.
    """
    n_out = 0  # every token the request makes goes through ``t.events``, from the first
    try:
        if chat:
            yield _sse(
                _chunk(
                    rid,
                    created,
                    model,
                    chat,
                    index=0,
                    delta={"role": "assistant", "content": ""},
                    logprobs=None,
                    finish_reason=None,
                )
            )
        while True:
            ev = await t.events.get()
            if ev[0] == "token":
                n_out += 1
                if chat:
                    choice = {"index": 0, "delta": {"content": ev[1]}, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": ev[1], "finish_reason": None}
                obj = _chunk(rid, created, model, chat, logprobs=None, **choice)
                if per_token:
                    obj["usage"] = _usage_of(len(t.prompt_ids), n_out)
                yield _sse(obj)
                if ev[3] is not None:  # its hops are measured: the chunk is written now
                    c.hops.written(t, ev[3], time.monotonic())
            elif ev[0] == "done":
                c.hops.flush()  # every token's hops are in the log before the last chunk
                last: dict[str, Any] = {"index": 0, "finish_reason": ev[1], "logprobs": None}
                if chat:
                    last["delta"] = {}
                else:
                    last["text"] = ""
                obj = _chunk(rid, created, model, chat, **last)
                if per_token:
                    obj["usage"] = _usage(t)
                yield _sse(obj)
                if usage:
                    obj = _chunk(rid, created, model, chat, index=0)
                    obj["choices"] = []
                    obj["usage"] = _usage(t)
                    yield _sse(obj)
                break
            else:
                _kind, status, message = ev
                err = {"message": message, "type": _error_type(status), "code": status}
                yield _sse({"error": err})
                break
        yield "data: [DONE]\n\n"
    finally:
        if not t.done:
            c.abort(t.id)
        c.forget(t.id)


def _error_type(status: int) -> str:
    return {429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error"
    )


async def _complete(
    c: Controller, request: Request, t: Tracked, rid: str, created: int, model: str, chat: bool
) -> Response:
    """Wait for the whole answer; abort the request the moment the client goes away
    (a task waits for the disconnect while tokens keep coming)."""

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                c.abort(t.id)
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        while True:
            ev = await t.events.get()
            if ev[0] == "token":
                if ev[3] is not None:  # its hops are measured: the handler has it
                    c.hops.written(t, ev[3], time.monotonic())
                continue
            if ev[0] == "error":
                _kind, status, message = ev
                if watcher.done():  # aborted because the client left: nobody to answer
                    return Response(status_code=499)
                return error_response(ServeError(status, message, type=_error_type(status)))
            break
        c.hops.flush()
        reason = ev[1]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": t.text},
                "logprobs": None,
                "finish_reason": reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": t.text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        body = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(t),
        }
        return JSONResponse(body)
    finally:
        watcher.cancel()
        if not t.done:
            c.abort(t.id)
        c.forget(t.id)


def build_server(
    launch: Callable[[], Awaitable[Controller]],
    shutdown: Callable[[Controller], Awaitable[None]] | None,
    serve: ServeConfigSection,
    *,
    host: str,
    port: int,
    api_key: str | None = None,
    log_level: str = "warning",
) -> DrainingServer:
    """The app behind uvicorn with the limits of ``serve``: header deadline and
    connection cap (:func:`~fleetserve.runtime.http.guarded_protocol`), and a
    graceful drain on SIGTERM/SIGINT (:class:`~fleetserve.runtime.http.DrainingServer`)."""
    import uvicorn

    gate = ServeGate(serve.drain_timeout_s)
    app = create_app(launch, shutdown, api_key=api_key, serve=serve, gate=gate)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(serve.header_timeout_s, serve.max_connections, app.state.count),
        timeout_keep_alive=5,
        timeout_graceful_shutdown=5,  # after the drain: what is left has been ended already
        server_header=False,
    )
    return DrainingServer(config, gate)
