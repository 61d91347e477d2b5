"""Sampling parameters, logits processing, the sampler and the stop rules.

* :class:`SamplingParams`: how one request generates (vLLM / OpenAI fields).
* :func:`process_logits`: ``logit_bias``, ``min_tokens`` and
  ``repetition_penalty`` applied to one request's logits row (a no-op when
  they are at their defaults); :func:`sample_one` then picks the token
  (greedy, temperature, top-k, top-p); :func:`sample_token` does both.
* :class:`StopMatcher`: stop strings searched in the streamed text with one
  Knuth-Morris-Pratt automaton per stop string, so each token costs time
  linear in its own text (amortized), however long the stop strings are.
* :func:`append_token`: the token-append rules (EOS, stop token ids, stop
  strings, ``max_tokens``, text held back) shared by the engine, pipeline
  groups and buddy groups.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fleetserve.errors import ConfigError
from fleetserve.runtime.engine.tokenizer import IncrementalDetokenizer

__all__ = [
    "SamplingParams",
    "StopMatcher",
    "TokenStream",
    "append_token",
    "needs_logits_processing",
    "process_logits",
    "request_generator",
    "sample_one",
    "sample_token",
]

_MAX_BIAS = 100.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    Hashable and picklable (every field is immutable). Sequences given as
    lists (and ``logit_bias`` as a ``{token_id: bias}`` mapping) are stored
    as tuples.

    Attributes:
        max_tokens: stop after this many generated tokens.
        temperature: 0 means greedy (argmax); otherwise logits / temperature.
        top_p: nucleus sampling mass (1.0 = off).
        top_k: keep the k most likely tokens (0 = off).
        seed: seed of the request's own generator (None: derived from its id),
            so a sampled request is reproducible and independent of its batch.
        stop: stop strings; the output is cut before the first one (the stop
            string is not in the output).
        ignore_eos: keep generating past EOS (benchmarks). As in vLLM it
            concerns the model's EOS ids only, not ``stop_token_ids``.
        min_tokens: (vLLM) the first ``min_tokens`` generated tokens cannot be
            an EOS id (unless ``ignore_eos``) nor one of ``stop_token_ids``:
            their logits are set to -inf. As in vLLM, no stop condition is
            checked before ``min_tokens`` tokens are generated: a stop string
            counts only when the token that completes it is the
            ``min_tokens``-th generated token or a later one (a stop string
            completed earlier is streamed as ordinary text). Must be
            ``<= max_tokens``.
        stop_token_ids: (vLLM) generating one of these ends the request with
            finish reason ``stop``, like EOS; the token is in the output ids
            but its text is not in the output text (vLLM's default,
            ``include_stop_str_in_output=False``).
        repetition_penalty: (vLLM / HF) > 0; 1.0 is off. For every token id
            in the prompt or the output so far, a logit > 0 is divided by it
            and a logit < 0 multiplied by it.
        logit_bias: (OpenAI) ``(token_id, bias)`` pairs, bias in [-100, 100]
            added to that token's logit before sampling (-100 all but bans a
            token, +100 all but forces it). A token id may appear once.

    The logits of a request are processed in vLLM V1's order: ``logit_bias``,
    then the ``min_tokens`` ban, then ``repetition_penalty``; then
    temperature, top-k and top-p (see :func:`process_logits`).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        ids = tuple(self.stop_token_ids)
        bad = [t for t in ids if not _is_int(t) or t < 0]
        if bad:
            raise ConfigError(f"stop_token_ids must be token ids (integers >= 0), got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, int | float) or not 0 < rp < math.inf:
            raise ConfigError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        object.__setattr__(self, "logit_bias", self._bias_pairs(self.logit_bias))

    @staticmethod
    def _bias_pairs(given: object) -> tuple[tuple[int, float], ...]:
        items = given.items() if isinstance(given, Mapping) else given
        if not isinstance(items, Collection) or isinstance(items, str):
            raise ConfigError(f"logit_bias must be (token_id, bias) pairs, got {given!r}")
        out: list[tuple[int, float]] = []
        seen: set[int] = set()
        for item in items:
            if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 2:
                raise ConfigError(f"logit_bias must be (token_id, bias) pairs, got {item!r}")
            tok, bias = item
            if not _is_int(tok) or tok < 0:
                raise ConfigError(f"logit_bias: token ids must be integers >= 0, got {tok!r}")
            if tok in seen:
                raise ConfigError(f"logit_bias: token id {tok} is given twice")
            ok = isinstance(bias, int | float) and not isinstance(bias, bool)
            if not ok or not -_MAX_BIAS <= bias <= _MAX_BIAS:
                raise ConfigError(
                    f"logit_bias: the bias of token {tok} must be a number in "
                    f"[-100, 100], got {bias!r}"
                )
            seen.add(tok)
            out.append((tok, float(bias)))
        return tuple(out)

    def check_vocab(self, vocab_size: int) -> None:
        """Check that the token ids of ``stop_token_ids`` and ``logit_bias``
        are in the model's vocabulary ``[0, vocab_size)``.

        Raises:
            ConfigError: naming the field and the first id outside it.
        """
        for field_name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", tuple(t for t, _ in self.logit_bias)),
        ):
            out = [t for t in ids if t >= vocab_size]
            if out:
                raise ConfigError(
                    f"{field_name}: token id {out[0]} is outside the model's vocabulary "
                    f"[0, {vocab_size})"
                )


def request_generator(p: SamplingParams, rid: int) -> torch.Generator:
    """A request's own sampler generator: seeded by ``p.seed``, else by its id."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(p.seed if p.seed is not None else rid)
    return gen


# ------------------------------------------------------------------ logits
def needs_logits_processing(p: SamplingParams, generated: int) -> bool:
    """Whether :func:`process_logits` would change the logits of a request
    that has generated ``generated`` tokens (False: use the raw logits)."""
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or generated < p.min_tokens


def process_logits(
    logits: torch.Tensor,
    p: SamplingParams,
    tokens: Sequence[int],
    generated: int,
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """One request's logits row [V] after ``logit_bias``, ``min_tokens`` and
    ``repetition_penalty`` (in that order, as vLLM V1 applies them).

    Args:
        logits: the row (not modified).
        p: the request's parameters.
        tokens: its prompt + generated token ids (the repetition penalty
            concerns every id in them: vLLM counts the prompt too).
        generated: how many of ``tokens`` are generated (the ``min_tokens``
            ban holds while ``generated < min_tokens``).
        eos_token_ids: the model's EOS ids (banned under ``min_tokens``
            unless ``ignore_eos``).

    Returns:
        ``logits`` itself when every such field is at its default (the fast
        path: nothing is copied), else a float32 copy with them applied. Token
        ids outside the row are ignored (:meth:`SamplingParams.check_vocab`
        rejects them at admission).
    """
    if not needs_logits_processing(p, generated):
        return logits
    x = logits.to(torch.float32, copy=True)
    vocab = x.shape[-1]
    dev = x.device
    if p.logit_bias:
        pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
        if pairs:
            idx = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=dev)
            bias = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=dev)
            x.index_add_(0, idx, bias)
    if generated < p.min_tokens:
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_token_ids)
        ids = sorted(t for t in banned if 0 <= t < vocab)
        if ids:
            x[torch.tensor(ids, dtype=torch.long, device=dev)] = float("-inf")
    if p.repetition_penalty != 1.0 and tokens:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(list(tokens), dtype=torch.long, device=dev)] = True
        pen = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
    return x


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


def sample_token(
    logits: torch.Tensor,
    p: SamplingParams,
    gen: torch.Generator,
    tokens: Sequence[int],
    generated: int,
    eos_token_ids: Collection[int],
) -> int:
    """:func:`process_logits` then :func:`sample_one`: a request's next token."""
    return sample_one(process_logits(logits, p, tokens, generated, eos_token_ids), p, gen)


# ------------------------------------------------------------ stop strings
class StopMatcher:
    """Stop strings searched in streamed text, with the text held back.

    Semantics (those of the engine since the first version): each new piece
    of text is appended to the held-back text; when one or more stop strings
    end within the new piece, the output is cut before the earliest-starting
    of them (whatever its place in ``stop``) and the request stops.
    Otherwise the longest suffix of the text that is a proper prefix of some
    stop string is held back, so no client ever sees text that a stop string
    later removes; the caller releases the held text when the request ends
    otherwise (EOS, ``max_tokens``).

    Each stop string has a Knuth-Morris-Pratt automaton: its failure table
    (extended lazily, never past the longest match so far, so at most
    ``len(s)`` entries per request and usually far fewer) and its state (the
    length of the longest suffix of the text so far that is a proper prefix
    of ``s``). Feeding a piece advances every automaton character by
    character: amortized O(len(piece)) per stop string, whatever the stop
    strings' length (besides, the new held text is one string copy, no
    longer than the text matched so far). :attr:`held` is the longest of
    these suffixes, so the states are a function of the held text alone:
    ``StopMatcher(stop, held)`` (which runs the automata over ``held``)
    rebuilds them, as a request migrated with only its held text needs.

    Attributes:
        stop: the stop strings (non-empty).
        held: the text held back now.
        steps: automaton work done so far (characters fed plus failure-link
            and table steps), for tests and profiling.
    """

    __slots__ = ("_fail", "_state", "held", "steps", "stop")

    def __init__(self, stop: Sequence[str], held: str = "") -> None:
        self.stop = tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._fail: list[list[int]] = [[0] for _ in self.stop]
        self._state = [0] * len(self.stop)
        self.steps = 0
        if held:
            self._advance(held, 0, check=False)
        self.held = held

    @property
    def states(self) -> tuple[int, ...]:
        """Per stop string, the length of the longest suffix of the text that
        is a proper prefix of it."""
        return tuple(self._state)

    def feed(self, piece: str, *, check: bool = True) -> tuple[str, bool]:
        """Add ``piece`` to the text; returns ``(emit, stopped)``.

        ``emit`` is the text to stream now (what ``piece`` and the held text
        release); :attr:`held` becomes the new held-back text ("" when
        stopped). With ``check=False`` stop strings ending in ``piece`` do not
        stop (``min_tokens``): they are streamed as ordinary text, while a
        prefix of one at the end is still held back.
        """
        held = self.held
        if not self.stop:
            self.held = ""
            return held + piece, False
        best = self._advance(piece, len(held), check)
        text = held + piece
        if best is not None:
            self._state = [0] * len(self.stop)
            self.held = ""
            return text[:best], True
        cut = len(text) - max(self._state)
        self.held = text[cut:]
        return text[:cut], False

    def _advance(self, piece: str, base: int, check: bool) -> int | None:
        """Run the automata over ``piece`` (which starts at offset ``base`` of
        held + piece); with ``check``, returns where the earliest-starting
        stop string ending in ``piece`` starts (None: none)."""
        best: int | None = None
        steps = 0
        for i, s in enumerate(self.stop):
            m = len(s)
            fail = self._fail[i]
            q = self._state[i]
            for j, c in enumerate(piece):
                if best is not None and base + j + 1 - m >= best:
                    break  # a match of s ending here or later starts after the best
                steps += 1
                while q and s[q] != c:
                    q = fail[q - 1]
                    steps += 1
                if s[q] != c:
                    continue
                q += 1
                if q > len(fail):
                    steps += self._extend(s, fail)
                if q == m:
                    if check:
                        best = base + j + 1 - m
                        break
                    q = fail[m - 1]  # the longest proper border: a proper prefix again
            self._state[i] = q
        self.steps += steps
        return best

    @staticmethod
    def _extend(s: str, fail: list[int]) -> int:
        """Append the next failure-table entry of ``s``; returns the steps taken."""
        k = len(fail)
        g = fail[k - 1]
        steps = 1
        while g and s[k] != s[g]:
            g = fail[g - 1]
            steps += 1
        fail.append(g + 1 if s[k] == s[g] else 0)
        return steps


# ------------------------------------------------------------ token append
class TokenStream(Protocol):
    """What :func:`append_token` needs of a request (engine, pipeline and
    buddy requests all have it)."""

    tokens: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    text: str
    held: str
    stop_matcher: StopMatcher | None

    @property
    def generated(self) -> int: ...


def _matcher(req: TokenStream) -> StopMatcher:
    """The request's stop matcher; rebuilt from its held text when that was
    set from elsewhere (a restored or migrated request)."""
    m = req.stop_matcher
    if m is None or m.held is not req.held or m.stop is not req.params.stop:
        m = req.stop_matcher = StopMatcher(req.params.stop, req.held)
    return m


def append_token(
    req: TokenStream, tok: int, eos_token_ids: Collection[int]
) -> tuple[str, str | None]:
    """Record a sampled token of ``req``: the rules every executor shares.

    Updates ``req.tokens``, ``req.text`` (the text streamed so far) and
    ``req.held`` (text held back because it may begin a stop string).
    Before ``min_tokens`` tokens are generated (this one included) nothing
    stops the request but ``max_tokens`` (see :class:`SamplingParams`). Then
    an EOS id (unless ``ignore_eos``) or one of ``stop_token_ids`` ends it
    with ``stop``, releasing the held text but not the token's own text; a
    stop string ends it with ``stop``, the text cut before it; reaching
    ``max_tokens`` ends it with ``length``, releasing the held text.

    Returns:
        The text this token releases to the client and the finish reason
        (None: the request goes on). The caller streams the text and, when
        finished, frees the request's pages and sets its finish reason.
    """
    req.tokens.append(tok)
    p = req.params
    check = req.generated >= p.min_tokens
    if check and ((tok in eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids):
        piece = req.held + req.detok.flush()
        req.text += piece
        req.held = ""
        return piece, "stop"
    piece = req.detok.push(tok)
    if p.stop:
        m = _matcher(req)
        piece, stopped = m.feed(piece, check=check)
        req.held = m.held
        if stopped:
            req.text += piece
            return piece, "stop"
    if req.generated >= p.max_tokens:
        piece += req.held + req.detok.flush()
        req.held = ""
        req.text += piece
        return piece, "length"
    req.text += piece
    return piece, None
