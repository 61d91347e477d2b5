"""The request record every loader, generator and backend shares.

Prefix blocks. A trace may say which prompts share a prefix (Mooncake's
``hash_ids``): ``prefix_blocks[i]`` names the prompt's tokens
``[0, (i + 1) * prefix_block_tokens)`` — block ``i`` *and everything before it*
(the ids are chained), so two requests whose ``prefix_blocks[i]`` are equal
have equal prompts up to the end of block ``i``. The last block may be partial
(the prompt ends inside it), so ``len(prefix_blocks) <= ceil(prompt_tokens /
prefix_block_tokens)``::

    prompt_tokens = 1300, prefix_block_tokens = 512
    tokens:  [0 ........ 512) [512 ...... 1024) [1024 .. 1300)
    blocks:        h0               h1              h2 (partial)

Requests from sources without such ids have none (both fields None). A length
change (:func:`with_lengths`) keeps the ids honest: see there.
"""

from __future__ import annotations

import dataclasses
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
        prefix_blocks: chained ids of the prompt's prefix blocks (see the module
            docstring), or None.
        prefix_block_tokens: tokens per prefix block (Mooncake: 512), set
            exactly when ``prefix_blocks`` is.
    """

    id: int
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    length_capped: bool = False
    prefix_blocks: tuple[int, ...] | None = None
    prefix_block_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ConfigError(f"request {self.id}: prompt_tokens must be >= 1")
        if self.output_tokens < 1:
            raise ConfigError(f"request {self.id}: output_tokens must be >= 1")
        if self.arrival_s < 0:
            raise ConfigError(f"request {self.id}: arrival_s must be >= 0")
        blocks, size = self.prefix_blocks, self.prefix_block_tokens
        if blocks is None and size is None:
            return
        if blocks is None or size is None or size < 1 or not blocks:
            raise ConfigError(
                f"request {self.id}: prefix_blocks (non-empty) and prefix_block_tokens "
                f"(>= 1) go together, got {blocks!r} and {size!r}"
            )
        if len(blocks) > -(-self.prompt_tokens // size):
            raise ConfigError(
                f"request {self.id}: {len(blocks)} prefix blocks of {size} tokens are more "
                f"than its {self.prompt_tokens}-token prompt spans"
            )

    @property
    def total_tokens(self) -> int:
        """Prompt plus output tokens."""
        return self.prompt_tokens + self.output_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Tokens held in the KV cache at the last decode step (the last token is never cached)."""
        return self.prompt_tokens + self.output_tokens - 1


def with_lengths(
    req: Request,
    prompt_tokens: int,
    output_tokens: int,
    *,
    scale: float = 1.0,
    length_capped: bool | None = None,
) -> Request:
    """``req`` with new lengths; its prefix blocks follow the prompt.

    ``scale`` is the factor the lengths were multiplied by (1: the prompt was
    only cut, e.g. capped to fit). The prefix blocks keep their ids and
    describe the new prompt as follows:

    * scaled by ``f``: every token of the trace stands for ``f`` tokens, so a
      shared prefix stays shared and the block size becomes
      ``round(prefix_block_tokens * f)`` (512 x 10 = 5120 for Mell's x10); the
      ids are dropped when that rounds to 0;
    * shorter than the blocks span (a cap keeps the prompt's head): the blocks
      beyond the new prompt are dropped, so ``len(prefix_blocks) <=
      ceil(prompt_tokens / block)`` holds again (the last kept one may become
      partial; a prefix cache uses full blocks only).

    Args:
        req: the request.
        prompt_tokens, output_tokens: the new lengths (>= 1).
        scale: the length factor applied (> 0).
        length_capped: new ``length_capped`` (None: unchanged).
    """
    capped = req.length_capped if length_capped is None else length_capped
    blocks, size = req.prefix_blocks, req.prefix_block_tokens
    if blocks is not None and size is not None:
        size = round(size * scale) if scale != 1.0 else size
        keep = -(-prompt_tokens // size) if size >= 1 else 0
        if keep <= 0:
            blocks, size = None, None
        elif keep < len(blocks):
            blocks = blocks[:keep]
    return dataclasses.replace(
        req,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        length_capped=capped,
        prefix_blocks=blocks,
        prefix_block_tokens=size,
    )


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
