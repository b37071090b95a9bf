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

gpt-oss replies (OpenAI's *harmony* format) are split too, in ``"auto"`` and
``"deepseek"``: a reply that starts with ``<|channel|>`` (or ``<|start|>``) is a run of
messages ``[<|start|>assistant]<|channel|>NAME[ to=RECIPIENT][<|constrain|>…]<|message|>BODY``,
each ended by ``<|end|>`` (or the end of the reply). llama.cpp renders those markers as text
for gpt-oss vocabularies (they are user-defined tokens, and ``<|end|>`` is taken off the
end-of-generation list), so the split works on the text like the ``<think>`` one.
The ``analysis`` channel is the thinking; ``final`` and a recipient-less ``commentary``
(a preamble) are content; a message addressed ``to=functions.NAME`` is a tool call, which
reaches the content as llamax's own call markup (``<tool_call>{"name": …, "arguments": …}
</tool_call>``) so the tool-call parser reads it like any other.
"""

from __future__ import annotations

import json
import re
from typing import Literal, get_args

from .errors import InvalidParameterError

__all__ = [
    "CHANNEL",
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
CHANNEL = "<|channel|>"
"""The marker a gpt-oss (harmony) reply starts with (after an optional ``<|start|>``)."""
_START_MARK, _MESSAGE, _CONSTRAIN = "<|start|>", "<|message|>", "<|constrain|>"
_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", _START_MARK)
"""What ends a harmony message's body (``<|start|>``: a new message with no ``<|end|>``)."""
_MAX_HEADER_CHARS = 256
"""A harmony header not ended by ``<|message|>`` within this many characters is not one."""
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CALL_OPEN, _CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
"""llamax's tool-call markup (:mod:`llamax.tools`), which a harmony call is rewritten into."""

_START, _INSIDE, _AFTER, _CONTENT, _HARMONY = range(5)


def check_reasoning_format(value: object) -> ReasoningFormat:
    """``value`` as a :data:`ReasoningFormat`.

    Raises:
        InvalidParameterError: It is not one.
    """
    if value not in get_args(ReasoningFormat):
        allowed = ", ".join(repr(v) for v in get_args(ReasoningFormat))
        raise InvalidParameterError(
            f"reasoning_format must be one of {allowed}, got {value!r}", param="reasoning_format"
        )
    return value  # type: ignore[return-value]


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a rendered prompt ending in ``prompt_tail`` leaves a ``<think>`` open (the
    template starts the reply's thinking itself)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(THINK_OPEN)


def _held_prefix(text: str, *tags: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    for size in range(min(len(text), max(len(tag) for tag in tags) - 1), 0, -1):
        if any(tag.startswith(text[-size:]) and len(tag) > size for tag in tags):
            return size
    return 0


def _starts_harmony(stripped: str) -> bool | None:
    """Whether a reply's text (leading whitespace stripped) starts a harmony message; None
    while it is still a prefix of one of its markers."""
    for mark in (CHANNEL, _START_MARK):
        if stripped.startswith(mark):
            return True
        if mark.startswith(stripped):
            return None
    return False


class _Channels:
    """The harmony split (see the module's docs): one reply's messages, routed by channel.

    Each message body's leading and trailing whitespace is dropped, as with ``<think>``;
    a second body on the same side is set off from the first by a newline.
    """

    __slots__ = ("_body_started", "_held", "_kind", "_pending_ws", "_said", "saw_reasoning")

    def __init__(self) -> None:
        self._kind: str | None = None  # None: reading a header; else reasoning/content/call
        self._held = ""
        self._body_started = False
        self._pending_ws: list[str] = []  # pieces, joined once: a long run stays linear
        self._said = {"reasoning": False, "content": False}
        self.saw_reasoning = False

    @property
    def in_reasoning(self) -> bool:
        return self._kind == "reasoning"

    def feed(self, text: str, out: dict[str, list[str]]) -> bool:
        """Route ``text`` into ``out``; False when the header is not harmony after all
        (everything held so far is then given back in ``out["content"]``)."""
        buf, self._held = self._held + text, ""
        while buf:
            if self._kind is None:
                end = buf.find(_MESSAGE)
                if (end if end >= 0 else len(buf)) > _MAX_HEADER_CHARS:
                    out["content"].append(buf)  # too long for a header
                    return False
                if end < 0:
                    self._held = buf
                    return True
                self._open(buf[:end], out)
                buf = buf[end + len(_MESSAGE) :]
                continue
            ends = [(i, mark) for mark in _BODY_ENDS if (i := buf.find(mark)) >= 0]
            if ends:
                at, mark = min(ends)
                self._body(buf[:at], out, final=True)
                self._close(out)
                buf = buf[at + (0 if mark == _START_MARK else len(mark)) :]
                continue
            keep = _held_prefix(buf, *_BODY_ENDS)
            self._body(buf[: len(buf) - keep], out, final=False)
            self._held = buf[len(buf) - keep :]
            break
        return True

    def flush(self, out: dict[str, list[str]], *, cut: bool) -> None:
        """Route what is held at the end of the reply. A call the reply ended inside is
        closed unless the reply was ``cut`` (by ``max_tokens`` or a cancel): a cut call
        is left open for the tool-call parser to drop."""
        held, self._held = self._held, ""
        if self._kind is None:
            if held.strip():
                out["content"].append(held)  # a header that never got its body
            return
        self._body(held, out, final=True)
        if not (cut and self._kind == "call"):
            self._close(out)

    def _open(self, header: str, out: dict[str, list[str]]) -> None:
        channel = header.partition(CHANNEL)[2].split(_CONSTRAIN)[0].split()
        name = channel[0] if channel else ""
        recipient = _RECIPIENT.search(header)
        self._body_started, self._pending_ws = False, []
        if recipient and recipient.group(1).startswith("functions."):
            function = recipient.group(1).removeprefix("functions.")
            self._kind = "call"
            out["content"].append(f'{_CALL_OPEN}{{"name": {json.dumps(function)}, "arguments": ')
        elif name == "analysis":
            self._kind, self.saw_reasoning = "reasoning", True
        else:
            self._kind = "content"  # final, a preamble, or a channel unknown here

    def _body(self, text: str, out: dict[str, list[str]], *, final: bool) -> None:
        kind = self._kind
        assert kind is not None
        side = "content" if kind == "call" else kind
        if not self._body_started:
            text = text.lstrip()
            if not text:
                return
            self._body_started = True
            if kind != "call" and self._said[kind]:
                text = "\n" + text  # a second body on this side
        if final:
            if text := text.rstrip():
                out[side].append("".join(self._pending_ws) + text)
            self._pending_ws = []
            return
        trimmed = text.rstrip()
        if not trimmed:  # whitespace only: held until text follows (or dropped at the end)
            self._pending_ws.append(text)
            return
        out[side].append("".join(self._pending_ws) + trimmed)
        self._pending_ws = [text[len(trimmed) :]]
        if kind != "call":
            self._said[kind] = True

    def _close(self, out: dict[str, list[str]]) -> None:
        if self._kind == "call":
            out["content"].append(f"}}{_CALL_CLOSE}")
        elif self._kind is not None and self._body_started:
            self._said[self._kind] = True
        self._kind, self._pending_ws = None, []


class ReasoningSplitter:
    """Splits one reply's streamed text into reasoning and content.

    Feed it every piece of text in order (:meth:`feed`), then :meth:`flush` once at the
    end. Joined, the reasoning pieces are the thinking without its tags and surrounding
    whitespace, and the content pieces are the rest, also without the whitespace that
    followed the closing tag.
    """

    __slots__ = ("_channels", "_held", "_reasoning_started", "_state", "_ws", "saw_reasoning")

    def __init__(self, *, inside: bool = False) -> None:
        """
        Args:
            inside: The prompt opened the thinking: the reply starts inside it.
        """
        self._state = _INSIDE if inside else _START
        # Design note: what is held back is split in two, so that a long run of whitespace
        # costs linear time: ``_held``, a few characters that may still become a tag (an
        # opening one at the start, ``</think>`` inside), looked at again with each piece;
        # and ``_ws``, the whitespace before them (leading the reply, or trailing the
        # thinking so far), kept as pieces and joined once, when text follows it.
        self._held = ""
        self._ws: list[str] = []
        self._reasoning_started = False
        self._channels: _Channels | None = None
        self.saw_reasoning = inside
        """Whether the reply has a thinking part (its tag was seen, or the prompt opened it)."""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the thinking (a reply cut here has thought
        but not answered)."""
        if self._channels is not None and self._state == _HARMONY:
            return self._channels.in_reasoning
        return self._state == _INSIDE

    def feed(self, text: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` that ``text`` completes (either may be empty)."""
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state == _START:
                stripped = buf.lstrip()  # _held, if any, starts with a non-space
                if len(stripped) < len(buf):
                    self._ws.append(buf[: len(buf) - len(stripped)])
                harmony = _starts_harmony(stripped)
                if not stripped or THINK_OPEN.startswith(stripped) or harmony is None:
                    self._held = stripped  # an opening tag not yet whole (a few characters)
                    break
                lead, self._ws = "".join(self._ws), []
                if harmony:
                    self._state, self._channels, buf = _HARMONY, _Channels(), stripped
                    continue
                if stripped.startswith(THINK_OPEN):
                    self._state, self.saw_reasoning = _INSIDE, True
                    buf = stripped[len(THINK_OPEN) :]
                    continue
                self._state, buf = _CONTENT, lead + stripped  # no thinking: all is content
            elif self._state == _INSIDE:
                if not self._reasoning_started:
                    buf = buf.lstrip()
                    if not buf:
                        break
                    self._reasoning_started = True
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    self._say(buf[:end].rstrip(), reasoning)  # the whitespace before is dropped
                    self._ws = []
                    self._state = _AFTER
                    buf = buf[end + len(THINK_CLOSE) :]
                    continue
                keep = _held_prefix(buf, THINK_CLOSE)
                body = buf[: len(buf) - keep]
                trimmed = body.rstrip()  # whitespace before a closing tag is dropped
                if trimmed:
                    self._say(trimmed, reasoning)
                    self._ws = [body[len(trimmed) :]]
                else:
                    self._ws.append(body)
                self._held = buf[len(buf) - keep :]
                break
            elif self._state == _AFTER:
                buf = buf.lstrip()
                if buf:
                    self._state = _CONTENT
                continue
            elif self._state == _HARMONY:
                assert self._channels is not None
                out = {"reasoning": reasoning, "content": content}
                if not self._channels.feed(buf, out):
                    self._state = _CONTENT  # not harmony after all: the rest is content
                self.saw_reasoning = self._channels.saw_reasoning
                break
            if self._state == _CONTENT:
                content.append(buf)
                break
        return "".join(reasoning), "".join(content)

    def _say(self, text: str, out: list[str]) -> None:
        """Send ``text`` (not empty, or nothing is sent), after the whitespace held before
        it."""
        if text:
            out.append("".join(self._ws) + text)
            self._ws = []

    def flush(self, *, cut: bool = False) -> tuple[str, str]:
        """The ``(reasoning, content)`` held back at the end of the reply.

        Args:
            cut: The reply was cut off (``max_tokens``, a cancel): a gpt-oss tool call it
                ended inside is left unclosed, for the tool-call parser to drop.
        """
        held = "".join(self._ws) + self._held
        self._held, self._ws = "", []
        if self._state == _HARMONY:
            assert self._channels is not None
            out: dict[str, list[str]] = {"reasoning": [], "content": []}
            self._channels.flush(out, cut=cut)
            return "".join(out["reasoning"]), "".join(out["content"])
        if self._state == _START:
            return "", held  # whitespace or a lone "<thi": the reply's content
        if self._state == _INSIDE:
            return (held.rstrip() if self._reasoning_started else ""), ""
        return "", ""


def split_reasoning(
    text: str, *, inside: bool = False, cut: bool = False
) -> tuple[str | None, str]:
    """A whole reply's ``(reasoning, content)``; reasoning is None when it has no thinking.

    ``cut``: the reply was cut off (see :meth:`ReasoningSplitter.flush`)."""
    splitter = ReasoningSplitter(inside=inside)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush(cut=cut)
    if not splitter.saw_reasoning:
        return None, content + more_content
    return reasoning + more_reasoning, content + more_content
