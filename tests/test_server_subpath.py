"""The chat page behind a reverse proxy on a sub-path, and the server's small first-contact
details (issue 57): the model id, the favicon. In process, on the fake backend."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send
from test_server_fake import SPECIALS, TEMPLATE

import llamax
from llamax.server import create_app
from llamax.testing import FakeBackend, assert_idle

PAGE = resources.files("llamax.server").joinpath("static/chat.html").read_text("utf-8")
PREFIX = "/llm"
HELLO = [{"role": "user", "content": "Hi"}]


def behind_proxy(app: ASGIApp, prefix: str = PREFIX) -> ASGIApp:
    """What nginx's ``location /llm/ { proxy_pass http://llamax/; }`` does: strip the
    prefix from paths under it; everything else is the proxy's own 404."""

    async def proxy(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and not path.startswith(prefix + "/"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"proxy: not found"})
            return
        inner = path[len(prefix) :]
        await app({**scope, "path": inner, "raw_path": inner.encode()}, receive, send)

    return proxy


def request(app: ASGIApp, method: str, url: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as client:
            return await client.request(method, url, **kwargs)

    return asyncio.run(go())


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    backend = FakeBackend(
        n_ctx=1024, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )
    context = llamax.Context("/models/SmolLM2-135M-Instruct-Q8_0.gguf", backend=backend)
    yield context
    assert_idle(context)
    context.close()


def page_fetches() -> list[str]:
    """The URLs the chat page's script fetches (its first argument of each ``fetch``)."""
    return re.findall(r"""fetch\(\s*["'`]([^"'`]+)["'`]""", PAGE)


def test_page_fetches_are_relative_and_reach_the_server_behind_a_prefix(
    ctx: llamax.Context,
) -> None:
    app = behind_proxy(create_app(ctx))
    page = request(app, "GET", PREFIX + "/")
    assert page.status_code == 200 and "llamax chat" in page.text
    fetched = page_fetches()
    assert {"health", "props", "v1/chat/completions"} <= {u.lstrip("./") for u in fetched}
    for url in fetched:
        resolved = urljoin(f"http://host{PREFIX}/", url)
        path = urlsplit(resolved).path
        assert path.startswith(PREFIX + "/"), f"{url!r} leaves the prefix: {resolved}"
        if path.endswith("/chat/completions"):
            answer = request(app, "POST", path, json={"messages": HELLO, "max_tokens": 2})
        else:
            answer = request(app, "GET", path)
        assert answer.status_code == 200, (url, answer.text)


def test_favicon_is_not_a_404(ctx: llamax.Context) -> None:
    answer = request(create_app(ctx, api_key="k"), "GET", "/favicon.ico")
    assert answer.status_code == 204  # public, as browsers ask for it without a key


def test_models_id_is_the_file_name_and_the_old_name_still_answers(
    ctx: llamax.Context,
) -> None:
    app = create_app(ctx)
    listed = request(app, "GET", "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["SmolLM2-135M-Instruct-Q8_0"]
    for name in ("SmolLM2-135M-Instruct-Q8_0", ctx.model_name):
        got = request(app, "GET", f"/v1/models/{name}")
        assert got.status_code == 200 and got.json()["id"] == "SmolLM2-135M-Instruct-Q8_0"
    assert request(app, "GET", "/v1/models/nope").status_code == 404
    assert request(app, "GET", "/health").json()["model"] == "SmolLM2-135M-Instruct-Q8_0"
    reply = request(app, "POST", "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1})
    assert reply.json()["model"] == "SmolLM2-135M-Instruct-Q8_0"  # a request naming none


def test_a_context_without_a_file_keeps_its_metadata_name() -> None:
    context = llamax.Context(backend=FakeBackend(n_ctx=256))
    try:
        listed = request(create_app(context), "GET", "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [context.model_name]
    finally:
        context.close()


def test_the_page_fits_a_phone_and_short_bubbles_do_not_wrap() -> None:
    """The CSS rules that keep ``Hi!`` on one line (the row's column caps the width, not the
    bubble's percentage of itself) and the composer on a 390 px screen (the headless
    Chromium check is tests/test_server_browser.py)."""
    assert re.search(r"\.msg > div \{[^}]*max-width: 85%", PAGE)
    assert re.search(r"\.bubble \{[^}]*max-width: 100%", PAGE)
    assert re.search(r"main \{[^}]*min-height: 0", PAGE)
    assert "100dvh" in PAGE
