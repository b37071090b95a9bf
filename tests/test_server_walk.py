"""The server's one path (issue 58): every completion route is a ``CompletionRoute`` object
served by ``serve()``, and a request's walk builds no closure in the server and crosses at
most three threads beside the event loop (the parse in a worker, the rendering and
submission in a worker, the engine). Fake backend; the walk is traced with a profiler."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import httpx
import pytest
from test_chat import make

from llamax.server import BackgroundServer, create_app

COMPLETION_PATHS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/responses": "responses",
    "/completion": "completion",
    "/completions": "completion",
    "/infill": "infill",
}

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "Hi!"}]},
    "/v1/responses": {"input": "Hi!", "max_output_tokens": 4},
    "/completion": {"prompt": "Hi", "n_predict": 4},
}  # fmt: skip

# Closures of the server that run in a request and are built once per app (the route's
# endpoint, the API-key dependency) or per connection by the shutdown middleware.
PER_APP = {"_endpoint.<locals>.endpoint", "api_routes.<locals>.require_key",
           "responses_routes.<locals>.require_key", "llama_routes.<locals>.require_key",
           "_AnswerCutRequests.__call__.<locals>.watched"}  # fmt: skip


def _routes(routes: list[Any]) -> Iterator[Any]:
    """Every route of an app, included routers flattened."""
    for route in routes:
        inner = getattr(route, "original_router", None) or getattr(route, "router", None)
        if inner is not None and hasattr(inner, "routes"):
            yield from _routes(inner.routes)
        else:
            yield route


def test_every_completion_path_is_a_route_object_served_by_serve() -> None:
    with make("Hello there!") as ctx:
        app = create_app(ctx)
        found = {}
        for route in _routes(app.routes):
            served = getattr(getattr(route, "endpoint", None), "route", None)
            if served is not None:
                for method in getattr(route, "methods", ()):
                    assert method == "POST"
                found[route.path] = served.endpoint  # type: ignore[attr-defined]
        assert found == COMPLETION_PATHS


class _Walk:
    """The closures defined in ``llamax/server/`` that run, and the threads that run any
    of llamax's code, while :attr:`on` is set."""

    def __init__(self) -> None:
        self.on = threading.Event()
        self.closures: set[str] = set()
        self.threads: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not self.on.is_set():
            return
        code = frame.f_code
        if "/llamax/" not in code.co_filename:
            return
        self.threads.add(threading.current_thread().name)
        name = code.co_qualname
        comprehension = any(
            k in name for k in ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")
        )
        if "/llamax/server/" in code.co_filename and "<locals>" in name and not comprehension:
            self.closures.add(name)


@pytest.fixture
def walk() -> Iterator[_Walk]:
    tracer = _Walk()
    threading.setprofile(tracer)  # every thread started from here on: the engine's too
    try:
        yield tracer
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_request_builds_no_closure_in_the_server_and_crosses_three_threads(
    walk: _Walk, path: str, stream: bool
) -> None:
    with make("Hello there!", autostart=True) as ctx, BackgroundServer(create_app(ctx)) as srv:
        body = {**BODIES[path], "stream": stream}
        assert httpx.post(srv.url + path, json=body, timeout=30).status_code == 200  # warm
        sys.setprofile(walk)
        walk.on.set()
        reply = httpx.post(srv.url + path, json=body, timeout=30)
        walk.on.clear()
        sys.setprofile(None)
        assert reply.status_code == 200, reply.text
        assert walk.closures <= PER_APP, walk.closures - PER_APP
        loop = next(t for t in walk.threads if t.startswith("llamax-server"))
        others = walk.threads - {loop, "MainThread"}  # MainThread: this test's client
        assert len(others) <= 3, others  # a parse worker, a render worker, the engine
