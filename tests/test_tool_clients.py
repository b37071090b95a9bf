"""Tool calls agents can rely on (issue 56), through the real ``anthropic`` and ``openai``
clients against ``llamax serve`` on the fake backend, whose scripted replies stand in for
what a model writes (the fake does not apply the grammar: it writes what it is told)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import anthropic
import openai
from gbnf import Grammar
from test_chat import IM_END, IM_START, SPECIALS, TEMPLATE

import llamax
from llamax.grammar import schema_to_gbnf
from llamax.server import BackgroundServer, create_app
from llamax.testing import FakeBackend, assert_idle

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}
CALCULATE = {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression",
    "input_schema": {
        "type": "object",
        "properties": {"zeta": {"type": "string"}, "expression": {"type": "string"}},
        "required": ["expression"],
    },
}
TOOLS = [WEATHER, CALCULATE]
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        },
    }
    for t in TOOLS
]
T0 = {"temperature": 0}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class _Script:
    """A fake model answering every assistant turn with ``reply``; it keeps the prompts."""

    def __init__(self, reply: str) -> None:
        self.tokens = [b + 1 for b in reply.encode()] + [IM_END]
        self.prompts: list[str] = []

    def __call__(self, history: Sequence[int]) -> int:
        if IM_START not in history:
            return ord("x") + 1
        start = max(i for i, t in enumerate(history) if t == IM_START)
        generated = len(history) - 1 - start - len(b"assistant\n")
        if generated <= 0:
            self.prompts.append(bytes(t - 1 for t in history if 0 < t <= 256).decode())
        return self.tokens[min(max(generated, 0), len(self.tokens) - 1)]


@contextmanager
def serve(reply: str) -> Iterator[tuple[str, _Script]]:
    """A server on the fake that answers ``reply``: its URL and the script."""
    script = _Script(reply)
    backend = FakeBackend(
        n_ctx=8192,
        n_seq_max=4,
        next_token=script,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SPECIALS,
    )
    with (
        llamax.Context(backend=backend, autostart=True) as ctx,
        BackgroundServer(create_app(ctx)) as server,
    ):
        yield server.url, script
        assert_idle(ctx)


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


# --- the finding: a forced call whose string held a raw newline came back as text ----------
RAW_NEWLINE = _call("calculate", '{"expression": "2\n+ 2"}')


def test_a_forced_call_with_a_raw_newline_is_a_tool_use_not_text() -> None:
    with serve(RAW_NEWLINE) as (url, _):
        client = _anthropic(url)
        forced = {"type": "tool", "name": "calculate"}
        message = client.messages.create(
            model="fake",
            extra_body=T0,
            max_tokens=200,
            messages=PARIS,
            tools=TOOLS,
            tool_choice=forced,
        )  # type: ignore[arg-type]
        assert message.stop_reason == "tool_use"
        assert [b.type for b in message.content] == ["tool_use"]
        assert message.content[0].input == {"expression": "2\n+ 2"}  # type: ignore[union-attr]
        with client.messages.stream(
            model="fake",
            extra_body=T0,
            max_tokens=200,
            messages=PARIS,
            tools=TOOLS,
            tool_choice=forced,
        ) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert final.content[0].input == {"expression": "2\n+ 2"}  # type: ignore[union-attr]
        chat = _openai(url).chat.completions.create(
            model="fake", extra_body=T0, messages=PARIS, tools=OPENAI_TOOLS, tool_choice="required"
        )  # type: ignore[arg-type]
        calls = chat.choices[0].message.tool_calls
        assert chat.choices[0].finish_reason == "tool_calls" and calls
        assert json.loads(calls[0].function.arguments) == {"expression": "2\n+ 2"}  # type: ignore[union-attr]


def test_a_forced_call_cut_off_never_comes_back_as_markup() -> None:
    with serve(_call("calculate", '{"expression": "2 + 2"}')) as (url, _):
        client = _anthropic(url)
        forced = {"type": "tool", "name": "calculate"}
        cut = client.messages.create(
            model="fake",
            extra_body=T0,
            max_tokens=30,
            messages=PARIS,
            tools=TOOLS,
            tool_choice=forced,
        )  # type: ignore[arg-type]
        assert (cut.stop_reason, cut.content) == ("max_tokens", [])
        stopped = client.messages.create(
            model="fake",
            extra_body=T0,
            max_tokens=200,
            messages=PARIS,
            tools=TOOLS,
            tool_choice=forced,  # type: ignore[arg-type]
            stop_sequences=["+"],
        )
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "+")
        assert not any("<tool_call>" in getattr(b, "text", "") for b in stopped.content)


# --- streamed arguments, parallel calls, in every dialect ----------------------------------
TWO_CALLS = (
    "Checking both.\n"
    + _call("get_weather", '{"location": "Paris"}')
    + "\n"
    + _call("calculate", '{"zeta": "z", "expression": "2 + 2"}')
)
FIRST, SECOND = {"location": "Paris"}, {"zeta": "z", "expression": "2 + 2"}


def test_parallel_calls_stream_their_arguments_across_chunks_in_every_dialect() -> None:
    with serve(TWO_CALLS) as (url, _):
        chat = _openai(url).chat.completions.create(
            model="fake", extra_body=T0, messages=PARIS, tools=OPENAI_TOOLS, stream=True
        )  # type: ignore[arg-type]
        pieces: dict[int, list[str]] = {}
        ids: dict[int, str] = {}
        for chunk in chat:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if delta.id:
                    ids[delta.index] = delta.id
                pieces.setdefault(delta.index, []).append(delta.function.arguments or "")  # type: ignore[union-attr]
        assert [json.loads("".join(pieces[i])) for i in (0, 1)] == [FIRST, SECOND]
        assert all(len(p) > 2 for p in pieces.values()) and len(set(ids.values())) == 2
        with _anthropic(url).messages.stream(
            model="fake", extra_body=T0, max_tokens=300, messages=PARIS, tools=TOOLS
        ) as stream:  # type: ignore[arg-type]
            deltas = [e for e in stream if e.type == "input_json"]
            final = stream.get_final_message()
        assert len(deltas) > 4 and final.stop_reason == "tool_use"
        uses = [b for b in final.content if b.type == "tool_use"]
        assert [u.input for u in uses] == [FIRST, SECOND] and uses[0].id != uses[1].id
        events = list(
            _openai(url).responses.create(
                model="fake",
                extra_body=T0,
                input="What's the weather in Paris?",
                tools=[{"type": "function", **t["function"]} for t in OPENAI_TOOLS],  # type: ignore[misc]
                stream=True,
            )
        )
        argument_deltas: dict[str, list[str]] = {}
        for event in events:
            if event.type == "response.function_call_arguments.delta":
                argument_deltas.setdefault(event.item_id, []).append(event.delta)
        done = [e.item for e in events if e.type == "response.output_item.done"]  # type: ignore[attr-defined]
        calls = [item for item in done if item.type == "function_call"]
        assert [json.loads(c.arguments) for c in calls] == [FIRST, SECOND]
        assert all(len(argument_deltas[c.id]) > 2 for c in calls)  # type: ignore[index]


# --- results by id, property order, long results -------------------------------------------
def test_tool_results_are_matched_to_their_calls_by_id() -> None:
    with serve("Done.") as (url, script):
        calls = [
            {
                "id": "call_w",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
            },
            {
                "id": "call_c",
                "type": "function",
                "function": {"name": "calculate", "arguments": '{"expression": "2 + 2"}'},
            },
        ]
        messages = [
            *PARIS,
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_c", "content": "RESULT-OF-CALCULATE"},
            {"role": "tool", "tool_call_id": "call_w", "content": "RESULT-OF-WEATHER"},
        ]
        _openai(url).chat.completions.create(
            model="fake", extra_body=T0, messages=messages, tools=OPENAI_TOOLS
        )  # type: ignore[arg-type]
        prompt = script.prompts[-1]
        assert prompt.index("RESULT-OF-WEATHER") < prompt.index("RESULT-OF-CALCULATE"), prompt


def test_property_order_is_kept_in_the_prompt_and_the_grammar() -> None:
    with serve("Done.") as (url, script):
        _openai(url).chat.completions.create(
            model="fake", extra_body=T0, messages=PARIS, tools=OPENAI_TOOLS
        )  # type: ignore[arg-type]
        prompt = script.prompts[-1]
        assert prompt.index('"zeta"') < prompt.index('"expression"')
    grammar = Grammar.parse(schema_to_gbnf(json.dumps(CALCULATE["input_schema"])))
    assert grammar.accepts('{"zeta": "z", "expression": "1"}')
    assert not grammar.accepts('{"expression": "1", "zeta": "z"}')


def test_a_long_tool_result_reaches_the_prompt_whole() -> None:
    result = "".join(f"line {i}: {'x' * 40}\n" for i in range(120))  # ~6 kB
    with serve("Done.") as (url, script):
        reply = _anthropic(url).messages.create(
            model="fake",
            extra_body=T0,
            max_tokens=16,
            tools=TOOLS,  # type: ignore[arg-type]
            messages=[
                *PARIS,
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"location": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": result}
                    ],
                },
            ],
        )
        assert reply.stop_reason == "end_turn"
        assert result.strip() in script.prompts[-1]


def test_tool_choice_is_honoured() -> None:
    with serve(_call("calculate", '{"expression": "1"}')) as (url, script):
        client = _anthropic(url)
        for choice in ({"type": "any"}, {"type": "tool", "name": "calculate"}, {"type": "auto"}):
            message = client.messages.create(
                model="fake",
                extra_body=T0,
                max_tokens=200,
                messages=PARIS,
                tools=TOOLS,
                tool_choice=choice,
            )  # type: ignore[arg-type]
            assert message.stop_reason == "tool_use", choice
        message = client.messages.create(
            model="fake",
            extra_body=T0,
            max_tokens=200,
            messages=PARIS,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "none"},
        )
        assert message.stop_reason == "end_turn" and message.content[0].type == "text"
        assert "calculate" not in script.prompts[-1]
        chat = _openai(url).chat.completions.create(
            model="fake", extra_body=T0, messages=PARIS, tools=OPENAI_TOOLS, tool_choice="none"
        )  # type: ignore[arg-type]
        assert chat.choices[0].finish_reason == "stop" and not chat.choices[0].message.tool_calls
