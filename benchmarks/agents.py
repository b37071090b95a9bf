"""Coding-agent sessions replayed over HTTP (issue 56): ``llamax serve`` beside llama-server.

Three sessions, written from the clients' documented request shapes (no recorded traffic
is available here), each a conversation that grows by the model's own reply and a tool
result per turn:

``claude_code`` (``POST /v1/messages``, streamed)
    A system of three text blocks as Claude Code sends them: its attribution block
    ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=<5 hex>;`` with a
    fresh ``cch`` on every request, the identity line, and a long system prompt carrying a
    ``cache_control`` breakpoint; twelve tools with Claude Code's names and input schemas;
    per turn the reply's blocks are sent back as the assistant turn and each ``tool_use``
    gets a ``tool_result`` (a user text turn where the reply called no tool); the
    breakpoint moves to the newest block. Halfway, a burst of three sub-agents (the
    ``Task`` tool: the same system and tools, a conversation of their own each) at once.
``claude_code_plain``
    The same session without the attribution block: what the block costs.
``codex`` (``POST /v1/responses``, streamed)
    Stateless, as Codex CLI is: ``store: false``, the whole ``input`` every turn,
    ``instructions``, ``prompt_cache_key`` (the session's id), ``include:
    ["reasoning.encrypted_content"]``, function tools; the reply's output items are sent
    back, each ``function_call`` followed by its ``function_call_output``. The first
    turn's input holds a ``reasoning`` item with ``encrypted_content`` from another
    provider, which neither server can read (it must not 400 nor break the prefix).
``opencode`` (``POST /v1/chat/completions``, streamed with ``include_usage``)
    Two system messages (the agent prompt, then the environment), OpenAI function tools,
    ``tool_calls`` sent back with ``tool`` messages matched by id.

Per turn: the prompt tokens, those the server says it read from its cache
(``cache_read_input_tokens``, ``input_tokens_details.cached_tokens``,
``prompt_tokens_details.cached_tokens``), those it computed (the difference), the turn's
new tokens (its prompt minus the previous turn's), and the time to the first streamed
delta of the reply (TTFT). Greedy replies of at most ``--max-tokens`` tokens.

Targets (issue 56), from the second turn on: tokens computed <= the turn's new tokens +
64; median TTFT <= 0.15x the first turn's and <= 0.7x llama-server's on the same
replay; ``claude_code`` within 10% of ``claude_code_plain``.

::

    .venv/bin/python benchmarks/agents.py --llama-server "$(bash benchmarks/peers.sh)" \\
        --json-out benchmarks/results/agents.json

``--no-tools`` sends no tool schemas: on a template that renders no tools (SmolLM2's)
llamax writes them into the system turn and llama-server leaves them out, so only without
them are the two servers' prompts the same.

Both servers get the same model, ``--n-ctx`` cells, ``--slots`` sequences and
``LLAMAX_BENCH_THREADS`` threads; llama-server with a unified KV cache (``-kvu``, so one
conversation may use every cell, as llamax's) and its default prompt cache.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import (
    N_THREADS,
    REPO,
    add_common_args,
    base_config,
    emit_report,
    filler_sentences,
    load_average,
    load_module,
    log,
    model_path,
    ratio,
)

_server = None  # benchmarks/server.py, loaded on first use (its Peer and start)


@dataclass
class Turn:
    """One request of a session, as the server reported it."""

    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    seconds: float
    new_tokens: int = 0
    agent: str = "main"
    error: str | None = None
    server_prompt_s: float | None = None
    """llama-server's own time computing the prompt (``timings.prompt_ms``), where given."""

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


_CURRENT: list[Session] = []  # the session running now (its turns so far, if it fails)


@dataclass
class Session:
    """The turns of one session on one server."""

    name: str
    system: str
    turns: list[Turn] = field(default_factory=list)


# ------------------------------------------------------------------------------ content
def words_of_tokens(label: str, tokens: int) -> str:
    """Filler text of about ``tokens`` tokens (a sentence is ~15 of SmolLM2's)."""
    sentences = filler_sentences(label)
    return "\n".join(next(sentences) for _ in range(max(1, tokens // 15)))


def system_prompt(tokens: int) -> str:
    head = (
        "You are an interactive CLI tool that helps users with software engineering tasks. "
        "Use the instructions below and the tools available to you to assist the user.\n"
        "# Tone and style\nBe concise, direct, and to the point.\n# Guidelines\n"
    )
    return head + words_of_tokens("Guideline", tokens)


_TOOLS: list[tuple[str, str, dict[str, Any], list[str]]] = [
    (
        "Bash",
        "Executes a given bash command in a persistent shell session.",
        {
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
            "description": {
                "type": "string",
                "description": "What this command does, in 5-10 words",
            },
        },
        ["command"],
    ),
    (
        "Glob",
        "Fast file pattern matching tool that works with any codebase size.",
        {
            "pattern": {"type": "string", "description": "The glob pattern to match files against"},
            "path": {"type": "string", "description": "The directory to search in"},
        },
        ["pattern"],
    ),
    (
        "Grep",
        "A powerful search tool built on ripgrep.",
        {
            "pattern": {"type": "string", "description": "The regular expression to search for"},
            "path": {"type": "string", "description": "File or directory to search in"},
            "glob": {"type": "string", "description": "Glob pattern to filter files"},
            "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
        },
        ["pattern"],
    ),
    (
        "LS",
        "Lists files and directories in a given path.",
        {"path": {"type": "string", "description": "The absolute path to the directory"}},
        ["path"],
    ),
    (
        "Read",
        "Reads a file from the local filesystem.",
        {
            "file_path": {"type": "string", "description": "The absolute path to the file to read"},
            "offset": {"type": "number", "description": "The line number to start reading from"},
            "limit": {"type": "number", "description": "The number of lines to read"},
        },
        ["file_path"],
    ),
    (
        "Edit",
        "Performs exact string replacements in files.",
        {
            "file_path": {"type": "string", "description": "The absolute path to the file"},
            "old_string": {"type": "string", "description": "The text to replace"},
            "new_string": {"type": "string", "description": "The text to replace it with"},
            "replace_all": {"type": "boolean", "default": False},
        },
        ["file_path", "old_string", "new_string"],
    ),
    (
        "MultiEdit",
        "Makes multiple edits to a single file in one operation.",
        {
            "file_path": {"type": "string"},
            "edits": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "old_string": {"type": "string"},
                        "new_string": {"type": "string"},
                    },
                    "required": ["old_string", "new_string"],
                },
            },
        },
        ["file_path", "edits"],
    ),
    (
        "Write",
        "Writes a file to the local filesystem.",
        {"file_path": {"type": "string"}, "content": {"type": "string"}},
        ["file_path", "content"],
    ),
    (
        "NotebookEdit",
        "Replaces the contents of a specific cell in a Jupyter notebook.",
        {
            "notebook_path": {"type": "string"},
            "cell_id": {"type": "string"},
            "new_source": {"type": "string"},
        },
        ["notebook_path", "new_source"],
    ),
    (
        "WebFetch",
        "Fetches content from a specified URL and processes it.",
        {"url": {"type": "string", "format": "uri"}, "prompt": {"type": "string"}},
        ["url", "prompt"],
    ),
    (
        "TodoWrite",
        "Create and manage a structured task list for your current session.",
        {
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "content": {"type": "string"},
                        "status": {
                            "type": "string",
                            "enum": ["pending", "in_progress", "completed"],
                        },
                        "id": {"type": "string"},
                    },
                    "required": ["content", "status", "id"],
                },
            }
        },
        ["todos"],
    ),
    (
        "Task",
        "Launch a new agent to handle complex, multi-step tasks autonomously.",
        {
            "description": {"type": "string"},
            "prompt": {"type": "string"},
            "subagent_type": {"type": "string"},
        },
        ["description", "prompt", "subagent_type"],
    ),
]


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }


def anthropic_tools() -> list[dict[str, Any]]:
    return [{"name": n, "description": d, "input_schema": _schema(p, r)} for n, d, p, r in _TOOLS]


def openai_tools(*, responses: bool) -> list[dict[str, Any]]:
    tools = [(n.lower(), d, _schema(p, r)) for n, d, p, r in _TOOLS]
    if responses:  # the Responses API's flat function tools
        return [
            {"type": "function", "name": n, "description": d, "parameters": s, "strict": False}
            for n, d, s in tools
        ]
    return [
        {"type": "function", "function": {"name": n, "description": d, "parameters": s}}
        for n, d, s in tools
    ]


TASKS = [
    "Find where the retry limit of the HTTP client is set and raise it to five.",
    "The tests in tests/test_parser.py fail on Windows paths; find out why.",
    "Add a --verbose flag to the CLI that prints each step.",
    "Rename the function load_config to read_config everywhere.",
]


def tool_output(turn: int, tokens: int) -> str:
    return f"Output of step {turn}:\n" + words_of_tokens(f"Line {turn}", tokens)


def billing_block(rng: random.Random) -> dict[str, Any]:
    cch = "".join(rng.choice("0123456789abcdef") for _ in range(5))
    text = f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={cch};"
    return {"type": "text", "text": text}


# ------------------------------------------------------------------------------- streams
def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON ``data:`` payloads of a server-sent event stream (``[DONE]`` ends it)."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def post_stream(
    client: httpx.Client, path: str, body: dict[str, Any], first: Callable[[dict[str, Any]], bool]
) -> tuple[list[dict[str, Any]], float, float]:
    """POST ``body`` streamed: its events, the seconds to the first event ``first`` accepts
    (the first delta of the reply), and the seconds to the end."""
    started = time.perf_counter()
    ttft = None
    events: list[dict[str, Any]] = []
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{path} -> {response.status_code}: {response.text[:300]}")
        for event in sse_events(response):
            if ttft is None and first(event):
                ttft = time.perf_counter() - started
            events.append(event)
    done = time.perf_counter() - started
    return events, ttft if ttft is not None else done, done


# ------------------------------------------------------------------------ claude code
def _anthropic_first(event: dict[str, Any]) -> bool:
    return event.get("type") == "content_block_delta"


def messages_turn(
    client: httpx.Client, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], int, int, float, float]:
    """One streamed ``/v1/messages`` request: the reply's content blocks, prompt and cached
    tokens (the largest either ``message_start`` or ``message_delta`` reports), TTFT."""
    events, ttft, seconds = post_stream(client, "/v1/messages", body, _anthropic_first)
    blocks: list[dict[str, Any]] = []
    usage: dict[str, int] = {}
    for event in events:
        kind = event.get("type")
        if kind == "message_start":
            usage.update({k: v for k, v in event["message"]["usage"].items() if v})
        elif kind == "message_delta":
            usage.update({k: v for k, v in (event.get("usage") or {}).items() if v})
        elif kind == "content_block_start":
            block = dict(event["content_block"])
            if block["type"] == "tool_use":
                block["partial"] = ""
            blocks.append(block)
        elif kind == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                block["partial"] += delta["partial_json"]
    for block in blocks:
        if block["type"] == "tool_use":
            partial = block.pop("partial")
            try:
                block["input"] = json.loads(partial) if partial else block.get("input", {})
            except json.JSONDecodeError:
                block["input"] = {}
    cached = usage.get("cache_read_input_tokens", 0)
    prompt = usage.get("input_tokens", 0) + cached + usage.get("cache_creation_input_tokens", 0)
    return [b for b in blocks if b.get("text") != ""], prompt, cached, ttft, seconds


def claude_code(client: httpx.Client, args: argparse.Namespace, *, billing: bool) -> Session:
    rng = random.Random(56)
    long_prompt = system_prompt(args.system_tokens)
    tools = anthropic_tools() if args.tools else []

    def system() -> list[dict[str, Any]]:
        blocks = [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": long_prompt, "cache_control": {"type": "ephemeral"}},
        ]
        return ([billing_block(rng)] if billing else []) + blocks

    def request(messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "model": "claude-sonnet-4-5",
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "system": system(),
            **({"tools": tools} if tools else {}),
            "messages": messages,
            "metadata": {"user_id": "user_bench_account__session_" + str(uuid.UUID(int=56))},
        }

    session = Session("claude_code" if billing else "claude_code_plain", long_prompt)
    _CURRENT[:] = [session]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": TASKS[0]}]}
    ]
    previous = 0
    for turn in range(1, args.turns + 1):
        for message in messages:  # Claude Code's breakpoint sits on the newest block only
            for block in message["content"]:
                block.pop("cache_control", None)
        messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        blocks, prompt, cached, ttft, seconds = messages_turn(client, request(messages))
        session.turns.append(Turn(turn, prompt, cached, ttft, seconds, prompt - previous))
        log(
            f"[agents] {session.name} turn {turn}: {prompt} prompt, {cached} cached, "
            f"ttft {ttft:.2f}s"
        )
        previous = prompt
        if turn == args.turns // 2:
            session.turns += sub_agents(client, request, turn)
        messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "."}]})
        calls = [b for b in blocks if b["type"] == "tool_use"]
        if calls:
            results = [
                {
                    "type": "tool_result",
                    "tool_use_id": b["id"],
                    "content": tool_output(turn, args.turn_tokens),
                }
                for b in calls
            ]
            messages.append({"role": "user", "content": results})
        else:
            text = tool_output(turn, args.turn_tokens) + "\nGo on."
            messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
    return session


def sub_agents(
    client: httpx.Client, request: Callable[[list[dict[str, Any]]], dict[str, Any]], turn: int
) -> list[Turn]:
    """Three ``Task`` sub-agents at once: the same system and tools, a task each."""
    bodies = [
        request([{"role": "user", "content": [{"type": "text", "text": task}]}])
        for task in TASKS[1:4]
    ]

    def one(body: dict[str, Any]) -> tuple[int, int, float, float]:
        with httpx.Client(base_url=str(client.base_url), timeout=client.timeout) as own:
            _, prompt, cached, ttft, seconds = messages_turn(own, body)
        return prompt, cached, ttft, seconds

    with ThreadPoolExecutor(len(bodies)) as pool:
        done = list(pool.map(one, bodies))
    return [Turn(turn, p, c, t, s, p, agent=f"sub{i + 1}") for i, (p, c, t, s) in enumerate(done)]


# ------------------------------------------------------------------------------ codex
def _responses_first(event: dict[str, Any]) -> bool:
    return event.get("type") in (
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
    )


def codex(client: httpx.Client, args: argparse.Namespace) -> Session:
    instructions = system_prompt(args.system_tokens)
    session = Session("codex", instructions)
    _CURRENT[:] = [session]
    key = str(uuid.UUID(int=5656))
    inputs: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": "<environment_context>\n  <cwd>/work/app</cwd>\n"
                    "  <approval_policy>on-request</approval_policy>\n</environment_context>",
                }
            ],
        },
        {
            "type": "reasoning",
            "id": "rs_" + "0" * 24,
            "summary": [],
            "encrypted_content": "gAAAAAB"
            + "".join(random.Random(5).choices(string.ascii_letters + string.digits, k=400)),
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASKS[0]}]},
    ]
    previous = 0
    for turn in range(1, args.turns + 1):
        body = {
            "model": "gpt-5-codex",
            "instructions": instructions,
            "input": inputs,
            **(
                {"tools": openai_tools(responses=True), "tool_choice": "auto"} if args.tools else {}
            ),
            "parallel_tool_calls": False,
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": key,
            "max_output_tokens": args.max_tokens,
            "temperature": 0,
        }
        events, ttft, seconds = post_stream(client, "/v1/responses", body, _responses_first)
        ends = ("response.completed", "response.incomplete", "response.failed")
        final = next((e["response"] for e in events if e.get("type") in ends), {})
        usage = final.get("usage") or {}
        prompt = int(usage.get("input_tokens", 0))
        cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
        session.turns.append(Turn(turn, prompt, cached, ttft, seconds, prompt - previous))
        log(f"[agents] codex turn {turn}: {prompt} prompt, {cached} cached, ttft {ttft:.2f}s")
        previous = prompt
        outputs = [item for item in final.get("output", []) if item.get("type") != "reasoning"]
        inputs += outputs
        calls = [item for item in outputs if item.get("type") == "function_call"]
        for call in calls:
            inputs.append(
                {
                    "type": "function_call_output",
                    "call_id": call["call_id"],
                    "output": tool_output(turn, args.turn_tokens),
                }
            )
        if not calls:
            inputs.append(
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": tool_output(turn, args.turn_tokens)}
                    ],
                }
            )
    return session


# --------------------------------------------------------------------------- opencode
def _chat_first(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


def opencode(client: httpx.Client, args: argparse.Namespace) -> Session:
    prompt_text = system_prompt(args.system_tokens)
    session = Session("opencode", prompt_text)
    _CURRENT[:] = [session]
    environment = (
        "Here is some useful information about the environment you are running in:\n"
        "<env>\n  Working directory: /work/app\n  Is directory a git repo: yes\n"
        "  Platform: linux\n</env>"
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": prompt_text},
        {"role": "system", "content": environment},
        {"role": "user", "content": TASKS[0]},
    ]
    previous = 0
    for turn in range(1, args.turns + 1):
        body = {
            "model": "local",
            "messages": messages,
            **(
                {"tools": openai_tools(responses=False), "tool_choice": "auto"}
                if args.tools
                else {}
            ),
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens,
            "temperature": 0,
        }
        events, ttft, seconds = post_stream(client, "/v1/chat/completions", body, _chat_first)
        content, calls = "", {}
        usage: dict[str, Any] = {}
        for event in events:
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    slot = calls.setdefault(
                        call.get("index", 0),
                        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    slot["id"] = call.get("id") or slot["id"]
                    function = call.get("function") or {}
                    slot["function"]["name"] += function.get("name") or ""
                    slot["function"]["arguments"] += function.get("arguments") or ""
        prompt = int(usage.get("prompt_tokens", 0))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        timings = next((e["timings"] for e in reversed(events) if e.get("timings")), None)
        session.turns.append(
            Turn(
                turn,
                prompt,
                cached,
                ttft,
                seconds,
                prompt - previous,
                server_prompt_s=timings["prompt_ms"] / 1e3 if timings else None,
            )
        )
        log(f"[agents] opencode turn {turn}: {prompt} prompt, {cached} cached, ttft {ttft:.2f}s")
        previous = prompt
        assistant: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            assistant["tool_calls"] = [calls[i] for i in sorted(calls)]
        messages.append(assistant)
        for call in assistant.get("tool_calls", []):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": tool_output(turn, args.turn_tokens),
                }
            )
        if not calls:
            messages.append({"role": "user", "content": tool_output(turn, args.turn_tokens)})
    return session


SESSIONS: dict[str, Callable[[httpx.Client, argparse.Namespace], Session]] = {
    "claude_code": lambda c, a: claude_code(c, a, billing=True),
    "claude_code_plain": lambda c, a: claude_code(c, a, billing=False),
    "codex": codex,
    "opencode": opencode,
}


# ---------------------------------------------------------------------------- summary
def summarize(session: Session, slack: int) -> dict[str, Any]:
    main = [t for t in session.turns if t.agent == "main"]
    later = main[1:]
    subs = [t for t in session.turns if t.agent != "main"]
    first = main[0].ttft_s if main else None
    median_later = statistics.median(t.ttft_s for t in later) if later else None
    over = [t.turn for t in later if t.computed_tokens > t.new_tokens + slack]
    prompts = [t.server_prompt_s for t in later if t.server_prompt_s is not None]
    return {
        "turns": [asdict(t) | {"computed_tokens": t.computed_tokens} for t in session.turns],
        "first_ttft_s": first,
        "median_ttft_later_s": median_later,
        "later_over_first": ratio(median_later, first),
        "median_computed_later": statistics.median(t.computed_tokens for t in later)
        if later
        else None,
        "median_new_later": statistics.median(t.new_tokens for t in later) if later else None,
        "turns_computing_more_than_new_plus_slack": over,
        "median_server_prompt_later_s": statistics.median(prompts) if prompts else None,
        "sub_agents_computed": [t.computed_tokens for t in subs],
        "sub_agents_prompt": [t.prompt_tokens for t in subs],
    }


def run_server(peer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every session on a server of its own (started fresh: its first turn is cold)."""
    report: dict[str, Any] = {}
    for name in args.sessions:
        log(f"[agents] {peer.name}: {name}")
        proc = _server.start(peer, args.slots)
        try:
            with httpx.Client(base_url=peer.url, timeout=args.timeout) as client:
                report[name] = summarize(SESSIONS[name](client, args), args.slack)
        except Exception as exc:  # a peer that refuses a shape or fails: recorded, not fatal
            log(f"[agents] {peer.name} {name} failed: {exc}")
            done = _CURRENT[0].turns if _CURRENT and _CURRENT[0].name == name else []
            report[name] = {
                **(summarize(_CURRENT[0], args.slack) if done else {}),
                "error": str(exc)[:500],
                "failed_at_turn": 1 + max((t.turn for t in done), default=0),
            }
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return report


def peers(args: argparse.Namespace, model: Path) -> list[Any]:
    found = [
        _server.Peer(
            "llamax",
            [
                sys.executable,
                "-m",
                "llamax.server",
                str(model),
                "--port",
                "{port}",
                "--n-ctx",
                str(args.n_ctx),
                "--n-seq-max",
                "{n_seq}",
                "--n-threads",
                str(N_THREADS),
                "--log-level",
                "warning",
                "--kv-layout",
                args.kv_layout,
                *(["--chat-template", args.chat_template] if args.chat_template else []),
            ],
            0,
        )
    ]
    if args.llama_server:
        found.append(
            _server.Peer(
                "llama-server",
                [
                    args.llama_server,
                    "-m",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "{port}",
                    "-c",
                    str(args.n_ctx),
                    "-np",
                    "{n_seq}",
                    "-kvu",
                    "-t",
                    str(N_THREADS),
                    "-tb",
                    str(N_THREADS),
                    "--log-disable",
                    *(
                        ["--jinja", "--chat-template-file", args.chat_template]
                        if args.chat_template
                        else []
                    ),
                ],
                0,
            )
        )
    return found


def targets(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = systems.get("llamax", {})
    peer = systems.get("llama-server", {})
    for name, got in mine.items():
        if "error" in got or not got.get("turns"):
            continue
        theirs = peer.get(name, {})
        out[name] = {
            "computed_within_new_plus_slack": not got["turns_computing_more_than_new_plus_slack"],
            "later_ttft_within_0_15x_first": (got["later_over_first"] or 9) <= 0.15,
            "later_ttft_vs_llama_server": ratio(
                got["median_ttft_later_s"], theirs.get("median_ttft_later_s")
            ),
        }
    if "claude_code" in mine and "claude_code_plain" in mine:
        out["billing_block_cost"] = ratio(
            mine["claude_code"].get("median_ttft_later_s"),
            mine["claude_code_plain"].get("median_ttft_later_s"),
        )
    return out


def main() -> None:
    global _server
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (peers.sh)")
    p.add_argument("--sessions", nargs="+", choices=list(SESSIONS), default=list(SESSIONS))
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=2500, help="the long system prompt")
    p.add_argument("--turn-tokens", type=int, default=150, help="each tool result")
    p.add_argument("--max-tokens", type=int, default=48, help="each reply (greedy)")
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--slots", type=int, default=4, help="sequences (llama-server's -np)")
    p.add_argument(
        "--no-tools",
        dest="tools",
        action="store_false",
        help="send no tool schemas (the same prompt on both servers, for templates such as "
        "SmolLM2's that render no tools: llamax writes them into the system turn, "
        "llama-server leaves them out)",
    )
    p.add_argument(
        "--kv-layout", choices=["auto", "unified", "streams"], default="auto", help="llamax's"
    )
    p.add_argument("--slack", type=int, default=64, help="computed <= new + slack")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template for both servers (for a GGUF without one, such as "
        "Gemma 3 270M's: SmolLM2's ChatML, as llama-server would fall back to)",
    )
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    _server = load_module(REPO / "benchmarks" / "server.py")
    model = model_path(args.model)
    load_at_start = load_average()
    systems = {peer.name: run_server(peer, args) for peer in peers(args, model)}
    report = {
        "benchmark": "agents",
        "config": base_config(args, load_at_start, model=str(model)),
        "systems": systems,
        "targets": targets(systems),
    }
    emit_report(report, sys.stdout, args.json_out)


if __name__ == "__main__":
    main()
