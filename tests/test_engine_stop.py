"""Stop strings while streaming (:class:`StopMatcher`, used by the engine,
pipeline and buddy groups through ``append_token``): the streamed text is
exactly the text up to the stopping token, cut before the earliest stop string
in it, no streamed piece is ever taken back, and the work per token is linear
in the token's text, not in the stop strings' length."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.runtime.engine.sampling import StopMatcher

ALPHA = "abc"


def naive_stop(emitted: str, held: str, piece: str, stop: Sequence[str]) -> tuple[str, str, bool]:
    """The reference (the engine's first algorithm, quadratic in the stop
    strings' length): returns ``(emit, held, stopped)``."""
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


def naive_states(text: str, stop: Sequence[str]) -> tuple[int, ...]:
    """Per stop string: the longest suffix of ``text`` that is a proper prefix of it."""
    return tuple(
        max((k for k in range(1, len(s)) if text.endswith(s[:k])), default=0) for s in stop
    )


def cut(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    """Generation stops at the first token after which the text holds a stop
    string; the output is that text cut before the earliest one."""
    for k in range(1, len(pieces) + 1):
        text = "".join(pieces[:k])
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return "".join(pieces), False


def stream(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stop)
    emitted = ""
    for p in pieces:
        out, stopped = m.feed(p)
        emitted += out
        if stopped:
            return emitted, True
    return emitted + m.held, False  # the end flushes the held-back text


PIECES = st.lists(st.text(ALPHA, max_size=4), max_size=30)
STOPS = st.lists(st.text(ALPHA, min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(PIECES, STOPS)
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(
    pieces: list[str], stop: list[str]
) -> None:
    assert stream(pieces, stop) == cut(pieces, stop)


@settings(max_examples=600, deadline=None)
@given(PIECES, STOPS)
def test_the_matcher_agrees_with_the_naive_algorithm_token_by_token(
    pieces: list[str], stop: list[str]
) -> None:
    m = StopMatcher(stop)
    emitted, held = "", ""
    for p in pieces:
        want = naive_stop(emitted, held, p, stop)
        emit, stopped = m.feed(p)
        assert (emit, m.held, stopped) == want
        if stopped:
            break
        emitted += emit
        held = m.held


@settings(max_examples=600, deadline=None)
@given(PIECES, STOPS, st.integers(0, 30))
def test_the_state_is_a_function_of_the_held_text(
    pieces: list[str], stop: list[str], unchecked: int
) -> None:
    """Running the automata over ``held`` from the empty state gives the
    matcher's state (what a migrated request rebuilds), also after stop
    strings were let through while not checked (``min_tokens``)."""
    m = StopMatcher(stop)
    twin = StopMatcher(stop)  # rebuilt from the held text before every piece
    text = ""
    for i, p in enumerate(pieces):
        check = i >= unchecked
        out = m.feed(p, check=check)
        assert twin.feed(p, check=check) == out  # a rebuilt matcher goes on alike
        if out[1]:
            break
        text += p
        assert m.states == naive_states(text, stop)
        assert len(m.held) == max(m.states)  # the held text is the longest such suffix
        twin = StopMatcher(stop, m.held)
        assert twin.states == m.states and twin.held == m.held


def test_unchecked_text_lets_stop_strings_through_but_still_holds_back() -> None:
    m = StopMatcher(["ab", "abcd"])
    assert m.feed("xab", check=False) == ("x", False)  # "ab" passes, "ab..." held
    assert m.held == "ab"
    assert m.feed("c", check=False) == ("", False)
    assert m.held == "abc"
    assert m.feed("e") == ("abce", False)
    assert m.feed("abcd") == ("", True)  # "ab" and "abcd" start together


def test_several_stops_in_one_piece_cut_at_the_earliest_start() -> None:
    # "bc" ends first, "abcde" starts first: the cut is before "abcde"
    assert StopMatcher(["bc", "abcde"]).feed("xabcdey") == ("x", True)
    assert StopMatcher(["abcde", "bc"]).feed("xabcdy") == ("xa", True)


def test_a_possible_stop_prefix_is_held_back_then_released() -> None:
    m = StopMatcher(["abc"])
    assert m.feed("xyzab") == ("xyz", False) and m.held == "ab"
    assert m.feed("d") == ("abd", False) and m.held == ""
    m = StopMatcher(["abc"], "ab")
    assert m.feed("c!") == ("", True) and m.held == ""


def test_a_huge_stop_string_costs_work_linear_in_the_tokens() -> None:
    """The old check took ~26 s for two tokens against a 900 KB stop string
    (O(len(s)^2) per token); the automaton's work is bounded by the text fed."""
    n = 1_000_000
    huge = "ab" * (n // 2)
    m = StopMatcher(["\n\n", huge])
    for piece in ("Hello", " abab", "ab"):
        m.feed(piece)
    fed = len("Hello abab" + "ab")
    assert m.held == "ababab"
    assert m.steps <= 4 * 2 * fed  # two stop strings, a few steps per character
    # a long partial match, then a mismatch: still linear in what was fed
    m = StopMatcher(["a" * n + "b"])
    for _ in range(200):
        m.feed("a" * 50)
    assert len(m.held) == 200 * 50
    m.feed("c")
    assert m.held == ""
    assert m.steps <= 4 * (200 * 50 + 1)
    # rebuilding from the held text (a migrated request) is linear in it too
    held = "ab" * 5000
    m = StopMatcher([huge], held)
    assert m.held == held and m.states == (len(held),)
    assert m.steps <= 4 * len(held)


@settings(max_examples=200, deadline=None)
@given(PIECES, STOPS)
def test_the_work_is_linear_in_the_text_fed(pieces: list[str], stop: list[str]) -> None:
    m = StopMatcher(stop)
    for p in pieces:
        if m.feed(p)[1]:
            break
    fed = sum(len(p) for p in pieces)
    assert m.steps <= 4 * len(stop) * fed
