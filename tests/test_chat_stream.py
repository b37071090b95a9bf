"""The typed chat stream every dialect encodes (llamax.chat_stream), on plain token events."""

from __future__ import annotations

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
