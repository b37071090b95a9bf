"""Anthropic Messages shapes built on the public API (llamax.anthropic, issue 25 items 2
and 4), fake backend, checked against the ``anthropic`` SDK's own types."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from test_chat import SPECIALS, TEMPLATE, make, replies
from test_chat_reasoning import QWEN3, THOUGHT

import llamax
from llamax.anthropic import amessages, count_tokens, messages
from llamax.testing import FakeBackend, assert_idle

EVENTS = TypeAdapter(RawMessageStreamEvent)
HI = [{"role": "user", "content": "Hi!"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'


def ask(ctx: llamax.Context, **request: Any) -> dict[str, Any]:
    reply = messages(ctx, {"messages": HI, "max_tokens": 64, "temperature": 0, **request})
    assert isinstance(reply, dict)
    Message.model_validate(reply)
    return reply


def events(ctx: llamax.Context, **request: Any) -> list[dict[str, Any]]:
    stream = messages(
        ctx, {"messages": HI, "max_tokens": 64, "temperature": 0, "stream": True, **request}
    )
    assert not isinstance(stream, dict)
    out = list(stream)
    for event in out:
        if event["type"] != "ping":  # a keep-alive the SDK skips; not among its types
            EVENTS.validate_python(event)
    return out


def blocks_of(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a client assembles from the events."""
    blocks: list[dict[str, Any]] = []
    for event in stream:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                block["partial"] = block.get("partial", "") + delta["partial_json"]
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial"))
    return blocks


def test_a_text_reply() -> None:
    with make("Hello there!") as ctx:
        reply = ask(ctx)
        assert reply["content"] == [{"type": "text", "text": "Hello there!"}]
        assert reply["stop_reason"] == "end_turn" and reply["stop_sequence"] is None
        assert reply["role"] == "assistant" and reply["id"].startswith("msg_")
        prompt = len(ctx.chat_prompt(HI))
        assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == prompt
        assert reply["usage"]["output_tokens"] == len("Hello there!")
        stream = events(ctx)
        kinds = [e["type"] for e in stream]
        assert kinds[:3] == ["message_start", "ping", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert blocks_of(stream) == [{"type": "text", "text": "Hello there!"}]
        assert stream[-2]["delta"]["stop_reason"] == "end_turn"
        assert stream[-2]["usage"]["output_tokens"] == len("Hello there!")
        final = stream[-2]["usage"]  # the cache's share is known by the end
        assert final["input_tokens"] + final["cache_read_input_tokens"] == prompt
        assert final["cache_read_input_tokens"] > 0  # the same prompt, asked again
        # ... and already in message_start, where Claude Code reads its cache counts
        started = stream[0]["message"]["usage"]
        assert started == {**final, "output_tokens": 0}
        assert_idle(ctx)


def test_system_prompts_and_count_tokens() -> None:
    with make("Hello there!") as ctx:
        system = [{"role": "system", "content": "Be brief."}, *HI]
        expected = len(ctx.chat_prompt(system))
        for given in (
            "Be brief.",
            [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        ):
            counted = count_tokens(ctx, {"messages": HI, "system": given})
            assert counted == {"input_tokens": expected}
            reply = ask(ctx, system=given)
            usage = reply["usage"]
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == expected
        assert count_tokens(ctx, {"messages": HI})["input_tokens"] == len(ctx.chat_prompt(HI))


def test_stop_sequences_and_max_tokens() -> None:
    with make("Hello there!") as ctx:
        reply = ask(ctx, stop_sequences=["zzz", "there"])
        assert reply["content"] == [{"type": "text", "text": "Hello "}]
        assert (reply["stop_reason"], reply["stop_sequence"]) == ("stop_sequence", "there")
        stream = events(ctx, stop_sequences=["there"])
        assert stream[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "there"}
        cut = ask(ctx, max_tokens=3)
        assert cut["content"] == [{"type": "text", "text": "Hel"}]
        assert cut["stop_reason"] == "max_tokens"


def test_thinking_comes_back_as_a_thinking_block() -> None:
    with make(THOUGHT, template=QWEN3) as ctx:
        reply = ask(ctx, max_tokens=128)
        assert [b["type"] for b in reply["content"]] == ["thinking", "text"]
        assert reply["content"][0]["thinking"] == "The user greets me. I greet back."
        assert reply["content"][1]["text"] == "Hello there!"
        stream = events(ctx, max_tokens=128)
        assert [(b["type"], b.get("text") or b.get("thinking")) for b in blocks_of(stream)] == [
            ("thinking", "The user greets me. I greet back."),
            ("text", "Hello there!"),
        ]
        off = count_tokens(ctx, {"messages": HI, "thinking": {"type": "disabled"}})
        assert off["input_tokens"] == len(ctx.chat_prompt(HI, enable_thinking=False))


def test_a_tool_round_trip() -> None:
    with make(f"Let me look.\n{CALL}") as ctx:
        reply = ask(ctx, max_tokens=200, tools=[WEATHER])
        assert reply["stop_reason"] == "tool_use"
        text, use = reply["content"]
        assert text == {"type": "text", "text": "Let me look."}
        assert use["type"] == "tool_use" and use["name"] == "get_weather"
        assert use["input"] == {"location": "Paris"}
        stream = events(ctx, max_tokens=200, tools=[WEATHER])
        streamed = blocks_of(stream)
        assert [b["type"] for b in streamed] == ["text", "tool_use"]
        assert (
            streamed[1]["input"] == {"location": "Paris"} and streamed[1]["name"] == "get_weather"
        )
        assert stream[-2]["delta"]["stop_reason"] == "tool_use"
        follow_up = [
            *HI,
            {"role": "assistant", "content": reply["content"]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use["id"], "content": "18 C, sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ]
        assert count_tokens(ctx, {"messages": follow_up, "tools": [WEATHER]})["input_tokens"] > 0
        answer = messages(
            ctx, {"messages": follow_up, "max_tokens": 8, "tools": [WEATHER], "temperature": 0}
        )
        assert isinstance(answer, dict)
        Message.model_validate(answer)
        forced = ask(
            ctx,
            max_tokens=200,
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        assert forced["stop_reason"] in ("tool_use", "max_tokens")
        assert_idle(ctx)


BAD_REQUESTS = [
    ({"messages": HI}, "max_tokens"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_tokens": 8, "n": 2}, "unsupported field"),
    ({"messages": [], "max_tokens": 8}, "non-empty"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 8}, "role"),
    (  # images are blocks since issue 42; this one has no data
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}
            ],
            "max_tokens": 8,
        },
        "needs a media_type and base64 data",
    ),
    (
        {
            "messages": [
                *HI,
                {"role": "assistant", "content": [{"type": "image", "source": {"type": "base64"}}]},
            ],
            "max_tokens": 8,
        },
        "unsupported content block 'image' for assistant",
    ),
    ({"messages": HI, "max_tokens": 8, "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"messages": HI, "max_tokens": 8, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"messages": HI, "max_tokens": 8, "stop_sequences": "END"}, "stop_sequences"),
    ({"messages": HI, "max_tokens": 8, "tools": [{"name": "f"}]}, "input_schema"),
    ({"messages": HI, "max_tokens": 8, "system": [{"type": "image"}]}, "text blocks"),
    ({"messages": HI, "max_tokens": 8, "stream": "no"}, "stream must be a boolean"),
    (
        {
            "messages": HI,
            "max_tokens": 8,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"},
        },
        "disable_parallel_tool_use must be a boolean",
    ),
    ({"messages": HI, "max_tokens": 8, "temperature": 10**400}, "temperature"),
    ({"messages": HI, "max_tokens": 10**400}, "max_tokens"),
]


@pytest.mark.parametrize(("request_body", "message"), BAD_REQUESTS)
def test_bad_requests_are_typed_errors_and_enqueue_nothing(
    request_body: dict[str, Any], message: str
) -> None:
    with make("Hello there!") as ctx:
        with pytest.raises(llamax.InvalidRequestError, match=message):
            messages(ctx, request_body)
        assert ctx.stats().num_waiting == 0 and ctx.stats().num_running == 0


def test_async_and_an_early_close_frees_the_request() -> None:
    async def main(ctx: llamax.Context) -> tuple[dict[str, Any], list[str]]:
        reply = await amessages(ctx, {"messages": HI, "max_tokens": 64, "temperature": 0})
        assert isinstance(reply, dict)
        stream = await amessages(ctx, {"messages": HI, "max_tokens": 64, "stream": True})
        assert not isinstance(stream, dict)
        kinds = [event["type"] async for event in stream]
        return reply, kinds

    with make("Hello there!", autostart=True) as ctx:
        reply, kinds = asyncio.run(main(ctx))
        assert reply["content"][0]["text"] == "Hello there!"
        assert kinds[-1] == "message_stop"
        stream = messages(ctx, {"messages": HI, "max_tokens": 512, "stream": True})
        assert not isinstance(stream, dict)
        next(stream), next(stream)  # message_start, ping
        stream.close()  # type: ignore[attr-defined]
        assert_idle(ctx)


# ---------------------------------------------------------------------- over HTTP
def test_the_anthropic_client_against_the_server() -> None:
    import anthropic
    import httpx

    from llamax.server import BackgroundServer, create_app

    reply = f"Let me look.\n{CALL}"
    with (
        make(reply, autostart=True) as ctx,
        BackgroundServer(create_app(ctx, api_key="sekrit")) as server,
    ):
        client = anthropic.Anthropic(base_url=server.url, api_key="sekrit")
        message = client.messages.create(
            model="fake",
            max_tokens=200,
            extra_body={"temperature": 0},
            system="Be brief.",
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER],  # type: ignore[list-item]
        )
        assert message.stop_reason == "tool_use"
        text, use = message.content
        assert text.type == "text" and text.text == "Let me look."
        assert use.type == "tool_use" and use.input == {"location": "Paris"}
        follow_up = client.messages.create(
            model="fake",
            max_tokens=8,
            extra_body={"temperature": 0},
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": message.content},  # type: ignore[typeddict-item]
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
                },
            ],
            tools=[WEATHER],  # type: ignore[list-item]
        )
        assert follow_up.stop_reason == "max_tokens" and follow_up.usage.output_tokens == 8
        with client.messages.stream(
            model="fake",
            max_tokens=200,
            extra_body={"temperature": 0},
            messages=HI,
            tools=[WEATHER],  # type: ignore[arg-type,list-item]
        ) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].input == {"location": "Paris"}  # type: ignore[union-attr]
        stopped = client.messages.create(
            model="fake",
            max_tokens=64,
            extra_body={"temperature": 0},
            messages=HI,
            stop_sequences=["look"],
        )
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "look")
        counted = client.messages.count_tokens(model="fake", messages=HI, system="Be brief.")
        system = [{"role": "system", "content": "Be brief."}, *HI]
        assert counted.input_tokens == len(ctx.chat_prompt(system))
        # errors, in Anthropic's shape, through the client's typed exceptions
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(
                model="fake",
                max_tokens=8,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x"}}
                        ],
                    }
                ],  # type: ignore[list-item]
            )
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "image" in bad.value.body["error"]["message"]  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="wrong").messages.create(
                model="fake", max_tokens=8, messages=HI
            )
        raw = httpx.post(
            server.url + "/v1/messages",
            headers={"x-api-key": "sekrit"},
            content=b'{"messages": [{"role": "user", "content": "x"}]}',
        )
        assert raw.status_code == 400
        assert raw.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": raw.json()["error"]["message"]},
        }
        assert "max_tokens" in raw.json()["error"]["message"]
        not_json = httpx.post(
            server.url + "/v1/messages", headers={"x-api-key": "sekrit"}, content=b"{nope"
        )
        assert not_json.status_code == 400 and not_json.json()["type"] == "error"
        # a client that leaves mid-stream frees its sequence
        long = {"messages": HI, "max_tokens": 900, "stream": True, "temperature": 0}
        url = server.url + "/v1/messages"
        assert leave_mid_stream(ctx, url, long, {"x-api-key": "sekrit"}) == "message_start"
    assert_idle(ctx)


def test_a_quiet_stream_gets_pings_on_a_timer() -> None:
    """A stream that sends nothing for ``stream_ping_seconds`` (here: a model slower than
    that per token) gets ``ping`` events between its deltas, and still ends well-formed."""
    import anthropic

    from llamax.server import BackgroundServer, create_app

    quick = replies("Hi!")
    with make() as unserved:
        for bad in (0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="stream_ping_seconds"):
                create_app(unserved, stream_ping_seconds=bad)
        with pytest.raises(ValueError, match="max_stored_responses"):
            create_app(unserved, max_stored_responses=0)

    def slow(history: Any) -> int:
        time.sleep(0.25)
        return int(quick(history))

    backend = FakeBackend(
        n_ctx=1024,
        next_token=slow,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SPECIALS,
    )
    with (
        llamax.Context(backend=backend, autostart=True) as ctx,
        BackgroundServer(create_app(ctx, stream_ping_seconds=0.05)) as server,
    ):
        body = {"messages": HI, "max_tokens": 8, "stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/messages", json=body) as response:
            kinds = [
                line.removeprefix("event: ")
                for line in response.iter_lines()
                if line.startswith("event: ")
            ]
        deltas = [i for i, kind in enumerate(kinds) if kind == "content_block_delta"]
        assert len(deltas) == 3 and kinds[-1] == "message_stop"
        pings_between = kinds[deltas[0] : deltas[-1]].count("ping")
        assert pings_between >= 2, kinds
        client = anthropic.Anthropic(base_url=server.url, api_key="unused")
        with client.messages.stream(
            model="fake", max_tokens=8, messages=HI, extra_body={"temperature": 0}
        ) as stream:
            assert stream.get_final_message().content[0].text == "Hi!"  # type: ignore[union-attr]
    assert_idle(ctx)


def leave_mid_stream(
    ctx: llamax.Context, url: str, body: dict[str, Any], headers: dict[str, str]
) -> str:
    """Open a long stream, read its first event, leave, and check that the sequence is
    freed (within 10 s); return the first event's name."""
    with httpx.stream("POST", url, headers=headers, json=body) as response:
        first = next(
            line.removeprefix("event: ")
            for line in response.iter_lines()
            if line.startswith("event: ")
        )
    deadline = time.monotonic() + 60
    while ctx.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ctx.stats().num_running == 0
    return first
