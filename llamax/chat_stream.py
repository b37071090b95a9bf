"""One typed stream of chat deltas, under every API dialect.

A chat reply streams as token events (:class:`~llamax.TokenEvent`). :class:`ChatStream`
turns each event into typed parts, once, for every dialect: the reply's thinking split off
(:mod:`llamax.reasoning`), tool-call markup parsed into calls (:mod:`llamax.tools`), and the
finish reason as the reply ended. OpenAI's chunks (``llamax.openai``), Anthropic's Messages
events (``llamax.anthropic``) and the Responses API's events are encoders over these
parts; none of them parses text.

A whole (not streamed) reply is the fold of the same parts (:class:`ChatFold`,
:func:`fold`): what a streaming client rebuilds from what it was sent is what a whole reply
says, in every dialect. Parts are never taken back, so the tool-call parser's verdict at
the end is in the parts themselves: markup that never named a call and ended on a stop
that no forced call explains is sent back as content, verbatim, before :class:`Finished`;
a call whose start was sent stays a call (:attr:`Finished.broken` says which never
completed).

Parts, in the order a choice streams them: :class:`Started` (first), then any of
:class:`ReasoningDelta`, :class:`ContentDelta` and :class:`ToolCallDelta`, and
:class:`Finished` (last). A request that asked for its prompt's progress
(``prefill_progress``) also gets :class:`Progress` parts, before its first choice starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from .reasoning import ReasoningSplitter
from .results import FinishReason, PrefillProgress, TokenEvent, TokenLogprob
from .tools import ToolCallStreamParser, ToolPlan
from .tools.parse import ToolCall, ToolDelta

__all__ = [
    "ChatFinish",
    "ChatFold",
    "ChatPart",
    "ChatReply",
    "ChatStream",
    "ContentDelta",
    "Finished",
    "Progress",
    "ReasoningDelta",
    "Started",
    "ToolCallDelta",
    "fold",
]

ChatFinish: TypeAlias = Literal["stop", "length", "tool_calls"]
"""Why a choice ended: a stop (end of turn, stop string or token), the token limit, or a
stop right after tool calls."""


@dataclass(frozen=True, slots=True)
class Started:
    """A choice begins: the assistant's turn."""

    index: int


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """More of a choice's thinking."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """More of a choice's answer; ``logprobs`` of the tokens the event carried (text held
    back by the reasoning split still reports them, with empty ``text``)."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A tool call begins (``call_id`` and ``name`` set, ``arguments`` empty) or its
    arguments grow (``call_id`` and ``name`` None)."""

    index: int
    position: int
    """The call's place among the choice's calls, from 0."""
    call_id: str | None
    name: str | None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Finished:
    """A choice has ended."""

    index: int
    reason: ChatFinish
    broken: tuple[int, ...] = ()
    """Positions of calls whose start was sent but whose markup never completed into a
    valid call (the reply was cut inside it, or its arguments are no JSON object)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """How far the prompt has been computed (before the reply begins)."""

    index: int
    progress: PrefillProgress


ChatPart: TypeAlias = Started | ReasoningDelta | ContentDelta | ToolCallDelta | Finished | Progress
"""One typed delta of a streamed chat reply."""


@dataclass(slots=True)
class _Choice:
    parser: ToolCallStreamParser
    splitter: ReasoningSplitter | None


@dataclass(slots=True)
class ChatStream:
    """Turns one chat request's token events into :data:`ChatPart` lists.

    Args:
        tools: The tool calling asked for (``mode="none"``: every answer is content).
        splits_reasoning: Whether thinking is split off the answer.
        thinking_opened: Whether the prompt left a ``<think>`` open (the reply starts
            thinking).
    """

    tools: ToolPlan
    splits_reasoning: bool = False
    thinking_opened: bool = False
    _choices: dict[int, _Choice] = field(default_factory=dict, init=False, repr=False)

    def parts(self, event: TokenEvent) -> list[ChatPart]:
        """The parts of one event, in order (a choice's first event starts with
        :class:`Started`, its last ends with :class:`Finished`). With tools on, content
        held back while markup may still open a call, and logprobs, are not reported."""
        index = event.index
        if event.progress is not None:
            return [Progress(index, event.progress)]
        parts: list[ChatPart] = []
        choice = self._choices.get(index)
        if choice is None:
            splitter = (
                ReasoningSplitter(inside=self.thinking_opened) if self.splits_reasoning else None
            )
            choice = self._choices[index] = _Choice(ToolCallStreamParser(self.tools), splitter)
            parts.append(Started(index))
        finished = event.finish_reason is not None
        reasoning, text = _split(choice.splitter, event.text, finished, event.finish_reason)
        if reasoning:
            parts.append(ReasoningDelta(index, reasoning))
        if self.tools.is_active:
            deltas = choice.parser.feed(text)
            if finished:
                # A stop inside markup that never named a call gives it back as content,
                # unless a call was forced (then the markup is no answer).
                give_back = event.finish_reason is FinishReason.STOP and self.tools.mode == "auto"
                deltas += choice.parser.close(give_back)
            parts += _typed(index, deltas)
        elif text or event.logprobs:
            parts.append(ContentDelta(index, text, tuple(event.logprobs)))
        if event.finish_reason is not None:
            raw = event.finish_reason
            reason: ChatFinish = "length" if raw is FinishReason.LENGTH else "stop"
            if self.tools.is_active and choice.parser.finish_reason(str(raw)) == "tool_calls":
                reason = "tool_calls"  # a cancel (reported as "stop") never ends on calls
            broken = tuple(choice.parser.broken) if self.tools.is_active else ()
            parts.append(Finished(index, reason, broken))
        return parts


def _split(
    splitter: ReasoningSplitter | None, text: str, finished: bool, reason: FinishReason | None
) -> tuple[str, str]:
    """``(reasoning, content)`` of an event's text; everything held, at the end (a reply
    cut off, not stopped, keeps an unclosed thought as thinking)."""
    if splitter is None:
        return "", text
    reasoning, content = splitter.feed(text)
    if finished:
        more_reasoning, more_content = splitter.flush(cut=reason is not FinishReason.STOP)
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning, content


def _typed(index: int, deltas: Sequence[ToolDelta]) -> list[ChatPart]:
    """The tool-call parser's deltas as parts."""
    parts: list[ChatPart] = []
    for delta in deltas:
        if delta.get("content"):
            parts.append(ContentDelta(index, delta["content"]))
        for call in delta.get("tool_calls", []):
            function = call["function"]
            parts.append(
                ToolCallDelta(
                    index,
                    call["index"],
                    call.get("id"),
                    function.get("name"),
                    function.get("arguments", ""),
                )
            )
    return parts


@dataclass(frozen=True, slots=True)
class ChatReply:
    """One choice's whole reply: the fold of its parts (:class:`ChatFold`)."""

    index: int
    content: str | None
    """The answer; None when the choice made calls and said nothing else."""
    reasoning: str | None
    """The thinking; None when there is none (or it was empty, as llama-server says)."""
    tool_calls: tuple[ToolCall, ...]
    finish: ChatFinish
    broken: tuple[int, ...] = ()
    """Positions of calls that never completed (:attr:`Finished.broken`)."""


@dataclass(slots=True)
class _Folding:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, ToolCall] = field(default_factory=dict)
    finished: Finished | None = None


@dataclass(slots=True)
class ChatFold:
    """Folds a reply's parts, as they come (:meth:`add`), into its whole
    :class:`ChatReply` per choice (:meth:`replies`): the one way a whole reply is built."""

    _choices: dict[int, _Folding] = field(default_factory=dict, init=False, repr=False)

    def add(self, part: ChatPart) -> None:
        """Fold in one more part."""
        if isinstance(part, Progress):
            return
        choice = self._choices.setdefault(part.index, _Folding())
        if isinstance(part, ContentDelta):
            if part.text:
                choice.content.append(part.text)
        elif isinstance(part, ReasoningDelta):
            if part.text:
                choice.reasoning.append(part.text)
        elif isinstance(part, ToolCallDelta):
            call = choice.calls.get(part.position)
            if call is None:
                call = choice.calls[part.position] = {
                    "id": part.call_id or "",
                    "type": "function",
                    "function": {"name": part.name or "", "arguments": ""},
                }
            call["function"]["arguments"] += part.arguments
        elif isinstance(part, Finished):
            choice.finished = part

    def replies(self) -> list[ChatReply]:
        """Each choice's reply so far, by index (a choice not finished yet: ``"stop"``)."""
        replies = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            calls = tuple(choice.calls[k] for k in sorted(choice.calls))
            content = "".join(choice.content)
            finished = choice.finished or Finished(index, "stop")
            replies.append(
                ChatReply(
                    index,
                    content if content or not calls else None,
                    "".join(choice.reasoning) or None,
                    calls,
                    finished.reason,
                    finished.broken,
                )
            )
        return replies


def fold(parts: Iterable[ChatPart]) -> list[ChatReply]:
    """The whole reply, per choice, that ``parts`` stream (:class:`ChatFold`)."""
    folding = ChatFold()
    for part in parts:
        folding.add(part)
    return folding.replies()
