"""The server's refusals in OpenAI's error shape, on the fake backend: bad bodies in-process
(httpx's ASGI transport), and the size, queue and key limits over a real socket.

Moved from ``test_server.py`` (issue 55), where each ran against SmolLM2 through uvicorn: the
shape of a refusal is the server's, not the model's. What only llama.cpp can refuse (a GBNF
it cannot parse, a prompt past the real ``n_ctx``) stays there, in
``test_errors_are_typed_client_exceptions``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
HELLO = [{"role": "user", "content": "Say hello."}]
FAKE_BAD_GRAMMAR = "root ::= INVALID"  # what the fake's check_grammar refuses


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    """A fake context with SmolLM2's template, n_ctx=4096 (a 40,000-byte prompt overflows)."""
    backend = FakeBackend(
        n_ctx=4096, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )
    context = llamax.Context(backend=backend)
    yield context
    backend.fault = None
    assert_idle(context, timeout=30)
    context.close()


JSON_SCHEMA_AS_TEXT = {"type": "json_schema", "json_schema": "{}"}
BAD_BODIES: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("chat", b"{not json", None),
    ("chat", b"", None),
    ("chat", b"[1, 2]", None),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    ("chat", {}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, "messages"),
    ("chat", {"messages": HELLO, "tools": []}, "tools"),
    ("chat", {"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {"messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ("chat", {"messages": HELLO, "tools": "get_weather"}, "tools"),
    ("chat", {"messages": HELLO, "functions": []}, "functions"),
    ("chat", {"messages": HELLO, "top_p": 0}, "top_p"),
    ("chat", {"messages": HELLO, "top_k": -1}, "top_k"),
    ("chat", {"messages": HELLO, "min_p": 2}, "min_p"),
    ("chat", {"messages": HELLO, "repeat_penalty": 0}, "repeat_penalty"),
    ("chat", {"messages": HELLO, "presence_penalty": 5}, "presence_penalty"),
    ("chat", {"messages": HELLO, "frequency_penalty": -5}, "frequency_penalty"),
    ("chat", {"messages": HELLO, "seed": "x"}, "seed"),
    ("chat", {"messages": HELLO, "stop": [1, 2]}, "stop"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("chat", {"messages": HELLO, "temperature": "hot"}, "temperature"),
    ("chat", {"messages": HELLO, "temperature": -1}, "temperature"),
    ("chat", {"messages": HELLO, "n": 0}, "n"),
    ("chat", {"messages": HELLO, "n": "3"}, "n"),
    ("chat", {"messages": HELLO, "max_tokens": -5}, "max_tokens"),
    ("chat", {"messages": HELLO, "max_tokens": 1, "max_completion_tokens": 1}, None),
    ("chat", {"messages": HELLO, "stream": "yes"}, "stream"),
    ("chat", {"messages": HELLO, "stream_options": {"include_usage": True, "x": 1}}, None),
    ("chat", {"messages": HELLO, "logit_bias": {"abc": 5}}, "logit_bias"),
    ("chat", {"messages": HELLO, "logit_bias": {"5": 500}}, "logit_bias"),
    ("chat", {"messages": HELLO, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat", {"messages": HELLO, "grammar": FAKE_BAD_GRAMMAR}, "grammar"),
    ("chat", {"messages": HELLO, "top_logprobs": 50, "logprobs": True}, None),
    ("chat", {"messages": HELLO, "truncate": "sometimes"}, "truncate"),
    ("chat", {"messages": HELLO, "speculative": "yes"}, "speculative"),
    ("completions", {"prompt": "x", "speculative": {"max_draft": 0}}, None),
    ("completions", {"prompt": "x", "speculative": {"draft": 4}}, None),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [1, -4]}, None),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),  # echo is honoured (issue 44)
    ("completions", {"prompt": "x", "stop": 3}, "stop"),
    ("completions", {"prompt": "x" * 40000, "max_tokens": 1}, "prompt"),
    # issue 22: these were 500s
    ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("chat", b'{"messages": [' + b"[" * 500 + b"]" * 500 + b"]}", "messages"),
    (
        "chat",
        {"messages": HELLO, "response_format": JSON_SCHEMA_AS_TEXT},
        "response_format.json_schema",
    ),
    ("chat", {"messages": HELLO, "response_format": "json"}, "response_format"),
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("chat", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("tokenize", b'{"content": "\\ud83d"}', "content"),
    ("embeddings", b'{"input": ["ok", "\\ud800"]}', "input"),
    ("completions", {"prompt": "x", "stop": [str(i) for i in range(401)]}, "stop"),
]

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "tokenize": "/tokenize", "embeddings": "/v1/embeddings"}  # fmt: skip


def test_bad_bodies_get_4xx_in_openai_shape(ctx: llamax.Context) -> None:
    """Each bad body is a 400 in OpenAI's shape naming its field, and the server goes on
    serving (a completion after each). One app for all cases: each case is one request."""
    app = create_app(ctx)

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for endpoint, body, param in BAD_BODIES:
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                response = await http.post(_PATHS[endpoint], content=raw)
                case = (endpoint, raw[:80], response.text[:300])
                assert response.status_code == 400, case
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, case
                assert error["type"] == "invalid_request_error" and error["message"], case
                if param is not None:
                    assert error["param"] == param, case
                ok = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                assert ok.status_code == 200, case

    asyncio.run(go())


def test_the_openai_client_gets_authentication_errors_then_is_served(
    ctx: llamax.Context,
) -> None:
    """The ``openai`` client's side of the key (``test_server_robust``'s
    ``test_every_route_needs_the_api_key`` checks every route's 401)."""
    app = create_app(ctx, api_key="s3cret")

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        for key in ("wrong", "x"):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                bad = openai.AsyncOpenAI(base_url="http://t/v1", api_key=key, max_retries=0,
                                         http_client=http)  # fmt: skip
                with pytest.raises(openai.AuthenticationError):
                    await bad.models.list()
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            good = openai.AsyncOpenAI(base_url="http://t/v1", api_key="s3cret", max_retries=0,
                                      http_client=http)  # fmt: skip
            assert (await good.models.list()).data[0].id == ctx.model_name

    asyncio.run(go())


def test_body_too_large(ctx: llamax.Context) -> None:
    """Over a socket: a chunked body (no Content-Length) is counted while it is read."""
    with BackgroundServer(create_app(ctx, max_body_bytes=1000)) as small:
        big = {"prompt": "x" * 2000, "max_tokens": 1}
        response = httpx.post(small.url + "/v1/completions", json=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"

        def chunked() -> Iterator[bytes]:
            yield b'{"prompt": "'
            yield b"x" * 2000
            yield b'"}'

        response = httpx.post(small.url + "/v1/completions", content=chunked())
        assert response.status_code == 413


def test_full_queue_gets_503_with_retry_after(ctx: llamax.Context) -> None:
    """One stream holds the only place in the queue (20 ms a fake step); the next request is
    a 503 with ``Retry-After``, and once the stream is gone a request is served."""
    ctx._backend.fault = lambda where: time.sleep(0.02) if where == "decode" else None  # type: ignore[attr-defined]
    body = {"prompt": "1, 2,", "max_tokens": 3000, "stream": True}
    with BackgroundServer(create_app(ctx, max_queue=1, retry_after_seconds=3)) as tight:
        client = openai.OpenAI(base_url=tight.url + "/v1", api_key="x", max_retries=0)
        with httpx.stream("POST", tight.url + "/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()  # keep it: a dropped iterator closes the response
            next(lines)
            with pytest.raises(openai.InternalServerError) as busy:
                client.completions.create(model="any", prompt="Hi", max_tokens=1)
            assert busy.value.status_code == 503
            assert busy.value.response.headers["retry-after"] == "3"
        deadline = time.monotonic() + 30
        while ctx.stats().num_running or ctx.stats().num_waiting:
            assert time.monotonic() < deadline, ctx.stats()
            time.sleep(0.01)
        assert client.completions.create(model="any", prompt="Hi", max_tokens=1).choices
