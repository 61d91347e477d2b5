"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetserve.errors import ConfigError

__all__ = ["SamplingParams", "apply_stop_strings", "request_generator", "sample_one"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    Attributes:
        max_tokens: stop after this many generated tokens.
        temperature: 0 means greedy (argmax); otherwise logits / temperature.
        top_p: nucleus sampling mass (1.0 = off).
        top_k: keep the k most likely tokens (0 = off).
        seed: seed of the request's own generator (None: derived from its id),
            so a sampled request is reproducible and independent of its batch.
        stop: stop strings; the output is cut before the first one.
        ignore_eos: keep generating past EOS (benchmarks).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")


def request_generator(p: SamplingParams, rid: int) -> torch.Generator:
    """A request's own sampler generator: seeded by ``p.seed``, else by its id."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(p.seed if p.seed is not None else rid)
    return gen


def sample_one(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """Next token from one request's logits [V] (greedy when temperature is 0)."""
    if p.temperature == 0:
        return int(torch.argmax(logits).item())
    x = logits.float() / p.temperature
    if p.top_k:
        k = min(p.top_k, x.numel())
        kth = torch.topk(x, k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        drop = cum - sp > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def apply_stop_strings(
    emitted: str, held: str, piece: str, stop: Sequence[str]
) -> tuple[str, str, bool]:
    """Stream text through stop strings: what to emit now, what to hold back.

    ``emitted`` is the text streamed so far, ``held`` the text held back at the
    last token (it may begin a stop string), ``piece`` the new token's text. A
    stop string is searched where it could newly appear (it may start in the
    emitted tail); when any is found the output is cut before the earliest. Otherwise the
    longest suffix that is a proper prefix of some stop string is held back,
    so no client ever sees text that a stop string later removes.

    Returns:
        ``(emit, held, stopped)``: the text to stream now, the new held-back
        text (empty when stopped), and whether a stop string was found.
    """
    text = held + piece
    whole = emitted + text
    hits = [h for s in stop if (h := whole.find(s, max(0, len(emitted) - len(s)))) >= 0]
    if hits:  # the earliest stop string wins, whatever its place in ``stop``
        return text[: max(min(hits) - len(emitted), 0)], "", True
    keep = max(
        (k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )
    return text[: len(text) - keep], text[len(text) - keep :] if keep else "", False
