"""Issue 56 item 1: per-request text that real coding agents put early in the prompt never
breaks the prefix cache (Claude Code's billing block, Codex's ``prompt_cache_key``,
``store: false`` and encrypted reasoning items), and the cached-token counts of every
dialect are the prefix cache's true hits. Through the real ``anthropic`` and ``openai``
clients against an in-process server on the fake backend."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from test_chat import make

import llamax
from llamax.anthropic import count_tokens, messages
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/src/app.py"}}\n</tool_call>'
LONG_SYSTEM = (
    "You are an interactive CLI tool that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user.\n"
    + "".join(
        f"- Rule {i}: keep answers short, read before you edit, run the tests.\n" for i in range(12)
    )
)
READ = {
    "name": "Read",
    "description": "Reads a file from the local filesystem.",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}},
        "required": ["file_path"],
    },
}
BASH = {
    "name": "Bash",
    "description": "Runs a bash command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
    },
}
FEW = 2
"""How many tokens short of the previous prompt a turn's cache hits may fall (the prompt's
last token is always computed again)."""


def billing_block() -> dict[str, Any]:
    """Claude Code's first system block, with a fresh ``cch`` (as on every request)."""
    cch = secrets.token_hex(3)[:5]
    text = f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={cch};"
    return {"type": "text", "text": text}


def claude_code_system() -> list[dict[str, Any]]:
    """The ``system`` list Claude Code sends: the billing block, the identity block, the
    long system prompt (the last two with ``cache_control``)."""
    ephemeral = {"type": "ephemeral"}
    return [
        billing_block(),
        {
            "type": "text",
            "text": "You are Claude Code, Anthropic's official CLI for Claude.",
            "cache_control": ephemeral,
        },
        {"type": "text", "text": LONG_SYSTEM, "cache_control": ephemeral},
    ]


@pytest.fixture
def served() -> Iterator[tuple[llamax.Context, str]]:
    """A fake model that always calls ``Read``, served in-process."""
    with make(f"Let me read it.\n{CALL}", autostart=True, n_ctx=4096) as ctx:
        with BackgroundServer(create_app(ctx)) as server:
            yield ctx, server.url
        assert_idle(ctx)


def claude_code_turns(
    client: anthropic.Anthropic, num_turns: int, *, stream: bool = False
) -> list[Any]:
    """A Claude-Code-shaped session: each turn resends the whole conversation with a fresh
    billing block and its ``cache_control`` breakpoint on the newest block, and grows it by
    the reply (with a signed ``thinking`` block, as Claude Code sends them back) and a
    ``tool_result``."""
    reminder = "<system-reminder>Today's date is 2026-12-02.</system-reminder>"
    first = [{"type": "text", "text": reminder}, {"type": "text", "text": "What does app.py do?"}]
    conversation: list[dict[str, Any]] = [{"role": "user", "content": first}]
    usages = []
    for _ in range(num_turns):
        last = conversation[-1]
        newest = [
            *last["content"][:-1],
            {**last["content"][-1], "cache_control": {"type": "ephemeral"}},
        ]
        request: dict[str, Any] = {
            "model": "claude-sonnet-4-5",
            "max_tokens": 200,
            "system": claude_code_system(),
            "messages": [*conversation[:-1], {**last, "content": newest}],
            "tools": [READ, BASH],
            "metadata": {"user_id": "user_abc_account_x_session_" + secrets.token_hex(4)},
            "extra_body": {"temperature": 0},
        }
        if stream:
            with client.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**request)
        usages.append(message.usage)
        use = next(block for block in message.content if block.type == "tool_use")
        conversation = [
            *conversation,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": "Read it.",
                        "signature": secrets.token_hex(32),
                    },
                    *(b.model_dump(exclude_none=True) for b in message.content),
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "print('hi')"}
                ],
            },
        ]
    return usages


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_claude_code_turns_are_served_from_cache_despite_the_billing_block(
    served: tuple[llamax.Context, str], stream: bool
) -> None:
    _, url = served
    client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    usages = claude_code_turns(client, 3, stream=stream)
    prompts = [u.input_tokens + u.cache_read_input_tokens for u in usages]
    assert usages[0].cache_read_input_tokens == 0
    for turn in (1, 2):
        assert usages[turn].cache_read_input_tokens >= prompts[turn - 1] - FEW, (turn, usages)
        assert usages[turn].cache_creation_input_tokens == 0


def test_the_billing_block_is_left_out_wherever_it_sits_and_counted_as_rendered() -> None:
    with make("Done.", n_ctx=4096) as ctx:
        hi = [{"role": "user", "content": "Hi"}]
        rest = claude_code_system()[1:]
        plain = count_tokens(ctx, {"messages": hi, "system": rest})["input_tokens"]
        for system in ([billing_block(), *rest], [rest[0], billing_block(), rest[1]]):
            assert count_tokens(ctx, {"messages": hi, "system": system})["input_tokens"] == plain
            reply = messages(ctx, {"messages": hi, "system": system, "max_tokens": 8})
            assert isinstance(reply, dict)
            usage = reply["usage"]
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == plain
        block = billing_block()
        kept = count_tokens(
            ctx, {"messages": hi, "system": [block, *rest]}, keep_billing_header=True
        )["input_tokens"]
        assert kept == plain + len(block["text"].encode())  # the fake: one token a byte
        alone = count_tokens(ctx, {"messages": hi, "system": [billing_block()]})["input_tokens"]
        assert alone == count_tokens(ctx, {"messages": hi})["input_tokens"]  # no system left
        # only that exact shape: the same words inside a system string or a message stay
        said = "x-anthropic-billing-header: is what Claude Code sends"
        as_string = count_tokens(ctx, {"messages": hi, "system": said})["input_tokens"]
        same_length = {"messages": hi, "system": "-" * len(said)}
        assert as_string == count_tokens(ctx, same_length)["input_tokens"]
        assert_idle(ctx)


def test_the_server_keeps_the_billing_block_when_told() -> None:
    with make(f"Let me read it.\n{CALL}", autostart=True, n_ctx=4096) as ctx:
        with BackgroundServer(create_app(ctx, keep_billing_header=True)) as server:
            client = anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0)
            usages = claude_code_turns(client, 2)
            counted = client.messages.count_tokens(
                model="m", messages=[{"role": "user", "content": "Hi"}], system=claude_code_system()
            )
        hi = [{"role": "user", "content": "Hi"}]
        without = count_tokens(ctx, {"messages": hi, "system": claude_code_system()})
        assert counted.input_tokens > without["input_tokens"]
        assert usages[1].cache_read_input_tokens < 100  # the fresh cch breaks the prefix early
        assert_idle(ctx)


def test_the_cli_switch_reaches_the_app() -> None:
    from llamax.server.cli import build_parser, server_config

    keep = server_config(build_parser().parse_args(["--keep-billing-header"]))
    assert keep.keep_billing_header is True
    assert server_config(build_parser().parse_args([])).keep_billing_header is False


# ---------------------------------------------------------------------- Codex, /v1/responses
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }
]
SHELL_CALL = '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>'


def codex_history() -> list[dict[str, Any]]:
    """The start of a Codex session as it resends it: developer and user context, then a
    reasoning item it got from elsewhere (``encrypted_content`` llamax cannot read, a
    summary), a call and its output."""
    return [
        {
            "type": "message",
            "role": "developer",
            "content": [
                {
                    "type": "input_text",
                    "text": "<permissions>sandbox: workspace-write</permissions>",
                }
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": "<environment_context><cwd>/src</cwd></environment_context>",
                }
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "List the files."}],
        },
        {
            "type": "reasoning",
            "id": "rs_0123",
            "summary": [{"type": "summary_text", "text": "**Listing** I should run ls."}],
            "encrypted_content": "gAAAAABo" + secrets.token_urlsafe(48),
        },
        {
            "type": "function_call",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
            "call_id": "call_1",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "app.py\ntests\n"},
    ]


def codex_request(history: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "gpt-5.1-codex",
        "instructions": "You are Codex, a coding agent. " * 8,
        "input": history,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a6c2-session",
        "max_output_tokens": 200,
        "temperature": 0,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_codex_session_with_encrypted_reasoning_reuses_its_prefix(stream: bool) -> None:
    with make(f"Listing.\n{SHELL_CALL}", autostart=True, n_ctx=4096) as ctx:
        with BackgroundServer(create_app(ctx)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
            history = codex_history()
            usages = []
            for turn in range(3):
                request = codex_request(history)
                if stream:
                    with client.responses.stream(**request) as events:
                        reply = events.get_final_response()
                else:
                    reply = client.responses.create(**request)
                assert reply.status == "completed", reply
                usages.append(reply.usage)
                output = [item.model_dump(exclude_none=True) for item in reply.output]
                call = next(item for item in output if item["type"] == "function_call")
                history = [
                    *history,
                    {  # Codex sends its reasoning items back, encrypted
                        "type": "reasoning",
                        "id": f"rs_{turn}",
                        "summary": [],
                        "encrypted_content": "gAAAAABo" + secrets.token_urlsafe(48),
                    },
                    *(item for item in output if item["type"] != "reasoning"),
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
                ]
            with pytest.raises(openai.NotFoundError):  # store: false kept nothing
                client.responses.retrieve(reply.id)
        assert usages[0] is not None and usages[0].input_tokens_details.cached_tokens == 0
        for turn in (1, 2):
            cached = usages[turn].input_tokens_details.cached_tokens  # type: ignore[union-attr]
            assert cached >= usages[turn - 1].input_tokens - FEW, (turn, usages)  # type: ignore[union-attr]
        assert_idle(ctx)


# ---------------------------------------------------------------------- true counts
def test_cached_counts_are_the_prefix_caches_hits_in_every_dialect() -> None:
    """A second request on the same prefix reports as cached exactly what the engine
    reused (its ``num_cached_tokens`` moved by that much), in all three dialects, whole
    and streamed."""
    with make("Hello there!", autostart=True, n_ctx=4096) as ctx:
        with BackgroundServer(create_app(ctx)) as server:
            url = server.url
            system = "You are a careful assistant. " * 10
            chat = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "Hi"},
                ]
            }
            hits = []
            for _ in range(2):
                for stream in (False, True):
                    before = ctx.stats().num_cached_tokens
                    cached = _chat_cached(url, chat, stream)
                    hits.append(cached)
                    assert cached == ctx.stats().num_cached_tokens - before
                    before = ctx.stats().num_cached_tokens
                    cached = _anthropic_cached(url, system, stream)
                    assert cached == ctx.stats().num_cached_tokens - before
                    before = ctx.stats().num_cached_tokens
                    cached = _responses_cached(url, system, stream)
                    assert cached == ctx.stats().num_cached_tokens - before
                    hits.append(cached)
            assert min(hits[1:]) > len(system) - FEW  # all but the very first reuse the system
        assert_idle(ctx)


def _chat_cached(url: str, chat: dict[str, Any], stream: bool) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    if not stream:
        reply = client.chat.completions.create(model="m", max_tokens=4, **chat)
        return reply.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr,return-value]
    chunks = list(
        client.chat.completions.create(
            model="m", max_tokens=4, stream=True, stream_options={"include_usage": True}, **chat
        )
    )
    return chunks[-1].usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr,return-value]


def _anthropic_cached(url: str, system: str, stream: bool) -> int:
    client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    request: dict[str, Any] = {
        "model": "m",
        "max_tokens": 4,
        "system": system,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    if stream:
        with client.messages.stream(**request) as events:
            usage = events.get_final_message().usage
    else:
        usage = client.messages.create(**request).usage
    return usage.cache_read_input_tokens or 0


def _responses_cached(url: str, system: str, stream: bool) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    request: dict[str, Any] = {
        "model": "m",
        "instructions": system,
        "input": "Hi",
        "max_output_tokens": 64,
        "store": False,
    }
    if stream:
        with client.responses.stream(**request) as events:
            usage = events.get_final_response().usage
    else:
        usage = client.responses.create(**request).usage
    assert usage is not None
    return usage.input_tokens_details.cached_tokens


# ---------------------------------------------------------------------- the small ones
def test_count_tokens_takes_what_messages_takes(served: tuple[llamax.Context, str]) -> None:
    _, url = served
    client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    hi = [{"role": "user", "content": "Hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    plain = client.messages.count_tokens(model="m", messages=hi).input_tokens  # type: ignore[arg-type]
    counted = client.messages.count_tokens(
        model="m",
        messages=hi,  # type: ignore[arg-type]
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
        extra_body={
            "max_tokens": 64,
            "temperature": 0.5,
            "top_k": 5,
            "stop_sequences": ["x"],
            "metadata": {"user_id": "u"},
            "stream": False,
        },
    )
    assert counted.input_tokens == plain
    bad = httpx.post(
        url + "/v1/messages/count_tokens",
        json={"messages": hi, "output_config": {"effort": "extreme"}},
    )
    assert bad.status_code == 400 and "output_config.effort" in bad.json()["error"]["message"]


def test_responses_compact_is_a_4xx_in_openais_shape(served: tuple[llamax.Context, str]) -> None:
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.compact(model="m", input="Hi")
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_endpoint"
    assert "compact" in error["message"] and error["type"] == "invalid_request_error"


def test_max_tool_calls_zero_is_accepted(served: tuple[llamax.Context, str]) -> None:
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    reply = client.responses.create(model="m", input="Hi", max_tool_calls=0, max_output_tokens=4)
    assert reply.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="Hi", max_tool_calls=-1, max_output_tokens=4)
    assert "max_tool_calls" in json.dumps(refused.value.body)
