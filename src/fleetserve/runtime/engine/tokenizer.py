"""Tokenizers for the engine: a byte-level one for the built-in models, HF ``tokenizer.json``.

* :class:`ByteTokenizer`: ids 0..255 are the UTF-8 bytes of the text, 256 is
  BOS, 257 EOS, 258 PAD (vocabulary 260, one spare id).
* :class:`HFTokenizer`: a checkpoint's ``tokenizer.json`` through the
  ``tokenizers`` library, with BOS / EOS ids from the model config.
* :class:`IncrementalDetokenizer` turns generated ids into text as they come,
  never emitting half of a multi-byte character, so the text can be streamed
  and searched for stop strings.
* :func:`export_hf_tokenizer` / :func:`hf_tokenizer_dir`: the byte tokenizer
  as a Hugging Face tokenizer folder (``tokenizer.json``,
  ``tokenizer_config.json``, ``special_tokens_map.json``), for clients that
  count tokens with ``transformers.AutoTokenizer`` (guidellm, aiperf,
  ``vllm bench serve``). ``AutoTokenizer.from_pretrained(folder)`` encodes
  any text to the byte tokenizer's ids and decodes any ids to its text.
"""

from __future__ import annotations

import difflib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fleetserve.errors import ConfigError, InputError
from fleetserve.runtime.engine.config import BUILTIN_MODELS, EngineModelConfig, load_config

__all__ = [
    "BYTE_HF_SPECIAL_TOKENS",
    "HF_TOKENIZER_FILES",
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "build_byte_hf_tokenizer",
    "byte_hf_tokenizer_config",
    "export_hf_tokenizer",
    "hf_tokenizer_dir",
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

    def ends_mid_character(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` end inside a character that more ids could still complete.

        Its text then ends with one U+FFFD standing for the incomplete bytes
        (see :meth:`IncrementalDetokenizer.flush`). This default cannot tell
        an incomplete character from invalid bytes or a generated U+FFFD, so
        it says True for any text ending in U+FFFD (vLLM's rule);
        :class:`ByteTokenizer` knows the bytes and answers exactly.
        """
        return self.decode(ids).endswith(_REPLACEMENT)


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

    def ends_mid_character(self, ids: Sequence[int]) -> bool:
        """See :meth:`Tokenizer.ends_mid_character`: exact, from the bytes (ids >= 256
        are skipped, as :meth:`decode` does)."""
        return _utf8_incomplete_tail(bytes(i for i in ids if 0 <= i < 256)) > 0

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Unicode Table 3-7 (well-formed UTF-8): the allowed range of the second byte
# after each lead byte; third and fourth bytes are 80..BF.
_UTF8_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _utf8_length(lead: int) -> int:
    """Length of the well-formed sequence starting with ``lead`` (0: not a lead byte)."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _utf8_incomplete_tail(data: bytes) -> int:
    """How many trailing bytes of ``data`` are a proper prefix of a well-formed
    UTF-8 sequence, i.e. a character more bytes could complete (0: none).

    Such a tail decodes (``errors="replace"``) to exactly one U+FFFD at the
    end. Python's incremental UTF-8 decoder is no help here: it buffers some
    tails that can never complete (``ED A0``, a surrogate).
    """
    for k in range(1, min(3, len(data)) + 1):
        tail = data[-k:]
        n = _utf8_length(tail[0])
        if n <= k:
            continue
        lo, hi = _UTF8_SECOND.get(tail[0], (0x80, 0xBF))
        if (k == 1 or lo <= tail[1] <= hi) and all(0x80 <= b <= 0xBF for b in tail[2:]):
            return k
    return 0


class HFTokenizer(Tokenizer):
    """A HuggingFace ``tokenizer.json`` (the ``tokenizers`` library).

    The tokenizer's own post-processor (which may add BOS) is not used: BOS is
    added here from the model config, so it is never doubled. Special tokens
    written out in the text (``"<s>"``) become their ids, as in
    ``transformers``, unless a ``tokenizer_config.json`` beside the file sets
    ``split_special_tokens: true`` (as the byte tokenizer's folder from
    :func:`export_hf_tokenizer` does): then they are encoded as plain text.

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
        if _split_special_tokens(self.path.with_name("tokenizer_config.json")):
            self._tok.encode_special_tokens = True
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


def _split_special_tokens(path: Path) -> bool:
    """``split_special_tokens`` of a ``tokenizer_config.json`` (False when the
    file is missing or unreadable: the engine needs nothing else from it)."""
    if not path.is_file():
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        logger.debug("%s: not read (%s)", path, e)
        return False
    return isinstance(data, dict) and data.get("split_special_tokens") is True


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
    already-shown part. Text ending in U+FFFD, from a UTF-8 sequence the next
    token may complete, is held back until it resolves or :meth:`flush` is
    called. Concatenating every :meth:`push` and the final :meth:`flush` gives
    the generated text, less a last character the ids left incomplete (see
    :meth:`flush`); decoding a window rather than only the new ids keeps
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
        if full.endswith(_REPLACEMENT):
            return ""
        # Not a length test: a prompt ending inside a character the new id
        # completes ("a\ufffd" -> "a€") adds text of the same length.
        new = _added_text(shown, full)
        if not new:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        self._text.append(new)
        return new

    def flush(self) -> str:
        """The held-back text, at the end of generation (EOS, ``max_tokens``).

        A last character the ids leave incomplete (a UTF-8 sequence cut short
        by the end of generation, :meth:`Tokenizer.ends_mid_character`) is
        dropped rather than emitted as U+FFFD. This is vLLM's choice: its
        incremental detokenizer holds back text ending in U+FFFD and has no
        final flush, so a streamed text never ends in a half character. A
        client that re-tokenizes the text (aiperf counting output tokens)
        then counts at most the tokens the server reports, never the 3 bytes
        of a U+FFFD that no token produced. U+FFFD of invalid bytes followed
        by other text is kept (it was emitted by :meth:`push` already, or is
        part of this text); so is, with :class:`ByteTokenizer`, a U+FFFD at
        the end of invalid bytes that no byte could complete (``FF``), or one
        the model generated (``EF BF BD``). With other tokenizers any
        trailing U+FFFD counts as incomplete, as in vLLM.
        """
        window = self._ids[self._prefix :]
        shown = self.tokenizer.decode(self._ids[self._prefix : self._read])
        full = self.tokenizer.decode(window)
        if full.endswith(_REPLACEMENT) and self.tokenizer.ends_mid_character(window):
            full = full[:-1]
        new = _added_text(shown, full)
        self._prefix = self._read = len(self._ids)
        if new:
            self._text.append(new)
        return new


def _added_text(shown: str, full: str) -> str:
    """What ``full`` (a window's text) adds to ``shown`` (its already-shown part).

    When the window's earlier text changed (e.g. the prompt ended inside a
    character the new ids complete), only the common prefix counts as shown.
    """
    if not full.startswith(shown):
        n = 0
        while n < min(len(shown), len(full)) and shown[n] == full[n]:
            n += 1
        shown = shown[:n]
    return full[len(shown) :]


# --- the byte tokenizer as a Hugging Face tokenizer folder ------------------------------

BYTE_HF_SPECIAL_TOKENS: dict[str, int] = {"<s>": 256, "</s>": 257, "<pad>": 258, "<unused0>": 259}
"""The added special tokens of the byte tokenizer's ``tokenizer.json``: BOS,
EOS, PAD and ``<unused0>`` for the spare id 259. The byte tokenizer never
produces 259 and skips it when decoding; as a special token it is skipped
alike, and ``len(tokenizer)`` is the models' vocabulary (260)."""

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""What a byte-tokenizer folder holds (:func:`export_hf_tokenizer`)."""

_HF_DIR = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "byte-level"
"""The shipped folder (package data ``fleetserve/data/tokenizers/byte-level``)."""

_SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def _byte_level_chars() -> dict[int, str]:
    """Byte -> character of the ByteLevel pre-tokenizer (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the other 68 bytes for
    U+0100..U+0143 in byte order."""
    chars = {b: chr(b) for b in (*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100))}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(0x100 + n) for n, b in enumerate(shifted)})
    return chars


def build_byte_hf_tokenizer() -> Any:
    """The byte tokenizer as a ``tokenizers.Tokenizer`` (what the shipped
    ``tokenizer.json`` holds).

    A BPE model without merges over the 256 characters of the ByteLevel
    pre-tokenizer (``use_regex=False``, ``add_prefix_space=False``): each
    UTF-8 byte of the text is one token whose id is the byte's value. The
    ByteLevel decoder joins the bytes and decodes them as UTF-8 with U+FFFD
    for bad bytes, as :meth:`ByteTokenizer.decode` does. Added special
    tokens: :data:`BYTE_HF_SPECIAL_TOKENS`. The post-processor puts ``<s>``
    first when special tokens are asked for (transformers' default), as the
    engine does with a prompt.

    Written out special tokens in the text (``"<s>"``) are matched as special
    unless ``encode_special_tokens`` is set, which ``tokenizer.json`` cannot
    store: the folder's ``tokenizer_config.json`` sets
    ``split_special_tokens`` for that (:func:`byte_hf_tokenizer_config`).
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as _HFTok

    vocab = {ch: b for b, ch in _byte_level_chars().items()}
    tok = _HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in BYTE_HF_SPECIAL_TOKENS]
    )
    got = {t: tok.token_to_id(t) for t in BYTE_HF_SPECIAL_TOKENS}
    if got != BYTE_HF_SPECIAL_TOKENS:  # pragma: no cover - a tokenizers change
        raise RuntimeError(f"special token ids {got}, expected {BYTE_HF_SPECIAL_TOKENS}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0",
        pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", ByteTokenizer.BOS)],
    )
    return tok


def byte_hf_tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of the byte tokenizer's folder.

    ``split_special_tokens`` makes ``"<s>"`` in a text encode as its three
    bytes, as :class:`ByteTokenizer` does (transformers honours it;
    :class:`HFTokenizer` too). ``clean_up_tokenization_spaces`` is off so
    decoding keeps ``" ."`` and the like as they are.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
    }


def _json_text(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _unknown_model(model: str) -> ConfigError:
    close = difflib.get_close_matches(model, list(BUILTIN_MODELS), n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(
        f"{model!r} is neither a built-in model nor a checkpoint folder.{hint} "
        f"Built-in models: {', '.join(sorted(BUILTIN_MODELS))}"
    )


def _byte_model_context(model: str) -> int:
    """The context window of ``model``, which the engine must serve with
    :class:`ByteTokenizer` (see :func:`export_hf_tokenizer`)."""
    cfg = BUILTIN_MODELS.get(model)
    if cfg is not None:
        return cfg.spec.max_context
    folder = Path(model)
    if not folder.is_dir():
        raise _unknown_model(model)
    own = folder / "tokenizer.json"
    if own.is_file():
        raise ConfigError(
            f"{folder} has its own tokenizer ({own}), which the engine uses: give the "
            f"benchmark client that folder (e.g. --tokenizer {folder})"
        )
    cfg = load_config(folder)
    if cfg.spec.vocab_size < ByteTokenizer.PAD + 1:
        raise ConfigError(
            f"{folder} has no tokenizer.json and a vocabulary of {cfg.spec.vocab_size} ids, "
            f"too small for the byte tokenizer ({ByteTokenizer.PAD + 1}); the engine cannot "
            "serve it"
        )
    return cfg.spec.max_context


def hf_tokenizer_dir(model_name: str) -> Path:
    """The shipped Hugging Face tokenizer folder of a built-in model.

    Every built-in model uses the byte tokenizer and a 4,096-token context,
    so they share one folder, ``fleetserve/data/tokenizers/byte-level``
    (:data:`HF_TOKENIZER_FILES`); ``AutoTokenizer.from_pretrained`` loads it
    offline. Do not write into it: :func:`export_hf_tokenizer` makes a copy.

    Raises:
        ConfigError: not a built-in model (lists them), or one whose context
            window is not the shipped ``model_max_length`` (export its folder
            with :func:`export_hf_tokenizer` instead).
    """
    cfg = BUILTIN_MODELS.get(model_name)
    if cfg is None:
        raise _unknown_model(model_name)
    shipped = json.loads((_HF_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    if shipped.get("model_max_length") != cfg.spec.max_context:
        raise ConfigError(
            f"model {model_name!r}: its context ({cfg.spec.max_context}) is not the shipped "
            f"tokenizer folder's model_max_length ({shipped.get('model_max_length')}); "
            "write one with export_hf_tokenizer (fleetserve tokenizer MODEL --out DIR)"
        )
    return _HF_DIR


def export_hf_tokenizer(model_name: str, out_dir: str | Path) -> Path:
    """Write a Hugging Face tokenizer folder for a model the engine serves with
    :class:`ByteTokenizer`.

    ``out_dir`` gets :data:`HF_TOKENIZER_FILES`: the shipped ``tokenizer.json``,
    ``special_tokens_map.json`` and a ``tokenizer_config.json`` whose
    ``model_max_length`` is the model's context window. No ``config.json``:
    ``AutoTokenizer.from_pretrained(out_dir)`` does not need one (the config
    names ``tokenizer_class``), and without it the folder is not mistaken for
    a checkpoint.

    Args:
        model_name: a built-in model, or a checkpoint folder without a
            ``tokenizer.json`` (the engine serves those with the byte
            tokenizer too, see :func:`load_tokenizer`).
        out_dir: created if missing; files of the same names are replaced,
            but not another tokenizer's ``tokenizer.json``.

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: an unknown model (lists the built-in ones); a checkpoint
            folder with its own ``tokenizer.json`` (names it: the clients
            should load that folder); ``out_dir`` is a file or holds another
            ``tokenizer.json``.
        InputError: a checkpoint folder with a bad ``config.json``.
    """
    max_len = _byte_model_context(model_name)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder")
    tok_json = (_HF_DIR / "tokenizer.json").read_text(encoding="utf-8")
    dest = out / "tokenizer.json"
    if dest.is_file():
        try:
            same = json.loads(dest.read_text(encoding="utf-8")) == json.loads(tok_json)
        except (OSError, UnicodeDecodeError, ValueError):
            same = False
        if not same:
            raise ConfigError(
                f"{dest} already exists and is another tokenizer; choose another folder"
            )
    out.mkdir(parents=True, exist_ok=True)
    dest.write_text(tok_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        _json_text(byte_hf_tokenizer_config(max_len)), encoding="utf-8"
    )
    (out / "special_tokens_map.json").write_text(_json_text(_SPECIAL_TOKENS_MAP), encoding="utf-8")
    return out
