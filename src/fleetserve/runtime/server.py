"""The OpenAI-compatible HTTP server (FastAPI).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (streaming over SSE ending with
``data: [DONE]``, or one JSON body), ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /v1/cluster`` (placement and memory state).

Behaviour an operator can rely on:

* errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
  400 for a malformed body or a prompt past the context window (the message
  says the limit), 401 for a missing or wrong API key, 404 for an unknown
  model or path, 413 for a body over ``serve.max_body_bytes``, 429 with
  ``Retry-After`` when the admission queue is full, 503 when no worker can
  serve the model;
* with an API key (``--api-key`` or ``FLEETSERVE_API_KEY``) every endpoint
  but ``/health`` needs ``Authorization: Bearer KEY``;
* a client that disconnects — mid-stream or while waiting for a
  non-streaming answer — has its request aborted at once, which frees its KV
  on the worker.

Request fields: ``model``, ``prompt`` (a string, a list of token ids, or a
one-element list of either), ``messages`` (chat), ``max_tokens`` (chat also
``max_completion_tokens``; default ``serve.max_tokens_default``),
``temperature`` (default 1.0, as OpenAI), ``top_p``, ``top_k``, ``seed``,
``stop``, ``n`` (only 1), ``stream``, ``stream_options.include_usage``, and
vLLM's ``ignore_eos`` and ``stream_options.continuous_usage_stats`` (every
streamed token gets a chunk carrying ``usage``, even a token whose text the
detokenizer holds back, so a client can time tokens rather than text).
Fields the engine does not implement with a non-default value (``n > 1``,
``echo``, ``logprobs``, ``best_of``, penalties) get a 400 naming the field
rather than being silently ignored; unknown fields are ignored, as OpenAI
does.

Chat prompts use a plain template (``<|system|>``, ``<|user|>``,
``<|assistant|>`` lines, ending with ``<|assistant|>``), documented here
because the built-in tiny models and most checkpoint folders carry no chat
template the engine's tokenizer can apply.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleetserve.errors import ConfigError
from fleetserve.runtime.controller import Controller, ServeError, Tracked
from fleetserve.runtime.engine.sampling import SamplingParams

API_KEY_ENV = "FLEETSERVE_API_KEY"


# ---------------------------------------------------------------- schemas
class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None


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


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The plain chat template (see the module docstring)."""
    parts = []
    for m in messages:
        c = m.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        role = "system" if m.role == "developer" else m.role
        parts.append(f"<|{role}|>\n{text}\n")
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


# ------------------------------------------------------------------ app
def create_app(
    launch: Callable[[], Awaitable[Controller]],
    shutdown: Callable[[Controller], Awaitable[None]] | None = None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 1_000_000,
) -> FastAPI:
    """The FastAPI app; ``launch`` starts the runtime in the server's event loop."""
    holder: dict[str, Controller] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        holder["ctl"] = await launch()
        app.state.controller = holder["ctl"]
        try:
            yield
        finally:
            if shutdown is not None:
                await shutdown(holder["ctl"])
            else:
                await holder["ctl"].stop()

    app = FastAPI(title="fleetserve", lifespan=lifespan, docs_url=None, redoc_url=None)

    def ctl() -> Controller:
        return holder["ctl"]

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        path = request.url.path
        endpoint = path if path in _ENDPOINTS else "other"
        if api_key is not None and path != "/health":
            got = request.headers.get("authorization", "")
            scheme, _, token = got.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
                resp: Response = error_response(
                    ServeError(
                        401,
                        "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key",
                    )
                )
                _count(endpoint, resp.status_code)
                return resp
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            resp = error_response(
                ServeError(
                    413,
                    f"request body of {length} bytes is over the limit of {max_body_bytes}",
                    code="request_too_large",
                )
            )
            _count(endpoint, resp.status_code)
            return resp
        resp = await call_next(request)
        _count(endpoint, resp.status_code)
        return resp

    def _count(endpoint: str, status: int) -> None:
        c = holder.get("ctl")
        if c is not None:
            c.metrics.http.labels(endpoint, str(status)).inc()

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
        c = ctl()
        alive = sum(w.alive for w in c.workers.values())
        body = {"status": "ok" if alive else "down", "workers_alive": alive}
        body["workers"] = len(c.workers)
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctl().metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cluster")
    async def cluster() -> JSONResponse:
        return JSONResponse(ctl().cluster_json())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        c = ctl()
        created = int(time.time() - c.now())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "fleetserve",
                "max_model_len": info.max_context,
            }
            for name, info in c.models.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def read_body(request: Request, cls: type[_Base]) -> _Base:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise ServeError(
                413,
                f"request body of {len(raw)} bytes is over the limit of {max_body_bytes}",
                code="request_too_large",
            )
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise _bad("the body must be a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None

    def params_of(c: Controller, body: _Base, max_tokens: int | None) -> SamplingParams:
        for name, bad in (
            ("n", body.n != 1),
            ("logprobs", body.logprobs not in (None, False, 0)),
            ("presence_penalty", body.presence_penalty != 0),
            ("frequency_penalty", body.frequency_penalty != 0),
            ("echo", getattr(body, "echo", False)),
            ("best_of", getattr(body, "best_of", None) not in (None, 1)),
            ("suffix", getattr(body, "suffix", None) is not None),
        ):
            if bad:
                raise _bad(f"{name} is not supported by this server", param=name)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            return SamplingParams(
                max_tokens=max_tokens or c.serve.max_tokens_default,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=stop,
                ignore_eos=body.ignore_eos,
            )
        except ConfigError as e:
            raise _bad(str(e)) from None

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
        request: Request, body: _Base, prompt_ids: list[int], params: SamplingParams, chat: bool
    ) -> Response:
        c = ctl()
        t = c.submit(body.model, prompt_ids, params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            opts = body.stream_options or {}
            usage = bool(opts.get("include_usage"))
            per_token = bool(opts.get("continuous_usage_stats"))
            gen = _stream(c, t, rid, created, body.model, chat, usage, per_token)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _complete(c, request, t, rid, created, body.model, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await read_body(request, CompletionBody)
            assert isinstance(body, CompletionBody)
            c = ctl()
            ids = tokens_of(c, body.model, body.prompt)
            return await run(request, body, ids, params_of(c, body, body.max_tokens), False)
        except ServeError as e:
            return error_response(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await read_body(request, ChatBody)
            assert isinstance(body, ChatBody)
            c = ctl()
            ids = tokens_of(c, body.model, chat_prompt(body.messages))
            mt = body.max_completion_tokens or body.max_tokens
            return await run(request, body, ids, params_of(c, body, mt), True)
        except ServeError as e:
            return error_response(e)

    return app


_ENDPOINTS = {
    "/health",
    "/metrics",
    "/v1/cluster",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
}


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

    ``per_token`` (vLLM's ``continuous_usage_stats``): a chunk for every token,
    text or not, each with the ``usage`` so far (``completion_tokens`` counts
    the tokens streamed up to it), and ``usage`` on the finishing chunk too.
    Without it, a token whose text is held back sends nothing.
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
                if not ev[1] and not per_token:
                    continue
                if chat:
                    choice = {"index": 0, "delta": {"content": ev[1]}, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": ev[1], "finish_reason": None}
                obj = _chunk(rid, created, model, chat, logprobs=None, **choice)
                if per_token:
                    obj["usage"] = _usage_of(len(t.prompt_ids), n_out)
                yield _sse(obj)
            elif ev[0] == "done":
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
    return {429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error"
    )


async def _complete(
    c: Controller, request: Request, t: Tracked, rid: str, created: int, model: str, chat: bool
) -> Response:
    """Wait for the whole answer; abort the request if the client goes away."""
    try:
        while True:
            try:
                ev = await asyncio.wait_for(t.events.get(), 0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    c.abort(t.id)
                    return Response(status_code=499)
                continue
            if ev[0] == "token":
                continue
            if ev[0] == "error":
                _kind, status, message = ev
                return error_response(ServeError(status, message, type=_error_type(status)))
            break
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
        if not t.done:
            c.abort(t.id)
        c.forget(t.id)
