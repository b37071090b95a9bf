"""Tool calling without a model: validation, grammar text, prompt rendering, parsers."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta

import llamax
from llamax.templates import ChatTemplate, InvalidMessageError
from llamax.tools import (
    CALL_OPEN,
    ToolCallStreamParser,
    ToolDelta,
    ToolPlan,
    fallback_messages,
    parse_tool_calls,
    prepare_tools,
    render_tool_prompt,
    template_supports_tools,
    tool_call_grammar,
    tool_system_text,
)

DATA = Path(__file__).parent / "data"
SMOLLM2 = ChatTemplate((DATA / "smollm2_chat_template.jinja").read_text(encoding="utf-8"))
HERMES = ChatTemplate((DATA / "hermes_tools_template.jinja").read_text(encoding="utf-8"))

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"properties": {"city": {"type": "string"}}}},
}
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _function(**fields: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", **fields}}]


BAD_OPTIONS = [
    ({"tools": {"type": "function"}}, "tools must be a list"),
    ({"tools": "get_weather"}, "tools must be a list"),
    ({"tools": [None]}, r"tools\[0\] must be a dict"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, r"tools\[0\]\.type"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\]\.function must be a dict"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "unknown keys"),
    ({"tools": _function(parameter={})}, r"tools\[0\]\.function has unknown keys \['parameter'\]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, r"function\.name must match"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, r"function\.name must match"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "name must match"),
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "name must match"),
    ({"tools": [{"type": "function", "function": {}}]}, "name must match"),
    ({"tools": _function(description=3)}, "description must be a str"),
    ({"tools": _function(strict="yes")}, "strict must be a bool"),
    ({"tools": _function(parameters=[])}, "parameters must be a JSON schema dict"),
    ({"tools": _function(parameters={"type": "array"})}, "must describe an object"),
    (  # the SDK tests' shape: a property that is not a schema names the tool and the place
        {"tools": _function(parameters={"properties": {"foo": "bar"}})},
        r"tools\[0\]\.function \('\w+'\)\.parameters: properties\.foo must be a schema",
    ),
    (
        {
            "tools": _function(
                parameters={
                    "properties": {"n": {"type": "integer", "minimum": 5, "exclusiveMaximum": 5}}
                }
            )
        },
        r"tools\[0\]\.function \('\w+'\)\.parameters: no integer is between",
    ),
    ({"tools": [WEATHER, WEATHER]}, r"tools\[1\]\.function\.name 'get_weather' is declared twice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice as a dict"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "as a dict"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "names the function 'nope', which is not in tools",
    ),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice is only allowed when tools"),
    ({"tools": [], "tool_choice": "required"}, "tools must hold at least one function"),
    ({"tools": None, "parallel_tool_calls": True}, "parallel_tool_calls is only allowed"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a bool"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_tool_options_raise_invalid_parameter(options: dict[str, Any], message: str) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=message):
        prepare_tools(**options)


def test_tool_options_defaults_and_choices() -> None:
    assert prepare_tools(None) == ToolPlan()
    with pytest.raises(llamax.InvalidParameterError, match="at least one function"):
        prepare_tools([], "none")  # OpenAI refuses an empty list too
    plan = prepare_tools([WEATHER, CLOCK])
    assert (plan.mode, plan.forced_name, plan.parallel, plan.is_active) == (
        "auto",
        None,
        True,
        True,
    )
    assert [f.name for f in plan.callable_functions] == ["get_weather", "get_time"]
    assert plan.functions[1].parameters == {
        "type": "object",
        "properties": {"city": {"type": "string"}},
    }
    named = {"type": "function", "function": {"name": "get_time"}}
    plan = prepare_tools([WEATHER, CLOCK], named, parallel_tool_calls=False)
    assert (plan.mode, plan.forced_name, plan.parallel) == ("required", "get_time", False)
    assert [f.name for f in plan.callable_functions] == ["get_time"]
    none = prepare_tools([WEATHER], "none")
    assert not none.is_active and none.callable_functions == ()
    assert tool_call_grammar(none) is None and tool_system_text(none) == ""
    no_parameters = prepare_tools(_function(description="d", strict=True))
    assert no_parameters.functions[0].parameters == {"type": "object", "properties": {}}


# ---------------------------------------------------------------------------- grammar
_RULE = re.compile(r"^([a-zA-Z0-9-]+) ::= (.*)$")
_BODY_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[a-zA-Z][a-zA-Z0-9-]*')


def _rules(grammar: str) -> dict[str, str]:
    rules = {}
    for line in grammar.splitlines():
        match = _RULE.match(line)
        assert match, f"not a one-line rule: {line!r}"
        assert match.group(1) not in rules, f"rule {match.group(1)} defined twice"
        rules[match.group(1)] = match.group(2)
    return rules


def _references(body: str) -> set[str]:
    return {t for t in _BODY_TOKEN.findall(body) if t[0] not in '"['}


@pytest.mark.parametrize(
    ("choice", "parallel", "root"),
    [
        ("required", False, "root ::= call"),
        ("required", True, 'root ::= call ("\\n" call){0,15}'),
        ("auto", False, "root ::= text-0 (call)?"),
        ("auto", True, 'root ::= text-0 (call ("\\n" call){0,15})?'),
    ],
)
def test_grammar_rules_are_closed_and_prefixed(choice: str, parallel: bool, root: str) -> None:
    grammar = tool_call_grammar(prepare_tools([WEATHER, CLOCK], choice, parallel))
    assert grammar is not None and grammar.splitlines()[0] == root
    rules = _rules(grammar)
    for name, body in rules.items():
        assert _references(body) <= set(rules), f"{name} references undefined rules"
    assert rules["call"] == '"<tool_call>\\n" ( fn-0 | fn-1 ) "\\n</tool_call>"'
    assert rules["fn-0"] == '"{\\"name\\": \\"get_weather\\", \\"arguments\\": " fn-0-root "}"'
    assert '"\\"celsius\\""' in rules["fn-0-unit"]
    assert "fn-1-root" in rules
    assert ("text-0" in rules) == (choice == "auto")


def test_named_choice_grammar_offers_only_that_function() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    rules = _rules(tool_call_grammar(prepare_tools([WEATHER, CLOCK], named)) or "")
    assert rules["call"] == '"<tool_call>\\n" ( fn-0 ) "\\n</tool_call>"'
    assert "get_time" in rules["fn-0"] and not any("get_weather" in b for b in rules.values())


def test_auto_text_rules_track_the_marker() -> None:
    rules = _rules(tool_call_grammar(prepare_tools([WEATHER], "auto")) or "")
    assert rules["text-0"] == '( [^<] text-0 | "<" text-1 )?'
    assert rules["text-1"] == '( "t" text-2 | "<" text-1 | [^t<] text-0 )?'
    last = f"text-{len(CALL_OPEN) - 1}"
    assert rules[last] == '( "<" text-1 | [^><] text-0 )?'  # ">" would complete the marker


# ---------------------------------------------------------------------------- prompts
def test_template_detection() -> None:
    assert template_supports_tools(HERMES)
    assert not template_supports_tools(SMOLLM2)
    assert not template_supports_tools(ChatTemplate("{{ tools }}{{ messages }}"))


def test_a_probe_out_of_time_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine that makes the tool probe overrun its render budget gets False for
    that request only: the answer is not cached, and the next probe finds the tools (a
    copy of HERMES, so no earlier test's cached answer is reused)."""
    from llamax.templates import sandbox

    hermes = ChatTemplate(HERMES.source + "{# a copy #}")
    start = sandbox.RenderBudget.start
    with monkeypatch.context() as patched:  # each render's deadline has passed as it starts
        patched.setattr(
            sandbox.RenderBudget,
            "start",
            classmethod(lambda cls, seconds, chars: cls(seconds, chars, time.monotonic() - 1)),
        )
        assert not template_supports_tools(hermes)
    assert sandbox.RenderBudget.start == start
    assert template_supports_tools(hermes)


def test_fallback_merges_tools_into_the_first_system_message() -> None:
    plan = prepare_tools([WEATHER], "required")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = render_tool_prompt(SMOLLM2, messages, plan)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in system and "You must call at least one function." in system
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    alone = fallback_messages([{"role": "user", "content": "Hi"}], plan)
    assert [m["role"] for m in alone] == ["system", "user"]
    assert alone[0]["content"] == tool_system_text(plan)


def test_choice_none_shows_no_tools() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    none = prepare_tools([WEATHER], "none")
    assert fallback_messages(messages, none) == messages
    assert "<tools>" not in render_tool_prompt(HERMES, messages, none)


ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]

ROUND_TRIP_TAIL = (
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Rome"}}\n</tool_call>'
    "<|im_end|>\n<|im_start|>user\n"
    "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
    "<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize("template", [SMOLLM2, HERMES], ids=["fallback", "native"])
def test_calls_and_results_render_as_hermes_turns(template: ChatTemplate) -> None:
    text = render_tool_prompt(template, ROUND_TRIP, prepare_tools([WEATHER]))
    assert text.endswith(ROUND_TRIP_TAIL)
    assert text.count("<tools>\n") == 1


def test_fallback_keeps_the_arguments_as_written_and_the_reasoning() -> None:
    """An ``arguments`` string goes back as it was written (the model's spacing: the next
    turn's prompt then repeats the reply to the byte); an object is serialized; an
    assistant turn's ``reasoning_content`` reaches the template."""
    written = '{ "location": "Paris" ,"unit":"celsius"}'
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": written}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"a": 1}}},
    ]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "R"},
    ]
    (_, _, turn) = fallback_messages(messages, prepare_tools([WEATHER]))
    assert turn == {
        "role": "assistant",
        "content": f'<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"a": 1}}\n</tool_call>',
        "reasoning_content": "R",
    }


BAD_CONVERSATIONS = [
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}], "no preceding"),
    ([*ROUND_TRIP[:2], {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "call_9"),
    ([*ROUND_TRIP[:2], {"role": "tool", "content": "x"}], "tool_call_id must be a str"),
    (
        [*ROUND_TRIP, {"role": "user", "content": "?"}, ROUND_TRIP[2]],
        r"messages\[5\] is a tool result",
    ),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only allowed on assistant"),
    ([{"role": "assistant", "content": "", "tool_calls": "f()"}], "must be a list"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}], "needs a str 'id'"),
    (
        [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}],
            }
        ],
        "arguments is not JSON",
    ),
    (
        [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "1"}}],
            }
        ],
        "must be a JSON object",
    ),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "code"}]}], "type 'function'"),
]


@pytest.mark.parametrize(("messages", "message"), BAD_CONVERSATIONS)
def test_bad_tool_turns_raise(messages: list[dict[str, Any]], message: str) -> None:
    for template in (SMOLLM2, HERMES):
        with pytest.raises(InvalidMessageError, match=message):
            render_tool_prompt(template, messages, prepare_tools([WEATHER]))


# ---------------------------------------------------------------------------- parsing
PLAN = prepare_tools([WEATHER, CLOCK])
CALL_PARIS = (
    '<tool_call>\n{"name": "get_weather", "arguments": '
    '{ "location": "Paris", "unit": "celsius"}}\n</tool_call>'
)
CALL_TOKYO = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"} }\n</tool_call>'


def _check_message(message: dict[str, Any]) -> ChatCompletionMessage:
    parsed = ChatCompletionMessage.model_validate(message)
    for call in parsed.tool_calls or []:
        assert CALL_ID.fullmatch(call.id)
        assert isinstance(json.loads(call.function.arguments), dict)
    return parsed


def test_parse_one_call() -> None:
    reply = parse_tool_calls(CALL_PARIS, PLAN)
    assert reply.finish_reason == "tool_calls" and reply.content is None
    message = _check_message(reply.message())
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    function = message.tool_calls[0].function
    assert function.name == "get_weather"
    assert json.loads(function.arguments) == {"location": "Paris", "unit": "celsius"}


def test_parse_text_then_two_calls() -> None:
    reply = parse_tool_calls(f"Let me check. \n{CALL_PARIS}\n{CALL_TOKYO}\n", PLAN)
    assert reply.content == "Let me check." and reply.finish_reason == "tool_calls"
    names = [c["function"]["name"] for c in reply.tool_calls]
    assert names == ["get_weather", "get_time"]
    assert reply.tool_calls[1]["function"]["arguments"] == '{"city": "Tokyo"}'
    assert reply.tool_calls[0]["id"] != reply.tool_calls[1]["id"]
    _check_message(reply.message())


@pytest.mark.parametrize(
    "text",
    [
        "Just text, <b>bold</b> and <tool_cal without a call.",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"city": }}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}\n</tool_call>',
        f"{CALL_TOKYO}\n<tool_call>\nnonsense",
    ],
)
def test_text_and_malformed_calls_come_back_unchanged(text: str) -> None:
    reply = parse_tool_calls(text, PLAN)
    assert (reply.content, reply.tool_calls, reply.finish_reason) == (text, (), "stop")
    _check_message(reply.message())


def test_cut_off_call_is_dropped_without_leaking_markup() -> None:
    text = f"{CALL_TOKYO}\n{CALL_PARIS[:40]}"
    reply = parse_tool_calls(text, PLAN, "length")
    assert reply.finish_reason == "length" and reply.content is None
    assert [c["function"]["name"] for c in reply.tool_calls] == ["get_time"]
    only_cut = parse_tool_calls(f"Checking.\n{CALL_PARIS[:40]}", PLAN, "length")
    assert (only_cut.content, only_cut.tool_calls) == ("Checking.", ())


def test_choice_none_parses_nothing() -> None:
    reply = parse_tool_calls(CALL_PARIS, prepare_tools([WEATHER], "none"))
    assert (reply.content, reply.tool_calls) == (CALL_PARIS, ())


# ---------------------------------------------------------------------------- streaming
def _stream(text: str, pieces: list[int]) -> tuple[list[ToolDelta], ToolCallStreamParser]:
    parser = ToolCallStreamParser(PLAN)
    deltas: list[ToolDelta] = []
    at = 0
    for size in pieces:
        deltas += parser.feed(text[at : at + size])
        at += size
    deltas += parser.feed(text[at:]) + parser.close()
    return deltas, parser


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_stream_matches_whole_parse(size: int) -> None:
    text = f"Let me check. \n{CALL_PARIS}\n{CALL_TOKYO}\n"
    deltas, parser = _stream(text, [size] * (len(text) // size))
    whole = parse_tool_calls(text, PLAN)
    assert parser.finish_reason("stop") == "tool_calls"
    content = "".join(d.get("content", "") for d in deltas)
    assert content == whole.content
    arguments: dict[int, str] = {}
    for delta in deltas:
        ChoiceDelta.model_validate(delta)
        for call in delta.get("tool_calls", []):
            index = call["index"]
            if index not in arguments:  # the first delta of a call names it
                assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
                assert call["function"] == {
                    "name": whole.tool_calls[index]["function"]["name"],
                    "arguments": "",
                }
                arguments[index] = ""
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                arguments[index] += call["function"]["arguments"]
    assert arguments == {i: c["function"]["arguments"] for i, c in enumerate(whole.tool_calls)}
    assert not any(CALL_OPEN in d.get("content", "") for d in deltas)


def _arguments_delta(fragment: str) -> list[ToolDelta]:
    return [{"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}]


def test_stream_streams_arguments_as_they_grow() -> None:
    parser = ToolCallStreamParser(PLAN)
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]  # the marker's start is held back
    start = parser.feed('_call>\n{"name": "get_time", "arguments": {"ci')
    assert start[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert start[1:] == _arguments_delta('{"ci')
    assert parser.feed('ty": "}{\\"') == _arguments_delta('ty": "}{\\"')  # braces in a string
    assert parser.feed('", "n": [1]') == _arguments_delta('", "n": [1]')
    assert parser.feed("} }\n</tool") == _arguments_delta("}")  # the wrapper's brace is not sent
    assert parser.tool_calls == []  # complete at the closing marker
    assert parser.feed("_call>") == []
    assert parser.tool_calls[0]["function"]["arguments"] == '{"city": "}{\\"", "n": [1]}'
    assert parser.close() == [] and parser.finish_reason("stop") == "tool_calls"


def test_stream_releases_text_that_is_not_a_marker() -> None:
    parser = ToolCallStreamParser(PLAN)
    assert parser.feed("a <tool") == [{"content": "a"}]
    assert parser.feed("box> b ") == [{"content": " <toolbox> b"}]
    assert parser.close() == [{"content": " "}]
    assert parser.finish_reason("stop") == "stop"


def test_stream_without_tools_passes_text_through() -> None:
    parser = ToolCallStreamParser(prepare_tools(None))
    assert parser.feed(CALL_PARIS) == [{"content": CALL_PARIS}]
    assert parser.close() == [] and parser.finish_reason("stop") == "stop"
