"""The typed chat stream every dialect encodes (llamax.chat_stream), on plain token events."""

from __future__ import annotations

import pytest

from llamax.chat_stream import (
    ChatPart,
    ChatStream,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    Started,
    ToolCallDelta,
)
from llamax.results import FinishReason, PrefillProgress, TokenEvent, TokenLogprob
from llamax.tools import ToolPlan, prepare_tools

WEATHER = [
    {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
    }
]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def run(
    stream: ChatStream, *texts: str, finish: FinishReason = FinishReason.STOP
) -> list[ChatPart]:
    """The parts of one choice streamed as ``texts``, the last event finishing it."""
    parts: list[ChatPart] = []
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        parts += stream.parts(TokenEvent(text, (k,), 0, finish if last else None))
    return parts


def text_of(parts: list[ChatPart], kind: type) -> str:
    return "".join(p.text for p in parts if isinstance(p, kind))  # type: ignore[attr-defined]


def test_a_plain_reply_starts_carries_content_and_finishes() -> None:
    parts = run(ChatStream(ToolPlan()), "Hel", "lo")
    assert parts == [
        Started(0),
        ContentDelta(0, "Hel"),
        ContentDelta(0, "lo"),
        Finished(0, "stop"),
    ]
    assert run(ChatStream(ToolPlan()), "x", finish=FinishReason.LENGTH)[-1] == Finished(0, "length")


def test_each_choice_starts_once_and_finishes_on_its_own() -> None:
    stream = ChatStream(ToolPlan())
    parts = stream.parts(TokenEvent("a", (1,), 0)) + stream.parts(TokenEvent("b", (2,), 1))
    parts += stream.parts(TokenEvent("c", (3,), 0, FinishReason.STOP))
    assert [p for p in parts if isinstance(p, Started)] == [Started(0), Started(1)]
    assert parts[-1] == Finished(0, "stop")


def test_thinking_is_split_off_across_events() -> None:
    stream = ChatStream(ToolPlan(), splits_reasoning=True)
    parts = run(stream, "<thi", "nk>why</th", "ink>Because.")
    assert text_of(parts, ReasoningDelta) == "why"
    assert text_of(parts, ContentDelta) == "Because."
    first_content = next(k for k, p in enumerate(parts) if isinstance(p, ContentDelta) and p.text)
    assert all(not isinstance(p, ReasoningDelta) for p in parts[first_content:])
    unsplit = run(ChatStream(ToolPlan()), "<think>why</think>Because.")
    assert text_of(unsplit, ContentDelta) == "<think>why</think>Because."


def test_a_prompt_that_opened_thinking_starts_the_reply_inside_it() -> None:
    stream = ChatStream(ToolPlan(), splits_reasoning=True, thinking_opened=True)
    parts = run(stream, "hmm</think>Yes.")
    assert (text_of(parts, ReasoningDelta), text_of(parts, ContentDelta)) == ("hmm", "Yes.")


def test_held_back_text_still_reports_its_logprobs() -> None:
    lp = TokenLogprob(7, "<", b"<", -0.5, ())
    stream = ChatStream(ToolPlan(), splits_reasoning=True)
    (started, held) = stream.parts(TokenEvent("", (7,), 0, None, (lp,)))
    assert started == Started(0) and held == ContentDelta(0, "", (lp,))


def test_a_tool_call_streams_as_a_start_then_arguments_and_finishes_on_calls() -> None:
    plan = prepare_tools(WEATHER)
    parts = run(ChatStream(plan), "Checking. ", CALL[:30], CALL[30:])
    calls = [p for p in parts if isinstance(p, ToolCallDelta)]
    assert calls[0].call_id is not None and calls[0].name == "weather"
    assert calls[0].arguments == "" and calls[0].position == 0
    assert all(c.call_id is None and c.name is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == '{"city": "Oslo"}'
    assert text_of(parts, ContentDelta).strip() == "Checking."
    assert parts[-1] == Finished(0, "tool_calls")


def test_a_cancelled_reply_never_finishes_on_calls() -> None:
    """A cancel is reported as ``stop``; the parser must see the raw reason, or a reply
    cancelled right after a complete call would claim ``tool_calls``."""
    parts = run(ChatStream(prepare_tools(WEATHER)), CALL, finish=FinishReason.CANCELLED)
    assert parts[-1] == Finished(0, "stop")


def test_without_tools_call_markup_is_content() -> None:
    parts = run(ChatStream(ToolPlan()), CALL)
    assert text_of(parts, ContentDelta) == CALL
    assert not any(isinstance(p, ToolCallDelta) for p in parts)


def test_a_progress_event_is_a_progress_part_before_the_choice_starts() -> None:
    stream = ChatStream(ToolPlan())
    progress = PrefillProgress(40, 8, 24)
    assert stream.parts(TokenEvent("", (), 0, progress=progress)) == [Progress(0, progress)]
    assert run(stream, "Hi") == [Started(0), ContentDelta(0, "Hi"), Finished(0, "stop")]


# ---------------------------------------------------------------------- folds (issue 58)
FOLD_TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
]
FOLD_TEXTS = [
    "Hello there!",
    "<think>hm</think>\n\nHi",
    "<think>cut off",
    "plain <tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    'Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {"b": "x"}}\n</tool_call>',
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": ',
    '<think>x</think><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
]


def _fold(
    text: str, pieces: list[str], finish: FinishReason, tools: bool, split: bool
) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """A reply's parts folded: content, thinking, the calls (name, arguments), finish."""
    stream = ChatStream(prepare_tools(FOLD_TOOLS if tools else None, None, None), split)
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    reason = None
    for i, piece in enumerate(pieces):
        event = TokenEvent(piece, (), 0, finish if i == len(pieces) - 1 else None)
        for part in stream.parts(event):
            if isinstance(part, ContentDelta):
                content += part.text
            elif isinstance(part, ReasoningDelta):
                reasoning += part.text
            elif isinstance(part, ToolCallDelta):
                call = calls.setdefault(part.position, ["", ""])
                call[0] = part.name or call[0]
                call[1] += part.arguments
            elif isinstance(part, Finished):
                reason = part.reason
    return content, reasoning, [(n, a) for _, (n, a) in sorted(calls.items())], reason


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("finish", [FinishReason.STOP, FinishReason.LENGTH])
@pytest.mark.parametrize("text", FOLD_TEXTS)
def test_a_reply_folds_the_same_whatever_its_event_boundaries(
    text: str, finish: FinishReason, tools: bool, split: bool
) -> None:
    """The ground a whole reply built as the fold of its parts stands on: the thinking
    split and the tool-call parser give the same parts, folded, whether the text comes in
    one event, one character at a time, or cut anywhere."""
    whole = _fold(text, [text], finish, tools, split)
    assert _fold(text, list(text), finish, tools, split) == whole
    for cut in range(1, len(text)):
        assert _fold(text, [text[:cut], text[cut:]], finish, tools, split) == whole, cut
