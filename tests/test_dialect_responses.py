"""The Responses API's request codec (``llamax.dialects.responses.parse_create``), pure: a
body and a store in, the call out, or the error the server answers. The errors and
mappings are pinned as the parse gave them before it moved out of ``llamax.openai`` (a
differential check over random bodies found no difference)."""

from __future__ import annotations

from typing import Any

import pytest
from test_chat_images import data_url

from llamax import Image, InvalidParameterError, InvalidRequestError, NotFoundError
from llamax.dialects.openai import RESPONSES
from llamax.dialects.responses import parse_create
from llamax.openai import ResponseStore
from llamax.server.errors import from_exception

FIELDS = frozenset(f.name for f in RESPONSES)
LOGPROBS = "message.output_text.logprobs"


def image(**extra: Any) -> dict[str, Any]:
    return {"input": [{"role": "user", "content": [{"type": "input_image", **extra}]}]}


ERRORS: list[tuple[Any, type[Exception], str | None, str]] = [
    (5, InvalidRequestError, None, "a responses request must be an object"),
    ({"input": "hi", "frobnicate": 1}, InvalidRequestError, "frobnicate",
     "responses: unsupported field(s): frobnicate"),
    ({"input": "hi", "background": True}, InvalidParameterError, "background",
     "background is not supported: background mode is not supported (false is accepted)"),
    ({"input": "hi", "stream": "no"}, InvalidParameterError, "stream",
     "stream must be a boolean, got str"),
    ({"input": "hi", "store": "false"}, InvalidParameterError, "store",
     "store must be a boolean, got str"),
    ({"input": "hi", "metadata": {"k": 5}}, InvalidParameterError, "metadata",
     "metadata['k'] must be a string of at most 512 characters"),
    ({"input": "hi", "user": "u" * 300}, InvalidParameterError, "user",
     "user must be a string of at most 256 characters"),
    ({"input": "hi", "previous_response_id": 5}, InvalidParameterError, "previous_response_id",
     "previous_response_id must be a string"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, NotFoundError,
     "previous_response_id", "previous_response_id: no stored response has id 'resp_missing' "
     "(it was never stored, was deleted, or the store evicted it)"),
    ({"input": []}, InvalidRequestError, "input",
     "input must be a string or a non-empty list of items"),
    ({"input": [5]}, InvalidRequestError, "input[0]", "input[0] must be an object"),
    ({"input": [{"role": "tool", "content": "x"}]}, InvalidRequestError, "input[0].role",
     "input[0]: role must be user, assistant, system or developer"),
    ({"input": [{"type": "function_call", "call_id": "c1"}]}, InvalidRequestError, "input[0]",
     "input[0]: a function_call needs a call_id and a name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     InvalidRequestError, "input[0].arguments", "input[0]: arguments must be a JSON string"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, InvalidRequestError,
     "input[0].call_id", "input[0]: a function_call_output needs a call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, InvalidRequestError, "input[0].type",
     "input[0]: unsupported input item type 'item_reference'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     InvalidRequestError, "input[0].content[0]",
     "input[0].content[0]: unsupported content part 'input_file' (text only)"),
    ({"input": [{"role": "user", "content": 5}]}, InvalidRequestError, "input[0]",
     "input[0]: content must be a string or a list of parts"),
    (image(image_url="https://x/y.png"), InvalidRequestError, "input[0].content[0].image_url",
     "input[0].content[0].image_url: remote image URLs are not fetched here; send a data: URL "
     "(llamax serve fetches them with --allow-image-urls)"),
    (image(file_id="file_1"), InvalidRequestError, "input[0].content[0].file_id",
     "input[0].content[0]: input_image by file_id is not supported (llamax stores no files); "
     "send image_url as a data: URL"),
    (image(image_url="data:,", detail="max"), InvalidParameterError,
     "input[0].content[0].detail",
     "input[0].content[0].detail must be 'auto', 'low' or 'high', got 'max'"),
    (image(image_url="data:,", x=1), InvalidRequestError, "input[0].content[0]",
     "input[0].content[0]: input_image has unknown field 'x'"),
    ({"input": "hi", "instructions": 5}, InvalidParameterError, "instructions",
     "instructions must be a string"),
    ({"input": "hi", "max_output_tokens": 0}, InvalidParameterError, "max_output_tokens",
     "max_output_tokens must be a positive integer: 0"),
    ({"input": "hi", "temperature": 2.5}, InvalidParameterError, "temperature",
     "temperature must be in [0, 2], got 2.5"),
    ({"input": "hi", "tools": "x"}, InvalidRequestError, "tools", "tools must be a list"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, InvalidRequestError, "tools",
     "tools: only function tools are supported, not 'web_search'"),
    ({"input": "hi", "tools": [{"type": "function"}]}, InvalidRequestError, "tools",
     "tools: a function tool needs a 'name'"),
    ({"input": "hi", "tool_choice": "any"}, InvalidParameterError, "tool_choice",
     "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}"),
    ({"input": "hi", "text": "json"}, InvalidParameterError, "text",
     "text must be an object with a 'format'"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, InvalidParameterError,
     "text.format", "text.format json_schema needs a 'schema' object"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, InvalidParameterError,
     "text.format.type",
     "text.format type must be 'text', 'json_object' or 'json_schema', got 'xml'"),
    ({"input": "hi", "reasoning": "high"}, InvalidParameterError, "reasoning",
     "reasoning must be an object"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, InvalidParameterError,
     "reasoning.effort", "reasoning.effort is not an effort: 'max'"),
    ({"input": "hi", "truncation": "oldest"}, InvalidParameterError, "truncation",
     "truncation must be 'auto' or 'disabled'"),
    ({"input": "hi", "include": [LOGPROBS]}, InvalidParameterError, "include",
     f"include: {LOGPROBS} is not supported on /v1/responses (use /v1/chat/completions "
     "with logprobs)"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "kind", "param", "message"), ERRORS)
def test_a_bad_request_is_refused_naming_its_field(
    body: Any, kind: type[Exception], param: str | None, message: str
) -> None:
    with pytest.raises(kind) as caught:
        parse_create(body, ResponseStore())
    assert type(caught.value) is kind and str(caught.value) == message
    assert getattr(caught.value, "param", None) == param
    error = from_exception(caught.value, FIELDS, "input")  # the server's answer
    assert error.status == (404 if kind is NotFoundError else 400)
    assert error.param in (param, None)  # a field's name, or a path into one


def test_a_follow_up_reads_the_store_and_maps_every_field() -> None:
    store = ResponseStore()
    earlier = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    store.put({"id": "resp_a", "output": [{"type": "message", "id": "m"}]}, earlier,
              [{"id": "msg_in0", "type": "message"}])  # fmt: skip
    weather = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {
        "model": "mine",
        "previous_response_id": "resp_a",
        "instructions": "be brief",
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "f"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "reasoning", "summary": []},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look "},
                    {"type": "input_image", "image_url": data_url(1)},
                ],
            },
        ],
        "tools": [weather],
        "tool_choice": {"type": "function", "name": "f"},
        "max_output_tokens": 7,
        "temperature": 0.5,
        "reasoning": {"effort": "minimal"},
        "metadata": {"k": "v"},
        "store": False,
        "stream": True,
        "include": [],  # a hint: not in the body the reply echoes
    }
    parsed = parse_create(body, store)
    messages = parsed.call.messages
    assert messages[:3] == ({"role": "system", "content": "be brief"}, *earlier)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert messages[3] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    text, picture = messages[5]["content"]
    assert text == {"type": "text", "text": "look "} and isinstance(picture, Image)
    assert parsed.conversation == messages[1:] and len(messages) == 6
    assert parsed.earlier_items == ({"id": "msg_in0", "type": "message"},
                                    {"type": "message", "id": "m"})  # fmt: skip
    assert parsed.call.model == "mine" and parsed.call.enable_thinking is False
    assert parsed.call.params.max_tokens == 7 and parsed.call.params.temperature == 0.5
    assert parsed.call.tools.is_active
    assert (parsed.stream, parsed.store, parsed.max_output_tokens) == (True, False, 7)
    assert (parsed.previous_response_id, parsed.metadata) == ("resp_a", {"k": "v"})
    assert "include" not in parsed.body and parsed.body["input"] is body["input"]


def test_without_a_store_a_previous_response_is_not_found() -> None:
    with pytest.raises(NotFoundError, match="cannot be found: no response store"):
        parse_create({"input": "hi", "previous_response_id": "resp_a"}, None)
    plain = parse_create({"input": "hi", "text": {"format": {"type": "json_object"}}})
    assert plain.call.messages == ({"role": "user", "content": "hi"},) and plain.store
    assert not plain.stream and plain.max_output_tokens is None and not plain.earlier_items
