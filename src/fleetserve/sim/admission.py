"""Requests no instance of their model can ever run: longer than its context window.

A model cannot attend beyond ``max_context`` positions (its
``max_position_embeddings``), so a request whose prompt plus output exceeds it
is rejected at arrival, with a reason, by every simulator, as the runtime's
server and engine reject it (HTTP 400 "This model's maximum context length
is ..."). Before this check the simulators served such requests as if the
model could, and counted them as finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from fleetserve.metrics.records import RequestRecord
from fleetserve.spec.types import ModelSpec
from fleetserve.workload.request import Request

CONTEXT_REASON = "exceeds the context window"
"""The words every context-window rejection's reason contains."""


def context_reason(req: Request, spec: ModelSpec, max_model_len: int | None = None) -> str | None:
    """Why ``req`` can never run on ``spec`` (None when it fits the context window).

    Args:
        req: the request (prompt plus output tokens count).
        spec: its model.
        max_model_len: the context window served (``engine.max_model_len``);
            None: the model's ``max_context``.
    """
    limit = spec.max_context if max_model_len is None else max_model_len
    if req.prompt_tokens + req.output_tokens <= limit:
        return None
    return f"prompt + output {CONTEXT_REASON} of {spec.name} ({limit} tokens)"


def context_note(records: Iterable[RequestRecord]) -> str | None:
    """The run's note on context-window rejections (None when there were none)."""
    n = sum(
        1
        for r in records
        if r.status == "rejected" and r.reason is not None and CONTEXT_REASON in r.reason
    )
    if not n:
        return None
    return (
        f"{n} requests longer than their model's context window (prompt + output > "
        "max_context, or engine.max_model_len when set) were rejected, as the runtime "
        "rejects them"
    )
