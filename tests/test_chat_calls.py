"""Typed calls (issue 58): a chat or text request is a frozen, checked ``ChatCall`` /
``TextCall`` first, and ``Context.submit_chat`` / ``submit_text`` (with their async twins)
are the one entry every way into chat goes through: the OpenAI conveniences, Anthropic's
Messages, the Responses API and the server's routes. Fake backend; a ``Chat`` works on any
``ChatHost``, so the facade builds it without climbing into a layer above it."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_chat import make

import llamax
from llamax.anthropic import messages as anthropic_messages
from llamax.chat import ChatCall, ChatHandle, TextCall, chat_prompt_tokens
from llamax.chat_stream import ContentDelta, Finished, Started, ToolCallDelta
from llamax.conversation import ChatHost
from llamax.openai import OpenAIRequest, create_response
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle
from llamax.tools import prepare_tools

USER = [{"role": "user", "content": "Hi!"}]
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    with make("Hello there!", autostart=True) as context:
        yield context
        assert_idle(context)


# ---------------------------------------------------------------------- the call itself
def test_a_call_is_frozen_and_holds_checked_values() -> None:
    call = ChatCall.of(USER, max_tokens=8, temperature=0, tools=[WEATHER], model="mine")
    assert call.messages == tuple(USER) and isinstance(call.messages, tuple)
    assert call.params.max_tokens == 8 and call.params.temperature == 0
    assert call.tools.is_active and call.model == "mine"
    assert call.request_id.startswith("req-")
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.prefill = "x"  # type: ignore[misc]
    text = TextCall.of([1, 2, 3], max_tokens=2, request_id="req-mine")
    assert text.prompt == (1, 2, 3) and text.request_id == "req-mine"


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"temprature": 0.5}, TypeError, "did you mean 'temperature'"),
        ({"stream": True}, TypeError, "stream"),  # how a result is read, not a call option
        ({"top_p": 2.0}, llamax.InvalidParameterError, "top_p"),
        ({"reasoning_format": "hidden"}, llamax.InvalidParameterError, "reasoning_format"),
        ({"enable_thinking": "yes"}, llamax.InvalidParameterError, "enable_thinking"),
        ({"truncate": "newest"}, llamax.InvalidParameterError, "truncate"),
        ({"parse_special_in_content": 1}, llamax.InvalidParameterError, "parse_special"),
        ({"keep_prefix": "yes"}, llamax.InvalidParameterError, "keep_prefix"),
        ({"tools": [WEATHER], "truncate": "oldest_messages"}, llamax.InvalidParameterError,
         "truncate is not supported together with tools"),
    ],
)  # fmt: skip
def test_a_bad_option_is_refused_before_anything_is_rendered(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ChatCall.of(USER, **options)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"messages": "Hi"}, "messages must be a list"),
        ({"messages": ()}, "must not be empty"),
        ({"messages": USER, "params": {"max_tokens": 2}}, "SamplingParams"),
        ({"messages": USER, "tools": [WEATHER]}, "ToolPlan"),
        ({"messages": USER, "prefill": 3}, "prefill"),
        ({"messages": USER, "model": 3}, "model"),
        ({"messages": USER, "truncate": "oldest_messages",
          "tools": prepare_tools([WEATHER], None, None)}, "together with tools"),
    ],
)  # fmt: skip
def test_a_call_built_field_by_field_is_checked_too(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(llamax.InvalidRequestError, match=match):
        ChatCall(**fields)


def test_a_text_call_refuses_what_is_no_prompt() -> None:
    with pytest.raises(llamax.InvalidParameterError, match="prompt"):
        TextCall(prompt=b"bytes")  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidParameterError, match="prompt"):
        TextCall(prompt=7)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the one entry
def test_the_handle_reads_the_reply_as_parts_or_whole(ctx: llamax.Context) -> None:
    call = ChatCall.of(USER, max_tokens=32, temperature=0)
    chat = ctx.submit_chat(call)
    assert isinstance(chat, ChatHandle) and chat.request_id == call.request_id
    parts = list(chat.parts())
    assert isinstance(parts[0], Started) and isinstance(parts[-1], Finished)
    streamed = "".join(p.text for p in parts if isinstance(p, ContentDelta))
    assert streamed == "Hello there!" == chat.result().text
    assert parts[-1].reason == "stop"
    # the OpenAI convenience is the same call read as OpenAI's shape
    reply = ctx.chat_completion(USER, max_tokens=32, temperature=0)
    assert OpenAIRequest(ctx.submit_chat(call)).result()["choices"] == reply["choices"]


def test_tool_calls_come_as_typed_parts() -> None:
    with make(
        '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>', autostart=True
    ) as ctx:
        call = ChatCall.of(USER, max_tokens=64, temperature=0, tools=[WEATHER],
                           tool_choice="required")  # fmt: skip
        parts = list(ctx.submit_chat(call).parts())
        calls = [p for p in parts if isinstance(p, ToolCallDelta) and p.name]
        assert [c.name for c in calls] == ["weather"]
        assert parts[-1] == Finished(0, "tool_calls")
        assert_idle(ctx)


def test_closing_the_parts_early_cancels_the_request(ctx: llamax.Context) -> None:
    chat = ctx.submit_chat(ChatCall.of(USER, max_tokens=64, temperature=0))
    parts = chat.parts()
    assert isinstance(next(parts), Started)
    parts.close()
    assert chat.result().choices[0].finish_reason is not None
    assert chat.handle.done()


def test_a_prefill_is_continued_and_left_out_of_the_reply(ctx: llamax.Context) -> None:
    plain = ctx.submit_chat(ChatCall.of(USER, max_tokens=32, temperature=0))
    prefilled = ctx.submit_chat(ChatCall.of(USER, max_tokens=32, temperature=0, prefill="Hel"))
    assert plain.result().usage.prompt_tokens + 3 == prefilled.result().usage.prompt_tokens
    assert prefilled.num_prompt_tokens == plain.num_prompt_tokens + 3


def test_text_calls_go_through_the_same_entry(ctx: llamax.Context) -> None:
    text = ctx.submit_text(TextCall.of("Hi", max_tokens=4, temperature=0))
    assert text.kind == "text" and len(text.result().choices[0].token_ids) == 4
    assert ctx.completion("Hi", max_tokens=4, temperature=0)["choices"][0]["text"] == (
        text.result().text
    )


def test_the_async_twin_renders_off_the_loop_and_cancels_what_a_gone_caller_submitted(
    ctx: llamax.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendering = threading.Event()
    release = threading.Event()
    submitted: list[ChatHandle] = []
    submit = ctx.submit_chat

    def slow(call: ChatCall, **kwargs: Any) -> ChatHandle:
        rendering.set()
        release.wait(10)
        submitted.append(submit(call, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(ctx, "submit_chat", slow)

    async def main() -> None:
        task = asyncio.ensure_future(ctx.asubmit_chat(ChatCall.of(USER, max_tokens=64)))
        while not rendering.is_set():  # the loop is free while the worker renders
            await asyncio.sleep(0.01)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    for _ in range(500):
        if submitted and submitted[0].handle.done():
            break
        threading.Event().wait(0.01)
    assert submitted and submitted[0].handle.done()  # cancelled once it existed


def test_every_way_into_chat_goes_through_submit_chat(
    ctx: llamax.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OpenAI conveniences (sync, async, streamed), Anthropic's Messages, the Responses
    API and the server's chat routes all submit a ``ChatCall`` through the one entry."""
    seen: list[str] = []
    submit = ctx.submit_chat

    def recording(call: ChatCall, **kwargs: Any) -> ChatHandle:
        assert isinstance(call, ChatCall)
        seen.append(call.messages[-1]["content"])
        return submit(call, **kwargs)

    monkeypatch.setattr(ctx, "submit_chat", recording)
    ask = [{"role": "user", "content": "one"}]
    ctx.chat_completion(ask, max_tokens=4)
    list(ctx.chat_completion([{"role": "user", "content": "two"}], max_tokens=4, stream=True))
    asyncio.run(ctx.achat_completion([{"role": "user", "content": "three"}], max_tokens=4))
    anthropic_messages(ctx, {"model": "m", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "four"}]})  # fmt: skip
    create_response(ctx, {"input": "five", "max_output_tokens": 4})
    with BackgroundServer(create_app(ctx)) as server:
        httpx.post(
            f"{server.url}/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "six"}], "max_tokens": 4},
        )
        httpx.post(f"{server.url}/v1/messages", timeout=30,
                   json={"model": "m", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "seven"}]})  # fmt: skip
    assert seen == ["one", "two", "three", "four", "five", "six", "seven"]


def test_token_counting_takes_the_same_call(ctx: llamax.Context) -> None:
    call = ChatCall.of(USER, max_tokens=4)
    assert chat_prompt_tokens(ctx, call) == ctx.chat_prompt(USER)
    assert ctx.submit_chat(call).num_prompt_tokens == len(ctx.chat_prompt(USER))


# ---------------------------------------------------------------------- Chat on a ChatHost
class _Host:
    """A ``ChatHost`` that is not a Context: it delegates, and counts sessions opened."""

    def __init__(self, ctx: llamax.Context) -> None:
        self._ctx = ctx
        self.sessions = 0

    def session(self) -> llamax.Session:
        self.sessions += 1
        return self._ctx.session()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def test_a_chat_works_on_any_chat_host(ctx: llamax.Context) -> None:
    host = _Host(ctx)
    typed: ChatHost[llamax.Session] = host  # type: ignore[assignment]  # __getattr__
    greedy = llamax.SamplingParams(max_tokens=32, temperature=0)
    with llamax.Chat(typed, max_context=512, params=greedy) as chat:
        assert chat.send("Hi!").text == "Hello there!"
        assert host.sessions == 1 and isinstance(chat.session, llamax.Session)
    with ctx.chat(params=greedy) as chat:  # what the facade builds: a Chat[Session]
        chat.send("Hi!")
        assert chat.session.token_ids  # typed as the context's Session


def test_an_unknown_option_is_named_by_the_call_that_took_it(ctx: llamax.Context) -> None:
    with pytest.raises(TypeError, match=r"^ChatCall\.of\(\) got .*'temprature'"):
        ChatCall.of(USER, temprature=0.5)
    with pytest.raises(TypeError, match=r"^TextCall\.of\(\) got .*'temprature'"):
        TextCall.of("Hi", temprature=0.5)
    with pytest.raises(TypeError, match=r"^chat_completion\(\) got .*'temprature'"):
        ctx.chat_completion(USER, temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^acompletion\(\) got .*'temprature'"):
        asyncio.run(ctx.acompletion("Hi", temprature=0.5))  # type: ignore[call-overload]
