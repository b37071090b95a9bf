"""The OpenAI chat and text codec (:mod:`llamax.dialects.openai_parse`) answers as the
server's pydantic request models did: these bodies, and what those models made of them
(the call options, or the 400's code, param and message), were recorded from the models
before they were removed. A throwaway differential (old parse, ``options()`` and
``ChatCall.of`` against the codec) found no difference over 1,475,000 random and
adversarial chat, text and ``/apply-template`` bodies."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from llamax.chat import ChatCall, TextCall
from llamax.dialects.json_types import FieldError
from llamax.dialects.openai_parse import chat_options, parse_chat, parse_text

HI = [{"role": "user", "content": "hi"}]

CHAT_CASES = [
    (
        {
            "messages": HI,
            "temperature": 1,
            "max_completion_tokens": 5,
            "reasoning_effort": "minimal",
        },
        {"temperature": 1.0, "enable_thinking": False, "max_tokens": 5},
    ),
    (
        {
            "messages": HI,
            "chat_template_kwargs": {"enable_thinking": True},
            "reasoning_effort": "none",
        },
        {"enable_thinking": True},
    ),
    (
        {
            "messages": HI,
            "stop": "x",
            "n": 2,
            "seed": 3,
            "logit_bias": {"5": 1},
            "logprobs": True,
            "top_logprobs": 2,
        },
        {
            "logit_bias": {"5": 1.0},
            "seed": 3,
            "stop": "x",
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ({"messages": HI, "parallel_tool_calls": False, "store": False, "metadata": {"a": "b"}}, {}),
    (
        {
            "messages": HI,
            "speculative": {"max_draft": 4},
            "lora": {"a.gguf": 1},
            "prompt_cache_key": "k",
        },
        {"speculative": {"max_draft": 4}, "lora": {"a.gguf": 1.0}, "prompt_cache_key": "k"},
    ),
    (
        {
            "messages": HI,
            "stream": True,
            "stream_options": {"include_usage": True},
            "model": "m",
            "user": "u",
        },
        {},
    ),
    (
        {"messages": HI, "temperature": 3},
        ("invalid_value", "temperature", "temperature must be in [0, 2], got 3.0"),
    ),
    (
        {"messages": HI, "temperature": 2.5, "top_p": "x"},
        ("invalid_type", "top_p", "top_p: Input should be a valid number"),
    ),
    (
        {"messages": HI, "stop": ["s"] * 401},
        ("invalid_value", "stop", "stop has 401 strings; at most 400 are allowed"),
    ),
    (
        {"messages": HI, "max_tokens": 3, "max_completion_tokens": 4},
        (
            "invalid_value",
            "max_completion_tokens",
            "give max_tokens or max_completion_tokens, not both",
        ),
    ),
    (
        {"messages": HI, "chat_template_kwargs": {"x": 1}},
        (
            "invalid_value",
            "chat_template_kwargs",
            "chat_template_kwargs takes only enable_thinking (a boolean); got x",
        ),
    ),
    (
        {"messages": HI, "chat_template_kwargs": {"enable_thinking": "yes"}},
        (
            "invalid_value",
            "chat_template_kwargs",
            "chat_template_kwargs takes only enable_thinking (a boolean)",
        ),
    ),
    (
        {"messages": HI, "temperature": True},
        ("invalid_type", "temperature", "temperature: Input should be a valid number"),
    ),
    (
        {"messages": HI, "max_tokens": 1.0},
        ("invalid_type", "max_tokens", "max_tokens: Input should be a valid integer"),
    ),
    ({"messages": HI, "max_tokens": 10**400}, {"max_tokens": 10**400}),
    (
        {"messages": HI, "temperature": 10**400},
        ("invalid_type", "temperature", "temperature: Input should be a valid number"),
    ),
    (
        {"messages": HI, "stop": ["a", 3]},
        ("invalid_type", "stop", "stop.str: Input should be a valid string"),
    ),
    (
        {"messages": HI, "speculative": {"max_draft": "8"}},
        ("invalid_type", "speculative", "speculative.bool: Input should be a valid boolean"),
    ),
    (
        {"messages": HI, "lora": [{"path": True}]},
        (
            "invalid_type",
            "lora",
            "lora.list[dict[str,union[str,int,float]]].0.path.str: Input should be a valid string",
        ),
    ),
    (
        {"messages": HI, "lora": {"a": "x"}},
        (
            "invalid_type",
            "lora",
            "lora.list[dict[str,union[str,int,float]]]: Input should be a valid list",
        ),
    ),
    (
        {"messages": HI, "truncate": 1},
        ("invalid_type", "truncate", "truncate: Input should be 'none' or 'oldest_messages'"),
    ),
    (
        {"messages": HI, "reasoning_effort": "max"},
        (
            "invalid_type",
            "reasoning_effort",
            "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high' or "
            "'xhigh'",
        ),
    ),
    (
        {"messages": HI, "prompt_cache_retention": "1h"},
        (
            "invalid_type",
            "prompt_cache_retention",
            "prompt_cache_retention: Input should be 'in_memory', '24h' or 'in-memory'",
        ),
    ),
    (
        {"messages": HI, "stream_options": 1},
        (
            "invalid_type",
            "stream_options",
            "stream_options: Input should be a valid dictionary or instance of StreamOptions",
        ),
    ),
    (
        {"messages": HI, "stream_options": {"include_usage": None}},
        (
            "invalid_type",
            "stream_options",
            "stream_options.include_usage: Input should be a valid boolean",
        ),
    ),
    (
        {"messages": HI, "stream_options": {"x": 1, "include_usage": 2}},
        ("unknown_field", "stream_options", "unknown field 'stream_options.x'"),
    ),
    (
        {"messages": HI, "temperature": "x", "stream_options": {"y": 1}, "zzz": 1},
        ("unknown_field", "stream_options", "unknown field 'stream_options.y'"),
    ),
    (
        {"messages": HI, "tool_choice": 1},
        ("invalid_type", "tool_choice", "tool_choice.str: Input should be a valid string"),
    ),
    (
        {"messages": HI, "tools": [1]},
        ("invalid_type", "tools", "tools.0: Input should be a valid dictionary"),
    ),
    (
        {"messages": []},
        (
            "invalid_type",
            "messages",
            "messages: List should have at least 1 item after validation, not 0",
        ),
    ),
    (
        {"messages": [1]},
        ("invalid_type", "messages", "messages.0: Input should be a valid dictionary"),
    ),
    ({"messages": "hi"}, ("invalid_type", "messages", "messages: Input should be a valid list")),
    ({"messages": None}, ("invalid_type", "messages", "messages: Input should be a valid list")),
    ({}, ("missing_field", "messages", "missing field 'messages'")),
    (
        {"temperature": "x"},
        ("invalid_type", "temperature", "temperature: Input should be a valid number"),
    ),
    (
        {"messages": HI, "functions": []},
        (
            "unsupported_parameter",
            "functions",
            "functions is not supported: the deprecated function-calling shape is not "
            "supported: send tools (the reply's tool_calls replace function_call)",
        ),
    ),
    (
        {"messages": HI, "audio": {}},
        (
            "unsupported_parameter",
            "audio",
            "audio is not supported: audio output is not supported (llamax produces text)",
        ),
    ),
    (
        {"messages": HI, "store": "no"},
        ("invalid_value", "store", "store must be a boolean, got str"),
    ),
    (
        {"messages": HI, "modalities": ["audio"]},
        (
            "invalid_value",
            "modalities",
            "modalities: llamax produces text only; audio output is not supported",
        ),
    ),
    ({"messages": HI, "fair_key": "x"}, ("unknown_field", "fair_key", "unknown field 'fair_key'")),
    ({"messages": HI, "echo": True}, ("unknown_field", "echo", "unknown field 'echo'")),
]
TEXT_CASES = [
    ({"prompt": "hi"}, {"max_tokens": 16}),
    (
        {"prompt": [1, 2], "logprobs": 2, "echo": True, "suffix": "s", "max_tokens": 4},
        {"max_tokens": 4, "logprobs": 2},
    ),
    ({"prompt": "hi", "best_of": 1, "n": 1}, {"n": 1, "max_tokens": 16}),
    (
        {"prompt": "hi", "best_of": 2},
        (
            "unsupported_parameter",
            "best_of",
            "best_of is not supported: server-side best-of ranking is not supported (1 or "
            "equal to n is accepted: it changes nothing)",
        ),
    ),
    ({"prompt": 3}, ("invalid_type", "prompt", "prompt.str: Input should be a valid string")),
    (
        {"prompt": [1.5, True]},
        ("invalid_type", "prompt", "prompt.str: Input should be a valid string"),
    ),
    (
        {"prompt": "x", "logprobs": True},
        ("invalid_type", "logprobs", "logprobs: Input should be a valid integer"),
    ),
    ({"prompt": None}, ("invalid_type", "prompt", "prompt.str: Input should be a valid string")),
    ({}, ("missing_field", "prompt", "missing field 'prompt'")),
    ({"messages": HI, "prompt": "x"}, ("unknown_field", "messages", "unknown field 'messages'")),
    (
        {"prompt": "x", "max_completion_tokens": 3},
        ("unknown_field", "max_completion_tokens", "unknown field 'max_completion_tokens'"),
    ),
    (
        {"prompt": "x", "temperature": 9, "stop": ["s"] * 401},
        ("invalid_value", "temperature", "temperature must be in [0, 2], got 9.0"),
    ),
]


def _error(parse: Any, body: dict[str, Any]) -> tuple[str, str | None, str]:
    with pytest.raises(FieldError) as caught:
        parse(body)
    return caught.value.code, caught.value.param, str(caught.value)


@pytest.mark.parametrize(("body", "expected"), CHAT_CASES, ids=str)
def test_a_chat_body_is_read_as_the_models_read_it(body: dict[str, Any], expected: Any) -> None:
    if isinstance(expected, tuple):
        assert _error(chat_options, body) == expected
        assert _error(parse_chat, body) == expected
        return
    _, options = chat_options(body)
    assert options.pop("messages") == HI
    assert options == expected
    assert all(type(options[k]) is type(v) for k, v in expected.items())  # 1 became 1.0
    if expected.get("max_tokens", 0) < 10**9:
        parsed = parse_chat(body)
        call = ChatCall.of(HI, **expected, model=body.get("model"))
        assert dataclasses.replace(parsed.call, request_id="") == dataclasses.replace(
            call, request_id=""
        )
        usage = (body.get("stream_options") or {}).get("include_usage", False)
        assert (parsed.stream, parsed.include_usage) == (body.get("stream", False), usage)


@pytest.mark.parametrize(("body", "expected"), TEXT_CASES, ids=str)
def test_a_text_body_is_read_as_the_model_read_it(body: dict[str, Any], expected: Any) -> None:
    if isinstance(expected, tuple):
        assert _error(parse_text, body) == expected
        return
    parsed = parse_text(body)
    call = TextCall.of(body["prompt"], **expected)
    assert dataclasses.replace(parsed.call, request_id="") == dataclasses.replace(
        call, request_id=""
    )
    assert (parsed.echo, parsed.suffix) == (body.get("echo", False), body.get("suffix"))


def test_defaults_fill_what_the_body_leaves_unset() -> None:
    server = {"max_tokens": 33, "seed": 9}
    assert parse_text({"prompt": "x"}, defaults=server).call.params.max_tokens == 33
    assert parse_text({"prompt": "x", "max_tokens": 2}, defaults=server).call.params.max_tokens == 2
    assert parse_text({"prompt": "x"}).call.params.max_tokens == 16  # OpenAI's default
    chat = parse_chat({"messages": HI, "max_completion_tokens": 4}, defaults=server).call
    assert (chat.params.max_tokens, chat.params.seed) == (4, 9)
