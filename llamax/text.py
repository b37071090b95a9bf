"""Incremental UTF-8 detokenization and stop-string matching. Pure Python."""

from __future__ import annotations

import codecs
from array import array
from collections.abc import Callable, Sequence

__all__ = ["Detokenizer", "StopMatcher", "StopStrings"]

_SHIFT = 21  # code points fit in 21 bits; an edge key is (node << _SHIFT) | code point
_CODE_MASK = (1 << _SHIFT) - 1


class Detokenizer:
    """Turns token ids into text, emitting only complete UTF-8 characters.

    A character whose bytes are split across tokens (emoji, CJK via byte tokens) is held
    until its last byte arrives. Bytes that can never form valid UTF-8 become U+FFFD.
    """

    __slots__ = ("_decoder", "_piece")

    def __init__(self, token_to_piece: Callable[[int], bytes]) -> None:
        self._piece = token_to_piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Return the text completed by ``token_id`` (may be empty)."""
        return self._decoder.decode(self._piece(token_id))

    def flush(self) -> str:
        """End the stream. Bytes of a character cut off by the end are dropped, never shown
        as U+FFFD (the token ids still hold them)."""
        self._decoder.reset()
        return ""


class StopStrings:
    """One request's stop strings, compiled once into an Aho-Corasick automaton.

    Immutable, so the ``n`` sequences of a request share it; each sequence walks it with
    its own :class:`StopMatcher`. A state is a node of the trie of the stop strings: the
    longest suffix of the text seen so far that is a prefix of some stop string, which is
    exactly the text a matcher holds back (its length is the node's depth). Each character
    costs one edge lookup plus failure links (amortized O(1) per character), so the cost
    per token does not grow with the number of stop strings.

    Memory stays near the input's size: node ``v``'s text is a prefix of stop string
    ``owner[v]``, and the edge to the node made right after it (``chained[v]``) is read off
    that string, so only branching edges (at most one per stop string) need a dict entry.
    """

    __slots__ = ("_branches", "_chained", "_depth", "_fail", "_match_len", "_owner", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        """Build the automaton, in time and memory linear in the total length of ``stops``.

        Args:
            stops: Non-empty stop strings; duplicates and overlaps are allowed.

        Raises:
            ValueError: a stop string is empty.
        """
        self._stops = tuple(stops)
        self._branches: dict[int, int] = {}
        """Edges that do not lead to the next node: ``(node << 21) | code point`` -> child."""
        self._chained = bytearray(1)
        """``chained[v]``: node ``v + 1`` is a child of ``v``."""
        self._depth = array("i", [0])
        self._owner = array("i", [0])
        """A stop string that node ``v``'s text is a prefix of."""
        self._match_len = array("i", [0])
        """Length of the longest stop string that ends node ``v``'s text (0: none)."""
        for index, stop in enumerate(self._stops):
            if not stop:
                raise ValueError("stop strings must be non-empty")
            self._insert(index, stop)
        self._fail = self._failure_links()
        """Node of the longest proper suffix of node ``v``'s text that is in the trie."""

    def _child(self, node: int, ch: str) -> int:
        """The trie child of ``node`` by ``ch``, or -1."""
        if self._chained[node] and self._stops[self._owner[node + 1]][self._depth[node]] == ch:
            return node + 1
        return self._branches.get(node << _SHIFT | ord(ch), -1)

    def _insert(self, index: int, stop: str) -> None:
        node = 0
        for offset, ch in enumerate(stop):
            child = self._child(node, ch)
            if child < 0:
                child = len(self._depth)
                if child == node + 1:
                    self._chained[node] = 1
                else:
                    self._branches[node << _SHIFT | ord(ch)] = child
                self._depth.append(offset + 1)
                self._owner.append(index)
                self._match_len.append(0)
                self._chained.append(0)
            node = child
        self._match_len[node] = len(stop)

    def _failure_links(self) -> array[int]:
        """Failure links, node by node in order of depth (a parent's link comes first)."""
        depth, owner, match_len = self._depth, self._owner, self._match_len
        parent = {child: key >> _SHIFT for key, child in self._branches.items()}
        fail = array("i", [0]) * len(depth)
        for node in sorted(range(1, len(depth)), key=depth.__getitem__):
            up = parent.get(node, node - 1)
            if up:
                ch = self._stops[owner[node]][depth[node] - 1]
                fail[node] = self._step(fail, fail[up], ch)
            if not match_len[node]:
                match_len[node] = match_len[fail[node]]
        return fail

    def _step(self, fail: array[int], node: int, ch: str) -> int:
        """The state after ``ch`` from state ``node``."""
        while True:
            child = self._child(node, ch)
            if child >= 0:
                return child
            if not node:
                return 0
            node = fail[node]

    @property
    def is_empty(self) -> bool:
        """Whether there are no stop strings."""
        return not self._stops

    def depth(self, node: int) -> int:
        """Length of the text state ``node`` holds back."""
        return self._depth[node]

    def prefix(self, node: int, text: str, length: int) -> str:
        """The first ``length`` characters of state ``node``'s held text followed by ``text``.

        Costs O(``length``): the held text is a prefix of one stop string, never stored.
        """
        held_len = self._depth[node]
        if not held_len:
            return text[:length]
        stop = self._stops[self._owner[node]]
        if length <= held_len:
            return stop[:length]
        return stop[:held_len] + text[: length - held_len]

    def scan(self, node: int, text: str) -> tuple[int, int]:
        """Walk ``text`` from state ``node``.

        Returns:
            ``(state, start)``: the state after ``text``, and where the earliest complete
            stop string starts, counted from the start of ``node``'s held text (``-1`` if
            none completed).
        """
        match_len, fail = self._match_len, self._fail
        offset = self._depth[node] + 1  # a match ending at text[i] ends at offset + i
        earliest = -1
        for i, ch in enumerate(text):
            node = self._step(fail, node, ch)
            length = match_len[node]
            if length and (earliest < 0 or offset + i - length < earliest):
                earliest = offset + i - length
        return node, earliest


class StopMatcher:
    """Holds back text that may be the start of a stop string; trims a full match.

    ``feed`` returns ``(safe_text, matched)``. When ``matched`` is true the stream is over
    and ``safe_text`` ends just before the stop string that starts earliest in the text
    seen so far. Otherwise the longest suffix of the text seen so far that is a proper
    prefix of some stop string is held back. Its cost per call is the length of the new
    and released text, whatever the number of stop strings (see :class:`StopStrings`).
    """

    __slots__ = ("_state", "_stops")

    def __init__(self, stops: Sequence[str] | StopStrings) -> None:
        """Start matching at the beginning of a stream.

        Args:
            stops: The stop strings, or a :class:`StopStrings` shared with other streams.

        Raises:
            ValueError: a stop string is empty.
        """
        self._stops = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self._state = 0

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return what may be emitted now and whether a stop string matched."""
        stops, before = self._stops, self._state
        if stops.is_empty:
            return text, False
        after, start = stops.scan(before, text)
        if start >= 0:
            self._state = 0
            return stops.prefix(before, text, start), True
        self._state = after
        released = stops.depth(before) + len(text) - stops.depth(after)
        return stops.prefix(before, text, released), False

    def flush(self) -> str:
        """Release the held-back text at the end of a stream that did not match."""
        held, self._state = self._state, 0
        return self._stops.prefix(held, "", self._stops.depth(held))
