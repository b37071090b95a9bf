"""Incremental UTF-8 detokenization and stop-string matching. Pure Python."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

__all__ = ["Detokenizer", "StopMatcher"]


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


class StopMatcher:
    """Holds back text that may be the start of a stop string; trims a full match.

    ``feed`` returns ``(safe_text, matched)``. When ``matched`` is true the stream is over
    and ``safe_text`` ends just before the stop string. Otherwise the longest suffix of the
    text seen so far that is a proper prefix of some stop string is held back.
    """

    __slots__ = ("_held", "_max_len", "_stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return what may be emitted now and whether a stop string matched."""
        if not self._stops:
            return text, False
        buf = self._held + text
        first = min(
            (i for i in (buf.find(stop) for stop in self._stops) if i >= 0),
            default=-1,
        )
        if first >= 0:
            self._held = ""
            return buf[:first], True
        keep = self._held_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back text at the end of a stream that did not match."""
        held, self._held = self._held, ""
        return held

    def _held_suffix_len(self, buf: str) -> int:
        for n in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
