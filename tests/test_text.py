"""Detokenizer and stop matcher, no model."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llamax.text import Detokenizer, StopMatcher

BYTE_TOKENS = {b + 1: bytes([b]) for b in range(256)}


def byte_tokens(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]


def test_detokenizer_holds_split_characters_until_complete() -> None:
    detok = Detokenizer(BYTE_TOKENS.__getitem__)
    deltas = [detok.feed(t) for t in byte_tokens("a😀b漢")]
    assert deltas == ["a", "", "", "", "😀", "b", "", "", "漢"]
    assert detok.flush() == ""


def test_detokenizer_replaces_only_invalid_bytes() -> None:
    detok = Detokenizer(BYTE_TOKENS.__getitem__)
    assert detok.feed(0xFF + 1) == "\ufffd"
    assert detok.feed(0xE6 + 1) == ""  # an incomplete lead byte is held, not replaced
    assert detok.flush() == ""  # a character cut off by the end of the stream is dropped


@given(st.text(), st.lists(st.integers(1, 6), max_size=50))
def test_detokenizer_joined_deltas_equal_text(text: str, sizes: list[int]) -> None:
    data = text.encode("utf-8")
    pieces: dict[int, bytes] = {}
    tokens, i = [], 0
    while i < len(data):
        n = sizes[len(tokens) % len(sizes)] if sizes else 1
        pieces[len(tokens)] = data[i : i + n]
        tokens.append(len(tokens))
        i += n
    detok = Detokenizer(pieces.__getitem__)
    deltas = [detok.feed(t) for t in tokens] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


def test_stop_matcher_holds_back_partial_match() -> None:
    stop = StopMatcher(["\n\n", "END"])
    assert stop.feed("hello E") == ("hello ", False)
    assert stop.feed("N") == ("", False)
    assert stop.feed("X") == ("ENX", False)
    assert stop.feed("ok\n") == ("ok", False)
    assert stop.feed("\nmore") == ("", True)


def test_stop_matcher_spanning_pieces_trims_at_earliest_stop() -> None:
    stop = StopMatcher(["cd", "bcde"])
    assert stop.feed("ab") == ("a", False)
    assert stop.feed("cdef") == ("", True)  # "bcde" starts first: the text is "a"


def test_stop_matcher_flush_releases_held_text() -> None:
    stop = StopMatcher(["world"])
    assert stop.feed("hello wor") == ("hello ", False)
    assert stop.flush() == "wor"


def test_stop_matcher_without_stops_passes_through() -> None:
    stop = StopMatcher([])
    assert stop.feed("abc") == ("abc", False)


@given(
    st.text(alphabet="abc\n", max_size=40),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(1, 5), min_size=1, max_size=10),
)
def test_stop_matcher_equals_reference(text: str, stops: list[str], sizes: list[int]) -> None:
    matcher = StopMatcher(stops)
    out, matched, i, k = [], False, 0, 0
    expected, seen = text, 0
    while i < len(text) and not matched:
        chunk = text[i : i + sizes[k % len(sizes)]]
        i, k = i + len(chunk), k + 1
        emitted, matched = matcher.feed(chunk)
        out.append(emitted)
        # Reference: a stop counts once it is complete in the text seen so far; the text is
        # cut at the earliest complete stop at that moment.
        hits = [p for p in (text[:i].find(s) for s in stops) if p >= 0]
        if hits and seen == 0:
            expected, seen = text[: min(hits)], 1
    if not matched:
        out.append(matcher.flush())
    assert "".join(out) == expected
    assert matched == bool(seen)
