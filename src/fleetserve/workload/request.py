"""The request record every loader, generator and backend shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleetserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request as the workload describes it.

    Attributes:
        id: unique within a workload (0..n-1 after loading, in arrival order).
        model: catalog name of the model that serves it.
        arrival_s: arrival time in seconds from the start of the workload.
        prompt_tokens: input length (>= 1).
        output_tokens: tokens to generate (>= 1), known to the simulator only.
        slo_ttft_s: optional time-to-first-token objective.
        slo_tpot_s: optional time-per-output-token objective.
        length_capped: True when a length transform had to cap this request.
    """

    id: int
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    length_capped: bool = False

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ConfigError(f"request {self.id}: prompt_tokens must be >= 1")
        if self.output_tokens < 1:
            raise ConfigError(f"request {self.id}: output_tokens must be >= 1")
        if self.arrival_s < 0:
            raise ConfigError(f"request {self.id}: arrival_s must be >= 0")

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens."""
        return self.prompt_tokens + self.output_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Tokens held in the KV cache at the last decode step (the last token is never cached)."""
        return self.prompt_tokens + self.output_tokens - 1


def check_run_order(requests: Sequence[Request]) -> None:
    """Check what every simulator assumes: ids ``0..n-1`` in order, sorted by arrival.

    Raises:
        ConfigError: the first request out of place.
    """
    prev = None
    for i, r in enumerate(requests):
        if r.id != i:
            raise ConfigError(f"request ids must be 0..n-1 in order; position {i} has {r.id}")
        if prev is not None and r.arrival_s < prev:
            raise ConfigError(f"requests must be sorted by arrival; request {i} is not")
        prev = r.arrival_s
