"""The server app on the fake backend, through httpx's ASGI transport (no model, no socket)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import llamax
from llamax.server import create_app, main
from llamax.testing import FakeBackend, FakeSampler, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
HELLO = [{"role": "user", "content": "Hi"}]


class BrittleBackend(FakeBackend):
    """Cannot build a sampler for seed 666: that request fails, the context survives."""

    def new_sampler(
        self, params: llamax.SamplingParams, seed: int, history: Sequence[int], **kw: Any
    ) -> FakeSampler:
        if params.seed == 666:
            raise RuntimeError("no sampler for you")
        return super().new_sampler(params, seed, history, **kw)


def fake_context(backend: FakeBackend | None = None) -> llamax.Context:
    backend = backend or BrittleBackend(
        n_ctx=1024, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )
    return llamax.Context(backend=backend)


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    context = fake_context()
    yield context
    if not context.closed:
        assert_idle(context)
    context.close()


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_chat_and_text_completions(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    chat = call(app, "POST", "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 5})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    greedy = {"prompt": "abc", "max_tokens": 3, "temperature": 0}
    text = call(app, "POST", "/v1/completions", json=greedy)
    assert text.json()["choices"][0]["text"] == "def"
    stream = call(app, "POST", "/v1/completions",
                  json={"prompt": "abc", "max_tokens": 3, "stream": True})  # fmt: skip
    events = [line for line in stream.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert "usage" not in stream.text  # only asked for with stream_options.include_usage


def test_speculative_extension_reports_prediction_tokens(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    body = {"prompt": "abcdefghijklmnopqrstuvwxyz" * 2, "max_tokens": 30, "temperature": 0}
    plain = call(app, "POST", "/v1/completions", json=body).json()
    assert "completion_tokens_details" not in plain["usage"]
    ctx._engine.scheduler.drafts.priced = False  # verify every proposal (timings are fake)
    spec = call(app, "POST", "/v1/completions", json={**body, "speculative": {"max_draft": 4}})
    assert spec.status_code == 200, spec.text
    usage = spec.json()["usage"]
    assert spec.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0


def test_a_failed_request_is_500_and_the_server_keeps_serving(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    failed = call(app, "POST", "/v1/completions", json={"prompt": "a", "seed": 666})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    ok = call(app, "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_an_engine_failure_is_500_then_503(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    ctx._backend.forced_statuses.append(-3)  # type: ignore[attr-defined]  # test seam
    failed = call(app, "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_error"
    after = call(app, "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert after.status_code == 503 and "retry-after" in after.headers
    assert call(app, "GET", "/health").json()["status"] == "closed"


def test_health_while_loading() -> None:
    loading: concurrent.futures.Future[llamax.Context] = concurrent.futures.Future()
    app = create_app(loading)
    health = call(app, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    busy = call(app, "POST", "/v1/completions", json={"prompt": "a"})
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_loading"
    ctx = fake_context()
    loading.set_result(ctx)
    try:
        assert call(app, "GET", "/health").json()["status"] == "ok"
        one = call(app, "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert one.is_success
    finally:
        assert_idle(ctx)
        ctx.close()


def test_cors_is_off_unless_configured(ctx: llamax.Context) -> None:
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    closed = call(create_app(ctx), "OPTIONS", "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in closed.headers
    opened = call(create_app(ctx, cors_origins=["http://example.com"]), "OPTIONS",
                  "/v1/completions", headers=preflight)  # fmt: skip
    assert opened.headers["access-control-allow-origin"] == "http://example.com"


def test_each_app_has_its_own_metrics(ctx: llamax.Context) -> None:
    first, second = create_app(ctx), create_app(ctx)
    call(first, "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert 'outcome="success"} 1.0' in call(first, "GET", "/metrics").text
    assert 'outcome="success"}' not in call(second, "GET", "/metrics").text


def test_unknown_route_and_method_use_the_error_shape(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    missing = call(app, "GET", "/v1/nothing")
    assert missing.status_code == 404 and set(missing.json()["error"]) >= {"message", "type"}
    wrong = call(app, "GET", "/v1/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_chat_page_is_self_contained(ctx: llamax.Context) -> None:
    page = call(create_app(ctx), "GET", "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN, no fetches out


def test_create_app_checks_its_options(ctx: llamax.Context) -> None:
    with pytest.raises(ValueError, match="max_queue"):
        create_app(ctx, max_queue=0)
    with pytest.raises(ValueError, match="api_key"):
        create_app(ctx, api_key="")


def test_cli_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    assert "--n-seq-max" in capsys.readouterr().out
    assert main(["--port", "not-a-port"]) == 2
    assert main(["/no/such/model.gguf", "--port", "0", "--log-level", "critical"]) == 1


NOT_BOOLEANS = [
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 4, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 4, "stream": True,
                              "stream_options": {"include_usage": "no"}}, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": "no"}, "stream"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "stream": "yes"}, "stream"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "store": "no"}, "store"),
    ("/v1/responses", {"input": "Hi", "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("/v1/messages", {"messages": HELLO, "max_tokens": 4, "stream": "no"}, "stream"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "field"), NOT_BOOLEANS)
def test_a_flag_that_is_not_a_json_boolean_is_400_naming_it(
    ctx: llamax.Context, path: str, body: dict[str, Any], field: str
) -> None:
    """Regression (issue 36, item 9): ``stream: "yes"`` streamed and ``store: "no"`` stored."""
    app = create_app(ctx)
    response = call(app, "POST", path, json=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")  # not a stream
    if path == "/v1/messages":
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(field)
    else:
        assert response.json()["error"]["param"] == field
    assert ctx.stats().num_waiting == ctx.stats().num_running == 0
    assert call(app, "GET", "/v1/responses/anything").status_code == 404  # nothing stored


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "Hi", "temperature": 10**400}),
        ("/v1/messages", {"messages": HELLO, "max_tokens": 4, "temperature": 10**400}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 10**400}),
    ],
)
def test_a_huge_number_is_400_not_500(ctx: llamax.Context, path: str, body: dict[str, Any]) -> None:
    """Regression (issue 36, item 9): ``float()`` of a huge int raised OverflowError (a 500)."""
    response = call(create_app(ctx), "POST", path, json=body)
    assert response.status_code == 400, response.text


def test_requests_cut_by_the_shutdown_timeout_get_a_503_in_their_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression (issue 36, item 9): uvicorn cancels what still runs when the shutdown
    timeout ends, and answered it with a plain-text 500 and a logged traceback."""
    from llamax.server import BackgroundServer

    backend = FakeBackend(
        n_ctx=4096, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )
    ctx = llamax.Context(backend=backend)
    backend.fault = lambda where: time.sleep(0.02) if where == "decode" else None  # ~50 tok/s
    server = BackgroundServer(create_app(ctx), shutdown_timeout=1)
    server.start()
    requests = {
        "/v1/completions": {"prompt": "Hi", "max_tokens": 1000},
        "/v1/messages": {"messages": HELLO, "max_tokens": 1000},
    }
    replies: dict[str, httpx.Response] = {}
    threads = [
        threading.Thread(
            target=lambda p=path, b=body: replies.update(
                {p: httpx.post(server.url + p, json=b, timeout=30)}
            )
        )
        for path, body in requests.items()
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while ctx.stats().num_running < 2:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.01)
        with caplog.at_level(logging.INFO):
            server.stop()
        for thread in threads:
            thread.join(30)
        openai, anthropic = replies["/v1/completions"], replies["/v1/messages"]
        assert (openai.status_code, anthropic.status_code) == (503, 503), openai.text
        assert openai.json()["error"]["code"] == "server_shutting_down"
        assert anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "overloaded_error"
        assert "Exception in ASGI application" not in caplog.text
    finally:
        backend.fault = None
        assert_idle(ctx)  # the cut requests were cancelled, their cells freed
        ctx.close()
