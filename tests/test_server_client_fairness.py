"""Fair turns between clients (issue 54, finding 9), in-process on the fake: every request
the server submits carries its client's fairness key (the peer address), so one client's
40 concurrent one-sequence requests hold one share together and another client's first
request is admitted within a few engine steps, on every chat and text route. The key comes
from the connection only: a body cannot name it. Counted in the fake's decode log (engine
steps), never in seconds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import llamax
from llamax.server import create_app
from llamax.testing import FakeBackend, assert_idle

FLOOD = 40
"""One client's concurrent requests, one sequence each."""
MAX_TOKENS = 200
"""Each flood request's reply: long enough that the flood still runs when the bystander
comes (40 x 200 tokens on 2 sequence ids take about 4,000 steps)."""
A, B = ("10.0.0.1", 1234), ("10.0.0.2", 1234)
TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301, "<fim_prefix>": 302, "<fim_suffix>": 303,
            "<fim_middle>": 304}  # fmt: skip


def _chat(text: str, num: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": num}


BODIES: dict[str, Callable[[str, int], dict[str, Any]]] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": lambda text, num: {"prompt": text, "max_tokens": num},
    "/v1/messages": lambda text, num: {"model": "m", **_chat(text, num)},
    "/v1/responses": lambda text, num: {"input": text, "max_output_tokens": num, "store": False},
    "/completion": lambda text, num: {"prompt": text, "n_predict": num},
    "/infill": lambda text, num: {"input_prefix": text, "input_suffix": "", "n_predict": num},
}


@pytest.fixture
def fake() -> Iterator[tuple[llamax.Context, FakeBackend]]:
    backend = FakeBackend(n_ctx=16384, n_seq_max=2, n_batch=512, special_tokens=SPECIALS,
                          metadata={"tokenizer.chat_template": TEMPLATE})  # fmt: skip
    ctx = llamax.Context(backend=backend, max_step_ms=None)
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


Submitted = list[tuple[int, list[int], str | None]]
"""Each engine request as submitted: the steps taken before it came, its prompt tokens
(images left out) and its fairness key."""


def recorded(ctx: llamax.Context, backend: FakeBackend, mp: pytest.MonkeyPatch) -> Submitted:
    """Record every request the context takes (``add_request`` and the OpenAI facade both
    go through ``_submit``)."""
    submitted: Submitted = []
    submit = ctx._submit

    def spy(prompt: Any, *args: Any, **kwargs: Any) -> llamax.RequestHandle:
        if isinstance(prompt, str):
            tokens = ctx.tokenize(prompt)
        else:
            tokens = [t for t in prompt if isinstance(t, int)]
        handle = submit(prompt, *args, **kwargs)
        submitted.append((len(backend.decode_log), tokens, kwargs.get("fair_key")))
        return handle

    mp.setattr(ctx, "_submit", spy)
    return submitted


def hold_until_the_bystander_came(
    backend: FakeBackend, submitted: Submitted, token: int, mp: pytest.MonkeyPatch
) -> None:
    """Hold the engine's steps until the request holding ``token`` is submitted, so the
    flood is still queued when the second client comes however fast the engine steps
    (on a busy machine the HTTP side is slower, and the flood could end first)."""
    decode, came = backend.decode, threading.Event()

    def held(items: Any) -> int:
        for _ in range(12_000):
            if came.is_set() or any(token in tokens for _, tokens, _ in submitted):
                came.set()
                break
            time.sleep(0.01)
        return decode(items)

    mp.setattr(backend, "decode", held)


def admitted_at(backend: FakeBackend, token: int) -> int:
    """The first step that computes a prompt holding ``token``."""
    return next(i for i, step in enumerate(backend.decode_log)
                if any(token in item.token_ids for item in step))  # fmt: skip


def prefilled_at(backend: FakeBackend, prompt: list[int]) -> int:
    """The first step that computes ``prompt`` (a row starting with it)."""
    return next(i for i, step in enumerate(backend.decode_log)
                if any(list(item.token_ids[:len(prompt)]) == prompt for item in step))  # fmt: skip


async def _flood_then_bystander(
    app: Any, path: str, submitted: Submitted
) -> tuple[httpx.Response, int]:
    body = BODIES[path]
    flooder = httpx.ASGITransport(app=app, client=A)
    other = httpx.ASGITransport(app=app, client=B)
    async with (
        httpx.AsyncClient(transport=flooder, base_url="http://test", timeout=120) as a,
        httpx.AsyncClient(transport=other, base_url="http://test", timeout=120) as b,
    ):
        flood = [asyncio.ensure_future(a.post(path, json=body(f"story {i}", MAX_TOKENS)))
                 for i in range(FLOOD)]  # fmt: skip
        for _ in range(20_000):  # until every flood request is in the engine
            if len(submitted) >= FLOOD or any(f.done() for f in flood):
                break
            await asyncio.sleep(0.01)
        answer = await b.post(path, json=body("ZZZZ", 1))
        running = sum(not f.done() for f in flood)
        for f in flood:
            f.cancel()  # the flooder leaves: its requests are cancelled
        await asyncio.gather(*flood, return_exceptions=True)
    return answer, running


@pytest.mark.parametrize("path", list(BODIES))
def test_a_second_client_is_admitted_within_steps_of_40_requests_of_another(
    fake: Any, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Before: every one of the flood's requests was a share of its own, so the second
    client's first request waited behind the 38 queued ones (thousands of steps)."""
    ctx, backend = fake
    submitted = recorded(ctx, backend, monkeypatch)
    bystander = ctx.tokenize("ZZZZ", add_special=False)[0]
    hold_until_the_bystander_came(backend, submitted, bystander, monkeypatch)
    answer, running = asyncio.run(_flood_then_bystander(create_app(ctx), path, submitted))
    assert answer.status_code == 200, answer.text[:300]
    came = next(step for step, tokens, _ in submitted if bystander in tokens)
    waited = admitted_at(backend, bystander) - came
    assert waited <= MAX_TOKENS + 8, f"{path}: the second client waited {waited} steps"
    assert running >= FLOOD - 4, f"only {running} flood requests were still running"
    keys = {key for _, tokens, key in submitted if bystander not in tokens}
    assert keys == {"client:10.0.0.1"}, keys
    assert [key for _, tokens, key in submitted if bystander in tokens] == ["client:10.0.0.2"]


def test_two_clients_take_turns(fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Client A sends 12 text requests, then client B 12 (each prompt a token of its own,
    three times; no end of text): once B's are in, the sequence ids go to A and B in turn
    (first come, first served gave A all its 12 first)."""
    ctx, backend = fake
    submitted = recorded(ctx, backend, monkeypatch)
    app = create_app(ctx)

    async def go() -> list[httpx.Response]:
        sent: list[asyncio.Future[httpx.Response]] = []
        for client, first in ((A, 100), (B, 150)):
            transport = httpx.ASGITransport(app=app, client=client)
            http = httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120)
            sent += [asyncio.ensure_future(http.post("/v1/completions", json={
                "prompt": [first + i] * 3, "max_tokens": 60, "logit_bias": {"0": -100}}))
                for i in range(12)]  # fmt: skip
            for _ in range(20_000):
                if len(submitted) >= len(sent) or any(f.done() for f in sent):
                    break
                await asyncio.sleep(0.01)
        return list(await asyncio.gather(*sent))

    answers = asyncio.run(go())
    assert all(a.status_code == 200 for a in answers)
    b_in = max(step for step, tokens, _ in submitted if tokens[0] >= 150)
    starts = sorted((prefilled_at(backend, t), "ab"[t[0] >= 150]) for _, t, _ in submitted)
    after = "".join(name for step, name in starts if step >= b_in)[:6]
    assert after.count("b") >= 3, f"admitted after B came: {after}"
    assert {key for _, t, key in submitted} == {"client:10.0.0.1", "client:10.0.0.2"}


@pytest.mark.parametrize("lenient", [False, True])
def test_a_body_cannot_name_its_fairness_key(
    fake: Any, monkeypatch: pytest.MonkeyPatch, lenient: bool
) -> None:
    """``fair_key`` in a body is an unknown field like any other: refused (400), or
    dropped under ``--lenient``; the key is always the peer's."""
    ctx, backend = fake
    submitted = recorded(ctx, backend, monkeypatch)
    app = create_app(ctx, lenient=lenient)

    async def go() -> dict[str, int]:
        transport = httpx.ASGITransport(app=app, client=A)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            codes = {}
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
                body = {**BODIES[path]("hi", 2), "fair_key": "client:10.0.0.2"}
                codes[path] = (await http.post(path, json=body, timeout=60)).status_code
            return codes

    codes = asyncio.run(go())
    assert set(codes.values()) == ({200} if lenient else {400}), codes
    assert {key for _, _, key in submitted} <= {"client:10.0.0.1"}
    assert len(submitted) == (3 if lenient else 0)


def test_the_key_is_the_peer_address_or_none() -> None:
    """The peer's host names the client (its port does not: one client, many connections);
    with no peer known there is no client key (a request is a share of its own)."""
    from starlette.requests import Request

    from llamax.server.fairness import client_key

    def scope(client: tuple[str, int] | None) -> Request:
        return Request({"type": "http", "client": client, "headers": []})

    assert client_key(scope(("10.0.0.1", 1))) == client_key(scope(("10.0.0.1", 2)))
    assert client_key(scope(("10.0.0.1", 1))) == "client:10.0.0.1"
    assert client_key(scope(None)) is None
