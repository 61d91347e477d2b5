"""What the serving path's overhead probes measured, as the client saw it.

:mod:`fleetserve.runtime.fidelity_probe` sends the probes to a running server
and records each as a :class:`ProbeRequest`;
:func:`fleetserve.experiments.fidelity.fit_overhead` fits the simulation's
:class:`~fleetserve.experiments.fidelity_overhead.RuntimeOverhead` to them.
A plain record; no torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ProbeRequest"]


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """One probe request as the client saw it (seconds from its group's start).

    Attributes:
        group: probes of one group were sent together (a burst) or alone.
        model: served model.
        send_s: when it was sent, from the group's start.
        prompt_tokens, output_tokens: its lengths (output = tokens received).
        ttft_s: first token seen, from its send.
        tpot_s: mean time per output token after the first (None with one token).
    """

    group: int
    model: str
    send_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeRequest:
        tpot = d.get("tpot_s")
        return cls(
            group=int(d["group"]),
            model=str(d["model"]),
            send_s=float(d["send_s"]),
            prompt_tokens=int(d["prompt_tokens"]),
            output_tokens=int(d["output_tokens"]),
            ttft_s=float(d["ttft_s"]),
            tpot_s=None if tpot is None else float(tpot),
        )
