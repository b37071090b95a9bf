"""The stop-string automaton: same answers as a naive matcher, cost independent of list size."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llamax
import llamax.engine.sequence
from llamax.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from llamax.testing import FakeBackend
from llamax.text import Detokenizer, StopMatcher, StopStrings

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]

BYTE_TOKENS = {b + 1: bytes([b]) for b in range(256)}
ALPHABET = "ab\né😀"  # few characters, so stops overlap; two of them are multi-byte


class NaiveStopMatcher:
    """The definition, with no cleverness: look at the whole text seen so far each time."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.seen = ""
        self.emitted = 0

    def feed(self, text: str) -> tuple[str, bool]:
        self.seen += text
        hits = [i for i in (self.seen.find(s) for s in self.stops) if i >= 0]
        if hits:
            out = self.seen[self.emitted : min(hits)]
            self.emitted = len(self.seen)
            return out, True
        held = max(
            (
                k
                for k in range(len(self.seen) + 1)
                if any(
                    len(s) > k and s.startswith(self.seen[len(self.seen) - k :]) for s in self.stops
                )
            ),
            default=0,
        )
        out = self.seen[self.emitted : len(self.seen) - held]
        self.emitted = len(self.seen) - held
        return out, False

    def flush(self) -> str:
        out = self.seen[self.emitted :]
        self.emitted = len(self.seen)
        return out


def token_stream(text: str, sizes: list[int]) -> Iterator[bytes]:
    """``text`` as UTF-8 pieces of the given sizes (cycled), splitting characters freely."""
    data = text.encode("utf-8")
    i = k = 0
    while i < len(data):
        size = sizes[k % len(sizes)]
        yield data[i : i + size]
        i, k = i + size, k + 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), max_size=8),
    st.lists(st.text(alphabet=ALPHABET, max_size=40), min_size=1, max_size=3),
    st.lists(st.integers(1, 7), min_size=1, max_size=12),
)
def test_automaton_equals_naive_matcher(
    stops: list[str], texts: list[str], sizes: list[int]
) -> None:
    # One automaton shared by several streams (a request's n sequences), fed in turns from
    # byte pieces through the incremental UTF-8 decoder, as the engine does.
    shared = StopStrings(stops)
    streams = [
        (
            pieces,
            Detokenizer(pieces.__getitem__),
            StopMatcher(shared),
            NaiveStopMatcher(stops),
        )
        for pieces in (list(token_stream(text, sizes)) for text in texts)
    ]
    done = [False] * len(streams)
    for step in range(max((len(s[0]) for s in streams), default=0)):
        for index, (pieces, detok, matcher, naive) in enumerate(streams):
            if done[index] or step >= len(pieces):
                continue
            text = detok.feed(step)
            got = matcher.feed(text)
            assert got == naive.feed(text), (stops, texts[index], step)
            done[index] = got[1]
    for index, (_, _, matcher, naive) in enumerate(streams):
        if not done[index]:
            assert matcher.flush() == naive.flush()
            assert matcher.feed("") == ("", False)  # a flushed matcher starts over


def test_earliest_start_wins_over_earliest_end() -> None:
    # "bc" ends first, but "abcd" starts first: the text is cut before "abcd".
    matcher = StopMatcher(["abcd", "bc", "x"])
    assert matcher.feed("zab") == ("z", False)
    assert matcher.feed("cd") == ("", True)
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("zabce") == ("za", True)  # "abcd" never completed: "bc" wins


def test_held_text_spans_many_pieces_and_multibyte_characters() -> None:
    stop = "é😀" * 5 + "!"
    matcher = StopMatcher([stop, "😀é😀é😀é😀é😀é😀é?"])
    out = [matcher.feed(ch) for ch in "xé😀é😀é😀é😀"]
    assert "".join(text for text, _ in out) == "x"
    # The first stop cannot follow "é😀" * 5 + "é"; its tail from the first "😀" leads the second.
    assert matcher.feed("é😀é") == ("é", False)
    assert matcher.flush() == "😀é" * 5


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["a", ""])


def test_request_builds_one_automaton_for_all_choices(
    make_fake: MakeFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[StopStrings] = []

    class Counting(StopStrings):
        __slots__ = ()

        def __init__(self, stops: Any) -> None:
            super().__init__(stops)
            built.append(self)

    monkeypatch.setattr(llamax.engine.sequence, "StopStrings", Counting)
    ctx, _ = make_fake(n_seq_max=8, n_ctx=1024)
    handle = ctx.add_request(
        "a", llamax.SamplingParams(n=8, max_tokens=8, temperature=0, stop=["fgh"])
    )
    while ctx.has_work():
        ctx.process()
    assert len(built) == 1
    assert [c.text for c in handle.result(0).choices] == ["bcde"] * 8
    assert {c.finish_reason for c in handle.result(0).choices} == {"stop"}


# --- cost: count the interpreter's calls (Python and C) instead of timing anything --------


def count_calls(fn: Callable[[], object]) -> int:
    """How many calls and returns (Python and builtin) ``fn()`` makes in this thread."""
    count = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        count += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count


CYCLE = "bcdefghijklmnopqrstuvwxyza" * 4  # what the fake model writes after "a"


def cycle_stops(num: int) -> list[str]:
    """``num`` distinct 64-character stops that follow the fake's output for 60 characters,
    so the matcher holds text back all along, and never match."""
    return [CYCLE[i % 26 : i % 26 + 60] + f"{i:04d}" for i in range(num)]


@pytest.mark.parametrize("text", [CYCLE[:50], "xyz" * 20, ("é😀" * 30)])
def test_cost_per_token_does_not_grow_with_the_stop_list(text: str) -> None:
    def feed_all(stops: list[str]) -> Callable[[], None]:
        matcher = StopMatcher(stops)  # built outside the counted part

        def feed() -> None:
            for ch in text:
                matcher.feed(ch)

        return feed

    small = count_calls(feed_all(cycle_stops(10)))
    largest = count_calls(feed_all(cycle_stops(MAX_STOP_STRINGS)))
    assert largest <= 1.5 * small, (small, largest)


def test_largest_stop_list_with_n8_does_not_slow_a_bystander(make_fake: MakeFake) -> None:
    """Issue 22 item 9: another user's stop list must not cost the engine work per token
    in proportion to its length (700k stops made a 20-token request take 23.5 s)."""

    def engine_work(stops: list[str]) -> tuple[int, int, str, list[str]]:
        ctx, _ = make_fake(n_seq_max=9, n_ctx=1024)
        hog = ctx.add_request(
            "a", llamax.SamplingParams(n=8, max_tokens=40, temperature=0, stop=stops)
        )
        bystander = ctx.add_request("m", llamax.SamplingParams(max_tokens=20, temperature=0))
        steps = 0

        def drive() -> None:
            nonlocal steps
            while not bystander.done():
                ctx.process()
                steps += 1

        work = count_calls(drive)  # the engine's work until the bystander is done
        while ctx.has_work():
            ctx.process()
        return work, steps, bystander.result(0).text, [c.text for c in hog.result(0).choices]

    largest = cycle_stops(MAX_STOP_STRINGS)
    assert sum(map(len, largest)) == MAX_STOP_CHARS  # the most SamplingParams accepts
    work_one, steps_one, text_one, hog_one = engine_work(cycle_stops(1))
    work_max, steps_max, text_max, hog_max = engine_work(largest)
    assert (text_max, steps_max, hog_max) == (text_one, steps_one, hog_one)
    assert hog_max == [CYCLE[:40]] * 8  # held back all along, released at the end
    assert work_max <= 1.25 * work_one, (work_one, work_max)
