"""Where a template's re-rendering of earlier turns caps prefix reuse (docs/kv-cache.md,
"Templates that re-render earlier turns"), on the fake backend: one token per byte, so a
reply's tokens are the canonical tokens of its text and reuse is counted in bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_chat import make

import llamax
from llamax.testing import assert_idle

DATA = Path(__file__).parent / "data"
QWEN3 = (DATA / "qwen3_style_thinking_template.jinja").read_text()
QWEN3_TOOLS = QWEN3.replace(
    '{%- if message.role == "user" -%}',
    '{%- if message.role == "user" and not message.content.startswith("<tool_response>") -%}',
)
"""With Qwen3's own rule: a user turn of tool results (how llamax's fallback, and Qwen3's
template itself, render them) is no new query, so the thinking before it stays."""
assert QWEN3_TOOLS != QWEN3
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
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
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SPACED = '{ "location": "Paris", "unit": "celsius"}'
"""The arguments as SmolLM2-135M writes them under the tool grammar (a space after ``{``,
which ``json.dumps`` would not write)."""
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {SPACED}}}\n</tool_call>'


def _cached(response: dict[str, Any]) -> int:
    cached: int = response["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _round_trip(ctx: llamax.Context, **first: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
    """A call, then its result sent back; the first request's KV length (prompt + reply)."""
    options: dict[str, Any] = {"tools": [WEATHER], "max_tokens": 256, "temperature": 0}
    call = ctx.chat_completion(ASK, **options, **first)
    message = call["choices"][0]["message"]
    (tool_call,) = message["tool_calls"]
    assert tool_call["function"]["arguments"] == SPACED  # the model's text, as written
    kv = call["usage"]["prompt_tokens"] + len(CALL)
    result = {"role": "tool", "tool_call_id": tool_call["id"], "content": "21 C"}
    answer = ctx.chat_completion([*ASK, message, result], **options)
    return call, answer, kv


def test_a_tool_round_trip_reuses_the_call_as_the_model_wrote_it() -> None:
    """SmolLM2's template has no tool format: llamax renders the call as ``<tool_call>``
    text in the assistant turn. The call's ``arguments`` string is written back as it
    came (the model's own spacing), so the next request reuses the whole KV of the first;
    re-serialized (``{"location"``), reuse stopped at the ``{``."""
    with make(CALL, n_ctx=2048) as ctx:
        _, answer, kv = _round_trip(ctx)
        assert answer["usage"]["prompt_tokens"] > kv
        assert _cached(answer) == kv
        assert_idle(ctx)


def test_changed_tool_options_change_the_system_turn() -> None:
    """The fallback's tool text says how many calls a reply may hold: a follow-up that
    changes ``parallel_tool_calls`` changes the system turn, and reuse stops there (the
    "11 of 251 tokens" a SmolLM2 round trip reused: ``one function`` became ``one or more
    functions``)."""
    with make(CALL, n_ctx=2048) as ctx:
        _, answer, _ = _round_trip(ctx, parallel_tool_calls=False)
        shared = "system\n# Tools\n\nYou may call one "  # after <|im_start|>, one token
        assert _cached(answer) == 1 + len(shared)
        assert_idle(ctx)


THOUGHT = "<think>\nThe user asks. I answer.\n</think>\n\n"


def test_a_dropped_thought_caps_reuse_at_the_reply() -> None:
    """Qwen3's way: a finished turn's thinking is not rendered again once a user turn
    follows, so the next request reuses the previous prompt and recomputes from the
    reply's first token: the thought is gone, the answer after it is recomputed."""
    with make(THOUGHT + "Sunny.", template=QWEN3) as ctx:
        first = ctx.chat_completion(ASK, max_tokens=128, temperature=0)
        message = first["choices"][0]["message"]
        assert message["reasoning_content"] == "The user asks. I answer."
        following = [*ASK, message, {"role": "user", "content": "And Rome?"}]
        second = ctx.chat_completion(following, max_tokens=128, temperature=0)
        assert _cached(second) == first["usage"]["prompt_tokens"]
        assert_idle(ctx)


def test_a_tool_loop_keeps_the_thought_and_reuses_it() -> None:
    """Within a tool loop no user query follows, so Qwen3's template keeps the thinking
    of the call's turn: llamax hands the template the turn's ``reasoning_content`` in
    the tool fallback too (it dropped it), and the whole KV of the call is reused."""
    with make(THOUGHT + CALL, template=QWEN3_TOOLS, n_ctx=2048) as ctx:
        _, answer, kv = _round_trip(ctx)
        assert _cached(answer) == kv + len(THOUGHT)
        assert_idle(ctx)


def test_the_measuring_script_finds_the_same_boundaries() -> None:
    """``scripts/template_reuse.py`` (which docs/kv-cache.md's table comes from), on the
    templates in tests/data: SmolLM2's tool round trip reuses everything, a Qwen3-style
    template's next user turn stops at the reply's thought."""
    from script_modules import load_script

    script = load_script("template_reuse")
    smollm2 = script.load(DATA / "smollm2_chat_template.jinja")
    tools = script.play("smollm2", smollm2, "tools", None)
    assert tools.error is None and len(tools.turns) == 2
    assert all(t.reused_chars == t.kv_chars for t in tools.turns)
    think = script.play("qwen3", script.load(DATA / "qwen3_style_thinking_template.jinja"),
                        "think", None)  # fmt: skip
    first = think.turns[0]
    assert first.reason == "past thinking dropped"
    assert "assistant\n|<think>\n" in first.kv_at and "assistant\n|Paris." in first.next_at
