"""Trace loaders: read a request trace file into :class:`~fleetserve.workload.request.Request` s.

Every loader returns a :class:`LoadedTrace` whose requests are in arrival order, have ids
``0..n-1`` and arrival times in seconds relative to the first request (the first is at
``0.0``). Any bad input raises :class:`~fleetserve.errors.InputError` whose one-line message
names the file, the 1-based line, the field and what was expected.

Formats (``fmt``)::

    azure     Azure LLM inference trace CSV (Patel et al., Splitwise).
              Columns: TIMESTAMP,ContextTokens,GeneratedTokens
              TIMESTAMP is a wall-clock time "2023-11-16 18:15:46.6805900" (any number of
              fractional digits, optional "T" separator, optional "Z"/"+hh:mm" offset).
    mooncake  Mooncake (Kimi) JSONL, one object per line.
              Keys: timestamp (milliseconds), input_length, output_length; optional
              hash_ids: the chained ids of the prompt's 512-token prefix blocks (the
              last one may be partial), kept as the request's ``prefix_blocks`` with
              ``prefix_block_tokens`` 512 (at most ceil(input_length / 512) ids,
              each an integer; an empty list means none). Other keys are ignored.
    burstgpt  BurstGPT CSV.
              Columns: Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
              Timestamp is in seconds. Failed requests have "Response tokens" 0: they are
              skipped (see below). The trace's own Model column (ChatGPT, GPT-4) is not a
              catalog name; every request is served by ``model``.
    lengths   Length-only CSV without timestamps (e.g. sarathi-serve's ShareGPT file).
              Columns: num_prefill_tokens,num_decode_tokens (others ignored).
              Arrivals are a Poisson process at ``rate`` req/s (required), drawn from
              ``numpy.random.default_rng(seed)``, in file order.
    jsonl     fleetserve's native JSONL, one object per line.
              Required keys: arrival_s, prompt_tokens, output_tokens.
              Optional keys: model (default: ``model``), slo_ttft_s, slo_tpot_s (> 0 or null).
              Any other key is an error.

Rules shared by all formats:

- the file must have at least one data row (an empty or header-only file is an error);
- a missing required column/key is an error naming it and listing the ones found;
- token counts must be non-negative integers (``"12.0"`` is accepted, ``"12.5"`` is not);
- timestamps must be non-decreasing in file order (no silent re-sorting);
- a row that is valid data but cannot be a request (0 prompt or 0 output tokens, such as a
  BurstGPT failure) is not dropped silently: it goes into :attr:`LoadedTrace.skipped` with
  its line and reason, and the loader logs one warning with the count.

Blank lines are ignored. Line numbers count every physical line, the CSV header included.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from fleetserve.errors import ConfigError, InputError, UnknownNameError
from fleetserve.workload.request import Request

logger = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("azure", "mooncake", "burstgpt", "lengths", "jsonl")
"""Trace formats :func:`load_trace` understands."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per prefix block of a Mooncake trace's ``hash_ids``."""

JSONL_REQUIRED: tuple[str, ...] = ("arrival_s", "prompt_tokens", "output_tokens")
JSONL_OPTIONAL: tuple[str, ...] = ("model", "slo_ttft_s", "slo_tpot_s")


@dataclass(frozen=True, slots=True)
class SkippedRow:
    """A data row that was valid but could not become a request.

    Attributes:
        line: 1-based line number in the source file.
        reason: why it was skipped, e.g. ``"output tokens is 0 (a failed request)"``.
    """

    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class LoadedTrace:
    """The result of :func:`load_trace`.

    Attributes:
        requests: requests in arrival order, ids ``0..n-1``, first arrival at 0.0.
        skipped: rows that were valid data but could not be requests.
        source: the path the trace was read from.
        fmt: the format it was read as (one of :data:`FORMATS`).
    """

    requests: tuple[Request, ...]
    skipped: tuple[SkippedRow, ...]
    source: str
    fmt: str

    def __len__(self) -> int:
        return len(self.requests)

    def skipped_note(self) -> str | None:
        """One line counting the skipped rows by reason (None when none were)."""
        if not self.skipped:
            return None
        reasons: dict[str, int] = {}
        for s in self.skipped:
            reasons[s.reason] = reasons.get(s.reason, 0) + 1
        detail = "; ".join(f"{n} x {r}" for r, n in sorted(reasons.items()))
        return f"skipped {len(self.skipped)} trace rows that cannot be requests: {detail}"


@dataclass(frozen=True, slots=True)
class _Row:
    """One parsed data row before it becomes a request."""

    line: int
    time_s: float | None
    prompt: int
    output: int
    model: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    stamp: str | None = None  # the timestamp as written, for error messages
    prefix: tuple[int, ...] | None = None  # prefix block ids (mooncake hash_ids)


# --------------------------------------------------------------------------- entry points


def load_trace(
    path: str | Path,
    fmt: str | None = None,
    *,
    model: str = "llama-2-7b",
    rate: float | None = None,
    seed: int = 0,
) -> LoadedTrace:
    """Load a trace file.

    Args:
        path: the trace file.
        fmt: one of :data:`FORMATS`; ``None`` detects it from the file (see
            :func:`detect_format`).
        model: catalog model name given to every request that does not name its own.
        rate: Poisson arrival rate in req/s; required for ``"lengths"`` and rejected for
            the formats that carry their own timestamps (use
            :func:`fleetserve.workload.transforms.scale_rate` to change their rate).
        seed: seed of the ``numpy.random.Generator`` drawing ``"lengths"`` arrivals.

    Returns:
        The requests plus the rows that were skipped.

    Raises:
        InputError: the file is missing, unreadable or malformed (one line naming file,
            line and field).
        ConfigError: ``rate`` is missing for ``"lengths"``, invalid, or given for a
            timestamped format.
        UnknownNameError: ``fmt`` is not a known format.
    """
    p = Path(path)
    src = str(path)
    if fmt is None:
        fmt = detect_format(p)
    if fmt not in FORMATS:
        raise UnknownNameError("trace format", fmt, FORMATS)
    if fmt == "lengths":
        if rate is None:
            raise ConfigError(
                f"{src}: format 'lengths' has no timestamps; give an arrival rate "
                "(rate=..., req/s) for its Poisson arrivals"
            )
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"{src}: rate must be a finite number > 0 req/s, got {rate!r}")
    elif rate is not None:
        raise ConfigError(
            f"{src}: rate applies only to format 'lengths'; format {fmt!r} has its own "
            "timestamps (use scale_rate to change its rate)"
        )

    if fmt == "azure":
        rows = _parse_azure(p, src)
    elif fmt == "burstgpt":
        rows = _parse_burstgpt(p, src)
    elif fmt == "lengths":
        rows = _parse_lengths(p, src)
    elif fmt == "mooncake":
        rows = _parse_mooncake(p, src)
    else:
        rows = _parse_native(p, src)
    return _build(rows, src, fmt, model=model, rate=rate, seed=seed)


def detect_format(path: str | Path) -> str:
    """Guess a trace's format from its first line.

    CSV headers are recognised by their columns (``ContextTokens`` → azure,
    ``Response tokens`` → burstgpt, ``num_prefill_tokens`` → lengths); a JSON first line by
    its keys (``input_length`` → mooncake, ``arrival_s`` → jsonl).

    Raises:
        InputError: the file cannot be read or matches no known format.
    """
    src = str(path)
    with _open(Path(path), src) as f:
        first = ""
        try:
            for raw in f:
                if raw.strip():
                    first = raw.strip()
                    break
        except UnicodeDecodeError:
            raise InputError("not a UTF-8 text file", file=src) from None
    if not first:
        raise InputError("file is empty; cannot detect its trace format", file=src)
    if first.startswith("{"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            keys = set()
        if "input_length" in keys:
            return "mooncake"
        if "arrival_s" in keys:
            return "jsonl"
    else:
        cols = {c.strip() for c in next(csv.reader([first]))}
        if "ContextTokens" in cols:
            return "azure"
        if "Response tokens" in cols:
            return "burstgpt"
        if "num_prefill_tokens" in cols:
            return "lengths"
    raise InputError(
        f"cannot detect the trace format from the first line {first[:80]!r}; "
        f"pass a format, one of {', '.join(FORMATS)}",
        file=src,
        line=1,
    )


# --------------------------------------------------------------------------- building


def _build(
    rows: list[_Row], src: str, fmt: str, *, model: str, rate: float | None, seed: int
) -> LoadedTrace:
    """Check order, split off unusable rows, re-base times and number the requests."""
    kept: list[_Row] = []
    skipped: list[SkippedRow] = []
    prev: _Row | None = None
    for row in rows:
        if row.time_s is not None:
            if prev is not None and prev.time_s is not None and row.time_s < prev.time_s:
                raise InputError(
                    f"timestamps must be non-decreasing: line {row.line} has "
                    f"{_shown(row)} < previous {_shown(prev)} "
                    f"(line {prev.line})",
                    file=src,
                    line=row.line,
                    field=_TIME_FIELD[fmt],
                )
            prev = row
        if row.prompt == 0:
            skipped.append(SkippedRow(row.line, "prompt tokens is 0"))
        elif row.output == 0:
            skipped.append(SkippedRow(row.line, "output tokens is 0 (e.g. a failed request)"))
        else:
            kept.append(row)

    if skipped:
        reasons = Counter(s.reason for s in skipped)
        logger.warning(
            "%s: skipped %d of %d rows that cannot be requests (%s); first at line %d",
            src,
            len(skipped),
            len(rows),
            "; ".join(f"{n} × {r}" for r, n in reasons.items()),
            skipped[0].line,
        )
    if not kept:
        raise InputError(
            f"no usable requests: all {len(rows)} data rows were skipped "
            f"(line {skipped[0].line}: {skipped[0].reason})",
            file=src,
        )

    if fmt == "lengths":
        assert rate is not None
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0 / rate, size=len(kept) - 1)
        times = [0.0, *np.cumsum(gaps).tolist()]
    else:
        t0 = kept[0].time_s
        assert t0 is not None
        times = [max(0.0, r.time_s - t0) if r.time_s is not None else 0.0 for r in kept]

    requests = tuple(
        Request(
            id=i,
            model=r.model if r.model is not None else model,
            arrival_s=t,
            prompt_tokens=r.prompt,
            output_tokens=r.output,
            slo_ttft_s=r.slo_ttft_s,
            slo_tpot_s=r.slo_tpot_s,
            prefix_blocks=r.prefix,
            prefix_block_tokens=None if r.prefix is None else MOONCAKE_BLOCK_TOKENS,
        )
        for i, (r, t) in enumerate(zip(kept, times, strict=True))
    )
    logger.debug("%s: loaded %d requests as %s", src, len(requests), fmt)
    return LoadedTrace(requests=requests, skipped=tuple(skipped), source=src, fmt=fmt)


_TIME_FIELD = {
    "azure": "TIMESTAMP",
    "burstgpt": "Timestamp",
    "mooncake": "timestamp",
    "jsonl": "arrival_s",
    "lengths": "",
}


def _shown(row: _Row) -> str:
    if row.stamp is not None:
        return row.stamp
    return f"{row.time_s:.7f}".rstrip("0").rstrip(".")


# --------------------------------------------------------------------------- file access


def _open(p: Path, src: str) -> IO[str]:
    try:
        return p.open(encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise InputError("file not found", file=src) from None
    except IsADirectoryError:
        raise InputError("is a directory, expected a trace file", file=src) from None
    except OSError as e:
        raise InputError(f"cannot open: {e.strerror}", file=src) from None


# --------------------------------------------------------------------------- CSV formats


def _csv_rows(p: Path, src: str, required: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """Yield ``(line, fields)`` for data rows, with ``fields`` in ``required`` order."""
    with _open(p, src) as f:
        reader = csv.reader(f)
        try:
            header: list[str] | None = None
            header_line = 0
            for raw in reader:
                if raw and any(c.strip() for c in raw):
                    header = [c.strip() for c in raw]
                    header_line = reader.line_num
                    break
            if header is None:
                raise InputError(
                    f"file is empty; expected a CSV header with columns {', '.join(required)}",
                    file=src,
                )
            idx: list[int] = []
            for col in required:
                if col not in header:
                    raise InputError(
                        f"missing required column {col!r}; found columns: "
                        f"{', '.join(repr(h) for h in header)}",
                        file=src,
                        line=header_line,
                        field=col,
                    )
                idx.append(header.index(col))
            width = len(header)
            n = 0
            for raw in reader:
                if not raw or (len(raw) == 1 and not raw[0].strip()):
                    continue
                if len(raw) != width:
                    raise InputError(
                        f"expected {width} comma-separated fields (as in the header), "
                        f"found {len(raw)}",
                        file=src,
                        line=reader.line_num,
                    )
                n += 1
                yield reader.line_num, [raw[i] for i in idx]
            if n == 0:
                raise InputError("no data rows after the header", file=src)
        except csv.Error as e:
            raise InputError(f"malformed CSV: {e}", file=src, line=reader.line_num) from None
        except UnicodeDecodeError:
            raise InputError("not a UTF-8 text file", file=src) from None


def _tokens(text: str, src: str, line: int, field: str) -> int:
    """Parse a non-negative integer token count."""
    try:
        v = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            shown = repr(text) if text.strip() else "an empty value"
            raise InputError(
                f"expected a non-negative integer token count, got {shown}",
                file=src,
                line=line,
                field=field,
            ) from None
        if not (math.isfinite(f) and f.is_integer()):
            raise InputError(
                f"expected a non-negative integer token count, got {text!r}",
                file=src,
                line=line,
                field=field,
            ) from None
        v = int(f)
    if v < 0:
        raise InputError(f"token count must be >= 0, got {v}", file=src, line=line, field=field)
    return v


def _seconds(text: str, src: str, line: int, field: str) -> float:
    """Parse a finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        shown = repr(text) if text.strip() else "an empty value"
        raise InputError(
            f"expected a timestamp in seconds (a finite number), got {shown}",
            file=src,
            line=line,
            field=field,
        )
    return v


_TS_RE = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)(Z|[+-]\d{2}:?\d{2})?"
)


class _Days:
    """Seconds from the trace's first date to each date seen (a trace spans few days).

    Times are kept relative to the first date rather than the Unix epoch so that the
    7 fractional digits of the Azure timestamps survive in a float.
    """

    __slots__ = ("_ref", "_seen")

    def __init__(self) -> None:
        self._ref: int | None = None
        self._seen: dict[str, float] = {}

    def offset(self, date_s: str) -> float:
        day = self._seen.get(date_s)
        if day is None:
            try:
                ordinal = dt.date.fromisoformat(date_s).toordinal()
            except ValueError:
                day = math.nan
            else:
                if self._ref is None:
                    self._ref = ordinal
                day = float((ordinal - self._ref) * 86400)
            self._seen[date_s] = day
        return day


def _wallclock(text: str, src: str, line: int, field: str, days: _Days) -> float:
    """Parse ``YYYY-MM-DD HH:MM:SS.fffffff[+hh:mm]`` to seconds (UTC) since the first date.

    Hand-parsed because ``datetime`` keeps only 6 fractional digits and is slower.
    """
    m = _TS_RE.fullmatch(text.strip())
    if m is not None:
        date_s, hh, mm, ss, tz = m.groups()
        day = days.offset(date_s)
        h, mi, s = int(hh), int(mm), float(ss)
        if not math.isnan(day) and h < 24 and mi < 60 and s < 61:
            t = day + h * 3600 + mi * 60 + s
            if tz and tz != "Z":
                sign = -1 if tz[0] == "-" else 1
                off = tz[1:].replace(":", "")
                t -= sign * (int(off[:2]) * 3600 + int(off[2:]) * 60)
            return t
    shown = repr(text) if text.strip() else "an empty value"
    raise InputError(
        f"expected a timestamp like '2023-11-16 18:15:46.6805900', got {shown}",
        file=src,
        line=line,
        field=field,
    )


def _parse_azure(p: Path, src: str) -> list[_Row]:
    cols = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    days = _Days()
    return [
        _Row(
            line,
            _wallclock(ts, src, line, cols[0], days),
            _tokens(pt, src, line, cols[1]),
            _tokens(ot, src, line, cols[2]),
            stamp=ts.strip(),
        )
        for line, (ts, pt, ot) in _csv_rows(p, src, cols)
    ]


def _parse_burstgpt(p: Path, src: str) -> list[_Row]:
    cols = ("Timestamp", "Request tokens", "Response tokens")
    return [
        _Row(
            line,
            _seconds(ts, src, line, cols[0]),
            _tokens(pt, src, line, cols[1]),
            _tokens(ot, src, line, cols[2]),
            stamp=ts.strip(),
        )
        for line, (ts, pt, ot) in _csv_rows(p, src, cols)
    ]


def _parse_lengths(p: Path, src: str) -> list[_Row]:
    cols = ("num_prefill_tokens", "num_decode_tokens")
    return [
        _Row(line, None, _tokens(pt, src, line, cols[0]), _tokens(ot, src, line, cols[1]))
        for line, (pt, ot) in _csv_rows(p, src, cols)
    ]


# --------------------------------------------------------------------------- JSONL formats


def _json_objects(p: Path, src: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line, object)`` for each non-blank line."""
    with _open(p, src) as f:
        n = 0
        line = 0
        try:
            for line, raw in enumerate(f, start=1):
                text = raw.strip()
                if not text:
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise InputError(
                        f"invalid JSON at column {e.colno}: {e.msg}", file=src, line=line
                    ) from None
                if not isinstance(obj, dict):
                    raise InputError(
                        f"expected a JSON object per line, got {type(obj).__name__}",
                        file=src,
                        line=line,
                    )
                n += 1
                yield line, obj
        except UnicodeDecodeError:
            raise InputError("not a UTF-8 text file", file=src, line=line + 1) from None
        if n == 0:
            raise InputError("file is empty; expected one JSON object per line", file=src)


def _require(obj: dict[str, Any], keys: Sequence[str], src: str, line: int) -> None:
    for k in keys:
        if k not in obj:
            raise InputError(
                f"missing required key {k!r}; found keys: {', '.join(repr(x) for x in obj)}",
                file=src,
                line=line,
                field=k,
            )


def _json_tokens(v: Any, src: str, line: int, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise InputError(
            f"expected a non-negative integer token count, got {json.dumps(v)}",
            file=src,
            line=line,
            field=field,
        )
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise InputError(
            f"expected a non-negative integer token count, got {v!r}",
            file=src,
            line=line,
            field=field,
        )
    if v < 0:
        raise InputError(f"token count must be >= 0, got {v}", file=src, line=line, field=field)
    return int(v)


def _json_number(v: Any, src: str, line: int, field: str, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InputError(f"expected {what}, got {json.dumps(v)}", file=src, line=line, field=field)
    return float(v)


def _parse_mooncake(p: Path, src: str) -> list[_Row]:
    rows = []
    for line, obj in _json_objects(p, src):
        _require(obj, ("timestamp", "input_length", "output_length"), src, line)
        ms = _json_number(obj["timestamp"], src, line, "timestamp", "a timestamp in ms")
        prompt = _json_tokens(obj["input_length"], src, line, "input_length")
        rows.append(
            _Row(
                line,
                ms / 1000.0,
                prompt,
                _json_tokens(obj["output_length"], src, line, "output_length"),
                stamp=json.dumps(obj["timestamp"]),
                prefix=_hash_ids(obj.get("hash_ids"), prompt, src, line),
            )
        )
    return rows


def _hash_ids(v: Any, prompt: int, src: str, line: int) -> tuple[int, ...] | None:
    """A Mooncake row's ``hash_ids`` (absent, null or [] -> None)."""
    if v is None:
        return None
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise InputError(
            f"expected a list of integer prefix-block ids, got {json.dumps(v)[:80]}",
            file=src,
            line=line,
            field="hash_ids",
        )
    if not v:
        return None
    span = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    if prompt and len(v) > span:
        raise InputError(
            f"{len(v)} prefix-block ids of {MOONCAKE_BLOCK_TOKENS} tokens, more than the "
            f"{prompt}-token input spans ({span})",
            file=src,
            line=line,
            field="hash_ids",
        )
    return tuple(v) if prompt else None


def _parse_native(p: Path, src: str) -> list[_Row]:
    allowed = set(JSONL_REQUIRED) | set(JSONL_OPTIONAL)
    rows = []
    for line, obj in _json_objects(p, src):
        for k in obj:
            if k not in allowed:
                raise InputError(
                    f"unknown key {k!r}; allowed keys: "
                    f"{', '.join(JSONL_REQUIRED + JSONL_OPTIONAL)}",
                    file=src,
                    line=line,
                    field=k,
                )
        _require(obj, JSONL_REQUIRED, src, line)
        model = obj.get("model")
        if model is not None and not (isinstance(model, str) and model.strip()):
            raise InputError(
                f"expected a model name (non-empty string), got {json.dumps(model)}",
                file=src,
                line=line,
                field="model",
            )
        slos: list[float | None] = []
        for key in ("slo_ttft_s", "slo_tpot_s"):
            v = obj.get(key)
            if v is None:
                slos.append(None)
                continue
            x = _json_number(v, src, line, key, "a number of seconds > 0 or null")
            if x <= 0:
                raise InputError(
                    f"expected a number of seconds > 0 or null, got {json.dumps(v)}",
                    file=src,
                    line=line,
                    field=key,
                )
            slos.append(x)
        rows.append(
            _Row(
                line,
                _json_number(obj["arrival_s"], src, line, "arrival_s", "a number of seconds"),
                _json_tokens(obj["prompt_tokens"], src, line, "prompt_tokens"),
                _json_tokens(obj["output_tokens"], src, line, "output_tokens"),
                model=model.strip() if model is not None else None,
                slo_ttft_s=slos[0],
                slo_tpot_s=slos[1],
                stamp=json.dumps(obj["arrival_s"]),
            )
        )
    return rows
