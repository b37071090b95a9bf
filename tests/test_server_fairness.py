"""One request's share of the engine (issue 54, finding 9), in-process on the fake: a body
asking for more sequences than ``max_sequences`` is a 400 in its API's shape before
anything is queued, and a large allowed batch does not hold a bystander back beyond a few
engine steps (counted in the fake's decode log, never in seconds)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import llamax
from llamax.server import create_app
from llamax.testing import FakeBackend, assert_idle

FINDING = {"prompt": [f"p{i}" for i in range(64)], "n_cmpl": 256, "n_predict": 1}
"""The finding's body: 64 prompts x 256 choices = 16,384 sequences."""


@pytest.fixture
def fake() -> Iterator[tuple[llamax.Context, FakeBackend]]:
    backend = FakeBackend(n_ctx=4096, n_seq_max=4, n_batch=512)
    ctx = llamax.Context(backend=backend, max_step_ms=None)
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


def post(app: Any, path: str, body: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=120)

    return asyncio.run(go())


def test_the_16384_sequence_completion_is_a_400_in_llama_servers_shape(fake: Any) -> None:
    """Before: accepted, 16,384 sequences queued (a bystander got nothing in 50 s)."""
    ctx, backend = fake
    response = post(create_app(ctx), "/completion", FINDING)
    assert response.status_code == 400, response.text[:200]
    error = response.json()["error"]
    assert set(response.json()) == {"error"} and error["code"] == 400
    assert error["type"] == "invalid_request_error"
    assert "16384 sequences (64 prompts x 256 choices)" in error["message"]
    assert "at most 64" in error["message"] and "--max-sequences-per-request" in error["message"]
    assert backend.decode_log == []  # nothing ran


def test_openai_n_over_the_bound_is_a_400_naming_n(fake: Any) -> None:
    ctx, backend = fake
    app = create_app(ctx)
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "n": 65, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"},  # the bound is checked before any image is read
            {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}],
            "n": 65, "max_tokens": 1}),
    ]:  # fmt: skip
        response = post(app, path, body)
        assert response.status_code == 400, (path, response.text[:200])
        error = response.json()["error"]
        assert error["param"] == "n" and error["code"] == "too_many_sequences"
        assert "65 choices" in error["message"] and "at most 64" in error["message"]
    assert backend.decode_log == []
    small = create_app(ctx, max_sequences=2)
    response = post(small, "/completion", {"prompt": ["a", "b", "c"], "n_predict": 1})
    assert response.status_code == 400 and "at most 2" in response.json()["error"]["message"]
    assert post(small, "/completion", {"prompt": ["a", "b"], "n_predict": 1}).status_code == 200


def test_a_large_allowed_batch_does_not_hold_a_bystander_back(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 prompts x 4 choices (64 sequences, allowed) then a one-token bystander from
    another client: the bystander's prompt is computed within a few steps of its
    submission. Before: it waited until every one of the batch's prompts had been admitted
    (hundreds of steps). (One client's own requests queue behind each other: they share
    its key, tests/test_server_client_fairness.py.)"""
    ctx, backend = fake
    app = create_app(ctx)
    bystander = ctx.tokenize("ZZZZ", add_special=False)[0]
    submitted: list[int] = []
    add_request = ctx.add_request

    def recorded(prompt: Any, *args: Any, **kwargs: Any) -> llamax.RequestHandle:
        if bystander in prompt:
            submitted.append(len(backend.decode_log))  # the steps taken before it came
        return add_request(prompt, *args, **kwargs)

    monkeypatch.setattr(ctx, "add_request", recorded)
    batch = {"prompt": [f"story {i}" for i in range(16)], "n_cmpl": 4, "n_predict": 200}

    async def go() -> tuple[httpx.Response, bool]:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.1", 123))
        other = httpx.ASGITransport(app=app, client=("10.0.0.2", 123))
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://test") as client,
            httpx.AsyncClient(transport=other, base_url="http://test") as bystander_client,
        ):
            big = asyncio.ensure_future(client.post("/completion", json=batch, timeout=120))
            for _ in range(10_000):  # until the batch is decoding
                if len(backend.decode_log) >= 3:
                    break
                await asyncio.sleep(0.01)
            small = {"prompt": "ZZZZ", "n_predict": 1}
            answer = await bystander_client.post("/completion", json=small, timeout=120)
            running = not big.done()
            big.cancel()  # the client leaves: its sequences are cancelled
            return answer, running

    answer, running = asyncio.run(go())
    assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 1
    assert running, "the batch had finished before the bystander came"
    admitted = next(i for i, step in enumerate(backend.decode_log)
                    if any(bystander in item.token_ids for item in step))  # fmt: skip
    waited = admitted - submitted[0]
    assert waited <= 4, f"the bystander waited {waited} steps behind the batch"
