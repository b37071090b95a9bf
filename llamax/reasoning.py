"""The reasoning split: a thinking model's ``<think>…</think>`` goes to
``reasoning_content``, the rest to ``content``. Pure Python, streaming-safe.

Models such as Qwen3, DeepSeek-R1 distills and SmolLM3 think before they answer, in
``<think>…</think>`` at the start of the reply; some templates open the tag in the prompt
(the reply then starts inside the thinking). :class:`ReasoningSplitter` takes the reply's
text as it streams and gives back, for each piece, what is reasoning and what is content.
A tag cut across tokens is held back until it is whole, like a stop string, so no part of
it ever reaches either side; the whitespace around the thinking is dropped, as
llama-server does.

``reasoning_format`` (:data:`ReasoningFormat`):

``"auto"`` (default)
    Split when the reply starts with ``<think>`` (after whitespace), or from its first
    token when the rendered prompt ends inside an open ``<think>``; otherwise the reply
    is all content.
``"deepseek"``
    llama-server's name for the same split; accepted so its clients need no change.
``"none"``
    No split: the thinking stays in ``content``, tags and all.
"""

from __future__ import annotations

from typing import Literal, get_args

from .errors import InvalidParameterError

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "ReasoningFormat",
    "ReasoningSplitter",
    "check_reasoning_format",
    "opens_thinking",
    "split_reasoning",
]

ReasoningFormat = Literal["auto", "deepseek", "none"]
"""How a reply's thinking is reported (see the module's docs)."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
"""The tags around a reply's thinking."""

_START, _INSIDE, _AFTER, _CONTENT = range(4)


def check_reasoning_format(value: object) -> ReasoningFormat:
    """``value`` as a :data:`ReasoningFormat`.

    Raises:
        InvalidParameterError: It is not one.
    """
    if value not in get_args(ReasoningFormat):
        allowed = ", ".join(repr(v) for v in get_args(ReasoningFormat))
        raise InvalidParameterError(f"reasoning_format must be one of {allowed}, got {value!r}")
    return value  # type: ignore[return-value]


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ending in ``prompt_tail`` leaves a ``<think>`` open (the
    template starts the reply's thinking itself)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(THINK_OPEN)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Splits one reply's streamed text into reasoning and content.

    Feed it every piece of text in order (:meth:`feed`), then :meth:`flush` once at the
    end. Joined, the reasoning pieces are the thinking without its tags and surrounding
    whitespace, and the content pieces are the rest, also without the whitespace that
    followed the closing tag.
    """

    __slots__ = ("_held", "_reasoning_started", "_state", "saw_reasoning")

    def __init__(self, *, inside: bool = False) -> None:
        """
        Args:
            inside: The prompt opened the thinking: the reply starts inside it.
        """
        self._state = _INSIDE if inside else _START
        self._held = ""
        self._reasoning_started = False
        self.saw_reasoning = inside
        """Whether the reply has a thinking part (its tag was seen, or the prompt opened it)."""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the thinking (a reply cut here has thought
        but not answered)."""
        return self._state == _INSIDE

    def feed(self, text: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` that ``text`` completes (either may be empty)."""
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state == _START:
                stripped = buf.lstrip()
                if not stripped or THINK_OPEN.startswith(stripped):
                    self._held = buf  # whitespace, or an opening tag not yet whole
                    break
                if stripped.startswith(THINK_OPEN):
                    self._state, self.saw_reasoning = _INSIDE, True
                    buf = stripped[len(THINK_OPEN) :]
                    continue
                self._state = _CONTENT  # no thinking: everything is content
            elif self._state == _INSIDE:
                if not self._reasoning_started:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    self._reasoning_started = True
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(buf[:end].rstrip())
                    self._state = _AFTER
                    buf = buf[end + len(THINK_CLOSE) :]
                    continue
                keep = _held_prefix(buf, THINK_CLOSE)
                body = buf[: len(buf) - keep]
                trimmed = body.rstrip()  # whitespace before a closing tag is dropped
                reasoning.append(trimmed)
                self._held = body[len(trimmed) :] + buf[len(buf) - keep :]
                break
            elif self._state == _AFTER:
                buf = buf.lstrip()
                if buf:
                    self._state = _CONTENT
                continue
            if self._state == _CONTENT:
                content.append(buf)
                break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The ``(reasoning, content)`` held back at the end of the reply."""
        held, self._held = self._held, ""
        if self._state == _START:
            return "", held  # whitespace or a lone "<thi": the reply's content
        if self._state == _INSIDE:
            return (held.rstrip() if self._reasoning_started else ""), ""
        return "", ""


def split_reasoning(text: str, *, inside: bool = False) -> tuple[str | None, str]:
    """A whole reply's ``(reasoning, content)``; reasoning is None when it has no thinking."""
    splitter = ReasoningSplitter(inside=inside)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    if not splitter.saw_reasoning:
        return None, content + more_content
    return reasoning + more_reasoning, content + more_content
