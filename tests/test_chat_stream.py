"""The typed chat stream every dialect encodes (llamax.chat_stream), on plain token events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk

from llamax.chat import ChatHandle
from llamax.chat_stream import (
    ChatPart,
    ChatStream,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    Started,
    ToolCallDelta,
    fold,
)
from llamax.openai import OpenAIRequest
from llamax.reasoning import split_reasoning
from llamax.results import (
    Choice,
    Completion,
    FinishReason,
    PrefillProgress,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from llamax.tools import ToolPlan, parse_tool_calls, prepare_tools

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


# ------------------------------------------- the whole reply is the fold of the stream
# Every format the stream reads (plain text, <think>, a prompt that opened the thinking,
# gpt-oss's channels, llamax's call markup: whole, several, malformed, unknown, cut), each
# reply cut at every position and ended there by a stop (a stop string or token inside
# markup), by max_tokens and by a cancel, under every tool mode, split or not.
HARMONY_REPLY = (
    "<|channel|>analysis<|message|>Think.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4."
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need f.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
    '<|message|>{"a": 1}'
)
WHOLE_TEXTS = [
    *FOLD_TEXTS,
    "<think></think>Hi",
    "<think>\n\n</think>\n\n",
    "a <tool_cal b </tool_call>",
    'Sure. <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> ok',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\nnonsense',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"s": "}"}} x\n</tool_call>',
    HARMONY_REPLY,
    HARMONY_CALL,
]
INSIDE_TEXTS = ["hm</think>Yes.", "</think>Yes.", "still thinking <tool_call>"]
PLANS = {
    "none": prepare_tools(None, None, None),
    "auto": prepare_tools(FOLD_TOOLS, None, None),
    "required": prepare_tools(FOLD_TOOLS, "required", None),
    "forced": prepare_tools(FOLD_TOOLS, {"type": "function", "function": {"name": "f"}}, None),
}
CONFIGS = [  # (tool plan, split, the prompt opened the thinking)
    ("none", False, False),
    ("none", True, False),
    ("auto", False, False),
    ("auto", True, False),
    ("required", True, False),
    ("forced", True, False),
]
WHOLE_CASES = [(t, *c) for t in WHOLE_TEXTS for c in CONFIGS] + [
    (t, plan, True, True) for t in INSIDE_TEXTS for plan in ("none", "auto", "forced")
]
FINISHES = [FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED]


class _Handle:
    """A finished request's handle: its events, then its completion."""

    request_id = "req-fold"

    def __init__(self, events: list[TokenEvent], completion: Completion) -> None:
        self.events, self.completion = events, completion

    def __iter__(self) -> Iterator[TokenEvent]:
        return iter(self.events)

    def result(self) -> Completion:
        return self.completion

    def cancel(self) -> None:
        pass

    def done(self) -> bool:
        return True


def _chat(text: str, pieces: list[str], finish: FinishReason, config: tuple) -> ChatHandle:
    plan, split, inside = config
    events = [
        TokenEvent(piece, (), 0, finish if k == len(pieces) - 1 else None)
        for k, piece in enumerate(pieces)
    ]
    completion = Completion("req-fold", (Choice(0, text, (), finish),), Usage(1, len(pieces)))
    return ChatHandle(
        None,  # type: ignore[arg-type]
        _Handle(events, completion),  # type: ignore[arg-type]
        "chat",
        "m",
        0,
        PLANS[plan],
        "auto" if split else "none",
        inside,
    )


def _pieces(text: str, size: int) -> list[str]:
    return [text[k : k + size] for k in range(0, len(text), size)] or [""]


def _message_of_parts(parts: list[ChatPart]) -> tuple[dict[str, Any], str | None]:
    """The test's own fold of a choice's parts into OpenAI's message and finish reason."""
    content = reasoning = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for part in parts:
        if isinstance(part, ContentDelta):
            content += part.text
        elif isinstance(part, ReasoningDelta):
            reasoning += part.text
        elif isinstance(part, ToolCallDelta):
            if part.call_id is not None:
                function = {"name": part.name, "arguments": ""}
                calls[part.position] = {
                    "id": part.call_id,
                    "type": "function",
                    "function": function,
                }
            calls[part.position]["function"]["arguments"] += part.arguments
        elif isinstance(part, Finished):
            finish = part.reason
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message, finish


def _message_of_chunks(chunks: list[Any]) -> tuple[dict[str, Any], str | None]:
    """What an OpenAI streaming client rebuilds from the chunks (content and thinking
    joined, each call's id, name and joined arguments by its index, the finish reason)."""
    message: dict[str, Any] = {"role": None, "content": None}
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["role"] = delta.get("role", message["role"])
            for key in ("content", "reasoning_content"):
                if delta.get(key) is not None:
                    message[key] = (message.get(key) or "") + delta[key]
            for call in delta.get("tool_calls", []):
                entry = calls.setdefault(
                    call["index"], {"id": None, "type": None, "function": {"name": None}}
                )
                entry["id"] = call.get("id", entry["id"])
                entry["type"] = call.get("type", entry["type"])
                function = call["function"]
                entry["function"]["name"] = function.get("name", entry["function"]["name"])
                arguments = entry["function"].get("arguments", "")
                entry["function"]["arguments"] = arguments + function.get("arguments", "")
            finish = choice["finish_reason"] or finish
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, finish


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{**c, "id": "call"} for c in message.get("tool_calls", [])]
    return {**message, **({"tool_calls": calls} if calls else {})}


def _old_whole(text: str, finish: FinishReason, config: tuple) -> tuple[dict[str, Any], str | None]:
    """The whole reply as llamax built it before it was the fold: the whole text parsed
    again (kept here to show where the fold differs, and that only where it must)."""
    plan, split, inside = config
    reasoning, content = None, text
    if split:
        reasoning, content = split_reasoning(text, inside=inside, cut=finish != "stop")
    reason = "length" if finish is FinishReason.LENGTH else "stop"
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if PLANS[plan].is_active:
        parsed = parse_tool_calls(content, PLANS[plan], str(finish))
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [dict(c) for c in parsed.tool_calls]
        reason = "tool_calls" if parsed.finish_reason == "tool_calls" else reason
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message, reason


def _same_replies(
    text: str, finish: FinishReason, config: tuple
) -> tuple[dict[str, Any], str | None]:
    """The reply to ``text`` as a whole, as the fold of its streamed parts (a character, or
    three, an event) and as rebuilt from its chunks, checked to be one; returned."""
    whole = OpenAIRequest(_chat(text, [text], finish, config)).result()["choices"][0]
    expected = (_without_ids(whole["message"]), whole["finish_reason"])  # type: ignore[typeddict-item]
    for size in (1, 3):
        pieces = _pieces(text, size)
        folded = _message_of_parts(list(_chat(text, pieces, finish, config).parts()))
        assert (_without_ids(folded[0]), folded[1]) == expected, ("parts", size)
        chunks = list(OpenAIRequest(_chat(text, pieces, finish, config)).chunks(False))
        rebuilt, reason = _message_of_chunks(chunks)
        assert rebuilt["role"] == "assistant"
        rebuilt["content"] = rebuilt["content"] or (None if "tool_calls" in rebuilt else "")
        assert (_without_ids(rebuilt), reason) == expected, ("chunks", size)
    return expected


def _differs_only_where_a_streamed_call_was_dropped(
    old: tuple[dict[str, Any], str | None], new: tuple[dict[str, Any], str | None]
) -> bool:
    """Where the old whole reply is right, the fold gives it; the two may differ only where
    the stream has sent a call (its start) that the old whole reply dropped, or turned back
    into text with the markup (cut, malformed or after a stop): the new reply has those
    calls, the old one's calls are where they were."""
    old_calls = _without_ids(old[0]).get("tool_calls", [])
    new_calls = _without_ids(new[0]).get("tool_calls", [])
    return len(new_calls) > len(old_calls) and new_calls[: len(old_calls)] == old_calls


@pytest.mark.parametrize(("text", "plan", "split", "inside"), WHOLE_CASES)
def test_the_whole_reply_is_the_fold_of_the_streamed_parts(
    text: str, plan: str, split: bool, inside: bool
) -> None:
    """For every cut of every reply, ended every way: the whole reply == the fold of the
    parts streamed == what an OpenAI streaming client rebuilds from the chunks. And that
    reply is the one the whole text's own parse gave, except (a) a call whose start has
    streamed stays a call, cut or not, (c) an empty thinking is no thinking (llama-
    server's ``reasoning_content`` is only there when it is not empty) and (d) a reply
    with no calls has a string ``content``, if empty (not None, when cut call markup was
    all it said)."""
    config = (plan, split, inside)
    for cut in range(len(text) + 1):
        for finish in FINISHES:
            new = _same_replies(text[:cut], finish, config)
            old = _old_whole(text[:cut], finish, config)
            if old[0].get("reasoning_content") == "":  # (c)
                del old[0]["reasoning_content"]
            if old[0]["content"] is None and "tool_calls" not in old[0]:  # (d)
                old[0]["content"] = ""
            if new != (_without_ids(old[0]), old[1]):
                assert _differs_only_where_a_streamed_call_was_dropped(old, new), (cut, finish)


def test_the_fold_of_a_replys_parts_is_its_whole_reply() -> None:
    """llamax.chat_stream.fold, the one fold, over the parts of every whole case."""
    for text, plan, split, inside in WHOLE_CASES[::5]:
        for finish in FINISHES:
            chat = _chat(text, _pieces(text, 2), finish, (plan, split, inside))
            (reply,) = fold(chat.parts())
            whole = OpenAIRequest(chat).result()["choices"][0]
            message: Any = whole["message"]  # type: ignore[typeddict-item]
            assert reply.content == message["content"]
            assert reply.reasoning == message.get("reasoning_content")
            calls = [dict(c["function"]) for c in reply.tool_calls]
            assert calls == [c["function"] for c in message.get("tool_calls", [])]
            assert reply.finish == whole["finish_reason"]
