"""A service (SeaLLM's "LLM service"): one model with its own traffic.

Two services may use the same catalog model (each holds its own weights).
Requests name their service in ``Request.model``. The multi-LLM workloads
(:mod:`fleetserve.workload.multi`) produce services; the placement policies
(:mod:`fleetserve.policy.groups` and the group placements) and the simulator
place and run them. A plain frozen record; no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.errors import ConfigError
from fleetserve.spec.types import ModelSpec

__all__ = ["Service"]


@dataclass(frozen=True, slots=True)
class Service:
    """One LLM service: a model and the traffic it receives.

    Attributes:
        name: unique service name (what ``Request.model`` holds).
        spec: the model's shape.
        rate: mean request rate, req/s (> 0 for placement; 0 allowed otherwise).
        mean_prompt: mean prompt tokens of its requests.
        mean_output: mean output tokens of its requests.
    """

    name: str
    spec: ModelSpec
    rate: float
    mean_prompt: float
    mean_output: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a service needs a name")
        if self.rate < 0:
            raise ConfigError(f"service {self.name!r}: rate must be >= 0, got {self.rate}")
        if self.mean_prompt < 1 or self.mean_output < 1:
            raise ConfigError(
                f"service {self.name!r}: mean prompt and output tokens must be >= 1, "
                f"got {self.mean_prompt} / {self.mean_output}"
            )
