"""Tokenizers for the engine: a byte-level one for the built-in models, HF ``tokenizer.json``.

* :class:`ByteTokenizer`: ids 0..255 are the UTF-8 bytes of the text, 256 is
  BOS, 257 EOS, 258 PAD (vocabulary 260, one spare id).
* :class:`HFTokenizer`: a checkpoint's ``tokenizer.json`` through the
  ``tokenizers`` library, with BOS / EOS ids from the model config.
* :class:`IncrementalDetokenizer` turns generated ids into text as they come,
  never emitting half of a multi-byte character, so the text can be streamed
  and searched for stop strings.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fleetserve.errors import ConfigError, InputError
from fleetserve.runtime.engine.config import EngineModelConfig

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"


class Tokenizer(ABC):
    """Text <-> token ids.

    Attributes:
        bos_id: prepended by :meth:`encode` (``add_bos``) when not None.
        eos_ids: ids that end generation.
        vocab_size: number of ids the tokenizer can produce.
    """

    bos_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first when ``add_bos`` and the model has one."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are skipped, bad bytes become U+FFFD."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 bytes, 256 BOS, 257 EOS, 258 PAD (vocabulary 260)."""

    BOS = 256
    EOS = 257
    PAD = 258
    VOCAB = 260

    def __init__(self) -> None:
        self.bos_id = self.BOS
        self.eos_ids = (self.EOS,)
        self.pad_id = self.PAD
        self.vocab_size = self.VOCAB

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """See :meth:`Tokenizer.encode`."""
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """See :meth:`Tokenizer.decode` (ids >= 256 are skipped)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer(Tokenizer):
    """A HuggingFace ``tokenizer.json`` (the ``tokenizers`` library).

    The tokenizer's own post-processor (which may add BOS) is not used: BOS is
    added here from the model config, so it is never doubled.

    Args:
        path: the ``tokenizer.json`` file.
        bos_id: the model's BOS id (``config.json``), or None.
        eos_ids: the model's EOS ids.

    Raises:
        InputError: the file is missing or not a valid tokenizer (names it).
    """

    def __init__(
        self, path: str | Path, bos_id: int | None = None, eos_ids: Sequence[int] = ()
    ) -> None:
        from tokenizers import Tokenizer as _HFTok

        self.path = Path(path)
        if not self.path.is_file():
            raise InputError("no such tokenizer file", file=str(self.path))
        try:
            self._tok: Any = _HFTok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise InputError(f"not a valid tokenizer.json ({e})", file=str(self.path)) from e
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """See :meth:`Tokenizer.encode`."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """See :meth:`Tokenizer.decode`."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(folder: str | Path | None, cfg: EngineModelConfig) -> Tokenizer:
    """The tokenizer of a model.

    Args:
        folder: a checkpoint folder, or None for a built-in model.
        cfg: the model config (BOS / EOS ids, vocabulary size).

    Returns:
        :class:`HFTokenizer` when ``folder/tokenizer.json`` exists, else
        :class:`ByteTokenizer`.

    Raises:
        ConfigError: no tokenizer.json and the model's vocabulary is too small
            for the byte tokenizer (fewer than 259 ids).
        InputError: an invalid tokenizer.json.
    """
    if folder is not None:
        path = Path(folder) / "tokenizer.json"
        if path.is_file():
            tok = HFTokenizer(path, cfg.bos_token_id, cfg.eos_token_ids)
            if tok.vocab_size > cfg.spec.vocab_size:
                logger.warning(
                    "%s: tokenizer has %d ids but the model's vocab_size is %d",
                    path,
                    tok.vocab_size,
                    cfg.spec.vocab_size,
                )
            return tok
    if cfg.spec.vocab_size < ByteTokenizer.PAD + 1:
        where = f"{folder} has no tokenizer.json and " if folder is not None else ""
        raise ConfigError(
            f"model {cfg.name!r}: {where}the byte tokenizer needs a vocabulary of at least "
            f"{ByteTokenizer.PAD + 1} ids, the model has {cfg.spec.vocab_size}"
        )
    tok_b = ByteTokenizer()
    if cfg.bos_token_id not in (None, tok_b.BOS) or cfg.eos_token_ids not in ((), tok_b.eos_ids):
        logger.warning(
            "model %s: byte tokenizer uses BOS %d / EOS %d, the config says %s / %s",
            cfg.name,
            tok_b.BOS,
            tok_b.EOS,
            cfg.bos_token_id,
            cfg.eos_token_ids,
        )
    return tok_b


class IncrementalDetokenizer:
    """Generated ids in, newly completed text out.

    Each :meth:`push` decodes a short window of ids (a few ids already shown,
    then the new ones) and returns what the window's text adds beyond the
    already-shown part. A trailing U+FFFD, from a UTF-8 sequence the next
    token may complete, is held back until it resolves or :meth:`flush` is
    called. Concatenating every :meth:`push` and the final :meth:`flush` gives
    the generated text; decoding a window rather than only the new ids keeps
    tokenizers that strip a leading space (SentencePiece) correct, and the
    cost per token constant.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt; its last few ids give the first tokens their
            context (e.g. a leading space). None: the text starts fresh.
    """

    CONTEXT = 5
    """Prompt ids kept as decoding context."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        ctx = list(prompt_ids[-self.CONTEXT :]) if prompt_ids else []
        # Do not start the window inside a multi-byte character of the prompt.
        while ctx and tokenizer.decode(ctx).startswith(_REPLACEMENT):
            ctx.pop(0)
        self._ids: list[int] = ctx
        self._prefix = 0  # window start
        self._read = len(ctx)  # ids[_prefix:_read] are already shown
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._text)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (possibly '')."""
        self._ids.append(int(token_id))
        shown = self.tokenizer.decode(self._ids[self._prefix : self._read])
        full = self.tokenizer.decode(self._ids[self._prefix :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(shown):
            return ""
        if not full.startswith(shown):
            # The window's earlier text changed (e.g. the prompt ended inside a
            # character the new id completes): keep the common prefix.
            n = 0
            while n < min(len(shown), len(full)) and shown[n] == full[n]:
                n += 1
            shown = shown[:n]
        new = full[len(shown) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._text.append(new)
        return new

    def flush(self) -> str:
        """The held-back text (trailing U+FFFD of bytes that never completed)."""
        shown = self.tokenizer.decode(self._ids[self._prefix : self._read])
        full = self.tokenizer.decode(self._ids[self._prefix :])
        new = full[len(shown) :] if full.startswith(shown) else ""
        self._prefix = self._read = len(self._ids)
        if new:
            self._text.append(new)
        return new
