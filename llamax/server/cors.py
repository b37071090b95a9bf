"""llama-server's CORS, on llama-server's own inference and information routes only.

llama-server answers every origin by default: it echoes the request's ``Origin`` with
``Access-Control-Allow-Credentials: true``, and answers a preflight (``OPTIONS``) with
methods ``GET, POST, DELETE, OPTIONS`` and headers ``*`` before any key check (browsers
send no key on a preflight). Clients written against it (a web UI on another port, an
editor's webview) rely on that, so llamax does the same on the routes such clients call:
:data:`NATIVE_PATHS`. Everything else keeps CORS off unless ``cors_origins`` allows an
origin: the OpenAI and Anthropic routes under ``/v1`` (where llamax's default has always
been off), the stored responses, ``/metrics``, and the routes that change server state or
write files (``POST /slots/{id}``, ``/models/load``, ``/models/unload``,
``/reset_prefix_cache``). An API key still guards every route it guarded: CORS only lets a
page read the answer to a request it was allowed to make.
"""

from __future__ import annotations

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["NATIVE_PATHS", "LlamaCors"]

NATIVE_PATHS = frozenset(
    {"/health", "/completion", "/completions", "/chat/completions",
     "/chat/completions/input_tokens", "/responses", "/responses/input_tokens", "/infill",
     "/tokenize", "/detokenize", "/apply-template", "/props", "/slots", "/models"}
)  # fmt: skip
"""The un-prefixed llama-server routes that answer any origin by default."""

_ALLOW_ORIGIN = b"Access-Control-Allow-Origin"
_PREFLIGHT = [
    (b"Access-Control-Allow-Credentials", b"true"),
    (b"Access-Control-Allow-Methods", b"GET, POST, DELETE, OPTIONS"),
    (b"Access-Control-Allow-Headers", b"*"),
    (b"content-type", b"text/html"),
    (b"content-length", b"0"),
]
"""A preflight's answer. The CORS names are spelled as llama-server spells them: header
names are case-insensitive, but some of its clients (llama.cpp's own tests among them)
look them up in a plain dict."""


class LlamaCors:
    """ASGI middleware: llama-server's default CORS on :data:`NATIVE_PATHS`.

    A preflight (``OPTIONS`` with an ``Origin``) on one of them is answered 200 here, as
    llama-server answers it; any other request to one of them gets the ``Origin`` echoed
    in ``Access-Control-Allow-Origin``. Other paths pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").rstrip("/") or "/"
        if scope["type"] != "http" or path not in NATIVE_PATHS:
            await self.app(scope, receive, send)
            return
        origin = Headers(scope=scope).get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        allow = (_ALLOW_ORIGIN, origin.encode("latin-1"))
        if scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [allow, *_PREFLIGHT]})  # fmt: skip
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).add_vary_header("Origin")
                message["headers"] = [*message["headers"], allow]
            await send(message)

        await self.app(scope, receive, with_origin)
