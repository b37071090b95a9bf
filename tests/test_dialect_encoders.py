"""Anthropic's and the Responses API's encoders are pure codecs (issue 58): typed parts in,
the API's events out, with no context, no handle and no server. What a client rebuilds from
the stream events is the whole reply the same codec encodes from the fold of the parts."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from llamax.chat_stream import (
    ChatPart,
    ContentDelta,
    Finished,
    Progress,
    ReasoningDelta,
    Started,
    ToolCallDelta,
    fold,
)
from llamax.dialects.anthropic_encode import MessageEvents, MessageIds, encode_message
from llamax.dialects.responses_encode import ResponseEvents, ResponseIds, ResponseJob
from llamax.results import Choice, Completion, FinishReason, PrefillProgress, Usage

CALL = [
    ToolCallDelta(0, 0, "call_ab", "get_weather", ""),
    ToolCallDelta(0, 0, None, None, '{"city": '),
    ToolCallDelta(0, 0, None, None, '"Paris"}'),
]
REPLIES: dict[str, list[ChatPart]] = {
    "text": [Started(0), ContentDelta(0, "Hello"), ContentDelta(0, ", world"),
             Finished(0, "stop")],
    "thinking, text": [Started(0), ReasoningDelta(0, "Let me"), ReasoningDelta(0, " think."),
                       ContentDelta(0, "Yes."), Finished(0, "stop")],
    "thinking, call": [Started(0), ReasoningDelta(0, "A tool."), *CALL,
                       Finished(0, "tool_calls")],
    "text, two calls": [Started(0), ContentDelta(0, "Two calls."), *CALL,
                        ToolCallDelta(0, 1, "call_cd", "get_time", '{"tz": "CET"}'),
                        Finished(0, "tool_calls")],
    "cut call": [Started(0), ToolCallDelta(0, 0, "call_ab", "get_weather", '{"ci'),
                 Finished(0, "length", broken=(0,))],
    "nothing": [Started(0), Finished(0, "stop")],
}  # fmt: skip


def _completion(parts: Sequence[ChatPart], stop_text: str = "") -> Completion:
    text = "".join(p.text for p in parts if isinstance(p, ContentDelta))
    finish = next(p.reason for p in parts if isinstance(p, Finished))
    reason = FinishReason.LENGTH if finish == "length" else FinishReason.STOP
    # the fake detokenizer below spells the reply's text, then what it stopped at
    choice = Choice(0, text, tuple(range(len(text + stop_text))), reason)
    return Completion("req-7", (choice,), Usage(prompt_tokens=10, completion_tokens=6,
                                                cached_tokens=3))  # fmt: skip


def _progress() -> Progress:
    return Progress(0, PrefillProgress(10, 3, 10))


def _anthropic_client(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The message as Anthropic's SDK accumulates it from the stream's events."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for event in events:
        match event["type"]:
            case "message_start":
                message = {**event["message"], "content": []}
            case "content_block_start":
                assert event["index"] == len(message["content"])
                message["content"].append(dict(event["content_block"]))
            case "content_block_delta":
                block, delta = message["content"][event["index"]], event["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                else:
                    partial[event["index"]] = (
                        partial.get(event["index"], "") + delta["partial_json"]
                    )
            case "content_block_stop":
                block = message["content"][event["index"]]
                if block["type"] == "tool_use" and event["index"] in partial:
                    try:
                        block["input"] = json.loads(partial[event["index"]])
                    except json.JSONDecodeError:
                        block["input"] = {}  # an incomplete call
            case "message_delta":
                message.update(event["delta"])
                message["usage"] = event["usage"]
    return message


@pytest.mark.parametrize("name", sorted(REPLIES))
@pytest.mark.parametrize("progress", [False, True])
def test_anthropic_stream_rebuilds_the_encoded_message(name: str, progress: bool) -> None:
    parts = REPLIES[name]
    ids = MessageIds("req-7", "m", 10)
    encoder = MessageEvents(ids)
    streamed = [_progress(), *parts] if progress else parts
    events = encoder.start()
    for part in streamed:
        events += encoder.parts([part])
    completion = _completion(parts)
    events += encoder.end(completion)
    whole = encode_message(ids, completion, fold(parts)[0])
    assert _anthropic_client(events) == whole
    assert whole["id"] == "msg_7"
    start = events[0]["message"]["usage"]
    # message_start says what the cache held once the prompt's first chunk is known
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (
        (7, 3) if progress else (10, 0)
    )
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]


def test_anthropic_names_the_stop_sequence_the_reply_met() -> None:
    parts = REPLIES["text"]
    spelled = "Hello, world###"
    ids = MessageIds("req-7", "m", 10, ("END", "###"), lambda tokens: spelled[: len(tokens)])
    completion = _completion(parts, "###")
    whole = encode_message(ids, completion, fold(parts)[0])
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "###")
    encoder = MessageEvents(ids)
    end = encoder.end(completion)
    assert end[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}


class _Sink:
    def __init__(self) -> None:
        self.kept: list[tuple[Any, ...]] = []

    def put(self, response: Any, conversation: Any, items: Any = ()) -> None:
        self.kept.append((response, list(conversation), list(items)))


def _job(sink: _Sink | None) -> ResponseJob:
    ids = ResponseIds("req-7", 1_700_000_000, "m", 0.0, lambda text, **_: text.split())
    request = {"input": "Hi", "reasoning": {"summary": "auto"}}
    return ResponseJob(ids, request, [{"role": "user", "content": "Hi"}], sink, 64)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_responses_stream_ends_with_the_encoded_response(name: str) -> None:
    parts = REPLIES[name]
    completion = _completion(parts)
    streamed_sink, whole_sink = _Sink(), _Sink()
    encoder = ResponseEvents(_job(streamed_sink))
    events = encoder.start()
    for part in parts:
        events += encoder.parts([part])
    events += encoder.end(completion)
    whole = _job(whole_sink).finish(completion, fold(parts)[0])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    expected = "response.incomplete" if name == "cut call" else "response.completed"
    assert last["type"] == expected
    assert last["response"]["status"] == whole["status"]
    # the stream's items are the whole response's items, in the same order
    streamed_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert streamed_items == last["response"]["output"]
    assert [i["type"] for i in streamed_items] == [i["type"] for i in whole["output"]]
    assert last["response"]["output"] == whole["output"]
    assert last["response"]["usage"] == whole["usage"]
    assert whole["id"] == "resp_7"
    # each finished response is kept once, with its reply appended to the conversation
    assert len(streamed_sink.kept) == len(whole_sink.kept) == 1
    assert streamed_sink.kept[0][1][-1]["role"] == "assistant"


def test_a_response_not_stored_goes_to_no_sink() -> None:
    parts = REPLIES["text"]
    whole = _job(None).finish(_completion(parts), fold(parts)[0])
    assert whole["store"] is False
    assert whole["output"][0]["content"][0]["text"] == "Hello, world"
