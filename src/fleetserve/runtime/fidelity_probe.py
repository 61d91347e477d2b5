"""Probe the serving path's overhead on an idle server (for ``fleetserve fidelity``).

Before the replay, on the otherwise idle server, the fidelity command sends
two kinds of probe groups of streamed ``/v1/completions`` (the bench's
request body: token-id prompts, ``ignore_eos``, greedy)::

    alone:  every (prompt, output) of prompts x outputs, repeats times,
            strictly one after another          -> fixed latency, per-token cost
    bursts: k requests sent at once (k in bursts), repeats times
                                                -> how both grow with the batch

Each probe becomes a :class:`~fleetserve.metrics.probes.ProbeRequest`
(TTFT and TPOT as bench-serve measures them: first and last chunk with text);
:func:`fleetserve.experiments.fidelity.fit_overhead` simulates the same groups
and fits the overhead model to them. One untimed warm-up request goes first.
No torch here: an HTTP client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from fleetserve.errors import ConfigError
from fleetserve.metrics.probes import ProbeRequest
from fleetserve.runtime.bench_serve import (
    Outcome,
    ServerResponseError,
    completion_body,
    prompt_ids,
    stream_completion,
)

__all__ = ["ProbePlan", "probe_overhead", "run_probe"]

ProbeProgress = Callable[[int, int], None]
"""``progress(done, total)`` over probe groups."""


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """What :func:`probe_overhead` sends (see the module docstring).

    Attributes:
        model: the served model probed.
        prompts, outputs: lengths of the requests sent alone.
        repeats: times each alone-pair and each burst is sent.
        bursts: sizes of the bursts of concurrent requests.
        burst_prompt, burst_output: lengths of a burst's requests.
        token_range: inclusive range of the prompt token ids.
        seed: seed of the prompts.
        pause_s: idle time between groups.
    """

    model: str
    prompts: tuple[int, ...] = (16, 64, 256)
    outputs: tuple[int, ...] = (8, 32)
    repeats: int = 2
    bursts: tuple[int, ...] = (4, 12)
    burst_prompt: int = 64
    burst_output: int = 32
    token_range: tuple[int, int] = (0, 255)
    seed: int = 0
    pause_s: float = 0.05

    def __post_init__(self) -> None:
        lengths = (*self.prompts, *self.outputs, self.burst_prompt, self.burst_output)
        if not self.prompts or not self.outputs or any(n < 1 for n in lengths):
            raise ConfigError("probe lengths must be positive integers")
        if self.repeats < 1 or any(k < 1 for k in self.bursts):
            raise ConfigError("probe repeats and burst sizes must be >= 1")

    def groups(self) -> list[list[tuple[int, int]]]:
        """The groups in send order: each a list of (prompt, output) sent together."""
        alone = [[(p, o)] for o in self.outputs for p in self.prompts]
        bursts = [[(self.burst_prompt, self.burst_output)] * k for k in self.bursts]
        return [*alone, *bursts] * self.repeats


def _probe(group: int, model: str, prompt: int, out: Outcome, t0: float) -> ProbeRequest:
    if out.status != "finished" or out.first_token is None or out.generated < 1:
        raise ServerResponseError(
            f"overhead probe of {model!r} (prompt {prompt}) did not finish: {out.reason}"
        )
    last = out.last_token if out.last_token is not None else out.end
    tpot = (last - out.first_token) / (out.generated - 1) if out.generated > 1 else None
    return ProbeRequest(
        group=group,
        model=model,
        send_s=out.send - t0,
        prompt_tokens=prompt,
        output_tokens=out.generated,
        ttft_s=out.first_token - out.send,
        tpot_s=tpot,
    )


async def probe_overhead(
    client: httpx.AsyncClient,
    plan: ProbePlan,
    timeout_s: float = 60.0,
    progress: ProbeProgress | None = None,
) -> list[ProbeRequest]:
    """Send the plan's groups to the server behind ``client`` and measure them.

    Raises:
        ServerResponseError: a probe that did not finish (the server is not
            serving ``plan.model`` properly; nothing to calibrate from).
    """
    key = 0

    def body(p: int, o: int) -> dict[str, object]:
        nonlocal key
        key += 1
        ids = prompt_ids(plan.seed, 2, key, p, plan.token_range)
        return completion_body(plan.model, ids, o)

    warm, _ = await stream_completion(client, body(16, 4), timeout_s)
    if warm.status != "finished":
        raise ServerResponseError(f"overhead probe warm-up failed: {warm.reason}")
    groups = plan.groups()
    probes: list[ProbeRequest] = []
    for g, members in enumerate(groups):
        if progress is not None:
            progress(g, len(groups))
        await asyncio.sleep(plan.pause_s)
        bodies = [body(p, o) for p, o in members]
        results = await asyncio.gather(*(stream_completion(client, b, timeout_s) for b in bodies))
        outs = [r[0] for r in results]
        t0 = min(o.send for o in outs)
        probes += [
            _probe(g, plan.model, p, o, t0) for (p, _o), o in zip(members, outs, strict=True)
        ]
    if progress is not None:
        progress(len(groups), len(groups))
    return probes


def run_probe(
    url: str,
    plan: ProbePlan,
    *,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    progress: ProbeProgress | None = None,
) -> list[ProbeRequest]:
    """:func:`probe_overhead` against ``url`` (synchronous)."""

    async def go() -> list[ProbeRequest]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout_s)
        ) as client:
            return await probe_overhead(client, plan, timeout_s, progress)

    return asyncio.run(go())
