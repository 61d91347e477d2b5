"""Stop strings while streaming (``apply_stop_strings``, shared by Engine and
PipelineGroup): the streamed text is exactly the text up to the stopping
token, cut before the earliest stop string in it, and no streamed piece is
ever taken back."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.runtime.engine.sampling import apply_stop_strings

ALPHA = "abc"


def cut(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    """The reference: generation stops at the first token after which the text
    holds a stop string; the output is that text cut before the earliest one."""
    for k in range(1, len(pieces) + 1):
        text = "".join(pieces[:k])
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return "".join(pieces), False


def stream(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    emitted, held = "", ""
    for p in pieces:
        out, held, stopped = apply_stop_strings(emitted, held, p, stop)
        emitted += out
        if stopped:
            return emitted, True
    return emitted + held, False  # the end flushes the held-back text


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text(ALPHA, max_size=3), max_size=25),
    st.lists(st.text(ALPHA, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(
    pieces: list[str], stop: list[str]
) -> None:
    assert stream(pieces, stop) == cut(pieces, stop)


def test_a_possible_stop_prefix_is_held_back_then_released() -> None:
    out, held, stopped = apply_stop_strings("", "", "xyzab", ["abc"])
    assert (out, held, stopped) == ("xyz", "ab", False)
    out, held, stopped = apply_stop_strings("xyz", held, "d", ["abc"])
    assert (out, held, stopped) == ("abd", "", False)
    out, held, stopped = apply_stop_strings("", "ab", "c!", ["abc"])
    assert (out, held, stopped) == ("", "", True)
