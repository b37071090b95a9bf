"""The reasoning split through chat_completion (issue 25, item 1), fake backend.

The fake model emits one byte per token, so every tag arrives cut at every byte position.
Templates: a Qwen3-style one that takes ``enable_thinking`` and an R1-style one that opens
``<think>`` in the prompt (tests/data)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_chat import USER, make

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

DATA = Path(__file__).parent / "data"
QWEN3 = (DATA / "qwen3_style_thinking_template.jinja").read_text()
R1 = (DATA / "r1_style_open_thinking_template.jinja").read_text()
THOUGHT = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"


def stream(ctx: llamax.Context, **options: Any) -> tuple[str, str, list[Any]]:
    chunks = list(ctx.chat_completion(USER, stream=True, temperature=0, **options))
    reasoning = content = ""
    finishes = []
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content") or ""
            assert "<" not in (delta.get("content") or "")  # no tag leaks, whole or cut
            finishes.append(choice["finish_reason"])
    return reasoning, content, [f for f in finishes if f]


def test_thinking_goes_to_reasoning_content() -> None:
    with make(THOUGHT, template=QWEN3) as ctx:
        response = ctx.chat_completion(USER, max_tokens=128, temperature=0)
        message = ChatCompletion.model_validate(response).choices[0].message
        assert message.content == "Hello there!"
        assert response["choices"][0]["message"]["reasoning_content"] == (
            "The user greets me. I greet back."
        )
        assert response["choices"][0]["finish_reason"] == "stop"
        reasoning, content, finishes = stream(ctx, max_tokens=128)
        assert (reasoning, content, finishes) == (
            "The user greets me. I greet back.",
            "Hello there!",
            ["stop"],
        )
        assert_idle(ctx)


def test_reasoning_format_none_leaves_the_thinking_in_content() -> None:
    with make(THOUGHT, template=QWEN3) as ctx:
        response = ctx.chat_completion(USER, max_tokens=128, temperature=0, reasoning_format="none")
        message = response["choices"][0]["message"]
        assert message["content"] == THOUGHT and "reasoning_content" not in message
        with pytest.raises(llamax.InvalidParameterError, match="reasoning_format"):
            ctx.chat_completion(USER, max_tokens=8, reasoning_format="hidden")


def test_a_reply_without_thinking_has_no_reasoning_content() -> None:
    with make("Just <think> this.", template=QWEN3) as ctx:
        message = ctx.chat_completion(USER, max_tokens=64, temperature=0)["choices"][0]["message"]
        assert message["content"] == "Just <think> this." and "reasoning_content" not in message


def test_a_reply_cut_inside_its_thinking_has_empty_content_and_says_length() -> None:
    with make(THOUGHT, template=QWEN3) as ctx:
        response = ctx.chat_completion(USER, max_tokens=20, temperature=0)
        choice = response["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] == ""
        # 20 tokens: "<think>\n" and 12 bytes of thought
        assert choice["message"]["reasoning_content"] == "The user gre"
        reasoning, content, finishes = stream(ctx, max_tokens=20)
        assert (reasoning, content, finishes) == ("The user gre", "", ["length"])


def skipped(prompt_tail: str) -> str:
    """Filler for the fake's script: it counts the reply from ``assistant\n``, so what the
    template adds after that is skipped."""
    return "#" * len(prompt_tail)


def test_a_prompt_that_opens_the_thinking() -> None:
    with make(skipped("<think>\n") + "I should greet.\n</think>\n\nHi!", template=R1) as ctx:
        assert ctx.detokenize(ctx.chat_prompt(USER)).endswith("<think>\n")
        message = ctx.chat_completion(USER, max_tokens=64, temperature=0)["choices"][0]["message"]
        assert message == {
            "role": "assistant",
            "content": "Hi!",
            "reasoning_content": "I should greet.",
        }
        assert stream(ctx, max_tokens=64) == ("I should greet.", "Hi!", ["stop"])


def test_enable_thinking_reaches_the_template() -> None:
    with make(skipped("<think>\n\n</think>\n\n") + "Hi!", template=QWEN3) as ctx:
        off = ctx.chat_prompt(USER, enable_thinking=False)
        assert ctx.detokenize(off).endswith("assistant\n<think>\n\n</think>\n\n")
        assert len(off) > len(ctx.chat_prompt(USER))
        response = ctx.chat_completion(USER, max_tokens=16, temperature=0, enable_thinking=False)
        message = response["choices"][0]["message"]
        assert message["content"] == "Hi!" and "reasoning_content" not in message
        assert response["usage"]["prompt_tokens"] == len(off)
        with pytest.raises(llamax.InvalidParameterError, match="enable_thinking"):
            ctx.chat_completion(USER, max_tokens=8, enable_thinking="no")


def test_async_stream_splits_alike() -> None:
    async def main(ctx: llamax.Context) -> tuple[str, str]:
        reasoning = content = ""
        chunks = await ctx.achat_completion(USER, max_tokens=128, temperature=0, stream=True)
        async for chunk in chunks:
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content", "")
                content += choice["delta"].get("content") or ""
        return reasoning, content

    with make(THOUGHT, template=QWEN3, autostart=True) as ctx:
        assert asyncio.run(main(ctx)) == ("The user greets me. I greet back.", "Hello there!")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'


def test_tool_calls_after_thinking_still_parse() -> None:
    reply = f"<think>\nI need the weather.\n</think>\n\n{CALL}"
    with make(reply, template=QWEN3) as ctx:
        response = ctx.chat_completion(USER, max_tokens=200, temperature=0, tools=[WEATHER])
        choice = response["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "I need the weather."
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"location": "Paris"}
        chunks = list(
            ctx.chat_completion(USER, max_tokens=200, temperature=0, tools=[WEATHER], stream=True)
        )
        reasoning = "".join(
            c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"]
        )
        names = [
            d["function"]["name"]
            for c in chunks
            if c["choices"]
            for d in c["choices"][0]["delta"].get("tool_calls", [])
            if d.get("function", {}).get("name")
        ]
        assert reasoning == "I need the weather." and names == ["get_weather"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert_idle(ctx)


def test_the_server_splits_for_the_openai_client() -> None:
    with (
        make(THOUGHT, template=QWEN3, autostart=True) as ctx,
        BackgroundServer(create_app(ctx)) as server,
    ):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-")
        reply = client.chat.completions.create(
            model="fake", messages=USER, max_tokens=128, temperature=0
        )
        message = reply.choices[0].message
        assert message.content == "Hello there!"
        assert message.reasoning_content == "The user greets me. I greet back."  # type: ignore[attr-defined]
        reasoning = content = ""
        for chunk in client.chat.completions.create(
            model="fake", messages=USER, max_tokens=128, temperature=0, stream=True
        ):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == ("The user greets me. I greet back.", "Hello there!")
        plain = client.chat.completions.create(
            model="fake",
            messages=USER,
            max_tokens=128,
            temperature=0,
            extra_body={"reasoning_format": "none"},
        )
        assert plain.choices[0].message.content == THOUGHT
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="fake",
                messages=USER,
                max_tokens=8,
                extra_body={"chat_template_kwargs": {"documents": []}},
            )
        assert caught.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
        off = client.chat.completions.create(
            model="fake",
            messages=USER,
            max_tokens=8,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert off.usage is not None
        assert off.usage.prompt_tokens == len(ctx.chat_prompt(USER, enable_thinking=False))
        assert_idle(ctx)


def test_a_chat_keeps_the_thinking_apart_in_its_history() -> None:
    """``Chat`` stores the answer as ``content`` and the thinking as ``reasoning_content``;
    the template (Qwen3's way) drops the thinking of finished turns, and the next turn
    recomputes from the first token that differs."""
    user = {"role": "user", "content": "Hi!"}
    params = llamax.SamplingParams(max_tokens=128, temperature=0)
    with make(THOUGHT, template=QWEN3) as ctx:
        with ctx.chat(params=params) as chat:
            first = chat.send("Hi!")
            assert first.text == THOUGHT  # the Completion is the raw reply
            assert chat.messages == [
                user,
                {
                    "role": "assistant",
                    "content": "Hello there!",
                    "reasoning_content": "The user greets me. I greet back.",
                },
            ]
            chat.send("Again")
            stats = chat.last_turn
            assert stats is not None
            history = chat.messages[:-1]
            prompt = ctx.chat_prompt(history)
            assert stats.prompt_tokens == len(prompt)
            assert "greets" not in ctx.detokenize(prompt)
            # the cache held the thought: reuse stops where the answer starts
            assert stats.reused_tokens == len(ctx.chat_prompt([user]))
        with ctx.chat(params=params, reasoning_format="none") as raw:
            raw.send("Hi!")
            assert raw.messages[-1] == {"role": "assistant", "content": THOUGHT}
        with ctx.chat(params=params, enable_thinking=False) as off:
            off.send("Hi!")
            assert off.last_turn is not None
            unthinking = ctx.chat_prompt([user], enable_thinking=False)
            assert off.last_turn.prompt_tokens == len(unthinking)
        with pytest.raises(llamax.InvalidParameterError):
            ctx.chat(reasoning_format="maybe")  # type: ignore[arg-type]
        with pytest.raises(llamax.InvalidParameterError, match="enable_thinking"):
            ctx.chat(enable_thinking="yes")  # type: ignore[arg-type]
        assert_idle(ctx)
