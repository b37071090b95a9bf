"""gpt-oss (harmony) channels through chat_completion and the other APIs (issue 25, item 1),
fake backend.

The fake vocabulary has gpt-oss's markers as single special tokens. ``<|start|>``,
``<|channel|>``, ``<|message|>``, ``<|constrain|>`` and ``<|end|>`` render as their text
(llama.cpp makes them user-defined tokens for gpt-oss vocabularies and takes ``<|end|>``
off the end-of-generation list); ``<|return|>`` and ``<|call|>`` end generation and render
as nothing. Every other character is one byte token, so the channel names and bodies arrive
cut at every byte."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_chat_reasoning import WEATHER

import llamax
from llamax.anthropic import messages
from llamax.openai import create_response
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "gpt_oss_style_template.jinja").read_text()
SHOWN = {"<|start|>": 300, "<|channel|>": 301, "<|message|>": 302, "<|end|>": 303}
SHOWN |= {"<|constrain|>": 304}
ENDS = {"<|return|>": 305, "<|call|>": 306}
START, RETURN, CALL = SHOWN["<|start|>"], ENDS["<|return|>"], ENDS["<|call|>"]
USER = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "The user asks 2 + 2. That is 4."
REPLY = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
)
CALLING = (
    "<|channel|>analysis<|message|>I need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Paris"}<|call|>'
)


def script(reply: str) -> list[int]:
    """``reply``'s tokens: the markers as one token each, the rest one per byte."""
    backend = FakeBackend(special_tokens=SHOWN | ENDS)
    return backend.tokenize(reply, add_special=False)


def harmony(reply: str, **options: Any) -> llamax.Context:
    """A fake gpt-oss answering every assistant turn with ``reply``."""
    tokens = script(reply)
    assistant = [START, *(b + 1 for b in b"assistant")]
    user = [START, *(b + 1 for b in b"user")]

    def next_token(history: Sequence[int]) -> int:
        starts = [i for i in range(len(history)) if list(history[i : i + 5]) == user[:5]]
        if not starts:
            return ord("x") + 1
        after = starts[-1]
        opened = next(
            i
            for i in range(after, len(history))
            if list(history[i : i + len(assistant)]) == assistant
        )
        generated = len(history) - opened - len(assistant)
        return tokens[min(generated, len(tokens) - 1)]

    backend = FakeBackend(
        n_ctx=1024,
        next_token=next_token,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SHOWN | ENDS,
        extra_pieces={token: text.encode() for text, token in SHOWN.items()},
        eog_token_ids=(0, RETURN, CALL),
        **options,
    )
    return llamax.Context(backend=backend)


def streamed(
    ctx: llamax.Context, markers: bool = False, **options: Any
) -> tuple[str, str, list[Any], list[str]]:
    """The stream's thinking, content, call deltas and finish reasons (no harmony marker
    in the thinking or content, unless ``markers``: a reply cut inside a header)."""
    reasoning = content = ""
    calls: list[Any] = []
    finishes: list[str] = []
    for chunk in ctx.chat_completion(USER, stream=True, temperature=0, **options):
        ChatCompletionChunk.model_validate(chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content", "")
            piece = delta.get("content") or ""
            said = piece + delta.get("reasoning_content", "")
            assert markers or "<|" not in said
            content += piece
            calls += delta.get("tool_calls", [])
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return reasoning, content, calls, finishes


def test_the_fake_renders_the_markers_as_gpt_oss_does() -> None:
    with harmony(REPLY) as ctx:
        params = llamax.SamplingParams(max_tokens=200, temperature=0)
        (completion,) = ctx.generate([ctx.chat_prompt(USER)], params)
        assert completion.text == REPLY.removesuffix("<|return|>")
        assert completion.finish_reason == "stop"


def test_the_analysis_channel_goes_to_reasoning_content() -> None:
    with harmony(REPLY) as ctx:
        response = ctx.chat_completion(USER, max_tokens=200, temperature=0)
        ChatCompletion.model_validate(response)
        choice = response["choices"][0]
        assert choice["message"] == {
            "role": "assistant",
            "content": "It is 4.",
            "reasoning_content": THOUGHT,
        }
        assert choice["finish_reason"] == "stop"
        assert streamed(ctx, max_tokens=200) == (THOUGHT, "It is 4.", [], ["stop"])
        assert_idle(ctx)


def test_reasoning_format_none_keeps_the_channels_in_content() -> None:
    with harmony(REPLY) as ctx:
        response = ctx.chat_completion(USER, max_tokens=200, temperature=0, reasoning_format="none")
        message = response["choices"][0]["message"]
        assert message["content"] == REPLY.removesuffix("<|return|>")
        assert "reasoning_content" not in message


def test_a_reply_cut_inside_the_analysis_has_empty_content_and_says_length() -> None:
    with harmony(REPLY) as ctx:
        # 20 tokens: <|channel|>, "analysis", <|message|> and 10 bytes of thought
        response = ctx.chat_completion(USER, max_tokens=20, temperature=0)
        choice = response["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] == ""
        assert choice["message"]["reasoning_content"] == THOUGHT[:10].rstrip()
        reasoning, content, _, finishes = streamed(ctx, max_tokens=20)
        assert (reasoning, content, finishes) == (THOUGHT[:10].rstrip(), "", ["length"])


def test_a_commentary_call_becomes_a_tool_call() -> None:
    with harmony(CALLING) as ctx:
        response = ctx.chat_completion(USER, max_tokens=300, temperature=0, tools=[WEATHER])
        ChatCompletion.model_validate(response)
        choice = response["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "I need the weather."
        assert not choice["message"]["content"]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"location": "Paris"}
        reasoning, content, calls, finishes = streamed(ctx, max_tokens=300, tools=[WEATHER])
        assert (reasoning, content, finishes) == ("I need the weather.", "", ["tool_calls"])
        assert [c["function"]["name"] for c in calls if c["function"].get("name")] == [
            "get_weather"
        ]
        arguments = "".join(c["function"].get("arguments", "") for c in calls)
        assert json.loads(arguments) == {"location": "Paris"}
        assert_idle(ctx)


def test_a_call_cut_by_max_tokens_comes_back_as_far_as_it_streamed() -> None:
    """The whole reply is the fold of the streamed parts: the cut call's name and the
    arguments before the cut have gone out in the stream, so the whole reply has them too
    (``finish_reason: length``, as OpenAI ends a call cut by ``max_tokens``)."""
    cut_at = len(script(CALLING)) - 5  # inside the arguments
    with harmony(CALLING) as ctx:
        response = ctx.chat_completion(USER, max_tokens=cut_at, temperature=0, tools=[WEATHER])
        choice = response["choices"][0]
        assert choice["finish_reason"] == "length"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        whole_arguments = call["function"]["arguments"]
        assert whole_arguments and '{"location": "Paris"}'.startswith(whole_arguments)
        assert "<tool_call>" not in (choice["message"]["content"] or "")
        # streamed, the call's name has gone out before the cut, as for any call format
        _, content, calls, finishes = streamed(ctx, max_tokens=cut_at, tools=[WEATHER])
        assert (content, finishes) == ("", ["length"])
        assert "".join(c["function"].get("arguments", "") for c in calls) == whole_arguments


@pytest.mark.parametrize("reply", [REPLY, CALLING])
def test_the_whole_reply_is_what_its_stream_rebuilds_at_every_cut(reply: str) -> None:
    """End to end, through the engine: cut by ``max_tokens`` at every token, or stopped by
    a stop string inside the markup, the whole reply is what a client rebuilds from the
    stream of the same request (its thinking, content, calls and finish reason)."""
    endings: list[dict[str, Any]] = [{"max_tokens": n} for n in range(1, len(script(reply)))]
    endings += [{"stop": [s]} for s in ("functions", "json", '"Par', "4.", "<|end|>")]
    with harmony(reply) as ctx:
        for ending in endings:
            options = {"tools": [WEATHER], **ending}
            whole = ctx.chat_completion(USER, temperature=0, **options)["choices"][0]
            message = whole["message"]
            reasoning, content, calls, finishes = streamed(ctx, markers=True, **options)
            assert (reasoning or None, content or None) == (
                message.get("reasoning_content"),
                message["content"] or None,
            ), ending
            names = [c["function"]["name"] for c in calls if c["function"].get("name")]
            arguments = "".join(c["function"].get("arguments", "") for c in calls)
            whole_calls = message.get("tool_calls", [])
            assert names == [c["function"]["name"] for c in whole_calls], ending
            assert arguments == "".join(c["function"]["arguments"] for c in whole_calls)
            assert finishes == [whole["finish_reason"]], ending
        assert_idle(ctx)


def test_messages_and_responses_split_the_channels_too() -> None:
    with harmony(REPLY) as ctx:
        message = messages(
            ctx, {"model": "m", "max_tokens": 200, "messages": USER, "temperature": 0}
        )
        assert [(b["type"], b.get("thinking", b.get("text"))) for b in message["content"]] == [
            ("thinking", THOUGHT),
            ("text", "It is 4."),
        ]
        response = create_response(ctx, {"model": "m", "input": "What is 2 + 2?", "temperature": 0})
        kinds = [item["type"] for item in response["output"]]
        assert kinds == ["reasoning", "message"]
        assert response["output"][1]["content"][0]["text"] == "It is 4."
        assert_idle(ctx)


def test_messages_and_responses_end_on_a_cut_call_as_their_streams_do() -> None:
    """A call cut by the token limit after its name streamed: Messages' whole reply has the
    incomplete ``tool_use`` its stream opened (``input: {}``, as the arguments are no JSON
    yet), the Responses API's the call with the arguments so far."""
    cut_at = len(script(CALLING)) - 5  # inside the arguments
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    body = {"model": "m", "max_tokens": cut_at, "messages": USER, "temperature": 0}
    with harmony(CALLING) as ctx:
        message = messages(ctx, {**body, "tools": tools})
        assert message["stop_reason"] == "max_tokens"
        blocks = [(b["type"], b.get("name"), b.get("input")) for b in message["content"]]
        assert blocks == [("thinking", None, None), ("tool_use", "get_weather", {})]
        events = list(messages(ctx, {**body, "tools": tools, "stream": True}))
        started = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert started == ["thinking", "tool_use"]
        response = create_response(
            ctx,
            {
                "model": "m",
                "input": "What is 2 + 2?",
                "temperature": 0,
                "max_output_tokens": cut_at,
                "tools": [{"type": "function", **WEATHER["function"]}],
            },
        )
        (call,) = [item for item in response["output"] if item["type"] == "function_call"]
        assert call["name"] == "get_weather"
        assert '{"location": "Paris"}'.startswith(call["arguments"]) and call["arguments"]
        assert_idle(ctx)


def test_a_chat_keeps_the_thinking_out_of_its_history() -> None:
    with harmony(REPLY) as ctx:
        chat = ctx.chat(params=llamax.SamplingParams(max_tokens=200, temperature=0))
        assert chat.send("What is 2 + 2?").text == REPLY.removesuffix("<|return|>")
        assert chat.messages[-1] == {
            "role": "assistant",
            "content": "It is 4.",
            "reasoning_content": THOUGHT,
        }
        chat.close()
        assert_idle(ctx)


@pytest.mark.parametrize("reply", [REPLY, CALLING])
def test_one_token_at_a_time_the_split_is_the_whole_split(reply: str) -> None:
    from llamax.reasoning import ReasoningSplitter, split_reasoning

    with harmony(reply) as ctx:
        pieces = [ctx.detokenize([t]) for t in script(reply)]
    splitter = ReasoningSplitter()
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    assert (reasoning + r, content + c) == split_reasoning("".join(pieces))
