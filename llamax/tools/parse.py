"""Turn generated text into OpenAI ``tool_calls``, whole or as streamed deltas.

One incremental parser serves both: :func:`parse_tool_calls` feeds it the whole text, so a
reply parses the same streamed or not. Content before a call is passed on as it arrives,
except a tail that may be the start of ``<tool_call>`` (and trailing whitespace, which a
call would drop). A call's name is sent once its header ``{"name": "...", "arguments": ``
has arrived, then the arguments as they grow, up to the brace that closes them.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from typing_extensions import NotRequired

from .call_grammar import CALL_CLOSE, CALL_OPEN
from .spec import ToolPlan

__all__ = [
    "ParsedReply",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "ToolDelta",
    "new_call_id",
    "parse_tool_calls",
]

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_MAX_HEADER_CHARS = 256
"""A header not complete after this many characters is not a call."""


class ToolCallFunction(TypedDict):
    """The function a call names and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    """One entry of OpenAI's ``message.tool_calls``."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ToolCallDeltaFunction(TypedDict, total=False):
    """What a streamed chunk adds to a call's function."""

    name: str
    arguments: str


class ToolCallDelta(TypedDict):
    """One entry of OpenAI's ``delta.tool_calls``: the first has id, type and name."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: ToolCallDeltaFunction


class ToolDelta(TypedDict, total=False):
    """What one streamed chunk adds to the assistant message."""

    content: str
    tool_calls: list[ToolCallDelta]


def new_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class _State(enum.Enum):
    CONTENT = "content"  # text outside calls
    HEADER = "header"  # after <tool_call>, before the arguments
    ARGUMENTS = "arguments"  # inside the arguments object


class _ObjectEnd:
    """Finds where a JSON value that opens with a bracket ends, fed piece by piece."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.is_done = False

    def scan(self, text: str) -> tuple[int, str]:
        """How many characters of ``text`` belong to the value (all, until it closes), and
        those characters as JSON: a raw control character inside a string (which
        ``json.loads`` refuses, and a grammar from before issue 56 let through) escaped."""
        out: list[str] = []
        for at, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                elif char < " ":
                    char = json.dumps(char)[1:-1]
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.is_done = True
                    out.append(char)
                    return at + 1, "".join(out)
            out.append(char)
        return len(text), "".join(out)


class ToolCallStreamParser:
    """Incremental parser: text deltas in, OpenAI ``delta`` dicts out.

    Args:
        plan: The checked tool options. Calls may name only its callable functions; with
            ``mode="none"`` all text is content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._names = frozenset(f.name for f in plan.callable_functions)
        self._state = _State.CONTENT
        self._pending = ""
        self._num_args_sent = 0
        self._arguments_end = _ObjectEnd()
        self._tool_calls: list[ToolCall] = []
        self._current: ToolCall | None = None
        self._is_after_call = False
        self._space = ""  # the whitespace dropped before the markup being read
        self.broken: list[int] = []
        """Positions of calls whose start was sent but whose markup never completed into a
        valid call (cut off, or arguments that are no JSON object)."""
        self.is_malformed = False
        """Whether the text after a call marker was no valid call."""
        self.is_truncated = False
        """Whether the text ended inside a call (set by :meth:`close`)."""

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far (a call cut off by the end of the text is not one)."""
        return list(self._tool_calls)

    def feed(self, text: str) -> list[ToolDelta]:
        """Parse the next piece of generated text.

        Args:
            text: The new text (e.g. a :class:`~llamax.TokenEvent`'s ``text``).

        Returns:
            Zero or more deltas: ``{"content": ...}`` or ``{"tool_calls": [...]}``.
        """
        if not self._names:
            return [{"content": text}] if text else []
        self._pending += text
        deltas: list[ToolDelta] = []
        while self._step(deltas):
            pass
        return deltas

    def close(self, give_back: bool = False) -> list[ToolDelta]:
        """Flush at the end of generation.

        Text ending inside a call (cut off by ``max_tokens``, a stop or a cancel) sets
        :attr:`is_truncated`. A call whose start was sent stays started (its position
        joins :attr:`broken`); markup that never named a call is dropped, or with
        ``give_back`` (a stop that no forced call explains) sent as content, verbatim with
        the whitespace before it.

        Returns:
            The content still held back, if any.
        """
        deltas: list[ToolDelta] = []
        pending, self._pending = self._pending, ""
        if self._state is _State.CONTENT:
            if pending.strip() or not self._is_after_call:
                _add_content(deltas, pending)
        else:
            self.is_truncated = True
            if self._state is _State.HEADER and give_back:
                _add_content(deltas, self._space + CALL_OPEN + pending)
            elif self._state is _State.ARGUMENTS:
                self.broken.append(len(self._tool_calls))
        self._state = _State.CONTENT
        self._current = None
        return deltas

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: ``"tool_calls"`` when a normal stop ended on calls."""
        is_clean = not (self.is_malformed or self.is_truncated)
        if reason == "stop" and self._tool_calls and is_clean:
            return "tool_calls"
        return reason

    def _step(self, deltas: list[ToolDelta]) -> bool:
        """Advance on the pending text; True if the state changed (step again)."""
        if self._state is _State.CONTENT:
            return self._step_content(deltas)
        if self._state is _State.HEADER:
            return self._step_header(deltas)
        return self._step_arguments(deltas)

    def _step_content(self, deltas: list[ToolDelta]) -> bool:
        start = self._pending.find(CALL_OPEN)
        if start >= 0:
            before = self._pending[:start]
            sent = before.rstrip()
            _add_content(deltas, sent)
            self._space = before[len(sent) :]
            self._pending = self._pending[start + len(CALL_OPEN) :]
            self._state = _State.HEADER
            return True
        held = _partial_marker_length(self._pending, CALL_OPEN)
        sendable = self._pending[: len(self._pending) - held].rstrip()
        _add_content(deltas, sendable)
        self._pending = self._pending[len(sendable) :]
        return False

    def _step_header(self, deltas: list[ToolDelta]) -> bool:
        match = _HEADER.match(self._pending)
        if match is None:
            if CALL_CLOSE in self._pending or len(self._pending) > _MAX_HEADER_CHARS:
                self._not_a_call(deltas)
                return True
            return False
        try:
            name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:
            name = None
        if name not in self._names:
            self._not_a_call(deltas)
            return True
        call_delta: ToolCallDelta = {
            "index": len(self._tool_calls),
            "id": new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        deltas.append({"tool_calls": [call_delta]})
        self._current = {
            "id": call_delta["id"],
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        self._pending = self._pending[match.end() :]
        self._num_args_sent = 0
        self._arguments_end = _ObjectEnd()
        self._state = _State.ARGUMENTS
        return True

    def _step_arguments(self, deltas: list[ToolDelta]) -> bool:
        if self._num_args_sent == 0:
            self._pending = self._pending.lstrip()
        if not self._arguments_end.is_done:
            num_chars, fragment = self._arguments_end.scan(self._pending[self._num_args_sent :])
            self._add_arguments(deltas, num_chars, fragment)
            if not self._arguments_end.is_done:
                return False
        rest = self._pending[self._num_args_sent :]
        end = rest.find(CALL_CLOSE)
        if end < 0:
            return False
        arguments = self._current["function"]["arguments"] if self._current else ""
        if rest[:end].strip() != "}" or not _is_json_object(arguments):
            self.is_malformed = True
            self.broken.append(len(self._tool_calls))
        if self._current is not None:
            self._tool_calls.append(self._current)
            self._current = None
        self._is_after_call = True
        self._pending = rest[end + len(CALL_CLOSE) :]
        self._state = _State.CONTENT
        return True

    def _add_arguments(self, deltas: list[ToolDelta], num_chars: int, fragment: str) -> None:
        self._num_args_sent += num_chars
        if not fragment or self._current is None:
            return
        self._current["function"]["arguments"] += fragment
        index = len(self._tool_calls)
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def _not_a_call(self, deltas: list[ToolDelta]) -> None:
        """The text after ``<tool_call>`` is no call: pass the marker on as content."""
        self.is_malformed = True
        _add_content(deltas, self._space + CALL_OPEN)
        self._state = _State.CONTENT


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A whole reply split into content and calls.

    Attributes:
        content: The text outside calls (None when there are calls and no text).
        tool_calls: The calls, in order; empty when the reply holds none or is malformed.
        finish_reason: ``"tool_calls"`` when generation stopped normally after calls,
            else the reason given to :func:`parse_tool_calls`.
    """

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant ``message`` dict (``tool_calls`` only when there are some)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        return message


def parse_tool_calls(text: str, plan: ToolPlan, finish_reason: str = "stop") -> ParsedReply:
    """Split a finished reply into content and OpenAI ``tool_calls``.

    A reply whose call is malformed is returned unchanged as content, with no calls; a
    raw control character in an argument string is no malformation (it comes back
    escaped). A call cut off by ``max_tokens`` (or a cancel, or, when ``tool_choice``
    forces a call, a stop string) is dropped: the calls before it are kept and
    ``finish_reason`` stays ``"length"`` (``"stop"``). Call markup never reaches the
    content otherwise.

    Args:
        text: The generated text.
        plan: The checked tool options (``mode="none"``: everything is content).
        finish_reason: Why generation ended (``"stop"``, ``"length"`` ...).

    Returns:
        The :class:`ParsedReply`.
    """
    parser = ToolCallStreamParser(plan)
    deltas = parser.feed(text) + parser.close()
    # A forced call cut off by a stop string is dropped like one cut off by max_tokens:
    # its markup is no answer (``stop_reason: stop_sequence`` says what happened).
    cut_off_by_stop = parser.is_truncated and finish_reason == "stop" and plan.mode == "auto"
    if parser.is_malformed or cut_off_by_stop or not (parser.tool_calls or parser.is_truncated):
        return ParsedReply(text, (), finish_reason)
    content = "".join(delta.get("content", "") for delta in deltas)
    return ParsedReply(
        content or None, tuple(parser.tool_calls), parser.finish_reason(finish_reason)
    )


def _add_content(deltas: list[ToolDelta], text: str) -> None:
    if text:
        deltas.append({"content": text})


def _partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
