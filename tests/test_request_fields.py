"""Every request field of the OpenAI and Anthropic references is honoured, a hint or refused
(issue 44): the tables pinned to the parsers and the docs, then each route over HTTP on the
fake backend with an "all fields" body written from the API references, and the real
``openai`` and ``anthropic`` clients with their optional arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_chat import make

import llamax
from llamax.anthropic import REQUEST_FIELDS
from llamax.chat import ChatCall
from llamax.dialects.anthropic import MESSAGES
from llamax.dialects.fields import SHARED_FIELDS, Support, generated_blocks, honoured
from llamax.dialects.llama import NATIVE_TABLES
from llamax.dialects.openai import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from llamax.dialects.openai_parse import CHAT_TYPES, TEXT_TYPES, parse_chat
from llamax.openai import RESPONSE_FIELDS
from llamax.server import BackgroundServer, create_app
from llamax.server.schemas import EMBEDDING_FIELDS, FIELD_TABLES
from llamax.testing import assert_idle
from llamax.tools import ToolPlan

DOCS = Path(__file__).parent.parent / "docs"
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


# --- the tables: one source, pinned to the parsers and the docs ------------------------------
@pytest.mark.parametrize(
    ("table", "fields"),
    [
        (CHAT, set(CHAT_TYPES)),
        (COMPLETIONS, set(TEXT_TYPES)),
        (EMBEDDINGS, set(EMBEDDING_FIELDS)),
        (RESPONSES, set(RESPONSE_FIELDS)),
        (MESSAGES, set(REQUEST_FIELDS)),
    ],
)
def test_the_honoured_fields_are_what_the_parser_takes(table: Any, fields: set[str]) -> None:
    names = [f.name for f in table]
    assert len(names) == len(set(names))
    assert honoured(table) == fields
    assert all(f.doc for f in table)


def test_a_row_several_routes_share_is_written_once() -> None:
    """Rows with the same name, support and doc on two routes come from one source
    (``SHARED_FIELDS``); Messages' ``service_tier`` takes Anthropic's own values."""
    seen: dict[tuple[str, Support, str], Any] = {}
    for route, table in FIELD_TABLES.items():
        for row in table:
            key = (row.name, row.support, row.doc)
            if key in seen and (route, row.name) != ("messages", "service_tier"):
                assert seen[key] is row, (route, row.name)
            seen.setdefault(key, row)
    assert set(SHARED_FIELDS) <= {f.name for t in FIELD_TABLES.values() for f in t}


def test_the_docs_field_tables_are_current() -> None:
    text = (DOCS / "server.md").read_text(encoding="utf-8")
    tables = FIELD_TABLES | NATIVE_TABLES  # llama-server's native routes' tables too
    blocks = list(generated_blocks(text, tables))
    assert len(blocks) == len(tables)
    for current, wanted in blocks:
        assert current == wanted, "a fields table is stale; run python scripts/option_tables.py"


def test_reasoning_effort_is_the_thinking_switch() -> None:
    def call(**body: Any) -> ChatCall:
        return parse_chat({"messages": HI, **body}).call

    assert call(reasoning_effort="minimal").enable_thinking is False
    assert call(reasoning_effort="high").enable_thinking is True
    assert call(reasoning_effort="none", enable_thinking=True).enable_thinking is True
    assert call(parallel_tool_calls=True).tools == ToolPlan()  # no tools: no effect


# --- over HTTP, on the fake backend ----------------------------------------------------------
@pytest.fixture
def server() -> Iterator[tuple[llamax.Context, str]]:
    with make(autostart=True) as ctx, BackgroundServer(create_app(ctx)) as running:
        yield ctx, running.url
        assert_idle(ctx)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


CHAT_ALL = {
    "model": "my-model",
    "messages": [{"role": "developer", "content": "Be brief."}, *HI],
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "logit_bias": {"50": 1},
    "logprobs": True,
    "top_logprobs": 2,
    "max_completion_tokens": 5,
    "n": 2,
    "seed": 7,
    "stop": ["zzz"],
    "temperature": 0,
    "top_p": 0.9,
    "user": "user-1",
    "store": False,
    "metadata": {"purpose": "test"},
    "prompt_cache_key": "chat-1",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "reasoning_effort": "low",
    "service_tier": "auto",
    "safety_identifier": "hash-1",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "Hello there"},
    "parallel_tool_calls": False,
    "response_format": {"type": "text"},
}


def test_chat_takes_every_reference_field(server: tuple[llamax.Context, str]) -> None:
    _, url = server
    reply = post(url, "/v1/chat/completions", CHAT_ALL)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == "my-model" and len(body["choices"]) == 2  # model, n
    for choice in body["choices"]:
        assert choice["message"]["content"] == "Hello"  # max_completion_tokens
        assert choice["finish_reason"] == "length"
        tokens = choice["logprobs"]["content"]  # logprobs, top_logprobs
        assert len(tokens) == 5 and all(len(t["top_logprobs"]) == 2 for t in tokens)
    assert body["usage"]["completion_tokens"] == 10
    streamed = {
        **CHAT_ALL,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    chunks = [
        json.loads(line[6:])
        for line in post(url, "/v1/chat/completions", streamed).text.split("\n\n")
        if line.startswith("data: {")
    ]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_completions_take_every_reference_field(server: tuple[llamax.Context, str]) -> None:
    _, url = server
    body = {
        "model": "m",
        "prompt": "abc",
        "best_of": 2,
        "echo": True,
        "frequency_penalty": 0,
        "logit_bias": {},
        "logprobs": 1,
        "max_tokens": 3,
        "n": 2,
        "presence_penalty": 0,
        "seed": 1,
        "stop": "\n\n",
        "temperature": 0,
        "top_p": 1,
        "user": "u",
        "suffix": None,
    }
    reply = post(url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    texts = [c["text"] for c in reply.json()["choices"]]
    assert texts == ["abcxxx", "abcxxx"]  # echo: the prompt, then 3 tokens
    stream = post(url, "/v1/completions", {**body, "stream": True, "n": 1, "best_of": 1})
    chunks = [
        json.loads(line[6:]) for line in stream.text.split("\n\n") if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcxxx"


def test_completions_default_to_16_tokens(server: tuple[llamax.Context, str]) -> None:
    _, url = server
    reply = post(url, "/v1/completions", {"prompt": "abc"}).json()  # the fake never stops
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["choices"][0]["finish_reason"] == "length"


def test_responses_take_every_reference_field(server: tuple[llamax.Context, str]) -> None:
    _, url = server
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
    body = {
        "model": "m",
        "input": HI,
        "instructions": "Be brief.",
        "max_output_tokens": 5,
        "temperature": 0,
        "top_p": 0.9,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {"effort": "low"},
        "truncation": "disabled",
        "store": True,
        "metadata": {"k": "v"},
        "user": "u",
        "tools": [tool],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {},
        "service_tier": "default",
        "safety_identifier": "s",
        "max_tool_calls": 3,
        "background": False,
        "top_logprobs": 0,
        "stream_options": {"include_obfuscation": False},
    }
    reply = post(url, "/v1/responses", body)
    assert reply.status_code == 200, reply.text
    response = reply.json()
    assert response["output"][-1]["content"][0]["text"] == "Hello"  # max_output_tokens
    assert response["metadata"] == {"k": "v"} and response["user"] == "u"
    assert httpx.get(f"{url}/v1/responses/{response['id']}").status_code == 200  # store
    del body["tools"], body["tool_choice"]  # parallel_tool_calls alone changes nothing
    assert post(url, "/v1/responses", {**body, "stream": True}).status_code == 200


def test_messages_take_every_reference_field(server: tuple[llamax.Context, str]) -> None:
    _, url = server
    document = {
        "type": "document",
        "title": "Notes",
        "source": {"type": "text", "media_type": "text/plain", "data": "Paris is sunny."},
        "cache_control": {"type": "ephemeral"},
    }
    turn = {"role": "user", "content": [document, {"type": "text", "text": "Weather?"}]}
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [turn],
        "system": "Be brief.",
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["zzz"],
        "metadata": {"user_id": "u"},
        "thinking": {"type": "adaptive"},
        "tools": [WEATHER],
        "tool_choice": {"type": "auto"},
        "cache_control": {"type": "ephemeral"},
        "service_tier": "auto",
        "inference_geo": "us",
        "speed": "standard",
        "output_config": {"effort": "low"},
        "user_profile_id": "p",
        "diagnostics": {"previous_message_id": "msg_1"},
    }
    reply = post(url, "/v1/messages", body)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 5
    without = {**body, "messages": [{"role": "user", "content": "Weather?"}]}
    plain = post(url, "/v1/messages", without).json()
    added = message["usage"]["input_tokens"] - plain["usage"]["input_tokens"]
    assert added >= len("Notes\nParis is sunny.")  # the document reached the prompt (bytes)
    stream = post(url, "/v1/messages", {**body, "stream": True})
    assert stream.status_code == 200 and "message_stop" in stream.text
    counted = post(
        url,
        "/v1/messages/count_tokens",
        {
            "messages": [turn],
            "system": "Be brief.",
            "cache_control": {"type": "ephemeral"},
            "thinking": {"type": "adaptive"},
        },
    )
    assert counted.status_code == 200, counted.text


# --- refusals: named, in each route's error shape ---------------------------------------------
REFUSED = [
    ("/v1/chat/completions", {"messages": HI}, name, value)
    for name, value in [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("web_search_options", {}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("moderation", {"model": "omni-moderation-latest"}),
    ]
] + [
    ("/v1/completions", {"prompt": "a"}, "best_of", 3),
    ("/v1/responses", {"input": "a"}, "background", True),
    ("/v1/responses", {"input": "a"}, "conversation", "conv_1"),
    ("/v1/responses", {"input": "a"}, "context_management", [{"type": "compaction"}]),
    ("/v1/responses", {"input": "a"}, "prompt", {"id": "pmpt_1"}),
    ("/v1/responses", {"input": "a"}, "top_logprobs", 3),
]


@pytest.mark.parametrize(("path", "body", "name", "value"), REFUSED)
def test_a_refused_field_is_a_400_naming_it(
    server: tuple[llamax.Context, str], path: str, body: dict[str, Any], name: str, value: Any
) -> None:
    limit = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 2}
    reply = post(server[1], path, {**body, **limit, name: value})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == name and error["message"].startswith(f"{name} is not supported: ")


BAD_VALUES = [
    ("/v1/chat/completions", {"messages": HI}, "modalities", ["text", "audio"], "audio"),
    ("/v1/chat/completions", {"messages": HI}, "store", "no", "boolean"),
    ("/v1/chat/completions", {"messages": HI}, "metadata", {"k": 3}, "metadata"),
    ("/v1/chat/completions", {"messages": HI}, "service_tier", "gold", "one of"),
    ("/v1/chat/completions", {"messages": HI}, "temperature", 2.5, "[0, 2]"),
    ("/v1/chat/completions", {"messages": HI}, "temprature", 1, "unknown field"),
    ("/v1/completions", {"prompt": "a"}, "echo", "yes", "echo"),
    ("/v1/responses", {"input": "a"}, "include", ["message.output_text.logprobs"], "include"),
    ("/v1/responses", {"input": "a"}, "temperature", 2.5, "[0, 2]"),
]


@pytest.mark.parametrize(("path", "body", "name", "value", "says"), BAD_VALUES)
def test_a_bad_value_is_a_400_naming_the_field(
    server: tuple[llamax.Context, str],
    path: str,
    body: dict[str, Any],
    name: str,
    value: Any,
    says: str,
) -> None:
    limit = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 2}
    reply = post(server[1], path, {**body, **limit, name: value})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == name and says in error["message"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"container": "c"}, "container is not supported"),
        ({"mcp_servers": [{"type": "url", "url": "x", "name": "x"}]}, "mcp_servers"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        ({"temperature": 1.5}, "temperature must be in [0, 1]"),
        ({"speed": "ludicrous"}, "speed"),
        ({"temprature": 1}, "temprature"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "url", "url": "https://x/y.pdf"},
                            }
                        ],
                    }
                ]
            },
            "only text documents",
        ),
    ],
)
def test_messages_refusals_are_anthropic_400s(
    server: tuple[llamax.Context, str], extra: dict[str, Any], says: str
) -> None:
    reply = post(server[1], "/v1/messages", {"messages": HI, "max_tokens": 2, **extra})
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and says in body["error"]["message"]


def test_anthropic_tool_use_ids_start_with_toolu() -> None:
    with make(f"Let me look.\n{CALL}", autostart=True) as ctx:
        with BackgroundServer(create_app(ctx)) as running:
            body = {"messages": HI, "max_tokens": 200, "tools": [WEATHER], "temperature": 0}
            message = post(running.url, "/v1/messages", body).json()
            use = message["content"][-1]
            assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
            stream = post(running.url, "/v1/messages", {**body, "stream": True}).text
            starts = [
                json.loads(line[6:])
                for line in stream.split("\n")
                if line.startswith("data: ") and "content_block_start" in line
            ]
            assert starts[-1]["content_block"]["id"].startswith("toolu_")
        assert_idle(ctx)


# --- the real clients, with their optional arguments -------------------------------------------
def test_the_openai_client_with_optional_arguments(server: tuple[llamax.Context, str]) -> None:
    import openai

    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="-", max_retries=0)
    optional: dict[str, Any] = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "logit_bias": {"50": 1},
        "logprobs": True,
        "top_logprobs": 1,
        "max_completion_tokens": 4,
        "n": 1,
        "seed": 3,
        "stop": ["zzz"],
        "temperature": 0,
        "top_p": 0.9,
        "user": "u",
        "store": True,
        "metadata": {"k": "v"},
        "prompt_cache_key": "k",
        "prompt_cache_retention": "in_memory",
        "reasoning_effort": "medium",
        "service_tier": "auto",
        "safety_identifier": "s",
        "verbosity": "medium",
        "modalities": ["text"],
        "parallel_tool_calls": True,
        "prediction": {"type": "content", "content": "Hello"},
        "response_format": {"type": "text"},
    }
    reply = client.chat.completions.create(model="m", messages=HI, **optional)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "Hell" and reply.model == "m"
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=HI,
            stream=True,
            **optional,  # type: ignore[arg-type]
            stream_options={"include_usage": True, "include_obfuscation": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hell"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    text = client.completions.create(
        model="m", prompt="abc", echo=True, best_of=1, max_tokens=2, temperature=0, suffix=None
    )
    assert text.choices[0].text == "abcxx"
    response = client.responses.create(
        model="m",
        input="Hi!",
        max_output_tokens=4,
        temperature=0,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        service_tier="auto",
        safety_identifier="s",
        max_tool_calls=2,
        parallel_tool_calls=True,
        background=False,
        store=False,
        metadata={"k": "v"},
        text={"verbosity": "low"},
        reasoning={"effort": "minimal"},
    )
    assert response.output_text == "Hell"
    with pytest.raises(openai.BadRequestError, match="web_search_options is not supported"):
        client.chat.completions.create(model="m", messages=HI, web_search_options={})  # type: ignore[arg-type]


def test_the_anthropic_client_with_optional_arguments(server: tuple[llamax.Context, str]) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server[1], api_key="-", max_retries=0)
    optional: dict[str, Any] = {
        "system": "Be brief.",
        "stop_sequences": ["zzz"],
        "metadata": {"user_id": "u"},
        "thinking": {"type": "adaptive"},
        "tools": [WEATHER],
        "tool_choice": {"type": "auto"},
        "cache_control": {"type": "ephemeral"},
        "service_tier": "auto",
        "inference_geo": "us",
        "output_config": {"effort": "medium"},
        "speed": "standard",
        "extra_body": {"temperature": 0, "top_k": 40, "top_p": 0.9},
    }
    message = client.messages.create(model="m", max_tokens=4, messages=HI, **optional)  # type: ignore[arg-type]
    assert message.content[0].text == "Hell"  # type: ignore[union-attr]
    with client.messages.stream(model="m", max_tokens=4, messages=HI, **optional) as stream:  # type: ignore[arg-type]
        assert stream.get_final_message().usage.output_tokens == 4
    with pytest.raises(anthropic.BadRequestError, match="container is not supported"):
        client.messages.create(model="m", max_tokens=4, messages=HI, container="c")  # type: ignore[arg-type]


# --- embeddings' dimensions ------------------------------------------------------------------
def test_dimensions_truncate_and_renormalise() -> None:
    from llamax.server.errors import APIError
    from llamax.server.routes import _shortened

    vectors = [np.array([3.0, 4.0, 12.0], dtype=np.float32)]
    (short,) = _shortened(vectors, 2)
    assert np.allclose(short, [0.6, 0.8])
    assert _shortened(vectors, None) is vectors
    with pytest.raises(APIError, match="dimensions must be at most 3"):
        _shortened(vectors, 4)
    assert all(f.support is not Support.REFUSED for f in EMBEDDINGS)


# --- schemas with bounds: integer ranges enforced as llama.cpp does ---------------------------
def _gbnf_regex(expression: str) -> str:
    """The range rules' GBNF (literals, classes, groups, ``|``, ``{m,n}``) as a Python regex."""
    import re

    out, i = [], 0
    while i < len(expression):
        c = expression[i]
        if c == '"':
            end = expression.index('"', i + 1)
            out.append(re.escape(expression[i + 1 : end]))
            i = end + 1
            continue
        if c == "[":
            end = expression.index("]", i)
            out.append(expression[i : end + 1])
            i = end + 1
            continue
        if c != " ":
            out.append(c)
        i += 1
    return "".join(out)


@pytest.mark.parametrize(
    ("low", "high"),
    [
        (18, 130),
        (0, 9),
        (-15, 7),
        (-120, -3),
        (1, 1),
        (5, None),
        (0, None),
        (-7, None),
        (123, None),
        (None, 42),
        (None, -11),
        (None, 0),
        (7, 1000),
    ],
)
def test_integer_ranges_match_exactly_the_integers_in_range(
    low: int | None, high: int | None
) -> None:
    import re

    from llamax.grammar_ranges import int_range_rule

    pattern = re.compile(_gbnf_regex(int_range_rule(low, high)))
    for n in range(-1200, 1200):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, (n, low, high)
    assert not pattern.fullmatch("007") and not pattern.fullmatch("+5")


def test_bounded_schemas_are_taken_and_integer_bounds_enforced() -> None:
    from llamax.grammar import integer_bounds, schema_to_gbnf

    age = {"type": "integer", "minimum": 18, "exclusiveMaximum": 130}
    price = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e6, "multipleOf": 0.01}
    grammar = schema_to_gbnf(
        json.dumps({"type": "object", "properties": {"age": age, "price": price}})
    )
    assert "age ::= (" in grammar and "[1] ([8-9])" in grammar  # 18..129, not any integer
    assert "price ::= (" in grammar and "price-1 ::= " in grammar  # the number's own rules
    assert integer_bounds({"minimum": 0.5, "maximum": 9.5}) == (1, 9)
    with pytest.raises(llamax.GrammarError, match="no integer"):
        integer_bounds({"exclusiveMinimum": 2, "exclusiveMaximum": 3})


def test_a_pydantic_tool_with_bounds_and_a_malformed_one_over_http(
    server: tuple[llamax.Context, str],
) -> None:
    _, url = server
    bounded = {
        "type": "function",
        "function": {
            "name": "set_age",
            "parameters": {
                "type": "object",
                "properties": {
                    "age": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 150},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                },
                "required": ["age"],
            },
        },
    }
    ok = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "tools": [bounded]})
    assert ok.status_code == 200, ok.text
    malformed = {
        "type": "function",
        "function": {"name": "foo", "parameters": {"type": "object", "properties": {"bar": "baz"}}},
    }
    bad = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "tools": [malformed]})
    assert bad.status_code == 400
    message = bad.json()["error"]["message"]
    assert "'foo'" in message and "properties.bar must be a schema" in message
    assert "attribute" not in message
    anthropic_bad = post(
        url,
        "/v1/messages",
        {
            "messages": HI,
            "max_tokens": 3,
            "tools": [
                {"name": "foo", "input_schema": {"type": "object", "properties": {"bar": "baz"}}}
            ],
        },
    )
    assert anthropic_bad.status_code == 400
    assert "properties.bar must be a schema" in anthropic_bad.json()["error"]["message"]


def test_a_multiple_past_the_grammar_limit_is_a_400_naming_the_tool_and_field(
    server: tuple[llamax.Context, str],
) -> None:
    _, url = server
    steps = {"type": "object", "properties": {"step": {"type": "number", "multipleOf": 999983}}}
    tools = [{"type": "function", "function": {"name": "walk", "parameters": steps}}]
    bad = post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "tools": tools})
    assert bad.status_code == 400
    message = bad.json()["error"]["message"]
    assert "'walk'" in message and "field 'step'" in message and "2048 rules" in message
    fits = {"type": "number", "multipleOf": 5, "exclusiveMinimum": 0, "maximum": 100}
    ok = post(
        url,
        "/v1/chat/completions",
        {
            "messages": HI,
            "max_tokens": 3,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": {"type": "object", "properties": {"n": fits}},
                },
            },
        },
    )
    assert ok.status_code == 200, ok.text


def test_an_unknown_response_id_is_a_404_about_the_id(server: tuple[llamax.Context, str]) -> None:
    reply = httpx.get(server[1] + "/v1/responses/resp_nope")
    error = reply.json()["error"]
    assert reply.status_code == 404 and error["param"] is None
    assert error["message"].startswith("no stored response has id 'resp_nope'")


def test_an_anthropic_assistant_prefill_is_continued(server: tuple[llamax.Context, str]) -> None:
    turns = [*HI, {"role": "assistant", "content": "Hel"}]
    body = {"messages": turns, "max_tokens": 20, "temperature": 0}
    message = post(server[1], "/v1/messages", body).json()
    assert message["content"] == [{"type": "text", "text": "lo there!"}]  # not "Hello there!"
    stream = post(server[1], "/v1/messages", {**body, "stream": True}).text
    deltas = [
        json.loads(line[6:])["delta"]["text"]
        for line in stream.split("\n")
        if line.startswith("data: ") and "text_delta" in line
    ]
    assert "".join(deltas) == "lo there!"


def test_a_streamed_retrieve_is_refused_not_empty(server: tuple[llamax.Context, str]) -> None:
    import openai

    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="-", max_retries=0)
    response = client.responses.create(model="m", input="Hi!", max_output_tokens=3)
    assert client.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.BadRequestError, match="stream is not supported on a retrieve"):
        list(client.responses.retrieve(response.id, stream=True))
