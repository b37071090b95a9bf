"""OpenAI Responses shapes built on the public API (llamax.openai.create_response, issue 25
items 3 and 4), fake backend, checked against the ``openai`` SDK's own types; then the
``openai`` client's ``responses`` API against ``llamax serve``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_anthropic import leave_mid_stream
from test_chat import make
from test_chat_reasoning import QWEN3, THOUGHT

import llamax
from llamax.chat import ChatCall, chat_prompt_tokens
from llamax.openai import ResponseStore, acreate_response, create_response
from llamax.testing import assert_idle

EVENTS = TypeAdapter(ResponseStreamEvent)
HI = "Hi!"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'


def respond(
    ctx: llamax.Context, keep: ResponseStore | None = None, **request: Any
) -> dict[str, Any]:
    body = {"input": HI, "max_output_tokens": 64, "temperature": 0, **request}
    reply = create_response(ctx, body, store=keep)
    assert isinstance(reply, dict)
    Response.model_validate(reply)
    return reply


def events(
    ctx: llamax.Context, keep: ResponseStore | None = None, **request: Any
) -> list[dict[str, Any]]:
    body = {"input": HI, "max_output_tokens": 64, "temperature": 0, "stream": True, **request}
    stream = create_response(ctx, body, store=keep)
    assert not isinstance(stream, dict)
    out = list(stream)
    for event in out:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def assembled(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items a client assembles from the deltas (not from the ``done`` events)."""
    items: dict[int, dict[str, Any]] = {}
    for event in stream:
        kind = event["type"]
        if kind == "response.output_item.added":
            items[event["output_index"]] = {**event["item"], "text": ""}
        elif kind in (
            "response.output_text.delta",
            "response.reasoning_text.delta",
            "response.function_call_arguments.delta",
        ):
            items[event["output_index"]]["text"] += event["delta"]
    return [items[i] for i in sorted(items)]


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def test_a_text_reply_whole_and_streamed() -> None:
    with make("Hello there!") as ctx:
        reply = respond(ctx)
        assert reply["status"] == "completed" and reply["id"].startswith("resp_")
        assert [item["type"] for item in reply["output"]] == ["message"]
        assert output_text(reply) == "Hello there!"
        usage = reply["usage"]
        assert usage["input_tokens"] == len(ctx.chat_prompt([{"role": "user", "content": HI}]))
        assert usage["output_tokens"] == len("Hello there!")
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        stream = events(ctx)
        kinds = [e["type"] for e in stream]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [(i["type"], i["text"]) for i in assembled(stream)] == [("message", "Hello there!")]
        final = stream[-1]["response"]
        assert output_text(final) == "Hello there!" and final["usage"]["output_tokens"] == 12
        assert stream[0]["response"]["status"] == "in_progress"
        assert_idle(ctx)


def test_instructions_and_a_cut_reply() -> None:
    with make("Hello there!") as ctx:
        reply = respond(ctx, instructions="Be brief.")
        system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HI}]
        assert reply["usage"]["input_tokens"] == len(ctx.chat_prompt(system))
        assert reply["instructions"] == "Be brief."
        cut = respond(ctx, max_output_tokens=3)
        assert cut["status"] == "incomplete"
        assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
        assert output_text(cut) == "Hel" and cut["output"][0]["status"] == "incomplete"
        streamed = events(ctx, max_output_tokens=3)
        assert streamed[-1]["type"] == "response.incomplete"
        assert output_text(streamed[-1]["response"]) == "Hel"


def test_input_items_become_the_conversation() -> None:
    with make("Hello there!") as ctx:
        items = [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"location": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ]  # fmt: skip
        reply = respond(ctx, input=items, tools=[WEATHER])
        chat = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]  # fmt: skip
        expected = chat_prompt_tokens(ctx, ChatCall.of(chat, tools=[CHAT_WEATHER]))
        assert reply["usage"]["input_tokens"] == len(expected)


def test_thinking_comes_back_as_a_reasoning_item() -> None:
    with make(THOUGHT, template=QWEN3) as ctx:
        reply = respond(ctx, max_output_tokens=128)
        assert [item["type"] for item in reply["output"]] == ["reasoning", "message"]
        thought = reply["output"][0]
        assert thought["content"] == [
            {"type": "reasoning_text", "text": "The user greets me. I greet back."}
        ]
        assert thought["summary"] == []
        assert output_text(reply) == "Hello there!"
        assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
        summarized = respond(ctx, max_output_tokens=128, reasoning={"summary": "auto"})
        assert summarized["output"][0]["summary"] == [
            {"type": "summary_text", "text": "The user greets me. I greet back."}
        ]
        stream = events(ctx, max_output_tokens=128)
        assert [(i["type"], i["text"]) for i in assembled(stream)] == [
            ("reasoning", "The user greets me. I greet back."),
            ("message", "Hello there!"),
        ]
        assert stream[-1]["response"]["output"][0]["content"] == thought["content"]
        off = respond(ctx, max_output_tokens=128, reasoning={"effort": "none"})
        user = [{"role": "user", "content": HI}]
        assert off["usage"]["input_tokens"] == len(ctx.chat_prompt(user, enable_thinking=False))
        # cut inside the thought: no text, and the response says it was cut
        cut = respond(ctx, max_output_tokens=12)
        assert cut["status"] == "incomplete" and output_text(cut) == ""
        assert [item["type"] for item in cut["output"]] == ["reasoning", "message"]


def test_a_function_call_round_trip_through_previous_response_id() -> None:
    store = ResponseStore()
    with make(f"Let me look.\n{CALL}") as ctx:
        reply = respond(ctx, store, max_output_tokens=200, tools=[WEATHER])
        message, call = reply["output"]
        assert message["type"] == "message" and output_text(reply) == "Let me look."
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"location": "Paris"}
        assert call["call_id"].startswith("call_") and reply["status"] == "completed"
        stream = events(ctx, max_output_tokens=200, tools=[WEATHER])
        items = assembled(stream)
        assert [i["type"] for i in items] == ["message", "function_call"]
        assert json.loads(items[1]["text"]) == {"location": "Paris"}
        assert stream[-1]["response"]["output"][1]["arguments"] == items[1]["text"]
        done = [e for e in stream if e["type"] == "response.function_call_arguments.done"]
        assert [e["name"] for e in done] == ["get_weather"]
        # the follow-up continues the stored conversation
        result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        follow = respond(
            ctx,
            store,
            input=[result],
            previous_response_id=reply["id"],
            tools=[WEATHER],
            max_output_tokens=8,
        )
        assert follow["previous_response_id"] == reply["id"]
        chat = [
            {"role": "user", "content": HI},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": call["call_id"], "type": "function",
                 "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"},
        ]  # fmt: skip
        expected = chat_prompt_tokens(ctx, ChatCall.of(chat, tools=[CHAT_WEATHER]))
        assert follow["usage"]["input_tokens"] == len(expected)
        assert follow["usage"]["input_tokens_details"]["cached_tokens"] > 0
        forced = respond(
            ctx,
            max_output_tokens=200,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
        )
        assert forced["output"][-1]["type"] in ("function_call", "message")
        assert_idle(ctx)


def test_the_store_keeps_recent_responses_and_says_when_one_is_gone() -> None:
    store = ResponseStore(max_responses=2)
    with make("Hello there!") as ctx:
        first = respond(ctx, store)
        assert store.get(first["id"]) == first
        second = respond(ctx, store, input="Again", previous_response_id=first["id"])
        roles = [m["role"] for m in store.conversation(second["id"])]
        assert roles == ["user", "assistant", "user", "assistant"]
        unstored = respond(ctx, store, store=False)
        with pytest.raises(llamax.NotFoundError, match="no stored response"):
            store.get(unstored["id"])
        third = respond(ctx, store)  # evicts the least recently used: first
        assert len(store) == 2
        with pytest.raises(llamax.NotFoundError):
            respond(ctx, store, previous_response_id=first["id"])
        assert store.get(third["id"])["id"] == third["id"]
        assert store.delete(second["id"]) and not store.delete(second["id"])
        with pytest.raises(llamax.NotFoundError, match="no response store"):
            respond(ctx, None, previous_response_id=third["id"])
        assert ctx.stats().num_waiting == 0 and ctx.stats().num_running == 0


def test_the_store_bounds_its_characters() -> None:
    store = ResponseStore(max_responses=100, max_chars=400)
    response = {"id": "resp_a"}
    store.put(response, [{"role": "user", "content": "x" * 150}])
    store.put({"id": "resp_b"}, [{"role": "user", "content": "y" * 150}])
    assert len(store) == 2
    store.get("resp_a")  # now the most recently used
    store.put({"id": "resp_c"}, [{"role": "user", "content": "z" * 150}])
    assert len(store) == 2 and store.get("resp_a") and store.get("resp_c")
    with pytest.raises(llamax.NotFoundError):
        store.get("resp_b")
    store.put({"id": "resp_huge"}, [{"role": "user", "content": "w" * 1000}])
    with pytest.raises(llamax.NotFoundError):
        store.get("resp_huge")
    with pytest.raises(ValueError):
        ResponseStore(max_responses=0)


BAD_REQUESTS = [
    ({}, "input must be"),
    ({"input": []}, "input must be"),
    ({"input": HI, "n": 2}, "unsupported field"),
    ({"input": HI, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role"),
    (  # images are parts since issue 42; "x" is no data: URL
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "image_url of the input_image: an image URL must be a data: URL",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
        "unsupported content part 'input_file'",
    ),
    (
        {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "unsupported content part 'input_image'",
    ),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "unsupported input item"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"input": HI, "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": HI, "tool_choice": "maybe"}, "tool_choice"),
    ({"input": HI, "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": HI, "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"input": HI, "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": HI, "truncation": "sometimes"}, "truncation"),
    ({"input": HI, "instructions": 3}, "instructions"),
    ({"input": HI, "previous_response_id": 3}, "previous_response_id"),
    ({"input": HI, "stream": "yes"}, "stream must be a boolean"),  # "no" would stream too
    ({"input": HI, "store": "no"}, "store must be a boolean"),  # and would store
    ({"input": HI, "parallel_tool_calls": 0}, "parallel_tool_calls must be a boolean"),
    ({"input": HI, "temperature": 10**400}, "temperature"),  # float() would overflow
    # metadata and user, as OpenAI checks them (issue 36 item 7: ``[1, 2]`` ran the
    # generation, then failed with a 500 building the response)
    ({"input": HI, "metadata": [1, 2]}, "metadata must be an object"),
    ({"input": HI, "metadata": "tag"}, "metadata must be an object"),
    ({"input": HI, "metadata": {f"k{i}": "v" for i in range(17)}}, "17 pairs; at most 16"),
    ({"input": HI, "metadata": {"k" * 65: "v"}}, "metadata keys"),
    ({"input": HI, "metadata": {"k": "v" * 513}}, r"metadata\['k'\]"),
    ({"input": HI, "metadata": {"k": 3}}, r"metadata\['k'\]"),
    ({"input": HI, "user": 3}, "user must be a string"),
    ({"input": HI, "user": "u" * 257}, "user must be a string of at most 256"),
]


@pytest.mark.parametrize(("request_body", "message"), BAD_REQUESTS)
def test_bad_requests_are_typed_errors_and_enqueue_nothing(
    request_body: dict[str, Any], message: str
) -> None:
    with make("Hello there!") as ctx:
        store = ResponseStore()
        with pytest.raises(llamax.InvalidRequestError, match=message):
            create_response(ctx, request_body, store=store)
        stats = ctx.stats()
        assert stats.num_waiting == 0 and stats.num_running == 0 and stats.num_steps == 0
        assert len(store) == 0


def test_metadata_at_openais_bounds_is_echoed_and_stored() -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    store = ResponseStore()
    with make("Hello there!") as ctx:
        reply = respond(ctx, store, metadata=metadata, user="u" * 256)
        assert reply["metadata"] == metadata and reply["user"] == "u" * 256
        assert store.get(reply["id"])["metadata"] == metadata


def test_the_store_counts_the_whole_response_it_keeps() -> None:
    """Regression (issue 36 item 7): the store bounded the conversations' text only, but
    kept each response object too, with its echoed ``metadata``: 100 requests with 4 MiB
    of metadata each were all kept. Now the bound covers the whole entry; measured here
    by the store's own count, not by the process's memory."""
    metadata = {f"{i:02d}": "v" * 512 for i in range(16)}  # about 8 KiB of characters
    store = ResponseStore(max_responses=1000, max_chars=40_000)
    with make("Hello there!") as ctx:
        ids = [respond(ctx, store, metadata=metadata)["id"] for _ in range(30)]
        assert len(store) <= 40_000 // (16 * 512)  # each entry counts its metadata
        assert 0 < store.num_chars <= store.max_chars
        assert store.get(ids[-1])["metadata"] == metadata  # the newest are the ones kept
        with pytest.raises(llamax.NotFoundError):
            store.get(ids[0])
        assert_idle(ctx)
    lone = ResponseStore(max_chars=1000)
    lone.put({"id": "resp_a", "instructions": "x" * 2000}, [{"role": "user", "content": "Hi"}])
    assert len(lone) == 0 and lone.num_chars == 0  # larger than the bound alone: not kept
    lone.put({"id": "resp_b", "metadata": {"k" * 300: "v"}}, [])  # keys count too
    assert lone.num_chars >= 300


def test_async_and_an_early_close_frees_the_request() -> None:
    store = ResponseStore()

    async def main(ctx: llamax.Context) -> tuple[dict[str, Any], list[str]]:
        reply = await acreate_response(ctx, {"input": HI, "temperature": 0}, store=store)
        assert isinstance(reply, dict)
        again = {"input": "Again", "previous_response_id": reply["id"], "stream": True}
        stream = await acreate_response(ctx, again, store=store)
        assert not isinstance(stream, dict)
        kinds = [event["type"] async for event in stream]
        return reply, kinds

    with make("Hello there!", autostart=True) as ctx:
        reply, kinds = asyncio.run(main(ctx))
        assert output_text(reply) == "Hello there!"
        assert kinds[-1] == "response.completed" and len(store) == 2
        stream = create_response(ctx, {"input": HI, "max_output_tokens": 512, "stream": True})
        assert not isinstance(stream, dict)
        next(stream), next(stream)  # created, in_progress
        stream.close()  # type: ignore[attr-defined]
        assert_idle(ctx)


# ---------------------------------------------------------------------- over HTTP
def test_the_openai_client_against_the_server() -> None:
    import httpx
    import openai

    from llamax.server import BackgroundServer, create_app

    with (
        make(f"Let me look.\n{CALL}", autostart=True) as ctx,
        BackgroundServer(create_app(ctx, api_key="sekrit")) as server,
    ):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        reply = client.responses.create(
            model="fake",
            instructions="Be brief.",
            input="Weather in Paris?",
            tools=[WEATHER],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=200,
        )
        assert reply.status == "completed" and reply.output_text == "Let me look."
        call = reply.output[1]
        assert call.type == "function_call" and json.loads(call.arguments) == {"location": "Paris"}
        follow = client.responses.create(
            model="fake",
            previous_response_id=reply.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            tools=[WEATHER],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=8,
        )
        assert follow.status == "incomplete" and follow.usage is not None
        assert follow.usage.input_tokens_details.cached_tokens > 0
        assert client.responses.retrieve(reply.id).output_text == "Let me look."
        with client.responses.stream(
            model="fake",
            input="Weather?",
            tools=[WEATHER],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=200,
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            final = stream.get_final_response()
        assert json.loads("".join(deltas)) == {"location": "Paris"}
        assert [item.type for item in final.output] == ["message", "function_call"]
        raw_stream = client.responses.create(model="fake", input=HI, temperature=0, stream=True)
        kinds = [event.type for event in raw_stream]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        # errors, in OpenAI's shape, through the client's typed exceptions
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(model="fake", input=HI, previous_response_id="resp_nope")
        assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_nope")
        deleted = client.responses.delete(reply.id)
        assert deleted is None
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(reply.id)
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(
                model="fake",
                input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],  # type: ignore[list-item]
            )
        assert "input_image" in bad.value.body["message"]  # type: ignore[index]
        stranger = openai.OpenAI(base_url=server.url + "/v1", api_key="no", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.responses.create(model="fake", input=HI)
        not_json = httpx.post(
            server.url + "/v1/responses", headers={"authorization": "Bearer sekrit"}, content=b"{"
        )
        assert not_json.status_code == 400 and "error" in not_json.json()
        # a client that leaves mid-stream frees its sequence
        long = {"input": HI, "max_output_tokens": 900, "stream": True, "temperature": 0}
        key = {"authorization": "Bearer sekrit"}
        url = server.url + "/v1/responses"
        assert leave_mid_stream(ctx, url, long, key) == "response.created"
    assert_idle(ctx)


def test_bad_metadata_over_http_is_a_400_naming_it_before_any_generation() -> None:
    """Regression (issue 36 item 7): ``metadata: [1, 2]`` was a 500, after the generation
    had run."""
    import httpx

    from llamax.server import BackgroundServer, create_app

    with make("Hello there!", autostart=True) as ctx, BackgroundServer(create_app(ctx)) as server:
        bad = [
            ("metadata", [1, 2]),
            ("metadata", {"k": "v" * 513}),
            ("metadata", {str(i): "v" for i in range(17)}),
            ("user", 7),
        ]
        for field, value in bad:
            body = {"input": HI, "max_output_tokens": 8, field: value}
            reply = httpx.post(server.url + "/v1/responses", json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == field and error["type"] == "invalid_request_error"
        assert ctx.stats().num_steps == 0  # nothing reached the engine
        good = httpx.post(server.url + "/v1/responses", json={"input": HI, "metadata": {"k": "v"}})
        assert good.json()["metadata"] == {"k": "v"}
    assert_idle(ctx)


def test_metrics_count_the_tokens_of_messages_and_responses_streams() -> None:
    """/metrics counts what the final usage says for both flavours, cache hits included,
    whole or streamed (the prompt once, at the end)."""
    import httpx

    from llamax.server import BackgroundServer, create_app

    def counters(url: str) -> dict[str, float]:
        wanted = ("llamax_prompt_tokens_total", "llamax_generated_tokens_total",
                  "llamax_cached_prompt_tokens_total")  # fmt: skip
        values = {}
        for line in httpx.get(url + "/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                values[name] = float(value)
        return values

    with (
        make("Hello there!", autostart=True) as ctx,
        BackgroundServer(create_app(ctx)) as server,
    ):
        user = [{"role": "user", "content": HI}]
        prompt = len(ctx.chat_prompt(user))
        bodies = [
            ("/v1/messages", {"messages": user, "max_tokens": 64, "temperature": 0}),
            ("/v1/responses", {"input": HI, "max_output_tokens": 64, "temperature": 0}),
        ]
        httpx.post(server.url + bodies[0][0], json=bodies[0][1])  # the prompt, cached after
        for path, body in bodies:
            for stream in (False, True):
                before = counters(server.url)
                reply = httpx.post(server.url + path, json={**body, "stream": stream})
                assert reply.status_code == 200, reply.text
                after = counters(server.url)
                change = {name: after[name] - before.get(name, 0.0) for name in after}
                assert change["llamax_prompt_tokens_total"] == prompt, (path, stream)
                assert change["llamax_generated_tokens_total"] == 12, (path, stream)
                assert change["llamax_cached_prompt_tokens_total"] > 0, (path, stream)
    assert_idle(ctx)
