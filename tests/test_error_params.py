"""Errors carry the field they are about as data (issue 58): ``InvalidRequestError.param``.

The raise sites pass ``param=`` (a top-level field, or a path into one in the API's
spelling), and the server answers it as OpenAI's ``param`` without reading the message:
no regex recovers a field from a message any more.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Any

import httpx
import pytest
from test_chat import make

import llamax
import llamax.server.errors as server_errors
from llamax.errors import (
    ContextLengthError,
    InvalidMessageError,
    InvalidParameterError,
    InvalidRequestError,
    NotFoundError,
)
from llamax.server import create_app
from llamax.server.errors import from_exception, param_in
from llamax.testing import assert_idle

HI = [{"role": "user", "content": "Hi!"}]


# ---------------------------------------------------------------------- the attribute
@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("top_p must be in (0, 1], got 0", param="top_p"),
        InvalidParameterError("x is bad", param="response_format.json_schema"),
        NotFoundError("previous_response_id: nope", param="previous_response_id"),
        InvalidMessageError("bad message", index=2, field="role", param="messages"),
        ContextLengthError("too long", num_prompt_tokens=9, n_ctx=8, param="prompt"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_param_is_an_attribute_and_the_message_is_unchanged(error: InvalidRequestError) -> None:
    message = error.args[0]
    assert str(error) == message and error.args == (message,)
    assert isinstance(error.param, str)
    copy = pickle.loads(pickle.dumps(error))  # ContextLengthError did not unpickle before
    assert (type(copy), str(copy), copy.param) == (type(error), message, error.param)
    assert copy.__dict__ == error.__dict__  # the counts, index and field come back too


def test_param_defaults_to_none() -> None:
    assert InvalidRequestError("no field").param is None
    assert InvalidParameterError("no field").param is None
    assert InvalidMessageError("no field", index=0).param is None


# ---------------------------------------------------------------------- the raise sites
SAMPLING: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": 2**70}, "seed"),  # refused before any check converts it
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 1025}, "stop"),  # "stop may hold at most ..."
    ({"stop": ["a" * 65_537]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: "x"}}, "logit_bias"),
    ({"lora": {"": 1.0}}, "lora"),
    ({"lora": {"a": 1e9}}, "lora"),
    ({"speculative": "yes"}, "speculative"),
    ({"keep_prefix": "yes"}, "keep_prefix"),
    ({"grammar": "root ::= x", "json_schema": {}}, "json_schema"),  # not its first word
    ({"logprobs_after_sampling": True}, "logprobs_after_sampling"),
]


@pytest.mark.parametrize(("options", "param"), SAMPLING)
def test_sampling_params_name_the_field(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        llamax.SamplingParams(**options)
    assert caught.value.param == param, str(caught.value)


@pytest.mark.parametrize(
    ("make_it", "param"),
    [
        (lambda: llamax.ContextConfig("m.gguf", n_ctx=8), "n_ctx"),
        (lambda: llamax.ContextConfig("m.gguf", n_seq_max=0), "n_seq_max"),
        (lambda: llamax.ContextConfig("m.gguf", n_batch=2, n_seq_max=4), "n_batch"),
        (lambda: llamax.ContextConfig("m.gguf", kv_layout="sideways"), "kv_layout"),
        (lambda: llamax.PromptLookup(max_draft=0), "max_draft"),
        (lambda: llamax.PromptLookup(ngram_min=3, ngram_max=2), "ngram_max"),
    ],
)
def test_configs_name_the_field(make_it: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        make_it()
    assert caught.value.param == param, str(caught.value)


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
CHAT: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": [1]}, "stop"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": "{}"}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema"),
    ({"tools": []}, "tools"),
    ({"tools": "weather"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "retrieval"}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "grammar": "root ::= x"}, "tools"),
    ({"truncate": "sometimes"}, "truncate"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
    ({"reasoning_format": "xml"}, "reasoning_format"),
    ({"parse_special_in_content": "yes"}, "parse_special_in_content"),
    ({"speculative": {"draft": 4}}, "speculative"),
    ({"speculative": {"max_draft": 0}}, "speculative.max_draft"),  # PromptLookup's message
    ({"lora": [{"id": 0, "name": "a"}]}, "lora[0]"),
    ({"lora": 3}, "lora"),
    # OpenAI's name: SamplingParams' check on its ``logprobs`` answered "logprobs" before
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "param"), CHAT)
def test_chat_options_name_the_field(options: dict[str, Any], param: str) -> None:
    """Through the public API (``ctx.chat_completion`` on the fake backend): each bad
    option is refused before anything is queued, with its field (or path) as ``param``."""
    with make() as ctx:
        with pytest.raises(InvalidRequestError) as caught:
            ctx.chat_completion(HI, **options)
        assert caught.value.param == param, str(caught.value)
        assert_idle(ctx)


# ---------------------------------------------------------------------- the server's mapping
def test_no_regex_recovers_a_param_from_a_message() -> None:
    """The server answers the error's ``param``, whatever its message says."""
    assert not hasattr(server_errors, "_param_named_in") and not hasattr(server_errors, "_FIELD")
    fields = frozenset({"top_p", "tools", "stop"})
    named_by_message_only = InvalidParameterError("top_p must be in (0, 1], got 0")
    assert from_exception(named_by_message_only, fields).param is None
    named_by_data_only = InvalidParameterError("must be in (0, 1], got 0", param="top_p")
    assert from_exception(named_by_data_only, fields).param == "top_p"
    missing = NotFoundError("no such thing", param="tools")
    assert (from_exception(missing, fields).status, from_exception(missing, fields).param) == (
        404,
        "tools",
    )


@pytest.mark.parametrize(
    ("param", "expected"),
    [
        ("top_p", "top_p"),
        ("tools[0].function.name", "tools[0].function.name"),
        ("response_format.json_schema", None),  # response_format is not a field here
        ("stop_token_ids", None),  # a SamplingParams name this route's request does not have
        (None, None),
    ],
)
def test_a_param_is_answered_only_when_it_is_a_field_of_the_request(
    param: str | None, expected: str | None
) -> None:
    fields = frozenset({"top_p", "tools", "stop"})
    assert param_in(InvalidParameterError("bad", param=param), fields) == expected


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            raw = json.dumps(body).encode()  # ASCII: a lone surrogate goes as its escape
            return await client.post(
                path, content=raw, headers={"content-type": "application/json"}
            )

    return asyncio.run(go())


EMPTY_RANGE = {"type": "integer", "minimum": 5, "maximum": 1}
"""A schema no integer meets: its grammar cannot be built (a ``GrammarError``)."""
DEEP_GRAMMAR = "root ::= " + "(" * 300 + '"a"' + ")" * 300
"""A grammar nested past llamax's limit (refused before llama.cpp's parser sees it)."""

HTTP: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": HI, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "yaml"}},
     "response_format.type"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]},
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER], "tool_choice": "sometimes"},
     "tool_choice"),
    # the message begins "PromptLookup.max_draft must be ...": no field name to read back
    ("/v1/completions", {"prompt": "Hi", "speculative": {"max_draft": 0}},
     "speculative.max_draft"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 3.5}, "logprobs"),
    # the message begins "input[0]: role must be ...": the path names the field within
    ("/v1/responses", {"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    # a malformed message (a lone surrogate no tokenizer can take) is about the conversation:
    # on the Responses API that is ``input`` (it answered ``messages`` before)
    ("/v1/responses", {"input": [{"role": "user", "content": "\ud800"}]}, "input"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages"),
    # a grammar refused at submission names the field it came from (it said "grammar" for all)
    ("/v1/chat/completions", {"messages": HI, "grammar": DEEP_GRAMMAR}, "grammar"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema",
     "json_schema": {"name": "n", "schema": EMPTY_RANGE}}}, "response_format"),
    ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_schema",
     "json_schema": {"name": "n", "schema": EMPTY_RANGE}}}, "response_format"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n",
     "schema": EMPTY_RANGE}}}, "text"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), HTTP)
def test_the_openai_error_body_names_the_field(path: str, body: dict[str, Any], param: str) -> None:
    with make() as ctx:
        reply = _post(create_app(ctx), path, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), error
        assert ctx.stats().num_steps == 0  # refused before anything ran


def test_anthropic_errors_keep_their_shape() -> None:
    """Anthropic's error body has no ``param``: the attribute does not leak into it."""
    with make() as ctx:
        body = {"model": "m", "max_tokens": 8, "messages": HI, "temperature": 3}
        reply = _post(create_app(ctx), "/v1/messages", body)
        assert reply.status_code == 400, reply.text
        assert reply.json() == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "temperature must be in [0, 1], got 3",
            },
        }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "Hi", "n_probs": -1}, "n_probs must be None or an int in [0, 20], got -1"),
        ({"prompt": "Hi", "top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"prompt": "Hi", "grammar": "root ::= x", "json_schema": {}},
         "grammar and json_schema cannot both be set"),
    ],
)  # fmt: skip
def test_llama_server_errors_keep_their_shape(body: dict[str, Any], message: str) -> None:
    """llama-server's body has no ``param``; a field is still named as the client gave it
    (``n_probs``, not llamax's ``logprobs``), found from the error's ``param``."""
    with make() as ctx:
        reply = _post(create_app(ctx), "/completion", body)
        assert reply.status_code == 400, reply.text
        assert reply.json() == {
            "error": {"code": 400, "message": message, "type": "invalid_request_error"}
        }
