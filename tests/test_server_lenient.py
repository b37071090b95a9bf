"""``--lenient`` (issue 44): a top-level field in neither the OpenAI nor the Anthropic
reference is dropped and logged instead of refused, on every route with a field table;
strict (the default) still refuses it, and lenient still refuses what the tables refuse,
checks the hints' values and keeps nested objects strict. On the fake backend, over HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_chat import make

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.server.cli import build_parser, server_config
from llamax.server.errors import APIError
from llamax.server.schemas import parse_embedding
from llamax.testing import assert_idle

HI = [{"role": "user", "content": "Hi!"}]
ROUTES = [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
    ("/v1/responses", {"input": "Hi!", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": HI, "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": HI}),
]
TYPO = {"temprature": 0.5, "x_vendor_flag": True}


@pytest.fixture
def urls() -> Iterator[dict[bool, str]]:
    """The same context behind a strict and a lenient app."""
    with (
        make(autostart=True) as ctx,
        BackgroundServer(create_app(ctx)) as strict,
        BackgroundServer(create_app(ctx, lenient=True)) as lenient,
    ):
        yield {False: strict.url, True: lenient.url}
        assert_idle(ctx)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_lenient_drops_and_logs_unknown_fields(
    urls: dict[bool, str], path: str, body: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    strict = post(urls[False], path, {**body, **TYPO})
    assert strict.status_code == 400
    assert "temprature" in strict.text  # named, in the route's error shape
    with caplog.at_level(logging.WARNING, logger="llamax.server"):
        lenient = post(urls[True], path, {**body, **TYPO})
    assert lenient.status_code == 200, lenient.text
    assert lenient.json().keys() == post(urls[True], path, body).json().keys()
    warnings = [r.getMessage() for r in caplog.records if r.name == "llamax.server"]
    assert any("'temprature', 'x_vendor_flag'" in w and "--lenient" in w for w in warnings)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": HI, "audio": {"voice": "alloy"}}, "audio"),  # refused
        ("/v1/chat/completions", {"messages": HI, "store": "no"}, "store"),  # a hint, checked
        ("/v1/chat/completions", {"messages": HI, "stream_options": {"x": 1}}, "stream_options"),
        ("/v1/completions", {"prompt": "ab", "best_of": 3}, "best_of"),
        ("/v1/responses", {"input": "Hi!", "background": True}, "background"),
        ("/v1/messages", {"messages": HI, "max_tokens": 2, "container": "c"}, "container"),
        ("/v1/messages", {"messages": HI, "max_tokens": 2, "temperature": 1.5}, "temperature"),
    ],
)
def test_lenient_still_refuses_what_the_tables_refuse(
    urls: dict[bool, str], path: str, body: dict[str, Any], field: str
) -> None:
    reply = post(urls[True], path, {**body, **TYPO})
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"]


def test_lenient_embeddings_parse(caplog: pytest.LogCaptureFixture) -> None:
    """The fake backend embeds nothing: the embeddings route's parse, on its own."""
    raw = json.dumps({"input": "ab", "dimensions": 2, **TYPO}).encode()
    with pytest.raises(APIError, match="unknown field 'temprature'"):
        parse_embedding(raw)
    with caplog.at_level(logging.WARNING, logger="llamax.server"):
        body = parse_embedding(raw, lenient=True)
    assert body["input"] == "ab" and body["dimensions"] == 2
    assert "/v1/embeddings: ignored unknown field(s) 'temprature', 'x_vendor_flag'" in caplog.text
    with pytest.raises(APIError, match="dimensions"):  # a bad value is still a 400
        parse_embedding(json.dumps({"input": "a", "dimensions": 0}).encode(), lenient=True)


def test_the_flag() -> None:
    assert server_config(build_parser().parse_args([])).lenient is False
    assert server_config(build_parser().parse_args(["--lenient"])).lenient is True


def test_lenient_is_off_by_default_in_create_app() -> None:
    ctx: llamax.Context = make()
    with ctx:
        app = create_app(ctx)
        assert app.state.llamax.config.lenient is False
