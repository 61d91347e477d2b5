"""``fleetserve bench-serve``: replay a trace against an OpenAI-compatible server.

The load generator turns a trace into timed ``POST /v1/completions`` requests,
measures every response as a client sees it, and writes a result directory in the
simulator's schema (``summary.json``, ``requests.csv``, ``latency_cdf.png``,
``report.md``), so a real run and a simulated run of the same workload compare
field by field. It never imports torch: it is an HTTP client (``httpx`` + asyncio).

Pipeline::

    trace ──load_trace──► time window ► max_requests ► rate scale ► length scale ► caps
                                                                                 │
    GET /v1/models ─► served model names ─► model assignment ◄───────────────────┘
          │
          └─► probe (sequential, idle server) ─► ideal_s = a + b·prompt + c·output
                                                                 │
    open-loop replay (each request sent at its arrival time) ◄───┘
          │
          └─► RequestRecord per request ─► metrics.summary.summarize ─► result dir

Design choices:

* **Workload.** The project's loaders and transforms are reused in the simulator's
  order (``sim/build.py``): time window, ``max_requests``, rate scaling, model
  assignment, length scaling; then the bench-only caps ``max_prompt_tokens`` /
  ``max_output_tokens`` (a capped request is marked ``length_capped``). There is no
  separate "time scale": compressing inter-arrival times by ``X`` *is*
  ``scale_rate(X)`` (every arrival time divided by ``X``), so only ``rate_scale``
  exists (``--rate-scale 10`` replays a 10-minute trace in one minute).
* **Prompts.** Token-id lists (the OpenAI API accepts them), ``prompt_tokens`` ids
  drawn uniformly from ``token_range`` (inclusive, default ``0..255``: the built-in
  tiny models have a byte vocabulary) by ``numpy.random.default_rng((seed, 0, id))``
  — the same prompt for the same request and seed whatever the send order.
  ``max_tokens = output_tokens``, ``ignore_eos``, ``temperature 0``, streamed with
  ``include_usage`` and vLLM's ``continuous_usage_stats`` (usage on every chunk).
* **Open loop.** Request *i* is sent at ``t0 + arrival_s[i]`` whether or not earlier
  ones finished. With ``concurrency_limit`` a request waits (client side) for a
  free slot. A record's ``arrival_s`` is the moment it was actually sent (what the
  server saw), so latencies are server + network time; how late sends were against
  the schedule (event-loop lag and concurrency-limit waits) is reported separately
  as ``bench.send_lag_s``.
* **What is measured.** Token arrivals: a chunk whose ``usage.completion_tokens``
  rose by k brings k tokens, whatever their text (a byte-level tokenizer's token
  may be half a UTF-8 character, whose text the server holds back); from a server
  without per-chunk usage, each chunk with non-empty ``text`` is one token. TTFT:
  the first token's arrival; ``finish_s``: the last token's. ``generated``: the
  final ``usage.completion_tokens``, else the count of text chunks. TPOT is
  :attr:`RequestRecord.tpot_s` (``(finish - first) / (generated - 1)``, the
  simulator's mean decode step). ``bench.itl_s`` are gaps between successive
  tokens (0 between tokens that share a chunk).
* **Status.** Any non-200 answer (429/503 overload, 400, 5xx) is ``rejected`` with
  reason ``"HTTP <status>: <error message>"``; it is not retried (retrying would
  change the offered load). A timeout, a connection error, a malformed or truncated
  stream, or an error chunk mid-stream is ``unfinished`` with the reason in the
  record (``bench.unfinished_reasons`` counts them). Every request of the workload
  gets exactly one record: finished + rejected + unfinished == total.
* **ideal_s** (normalized latency, SLO attainment). ``ideal="probe"``: before the
  replay, on the idle server, one untimed warm-up request and then sequential probes
  at every (prompt, output) pair of ``probe_prompt_tokens × probe_output_tokens``
  (``probe_repeats`` times) per served model; ``ideal_s = a + b·prompt + c·output``
  is fitted to their end-to-end latencies by non-negative least squares
  (:func:`fit_ideal`) and stored with the measurements in ``bench.ideal_model``.
  The fit measures the server, never the replay. ``ideal="none"``: ``ideal_s`` is
  ``0``; ``metrics.summary`` then leaves those requests out of
  ``normalized_latency`` (-> ``None``) but would count them as SLO misses (``0.0``),
  which is not a measurement, so ``slo_attainment`` is set to ``None`` per scale
  and a note says why.
* **Fields a client cannot know.** ``gpus``, ``kv_utilization`` and ``migrations``
  keep their keys with ``None`` values (``by_mode`` empty) instead of the zeros the
  summary builder would compute from an empty cluster history.
  ``throughput_tokens_s`` counts the tokens the server returned (``generated``),
  which equals the simulator's definition when every finished request got its
  ``max_tokens``; a note reports any that did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from fleetserve.errors import ConfigError, FleetserveError
from fleetserve.metrics.records import RequestRecord, RunResult, Status, TimeSeries
from fleetserve.metrics.summary import DEFAULT_SLO_SCALES, latency_stats, summarize
from fleetserve.workload import (
    Request,
    assign_models,
    load_trace,
    scale_lengths,
    select_and_scale,
)

logger = logging.getLogger(__name__)

IDEAL_MODES: tuple[str, ...] = ("probe", "none")
"""How ``ideal_s`` is obtained: fitted from idle probes, or not at all."""

MODELS_PATH = "/v1/models"
COMPLETIONS_PATH = "/v1/completions"

UNNAMED_MODEL = ""
"""Model name the loaders give requests whose trace names no model."""

ProgressFn = Callable[[str, int, int, str], None]
"""``progress(phase, done, total, info)``; phase is ``"probe MODEL"`` or ``"replay"``."""

_PROBE_RETRIES = 3
_PROBE_MAX_WAIT_S = 5.0
_REASON_MAX_CHARS = 200


# --------------------------------------------------------------------------- errors


class ServerUnreachableError(FleetserveError):
    """The server could not be reached (connection refused, DNS, timeout) at start."""


class ServerAuthError(FleetserveError):
    """The server refused the API key (401/403) before the replay."""


class ServerResponseError(FleetserveError):
    """The server answered the start-up checks or the probe with something unusable."""


# --------------------------------------------------------------------------- config


def normalize_url(url: str) -> str:
    """``http://host:8000/v1/`` -> ``http://host:8000`` (the API paths are added here).

    Raises:
        ConfigError: not an ``http(s)://host[:port]`` URL.
    """
    text = url.strip().rstrip("/")
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, TypeError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"--url must look like http://HOST:PORT, got {url!r}")
    if text.endswith("/v1"):
        text = text[: -len("/v1")]
    return text


def _positive_int(name: str, v: int | None) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")


def _positive_float(name: str, v: float | None) -> None:
    if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What ``bench-serve`` replays, against which server, and how.

    Attributes:
        url: server base URL (``http://host:port``; a trailing ``/v1`` is accepted).
        trace: trace file.
        fmt: trace format (one of ``workload.FORMATS``); None detects it.
        rate: Poisson arrival rate for ``lengths`` traces (req/s).
        start_s, end_s: time window of the trace to keep (seconds from its start).
        max_requests: keep the first N requests (after the window).
        rate_scale: arrival-rate multiplier; every arrival time is divided by it
            (this is also the "time scale": 10 compresses the trace 10x).
        length_scale: multiply prompt and output lengths.
        max_prompt_tokens, max_output_tokens: caps applied last, so tiny models can
            replay a real trace.
        models: served model names to assign (weights ``model_weights``); None keeps
            the trace's names when the server serves all of them, else uses the
            server's first model.
        model_weights: popularity of ``models`` (default equal).
        token_range: inclusive ``(low, high)`` range of the prompt token ids.
        ideal: ``probe`` or ``none`` (see the module docstring).
        probe_prompt_tokens, probe_output_tokens: probe grid.
        probe_repeats: probes per grid point.
        timeout_s: limit of one request, send to end of stream.
        api_key: sent as ``Authorization: Bearer KEY`` when given.
        concurrency_limit: most requests in flight (None: open loop, no limit).
        seed: seeds the prompts, the model assignment and ``lengths`` arrivals.
        slo_scales: SLO scales reported in ``slo_attainment``.
    """

    url: str
    trace: str
    fmt: str | None = None
    rate: float | None = None
    start_s: float | None = None
    end_s: float | None = None
    max_requests: int | None = None
    rate_scale: float = 1.0
    length_scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    models: tuple[str, ...] | None = None
    model_weights: tuple[float, ...] | None = None
    token_range: tuple[int, int] = (0, 255)
    ideal: str = "probe"
    probe_prompt_tokens: tuple[int, ...] = (16, 128)
    probe_output_tokens: tuple[int, ...] = (8, 32)
    probe_repeats: int = 2
    timeout_s: float = 300.0
    api_key: str | None = None
    concurrency_limit: int | None = None
    seed: int = 0
    slo_scales: tuple[float, ...] = DEFAULT_SLO_SCALES

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        _positive_float("--rate-scale", self.rate_scale)
        _positive_float("--length-scale", self.length_scale)
        _positive_float("--timeout", self.timeout_s)
        _positive_float("--rate", self.rate)
        for name, v in (
            ("--max-requests", self.max_requests),
            ("--max-prompt-tokens", self.max_prompt_tokens),
            ("--max-output-tokens", self.max_output_tokens),
            ("--concurrency-limit", self.concurrency_limit),
            ("--probe-repeats", self.probe_repeats),
        ):
            _positive_int(name, v)
        for name, w in (("--start-s", self.start_s), ("--end-s", self.end_s)):
            if w is not None and not (math.isfinite(w) and w >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {w!r}")
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise ConfigError(f"--end-s ({self.end_s}) must be greater than --start-s")
        lo, hi = self.token_range
        if not (0 <= lo <= hi):
            raise ConfigError(
                f"--token-range must be LOW..HIGH with 0 <= LOW <= HIGH, got {lo}..{hi}"
            )
        if self.ideal not in IDEAL_MODES:
            raise ConfigError(
                f"--ideal must be one of {', '.join(IDEAL_MODES)}, got {self.ideal!r}"
            )
        for name, grid in (
            ("--probe-prompts", self.probe_prompt_tokens),
            ("--probe-outputs", self.probe_output_tokens),
        ):
            if not grid or any(isinstance(v, bool) or v < 1 for v in grid):
                raise ConfigError(f"{name} must be integers >= 1, got {list(grid)!r}")
        if self.models is not None and (not self.models or any(not m for m in self.models)):
            raise ConfigError(f"--model needs non-empty model names, got {list(self.models)!r}")
        if self.model_weights is not None:
            if self.models is None or len(self.models) != len(self.model_weights):
                raise ConfigError("--model-weights needs one weight per --model name")
            if any(not (math.isfinite(w) and w >= 0) for w in self.model_weights) or not any(
                self.model_weights
            ):
                raise ConfigError(
                    f"--model-weights must be >= 0 and not all 0, got {list(self.model_weights)!r}"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"--seed must be an integer >= 0, got {self.seed!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view for ``summary.json``'s ``config`` (the API key is redacted)."""
        d = asdict(self)
        d["api_key"] = None if self.api_key is None else "<redacted>"
        d["backend"] = "bench-serve"
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d


# --------------------------------------------------------------------------- workload


@dataclass(slots=True)
class BenchWorkload:
    """The requests to replay and what was done to them.

    Attributes:
        requests: arrival order, ids ``0..n-1``; ``model`` is the trace's name or
            :data:`UNNAMED_MODEL` until :func:`assign_served_models` runs.
        source: ``"path (format)"``.
        fmt: the trace format.
        notes: human-readable remarks (skipped rows, caps, model mapping).
        capped: requests shortened by ``max_prompt_tokens`` / ``max_output_tokens``.
    """

    requests: list[Request]
    source: str
    fmt: str
    notes: list[str] = field(default_factory=list)
    capped: int = 0


def cap_lengths(
    reqs: Sequence[Request], max_prompt: int | None, max_output: int | None
) -> tuple[list[Request], int]:
    """Clip prompt and output lengths to the caps; clipped requests get ``length_capped``.

    Returns:
        The requests (same order and ids) and how many were clipped.
    """
    out: list[Request] = []
    n = 0
    for r in reqs:
        p = r.prompt_tokens if max_prompt is None else min(r.prompt_tokens, max_prompt)
        o = r.output_tokens if max_output is None else min(r.output_tokens, max_output)
        if (p, o) != (r.prompt_tokens, r.output_tokens):
            n += 1
            r = Request(
                id=r.id,
                model=r.model,
                arrival_s=r.arrival_s,
                prompt_tokens=p,
                output_tokens=o,
                slo_ttft_s=r.slo_ttft_s,
                slo_tpot_s=r.slo_tpot_s,
                length_capped=True,
            )
        out.append(r)
    return out, n


def load_bench_workload(cfg: BenchConfig) -> BenchWorkload:
    """Load the trace and apply the window, ``max_requests``, rate and length transforms.

    Models are assigned later (:func:`assign_served_models`), once the server's
    model list is known.

    Raises:
        InputError: the trace is missing or malformed (file, line, field named).
        ConfigError: a transform argument is invalid or nothing is left.
    """
    loaded = load_trace(cfg.trace, cfg.fmt, model=UNNAMED_MODEL, rate=cfg.rate, seed=cfg.seed)
    reqs = list(loaded.requests)
    source = f"{cfg.trace} ({loaded.fmt})"
    skipped = loaded.skipped_note()
    notes: list[str] = [] if skipped is None else [skipped]
    reqs = select_and_scale(reqs, cfg.start_s, cfg.end_s, cfg.max_requests, cfg.rate_scale)
    if cfg.length_scale != 1.0:
        reqs, _ = scale_lengths(reqs, cfg.length_scale)
        notes.append(f"lengths scaled x{cfg.length_scale:g}")
    reqs, capped = cap_lengths(reqs, cfg.max_prompt_tokens, cfg.max_output_tokens)
    if capped:
        notes.append(
            f"{capped} of {len(reqs)} requests capped to prompt <= {cfg.max_prompt_tokens}, "
            f"output <= {cfg.max_output_tokens} tokens"
        )
    if not reqs:
        raise ConfigError(f"the workload from {source} is empty after its transforms")
    return BenchWorkload(reqs, source, loaded.fmt, notes, capped)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What ``GET /v1/models`` told about the server.

    Attributes:
        models: served model ids in the server's order; None when the server has no
            ``/v1/models`` (404).
        max_model_len: context length per model, where the server reports one
            (vLLM's ``max_model_len`` field).
    """

    models: tuple[str, ...] | None
    max_model_len: Mapping[str, int] = field(default_factory=dict)


def assign_served_models(
    wl: BenchWorkload, cfg: BenchConfig, server: ServerInfo
) -> tuple[list[Request], list[str]]:
    """Give every request a model name the server serves.

    With ``cfg.models``: drawn per request with ``cfg.model_weights`` (as the
    simulator's ``workload.models``). Without: the trace's names are kept where the
    server serves them, the others go to the server's first model (with a note).

    Returns:
        The requests and notes.

    Raises:
        ServerResponseError: a ``--model`` name the server does not list, or no
            ``--model`` and no model list to fall back on.
    """
    served = server.models
    notes: list[str] = []
    if cfg.models is not None:
        if served is not None:
            unknown = [m for m in cfg.models if m not in served]
            if unknown:
                raise ServerResponseError(
                    f"{cfg.url} does not serve model(s) {', '.join(map(repr, unknown))}; "
                    f"it serves: {', '.join(served) or 'nothing'}"
                )
        rng = np.random.default_rng(cfg.seed)
        return assign_models(wl.requests, list(cfg.models), cfg.model_weights, rng), notes
    if not served:
        why = "has no /v1/models" if served is None else "lists no models at /v1/models"
        raise ServerResponseError(f"{cfg.url} {why}; pass --model NAME")
    fallback = served[0]
    unknown_names = Counter(r.model for r in wl.requests if r.model not in served)
    if not unknown_names:
        return list(wl.requests), notes
    n = sum(unknown_names.values())
    if set(unknown_names) == {UNNAMED_MODEL}:
        notes.append(
            f"the trace names no models; all {n} requests sent to {fallback!r}, the server's "
            "first model (--model chooses)"
        )
    else:
        names = ", ".join(repr(m) for m in sorted(unknown_names) if m)
        notes.append(
            f"{n} of {len(wl.requests)} requests name no model the server serves "
            f"(trace: {names}); sent to {fallback!r}, the server's first model"
        )
    out = [
        r
        if r.model in served
        else Request(
            id=r.id,
            model=fallback,
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            output_tokens=r.output_tokens,
            slo_ttft_s=r.slo_ttft_s,
            slo_tpot_s=r.slo_tpot_s,
            length_capped=r.length_capped,
        )
        for r in wl.requests
    ]
    return out, notes


def prompt_ids(seed: int, stream: int, key: int, n: int, token_range: tuple[int, int]) -> list[int]:
    """``n`` token ids drawn uniformly from the inclusive ``token_range``.

    Deterministic in ``(seed, stream, key)``: stream 0 keys replay requests by id,
    stream 1 keys probes by their index.
    """
    lo, hi = token_range
    rng = np.random.default_rng((seed, stream, key))
    ids: list[int] = rng.integers(lo, hi + 1, size=n).tolist()
    return ids


# --------------------------------------------------------------------------- HTTP


def _one_line(text: str, limit: int = _REASON_MAX_CHARS) -> str:
    s = " ".join(text.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _describe(e: BaseException) -> str:
    return _one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _error_message(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the body text."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return _one_line(raw.decode("utf-8", "replace")) or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(str(err["message"]))
        if isinstance(err, str):
            return _one_line(err)
        if "detail" in data:  # FastAPI's own errors
            return _one_line(str(data["detail"]))
    return _one_line(raw.decode("utf-8", "replace"))


def _auth_hint(url: str, status: int, message: str) -> str:
    return (
        f"{url} answered {status} ({message}): wrong or missing API key; pass --api-key KEY "
        "or set FLEETSERVE_API_KEY"
    )


async def fetch_server_info(client: httpx.AsyncClient, url: str) -> ServerInfo:
    """``GET /v1/models``: the served model ids (and context lengths when reported).

    Raises:
        ServerUnreachableError: no connection (the message names ``url``).
        ServerAuthError: 401/403.
        ServerResponseError: another error status or a body that is not a model list.
    """
    try:
        resp = await client.get(MODELS_PATH)
    except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as e:
        raise ServerUnreachableError(
            f"the server at {url} accepted the connection but did not answer GET {MODELS_PATH} "
            f"({_describe(e)})"
        ) from None
    except httpx.HTTPError as e:
        raise ServerUnreachableError(
            f"cannot reach the server at {url} ({_describe(e)}); is it running and is the URL "
            "right?"
        ) from None
    if resp.status_code in (401, 403):
        raise ServerAuthError(_auth_hint(url, resp.status_code, _error_message(resp.content)))
    if resp.status_code == 404:
        return ServerInfo(None)
    if resp.status_code != 200:
        raise ServerResponseError(
            f"GET {url}{MODELS_PATH} answered {resp.status_code}: {_error_message(resp.content)}"
        )
    try:
        data = resp.json()
        items = data["data"]
        models = tuple(str(m["id"]) for m in items)
    except (ValueError, KeyError, TypeError):
        raise ServerResponseError(
            f"GET {url}{MODELS_PATH} did not return an OpenAI model list "
            f"({{'data': [{{'id': ...}}]}}): {_one_line(resp.text)}"
        ) from None
    ctx = {
        str(m["id"]): int(m["max_model_len"])
        for m in items
        if isinstance(m.get("max_model_len"), int) and m["max_model_len"] > 0
    }
    return ServerInfo(models, ctx)


@dataclass(slots=True)
class Outcome:
    """One streamed completion as the client saw it (``time.perf_counter`` seconds).

    Attributes:
        status: ``finished``, ``rejected`` (non-200) or ``unfinished``.
        reason: why it was rejected or did not finish.
        http_status: the response status (None without a response).
        send: when the request was sent.
        first_token: arrival of the first token (see :func:`_consume_sse`; None
            if none).
        last_token: arrival of the last token.
        end: when the exchange ended (stream closed, error, timeout).
        generated: ``usage.completion_tokens``, else non-empty text chunks.
        finish_reason: the last ``finish_reason`` seen.
        gaps: times between successive tokens (0 for tokens sharing a chunk).
    """

    status: Status = "unfinished"
    reason: str | None = None
    http_status: int | None = None
    send: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    end: float = 0.0
    generated: int = 0
    finish_reason: str | None = None
    gaps: list[float] = field(default_factory=list)

    @property
    def e2e_s(self) -> float | None:
        """Send to last token of a finished exchange."""
        if self.status != "finished":
            return None
        return (self.last_token if self.last_token is not None else self.end) - self.send


class _StreamError(Exception):
    """The stream broke its contract (error chunk, malformed JSON, early end)."""


async def _consume_sse(resp: httpx.Response, out: Outcome) -> None:
    """Read ``data:`` lines until ``[DONE]``; fill ``out``'s times and counts.

    Tokens are timed by ``usage.completion_tokens`` when the server sends it on
    its chunks (vLLM's ``continuous_usage_stats``, which :func:`completion_body`
    asks for): a chunk raising the count by k delivers k tokens, text or not.
    Otherwise each chunk with non-empty text counts as one token (a token whose
    text the server's detokenizer holds back then reaches the client late).
    """
    done = False
    usage_tokens: int | None = None
    per_token = False  # the server puts usage on its token chunks
    counted = 0
    first_choice: float | None = None

    def arrive(now: float, k: int) -> None:
        nonlocal counted
        for _ in range(k):
            if out.last_token is not None:
                out.gaps.append(now - out.last_token)
            if out.first_token is None:
                out.first_token = now
            out.last_token = now
        counted += k
        out.generated = counted  # so far; usage (if sent) has the last word

    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, event:/id: fields
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise _StreamError(f"malformed stream chunk {_one_line(payload, 80)!r}") from None
        if not isinstance(chunk, dict):
            raise _StreamError(f"stream chunk is not a JSON object: {_one_line(payload, 80)!r}")
        if "error" in chunk:
            raise _StreamError(f"error mid-stream: {_error_message(payload.encode())}")
        usage = chunk.get("usage")
        ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(ct, int) or isinstance(ct, bool):
            ct = None
        if ct is not None:
            usage_tokens = ct
        choices = [c for c in chunk.get("choices") or () if isinstance(c, dict)]
        if choices and first_choice is None:
            first_choice = now
        if choices and ct is not None:
            per_token = True
            if ct > counted:
                arrive(now, ct - counted)
        for choice in choices:
            if choice.get("text") and not per_token:
                arrive(now, 1)
            if choice.get("finish_reason") is not None:
                out.finish_reason = str(choice["finish_reason"])
    out.generated = usage_tokens if usage_tokens is not None else counted
    if out.first_token is None and first_choice is not None:
        out.first_token = out.last_token = first_choice  # tokens that decode to no text
    if not done and out.finish_reason is None:
        raise _StreamError("stream ended before [DONE] or a finish_reason")
    out.status = "finished"


async def stream_completion(
    client: httpx.AsyncClient, body: Mapping[str, Any], timeout_s: float
) -> tuple[Outcome, str | None]:
    """Send one streamed completion and measure it; never raises for HTTP trouble.

    Returns:
        The outcome and the ``Retry-After`` header of a non-200 answer (else None).
    """
    out = Outcome(send=time.perf_counter())
    retry_after: str | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", COMPLETIONS_PATH, json=body) as resp:
                out.http_status = resp.status_code
                if resp.status_code != 200:
                    raw = await resp.aread()
                    out.status = "rejected"
                    out.reason = f"HTTP {resp.status_code}: {_error_message(raw)}"
                    retry_after = resp.headers.get("retry-after")
                else:
                    await _consume_sse(resp, out)
    except TimeoutError:
        out.reason = f"timeout after {timeout_s:g} s"
    except httpx.TimeoutException as e:
        out.reason = f"timeout ({type(e).__name__})"
    except httpx.HTTPError as e:
        out.reason = f"connection error: {_describe(e)}"
    except _StreamError as e:
        out.reason = str(e)
    out.end = time.perf_counter()
    if out.status == "unfinished" and out.reason is None:  # pragma: no cover - defensive
        out.reason = "unknown"
    return out, retry_after


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The ``/v1/completions`` body of one replayed or probe request."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }


# --------------------------------------------------------------------------- ideal_s


@dataclass(frozen=True, slots=True)
class ProbePoint:
    """One probe: a request alone on the idle server."""

    prompt_tokens: int
    output_tokens: int
    e2e_s: float
    ttft_s: float | None


@dataclass(frozen=True, slots=True)
class IdealModel:
    """``ideal_s = a_s + b_s_per_prompt_token·prompt + c_s_per_output_token·output``.

    Attributes:
        a_s, b_s_per_prompt_token, c_s_per_output_token: the non-negative fit.
        rms_residual_s: root-mean-square residual of the fit over ``points``.
        points: the measurements it was fitted to.
    """

    a_s: float
    b_s_per_prompt_token: float
    c_s_per_output_token: float
    rms_residual_s: float
    points: tuple[ProbePoint, ...] = ()

    def ideal_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Predicted latency of a request alone on the idle server."""
        return (
            self.a_s
            + self.b_s_per_prompt_token * prompt_tokens
            + self.c_s_per_output_token * output_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view for ``bench.ideal_model``."""
        return {
            "formula": (
                "ideal_s = a_s + b_s_per_prompt_token * prompt + c_s_per_output_token * output"
            ),
            "a_s": self.a_s,
            "b_s_per_prompt_token": self.b_s_per_prompt_token,
            "c_s_per_output_token": self.c_s_per_output_token,
            "rms_residual_s": self.rms_residual_s,
            "points": [asdict(p) for p in self.points],
        }


def fit_ideal(points: Sequence[ProbePoint]) -> IdealModel:
    """Non-negative least squares of ``e2e ≈ a + b·prompt + c·output``.

    Exact NNLS for three unknowns: every subset of the columns is solved by
    ordinary least squares and the feasible (all coefficients >= 0) solution with
    the smallest residual wins — the NNLS optimum is the unconstrained optimum on
    its own set of positive coefficients, so it is among these candidates.

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("fit_ideal needs at least one probe point")
    x = np.array([[1.0, p.prompt_tokens, p.output_tokens] for p in points], dtype=np.float64)
    y = np.array([p.e2e_s for p in points], dtype=np.float64)
    best = np.zeros(3)
    best_res = float(np.sum(y**2))
    for k in (1, 2, 3):
        for cols in itertools.combinations(range(3), k):
            idx = list(cols)
            sol = np.linalg.lstsq(x[:, idx], y, rcond=None)[0]
            if np.any(sol < 0):
                continue
            coef = np.zeros(3)
            coef[idx] = sol
            res = float(np.sum((x @ coef - y) ** 2))
            if res < best_res - 1e-18:
                best, best_res = coef, res
    rms = math.sqrt(best_res / len(points))
    return IdealModel(float(best[0]), float(best[1]), float(best[2]), rms, tuple(points))


async def probe_ideal(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    context_len: int | None,
    progress: ProgressFn | None = None,
) -> IdealModel:
    """Measure ``model`` alone on the idle server and fit :class:`IdealModel`.

    One untimed warm-up request, then every (prompt, output) grid point
    ``probe_repeats`` times, strictly one after another. Prompts are cut so that
    prompt + output fits ``context_len`` when the server reports it. A 429/503 is
    retried after its ``Retry-After`` (at most 5 s, 3 times).

    Raises:
        ServerAuthError: 401/403.
        ServerResponseError: a probe that did not finish.
    """
    grid: set[tuple[int, int]] = set()
    for o in cfg.probe_output_tokens:
        for p in cfg.probe_prompt_tokens:
            if context_len is None:
                grid.add((p, o))
            else:
                out_len = min(o, max(1, context_len - 1))
                grid.add((max(1, min(p, context_len - out_len)), out_len))
    points_plan = sorted(grid)
    plan = [points_plan[0], *points_plan * cfg.probe_repeats]  # plan[0] is the warm-up
    points: list[ProbePoint] = []
    for i, (p, o) in enumerate(plan):
        if progress is not None:
            progress(f"probe {model}", i, len(plan), f"prompt {p}, output {o}")
        body = completion_body(model, prompt_ids(cfg.seed, 1, i, p, cfg.token_range), o)
        out = await _probe_once(client, cfg, body)
        if i > 0:
            e2e = out.e2e_s
            assert e2e is not None
            ttft = None if out.first_token is None else out.first_token - out.send
            points.append(ProbePoint(p, out.generated or o, e2e, ttft))
    if progress is not None:
        progress(f"probe {model}", len(plan), len(plan), "done")
    fit = fit_ideal(points)
    logger.info(
        "ideal_s fit for %s: a=%.4g s, b=%.4g s/prompt token, c=%.4g s/output token (rms %.3g s)",
        model,
        fit.a_s,
        fit.b_s_per_prompt_token,
        fit.c_s_per_output_token,
        fit.rms_residual_s,
    )
    return fit


async def _probe_once(client: httpx.AsyncClient, cfg: BenchConfig, body: dict[str, Any]) -> Outcome:
    for attempt in range(_PROBE_RETRIES + 1):
        out, retry_after = await stream_completion(client, body, cfg.timeout_s)
        if out.status == "finished":
            return out
        if out.http_status in (401, 403):
            msg = (out.reason or "").split(": ", 1)[-1]
            raise ServerAuthError(_auth_hint(cfg.url, out.http_status, msg))
        if out.http_status in (429, 503) and attempt < _PROBE_RETRIES:
            wait = _PROBE_MAX_WAIT_S  # also for an HTTP-date Retry-After
            with contextlib.suppress(ValueError):
                wait = min(max(float(retry_after or 1.0), 0.0), _PROBE_MAX_WAIT_S)
            logger.info("probe got %s; retrying in %.1f s", out.reason, wait)
            await asyncio.sleep(wait)
            continue
        break
    raise ServerResponseError(
        f"ideal-time probe of model {body['model']!r} at {cfg.url} failed: {out.reason} "
        "(use --ideal none to skip the probe)"
    )


# --------------------------------------------------------------------------- replay


@dataclass(slots=True)
class _Live:
    """Counters the replay updates as requests go out and come back."""

    total: int
    sent: int = 0
    done: int = 0
    in_flight: int = 0
    peak: int = 0
    rejected: int = 0
    unfinished: int = 0

    def info(self) -> str:
        return (
            f"done, {self.in_flight} in flight ({self.sent} sent), "
            f"{self.rejected} rejected, {self.unfinished} unfinished"
        )


async def replay(
    client: httpx.AsyncClient,
    reqs: Sequence[Request],
    cfg: BenchConfig,
    progress: ProgressFn | None = None,
) -> tuple[list[Outcome], list[float], int, float]:
    """Send every request at its arrival time (open loop) and wait for all of them.

    Returns:
        Outcomes in request order, each request's scheduled send time (perf_counter
        seconds), the peak number in flight, and ``t0`` (the replay's time zero).
    """
    live = _Live(total=len(reqs))
    sem = asyncio.Semaphore(cfg.concurrency_limit) if cfg.concurrency_limit else None
    t0 = time.perf_counter() + 0.01
    scheduled = [t0 + r.arrival_s for r in reqs]

    def report() -> None:
        if progress is not None:
            progress("replay", live.done, live.total, live.info())

    async def send(r: Request) -> Outcome:
        prompt = prompt_ids(cfg.seed, 0, r.id, r.prompt_tokens, cfg.token_range)
        body = completion_body(r.model, prompt, r.output_tokens)
        live.sent += 1
        live.in_flight += 1
        live.peak = max(live.peak, live.in_flight)
        report()
        try:
            out, _ = await stream_completion(client, body, cfg.timeout_s)
        except Exception as e:  # anything unexpected still yields a record
            logger.exception("request %d failed in the client", r.id)
            out = Outcome(send=time.perf_counter(), end=time.perf_counter())
            out.reason = f"client error: {_describe(e)}"
        live.in_flight -= 1
        live.done += 1
        live.rejected += out.status == "rejected"
        live.unfinished += out.status == "unfinished"
        report()
        return out

    async def one(r: Request) -> Outcome:
        if sem is None:
            return await send(r)
        async with sem:
            return await send(r)

    tasks: list[asyncio.Task[Outcome]] = []
    for r, at in zip(reqs, scheduled, strict=True):
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(r)))
    outcomes = list(await asyncio.gather(*tasks))
    report()
    return outcomes, scheduled, live.peak, t0


# --------------------------------------------------------------------------- run


@dataclass(slots=True)
class BenchResult:
    """What a bench run produced.

    Attributes:
        result: records and metadata in the simulator's :class:`RunResult` form.
        summary: the ``summary.json`` dict.
    """

    result: RunResult
    summary: dict[str, Any]


def _record(r: Request, out: Outcome, t0: float, ideal: float) -> RequestRecord:
    rec = RequestRecord(
        id=r.id,
        model=r.model,
        arrival_s=out.send - t0,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
        status=out.status,
        reason=out.reason,
        generated=out.generated,
        ideal_s=ideal,
    )
    if out.status != "rejected" and out.first_token is not None:
        rec.first_token_s = out.first_token - t0
    if out.status == "finished":
        last = out.last_token if out.last_token is not None else out.end
        rec.finish_s = last - t0
    return rec


def _counts(values: Sequence[Any]) -> dict[str, int]:
    return {str(k): n for k, n in sorted(Counter(values).items(), key=lambda kv: str(kv[0]))}


def _unknowable(summary: dict[str, Any]) -> None:
    """Replace the cluster figures an HTTP client cannot observe by None."""
    summary["gpus"] = dict.fromkeys(("peak", "mean", "gpu_hours", "lower_bound"))
    summary["kv_utilization"] = {"mean": None}
    summary["migrations"] = {"count": None, "per_s": None, "bytes": None, "by_mode": {}}


async def run_bench_async(cfg: BenchConfig, progress: ProgressFn | None = None) -> BenchResult:
    """Load the workload, check the server, probe ``ideal_s``, replay, summarize.

    Raises:
        InputError, ConfigError: a bad trace or bad settings (before any request).
        ServerUnreachableError, ServerAuthError, ServerResponseError: the server
            at start or during the probe.
    """
    wall0 = time.perf_counter()
    wl = load_bench_workload(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency_limit, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 10.0))
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        server = await fetch_server_info(client, cfg.url)
        reqs, model_notes = assign_served_models(wl, cfg, server)
        notes = wl.notes + model_notes
        used = sorted({r.model for r in reqs})
        for m in used:
            ctx = server.max_model_len.get(m)
            over = sum(r.total_tokens > ctx for r in reqs if r.model == m) if ctx else 0
            if over:
                notes.append(
                    f"{over} requests for {m!r} need more than its context of {ctx} tokens; "
                    "the server may reject them (cap with --max-prompt-tokens/--max-output-tokens)"
                )
        ideals: dict[str, IdealModel] = {}
        if cfg.ideal == "probe":
            for m in used:
                ideals[m] = await probe_ideal(client, cfg, m, server.max_model_len.get(m), progress)
        else:
            notes.append(
                "--ideal none: no idle-server execution times, so normalized_latency and "
                "slo_attainment are not measured (None)"
            )
        replay0 = time.perf_counter()
        outcomes, scheduled, peak, t0 = await replay(client, reqs, cfg, progress)
        replay_wall = time.perf_counter() - replay0

    wall_s = time.perf_counter() - wall0
    run = _Run(cfg, wl, server, reqs, outcomes, scheduled, peak, t0, ideals, notes)
    return _summarize_run(run, wall_s, replay_wall)


@dataclass(slots=True)
class _Run:
    """Everything a replay produced, before it is summarized."""

    cfg: BenchConfig
    wl: BenchWorkload
    server: ServerInfo
    reqs: list[Request]
    outcomes: list[Outcome]
    scheduled: list[float]
    peak: int
    t0: float
    ideals: dict[str, IdealModel]
    notes: list[str]


def _summarize_run(run: _Run, wall_s: float, replay_wall_s: float) -> BenchResult:
    """Records, the ``bench`` section and the summary (see the module docstring)."""
    cfg, wl, reqs, outcomes, ideals, notes = (
        run.cfg,
        run.wl,
        run.reqs,
        run.outcomes,
        run.ideals,
        run.notes,
    )
    t0 = run.t0
    records = [
        _record(
            r, out, t0, ideals[r.model].ideal_s(r.prompt_tokens, r.output_tokens) if ideals else 0.0
        )
        for r, out in zip(reqs, outcomes, strict=True)
    ]
    end_s = max((out.end - t0 for out in outcomes), default=0.0)
    finished = [
        (rec, out) for rec, out in zip(records, outcomes, strict=True) if out.status == "finished"
    ]
    short = sum(rec.generated != rec.output_tokens for rec, _ in finished)
    if short:
        notes.append(
            f"{short} finished requests returned a different number of tokens than max_tokens "
            "(does the server honour ignore_eos?); throughput counts the tokens returned"
        )
    lags = [out.send - at for out, at in zip(outcomes, run.scheduled, strict=True)]
    gaps = [g for out in outcomes for g in out.gaps]
    bench: dict[str, Any] = {
        "url": cfg.url,
        "trace": wl.source,
        "format": wl.fmt,
        "scales": {
            "rate_scale": cfg.rate_scale,
            "length_scale": cfg.length_scale,
            "max_prompt_tokens": cfg.max_prompt_tokens,
            "max_output_tokens": cfg.max_output_tokens,
            "max_requests": cfg.max_requests,
            "start_s": cfg.start_s,
            "end_s": cfg.end_s,
            "length_capped": wl.capped,
        },
        "models": _counts([r.model for r in reqs]),
        "server_models": None if run.server.models is None else list(run.server.models),
        "concurrency_peak": run.peak,
        "concurrency_limit": cfg.concurrency_limit,
        "wall_s": wall_s,
        "replay_wall_s": replay_wall_s,
        "trace_span_s": reqs[-1].arrival_s - reqs[0].arrival_s,
        "send_lag_s": {**latency_stats(lags), "max": max(lags, default=None)},
        "itl_s": latency_stats(gaps),
        "http_status": _counts([out.http_status for out in outcomes if out.http_status]),
        "finish_reasons": _counts([o.finish_reason for o in outcomes if o.finish_reason]),
        "rejected_reasons": _counts([o.reason for o in outcomes if o.status == "rejected"]),
        "unfinished_reasons": _counts([o.reason for o in outcomes if o.status == "unfinished"]),
        "ideal": cfg.ideal,
        "ideal_model": {m: f.to_dict() for m, f in ideals.items()} if ideals else None,
        "timeout_s": cfg.timeout_s,
        "token_range": list(cfg.token_range),
    }
    result = RunResult(
        records=records,
        timeseries=TimeSeries(interval_s=1.0),
        gpu_intervals=[],
        migrations=[],
        end_s=end_s,
        kv_bytes_per_gpu=None,
        config=cfg.to_dict(),
        notes=notes,
        extra={"bench": bench},
    )
    summary = summarize(result, cfg.slo_scales)
    _unknowable(summary)
    start_s = min((rec.arrival_s for rec in records), default=0.0)
    span = end_s - start_s
    tokens = sum(rec.generated for rec, _ in finished)
    summary["throughput_tokens_s"] = tokens / span if span > 0 else None
    if not ideals:
        summary["slo_attainment"] = dict.fromkeys(summary["slo_attainment"])
        for svc in summary["services"].values():
            svc["slo_attainment"] = dict.fromkeys(svc["slo_attainment"])
    return BenchResult(result, summary)


def run_bench(cfg: BenchConfig, progress: ProgressFn | None = None) -> BenchResult:
    """Synchronous :func:`run_bench_async` (runs its own event loop)."""
    return asyncio.run(run_bench_async(cfg, progress))


def write_bench(out_dir: str | Path, bench: BenchResult) -> list[Path]:
    """Write ``summary.json``, ``requests.csv``, ``latency_cdf.png`` and ``report.md``.

    The simulator's ``timeseries.csv``/``migrations.csv``/``timeseries.png`` are not
    written: a client observes no cluster state.

    Returns:
        The paths written, ``summary.json`` first and ``report.md`` last.
    """
    from fleetserve.metrics.io import SUMMARY_FILE, dumps_summary, write_requests_csv
    from fleetserve.metrics.plots import plot_latency_cdf
    from fleetserve.metrics.report import render_report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / SUMMARY_FILE
    summary_path.write_text(dumps_summary(bench.summary), encoding="utf-8")
    files = [
        summary_path,
        write_requests_csv(out / "requests.csv", bench.result.records),
        plot_latency_cdf(bench.result.records, out / "latency_cdf.png"),
    ]
    report_path = out / "report.md"
    report_path.write_text(
        render_report(bench.summary, files) + _bench_markdown(bench.summary), encoding="utf-8"
    )
    files.append(report_path)
    return files


def _bench_markdown(summary: Mapping[str, Any]) -> str:
    b = summary.get("bench") or {}
    lines = [
        "",
        "## Benchmark (bench-serve)",
        "",
        f"- server: {b.get('url')}, trace: {b.get('trace')}",
        f"- peak in flight: {b.get('concurrency_peak')}, replay wall: "
        f"{b.get('replay_wall_s', 0.0):.2f} s, total wall: {b.get('wall_s', 0.0):.2f} s",
        f"- HTTP statuses: {b.get('http_status')}",
    ]
    for model, fit in (b.get("ideal_model") or {}).items():
        lines.append(
            f"- ideal_s for {model}: {fit['a_s']:.4g} s + {fit['b_s_per_prompt_token']:.4g} "
            f"s/prompt token + {fit['c_s_per_output_token']:.4g} s/output token "
            f"(rms residual {fit['rms_residual_s']:.3g} s over {len(fit['points'])} probes)"
        )
    return "\n".join(lines) + "\n"


__all__ = [
    "IDEAL_MODES",
    "BenchConfig",
    "BenchResult",
    "BenchWorkload",
    "IdealModel",
    "Outcome",
    "ProbePoint",
    "ServerAuthError",
    "ServerInfo",
    "ServerResponseError",
    "ServerUnreachableError",
    "assign_served_models",
    "cap_lengths",
    "completion_body",
    "fetch_server_info",
    "fit_ideal",
    "load_bench_workload",
    "normalize_url",
    "probe_ideal",
    "prompt_ids",
    "replay",
    "run_bench",
    "run_bench_async",
    "stream_completion",
    "write_bench",
]
