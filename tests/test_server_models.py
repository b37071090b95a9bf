"""Several models behind one server (``ModelPool``): the pool's logic on fake contexts, then
two real models (SmolLM2 under two names) through the ``openai`` client.

After each test every loaded context is idle (nothing leaked) and the pool is closed.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.server import BackgroundServer, ModelPool, create_app, main
from llamax.server.cli import _model_pool, build_parser
from llamax.server.models import DEFAULT_MAX_LOADED
from llamax.testing import FakeBackend, alphabet_model, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
HELLO = [{"role": "user", "content": "Hi"}]
TEXT = {"prompt": "abc", "max_tokens": 2, "temperature": 0}


class SlowBackend(FakeBackend):
    """A fake backend whose every decode takes ``step_delay`` seconds of real time."""

    def __init__(self, step_delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.step_delay = step_delay

    def decode(self, items: Sequence[BatchItem]) -> int:
        time.sleep(self.step_delay)
        return super().decode(items)


class Factory:
    """Builds fake contexts and counts them; ``gate`` (when set) holds every load until it
    opens, ``fail`` makes the next loads raise, ``next_token`` is the fake model, and
    ``step_delay`` the real time each decode takes (requests then last)."""

    def __init__(
        self,
        gate: threading.Event | None = None,
        fail: int = 0,
        next_token: Callable[[Sequence[int]], int] = alphabet_model,
        step_delay: float = 0.0,
    ) -> None:
        self.gate, self.fail, self.next_token = gate, fail, next_token
        self.step_delay = step_delay
        self.started = threading.Event()
        self.num_calls = 0
        self.made: list[llamax.Context] = []

    def __call__(self) -> llamax.Context:
        self.num_calls += 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            self.fail -= 1
            raise FileNotFoundError("no such file: /models/bad.gguf")
        backend = SlowBackend(
            self.step_delay,
            n_ctx=1024,
            n_seq_max=8,
            metadata={"tokenizer.chat_template": TEMPLATE},
            special_tokens=SPECIALS,
            next_token=self.next_token,
        )
        ctx = llamax.Context(backend=backend)
        self.made.append(ctx)
        return ctx


@pytest.fixture
def pools() -> Iterator[Callable[..., ModelPool]]:
    """Build pools; after the test each loaded context is idle, then every pool is closed
    and its contexts with it."""
    made: list[ModelPool] = []

    def make(models: dict[str, Any], **options: Any) -> ModelPool:
        pool = ModelPool(models, **options)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        assert_pool_idle(pool)
        pool.close()
        assert all(info.context is None for info in pool.models())


def assert_pool_idle(pool: ModelPool) -> None:
    """No model pinned; each loaded one idle (pinned while checked, so that the unloader
    cannot close it meanwhile). A response's last byte goes out just before its request
    unpins the model, so this waits a little for that."""
    wait_for(lambda: all(info.num_users == 0 for info in pool.models()))
    for info in pool.models():
        if info.context is None or pool.closed:
            continue
        held = pool.acquire(info.name)
        ctx = held.result(60)
        try:
            assert_idle(ctx, timeout=60)
        finally:
            pool.release(held)


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(path, json=body)


def run(app: Any, scenario: Callable[[httpx.AsyncClient], Any]) -> Any:
    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await scenario(client)

    return asyncio.run(go())


def states(pool: ModelPool) -> dict[str, str]:
    return {info.name: info.state.value for info in pool.models()}


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until ``predicate()`` holds (it polls the pool's state)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for a pool state"
        time.sleep(0.01)


# --- the pool on fake contexts --------------------------------------------------------------


def test_each_route_goes_to_the_model_it_names(pools: Callable[..., ModelPool]) -> None:
    a, b = Factory(), Factory()
    pool = pools({"a": a, "b": b})
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["status"]["value"]) for m in listed] == [
            ("a", "unloaded"), ("b", "unloaded"),
        ]  # fmt: skip
        assert (await post(client, "/v1/completions", {**TEXT, "model": "b"})).is_success
        assert a.num_calls == 0 and b.num_calls == 1
        chat = {"model": "a", "messages": HELLO, "max_tokens": 2}
        assert (await post(client, "/v1/chat/completions", chat)).is_success
        messages = {"model": "b", "messages": HELLO, "max_tokens": 2}
        assert (await post(client, "/v1/messages", messages)).is_success
        counted = await post(client, "/v1/messages/count_tokens", {"model": "b", "messages": HELLO})
        assert counted.json()["input_tokens"] > 0
        assert (await post(client, "/v1/responses", {"model": "a", "input": "Hi"})).is_success
        assert (await post(client, "/tokenize", {"content": "ab", "model": "b"})).is_success
        assert (await post(client, "/detokenize", {"tokens": [97], "model": "a"})).is_success
        default = await post(client, "/v1/completions", TEXT)  # no model: the first
        assert default.is_success
        listed = (await client.get("/v1/models")).json()["data"]
        assert all(m["status"]["value"] == "loaded" and "n_ctx" in m["meta"] for m in listed)
        health = (await client.get("/health")).json()
        assert health["status"] == "ok" and health["models"] == {"a": "loaded", "b": "loaded"}

    run(app, scenario)
    assert a.num_calls == b.num_calls == 1


def test_an_unknown_model_is_404_on_every_route(pools: Callable[..., ModelPool]) -> None:
    pool = pools({"a": Factory()})
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        for path, body in [
            ("/v1/completions", {**TEXT, "model": "zz"}),
            ("/v1/chat/completions", {"model": "zz", "messages": HELLO}),
            ("/v1/responses", {"model": "zz", "input": "Hi"}),
            ("/v1/embeddings", {"model": "zz", "input": "Hi"}),
            ("/tokenize", {"model": "zz", "content": "Hi"}),
        ]:
            reply = await post(client, path, body)
            assert reply.status_code == 404, path
            error = reply.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert "'zz'" in error["message"] and "a" in error["message"]
        anthropic = await post(client, "/v1/messages", {"model": "zz", "messages": HELLO})
        assert anthropic.status_code == 404
        assert anthropic.json()["error"]["type"] == "not_found_error"
        wrong = await post(client, "/v1/completions", {**TEXT, "model": 3})
        assert wrong.status_code == 400

    run(app, scenario)
    assert states(pool) == {"a": "unloaded"}
    metrics = run(app, lambda client: client.get("/metrics")).text
    assert 'llamax_requests_total{endpoint="completions",outcome="client_error"} 2.0' in metrics
    assert "llamax_requests_in_flight 0.0" in metrics


def test_models_max_unloads_the_least_recently_used(pools: Callable[..., ModelPool]) -> None:
    factories = {name: Factory() for name in "abc"}
    pool = pools(factories, max_loaded=2)
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        for name in ["a", "b", "a", "c"]:  # b is the least recently used when c loads
            assert (await post(client, "/v1/completions", {**TEXT, "model": name})).is_success
        assert states(pool) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert (await post(client, "/v1/completions", {**TEXT, "model": "b"})).is_success
        assert states(pool) == {"a": "unloaded", "b": "loaded", "c": "loaded"}

    run(app, scenario)
    assert [f.num_calls for f in factories.values()] == [1, 2, 1]
    assert all(ctx.closed for ctx in factories["a"].made[:1] + factories["b"].made[:1])
    metrics = run(app, lambda client: client.get("/metrics")).text
    assert 'llamax_model_loaded{model="b"} 1.0' in metrics
    assert 'llamax_model_loaded{model="a"} 0.0' in metrics
    assert 'llamax_model_unloads_total{model="a"} 1.0' in metrics
    assert 'llamax_model_loads_total{model="b",outcome="success"} 2.0' in metrics
    # each loaded model's engine figures, labelled; none for the unloaded one
    cells = factories["b"].made[-1].stats().kv_cells_total
    assert f'llamax_kv_cells_total{{model="b"}} {float(cells)}' in metrics
    assert 'llamax_engine_steps_total{model="c"}' in metrics
    assert 'llamax_prefix_ram_bytes{model="c"}' in metrics
    engine_lines = [line for line in metrics.splitlines() if '{model="a"}' in line]
    assert all(line.startswith("llamax_model_") for line in engine_lines), engine_lines


def test_a_model_in_use_is_never_unloaded_to_make_room(pools: Callable[..., ModelPool]) -> None:
    pool = pools({"a": Factory(), "b": Factory()}, max_loaded=1)
    held = pool.acquire("a")
    ctx_a = held.result(60)
    waiting = pool.acquire("b")  # must wait: a is in use and the bound is 1
    time.sleep(0.2)
    # a is drained (it takes no new request), not unloaded: its request still runs
    assert not waiting.done() and states(pool)["a"] == "draining" and not ctx_a.closed
    pool.release(held)
    ctx_b = waiting.result(60)
    assert ctx_a.closed and not ctx_b.closed and states(pool) == {"a": "unloaded", "b": "loaded"}
    pool.release(waiting)


def gated(gate: threading.Event) -> Callable[[Sequence[int]], int]:
    """The alphabet model, each token once ``gate`` has opened."""

    def next_token(history: Sequence[int]) -> int:
        assert gate.wait(30), "the test never opened the gate"
        return alphabet_model(history)

    return next_token


def test_a_waiting_load_drains_the_busy_model_then_serves_in_arrival_order(
    pools: Callable[..., ModelPool],
) -> None:
    """Issue 36 item 6: a request for an unloaded model must not wait for the loaded one to
    go idle (steady traffic never lets it): the loaded one is drained instead, and requests
    that arrive for it meanwhile wait behind the first, for its reload."""
    factories = {name: Factory() for name in "abc"}
    pool = pools(factories, max_loaded=1)
    b1 = pool.acquire("b")
    ctx_b = b1.result(60)
    want_a = pool.acquire("a")
    wait_for(lambda: states(pool)["b"] == "draining")
    b2 = pool.acquire("b")  # a newcomer for b queues behind a, for b's reload
    want_c = pool.acquire("c")
    time.sleep(0.1)
    assert not any(f.done() for f in (want_a, b2, want_c)) and not ctx_b.closed
    assert [info.num_users for info in pool.models()] == [1, 2, 1]
    gauges = {s.labels["model"]: s.value for family in pool.collector().collect()
              if family.name == "llamax_model_loaded" for s in family.samples}  # fmt: skip
    assert gauges == {"a": 0.0, "b": 1.0, "c": 0.0}  # draining, b is still loaded
    pool.release(b1)  # b's last request ends: b unloads, a loads
    ctx_a = want_a.result(60)
    assert ctx_b.closed
    # b's reload is the queue's head now, so a drains in its turn
    wait_for(lambda: states(pool) == {"a": "draining", "b": "loading", "c": "loading"})
    time.sleep(0.1)
    assert not b2.done() and not want_c.done()  # a is in use
    pool.release(want_a)  # then b (it came before c), then c
    assert b2.result(60) is not ctx_b and ctx_a.closed and not want_c.done()
    pool.release(b2)
    want_c.result(60)
    pool.release(want_c)
    assert states(pool) == {"a": "unloaded", "b": "unloaded", "c": "loaded"}
    assert [f.num_calls for f in factories.values()] == [1, 2, 1]


def test_a_load_nobody_waits_for_is_withdrawn_and_the_drain_called_off(
    pools: Callable[..., ModelPool],
) -> None:
    a, b = Factory(), Factory()
    pool = pools({"a": a, "b": b}, max_loaded=1)
    b1 = pool.acquire("b")
    ctx_b = b1.result(60)
    want_a = pool.acquire("a")
    wait_for(lambda: states(pool)["b"] == "draining")
    pool.release(want_a)  # its client left (or its wait timed out) before a could load
    assert states(pool) == {"a": "unloaded", "b": "loaded"}
    b2 = pool.acquire("b")  # b takes requests again, on the same context
    assert b2.result(60) is ctx_b
    # a newcomer queued while b drained gets b's context back when the drain is called off
    want_a = pool.acquire("a")
    wait_for(lambda: states(pool)["b"] == "draining")
    b3 = pool.acquire("b")
    assert not b3.done()
    pool.release(want_a)
    assert b3.result(60) is ctx_b and states(pool) == {"a": "unloaded", "b": "loaded"}
    for future in (b1, b2, b3):
        pool.release(future)
    assert a.num_calls == 0 and b.num_calls == 1 and not ctx_b.closed
    with pytest.raises(ValueError, match="no pin"):
        pool.release(b1)


def test_pooled_models_share_the_default_prefix_budgets(
    pools: Callable[..., ModelPool], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 36 item 6: each pooled model took the whole default RAM-tier budget (5 models:
    125% of the memory available) and disk budget (5 x 8 GiB). The pool now divides one
    budget: RAM among the models loaded at once, disk among all (files outlive a load)."""
    paths = {name: f"/models/{name}.gguf" for name in "abc"}
    assert pools(paths, max_loaded=2, n_ctx=512).context_options == {
        "n_ctx": 512, "prefix_ram_share": 1 / 2, "prefix_disk_share": 1 / 3,
    }  # fmt: skip
    assert pools(paths).context_options["prefix_ram_share"] == 1 / 3  # no bound: all at once
    given = pools(paths, prefix_ram_bytes=1 << 20, prefix_disk_bytes=1 << 30).context_options
    assert "prefix_ram_share" not in given and "prefix_disk_share" not in given
    monkeypatch.setattr("llamax.engine.kv.prefix.default_budget", lambda: 3000)
    monkeypatch.setattr("llamax.engine.kv.prefix.default_disk_budget", lambda directory: 9000)
    shared = {"prefix_ram_share": 1 / 2, "prefix_disk_share": 1 / 3}
    with llamax.Context(backend=FakeBackend(), prefix_disk_dir=str(tmp_path), **shared) as ctx:
        stats = ctx.stats()
        assert (stats.prefix_ram_budget_bytes, stats.prefix_disk_budget_bytes) == (1500, 3000)
    with llamax.Context(backend=FakeBackend(), prefix_disk_dir=str(tmp_path)) as ctx:
        stats = ctx.stats()
        assert (stats.prefix_ram_budget_bytes, stats.prefix_disk_budget_bytes) == (3000, 9000)


def test_a_request_for_another_model_is_served_while_traffic_continues(
    pools: Callable[..., ModelPool],
) -> None:
    """Regression (issue 36 item 6): with ``--models-max 1``, steady traffic to model b kept
    a request for model a waiting over 60 s (b was never idle, and a load waited for an
    idle model). Now a's request is served within a bound while b's traffic goes on, and b's
    traffic is served again after it."""
    pool = pools({"a": Factory(), "b": Factory(step_delay=0.005)}, max_loaded=1)
    app = create_app(pool)
    b_body = {**TEXT, "model": "b", "max_tokens": 40}  # 40 steps: 0.2 s or more

    def users_of_b() -> int:
        return pool.models()[1].num_users

    async def traffic(client: httpx.AsyncClient, stop: asyncio.Event) -> list[httpx.Response]:
        """A request to b every 40 ms, each lasting 0.2 s or more, the next one started
        only once every one not finished holds b (the transport ends a request after the
        app, so after its release): b is never idle, so the old code never loaded a."""
        tasks: list[asyncio.Task[httpx.Response]] = []
        while not stop.is_set():
            tasks.append(asyncio.create_task(post(client, "/v1/completions", b_body)))
            while users_of_b() < sum(not task.done() for task in tasks):
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.04)
        return list(await asyncio.gather(*tasks))

    async def scenario(client: httpx.AsyncClient) -> tuple[float, int, list[httpx.Response]]:
        stop = asyncio.Event()
        driver = asyncio.create_task(traffic(client, stop))
        while pool.models()[1].state.value != "loaded" or users_of_b() < 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        for_a = asyncio.create_task(post(client, "/v1/completions", {**TEXT, "model": "a"}))
        done, _ = await asyncio.wait({for_a}, timeout=60)
        waited = time.monotonic() - started if done else float("inf")
        deadline = time.monotonic() + 60  # b's traffic is served again after a's request
        while pool.models()[1].state.value != "loaded" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        stop.set()
        replies = await driver
        reply = await for_a  # the old code serves it once b's traffic stops
        assert reply.is_success
        return waited, len(replies), replies

    waited, num_b, replies = run(app, scenario)
    assert waited < 60, "a request for a was starved by the traffic to b"
    assert all(reply.is_success for reply in replies) and num_b > 3
    assert pool.models()[1].state.value == "loaded"


def test_a_request_that_cannot_get_its_model_in_time_gets_503(
    pools: Callable[..., ModelPool],
) -> None:
    """The wait for a model is bounded (``max_wait_seconds``): past it the request gets 503
    with ``Retry-After`` in OpenAI's shape, and the drain it started is called off."""
    gate = threading.Event()
    a, b = Factory(), Factory(next_token=gated(gate))
    pool = pools({"a": a, "b": b}, max_loaded=1, max_wait_seconds=0.5)
    app = create_app(pool, retry_after_seconds=3)

    async def scenario(client: httpx.AsyncClient) -> None:
        stuck = asyncio.create_task(post(client, "/v1/completions", {**TEXT, "model": "b"}))
        while pool.models()[1].num_users == 0 or pool.models()[1].state.value != "loaded":
            await asyncio.sleep(0.01)
        started = time.monotonic()
        refused = await post(client, "/v1/completions", {**TEXT, "model": "a"})
        assert 0.4 < time.monotonic() - started < 30  # waited 0.5 s, then gave up
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "3"
        error = refused.json()["error"]
        assert error["code"] == "model_wait_timeout" and "'a'" in error["message"]
        assert error["type"] == "unavailable_error"
        anthropic = await post(client, "/v1/messages",
                               {"model": "a", "messages": HELLO, "max_tokens": 2})  # fmt: skip
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
        assert states(pool) == {"a": "unloaded", "b": "loaded"}  # the drain is off
        gate.set()
        assert (await stuck).is_success
        assert (await post(client, "/v1/completions", {**TEXT, "model": "b"})).is_success

    run(app, scenario)
    assert a.num_calls == 0 and b.num_calls == 1
    metrics = run(app, lambda client: client.get("/metrics")).text
    assert "llamax_requests_in_flight 0.0" in metrics


def test_idle_models_unload_by_the_clock(pools: Callable[..., ModelPool]) -> None:
    now = [1000.0]
    pool = pools({"a": Factory(), "b": Factory()}, idle_unload_seconds=60, clock=lambda: now[0])
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await post(client, "/v1/completions", {**TEXT, "model": "a"})).is_success
        now[0] += 30
        assert (await post(client, "/v1/completions", {**TEXT, "model": "b"})).is_success

    run(app, scenario)
    assert pool.unload_idle() == []
    now[0] += 31  # a: idle 61 s, b: 31 s
    assert pool.unload_idle() == ["a"]
    assert states(pool) == {"a": "unloaded", "b": "loaded"}
    now[0] += 30
    assert pool.unload_idle() == ["b"]


def test_the_unloader_thread_unloads_idle_models(pools: Callable[..., ModelPool]) -> None:
    factory = Factory()
    pool = pools({"a": factory}, idle_unload_seconds=0.2)
    app = create_app(pool)
    assert run(app, lambda client: post(client, "/v1/completions", TEXT)).is_success
    wait_for(lambda: states(pool) == {"a": "unloaded"})
    assert factory.made[0].closed
    assert run(app, lambda client: post(client, "/v1/completions", TEXT)).is_success
    assert factory.num_calls == 2


def test_a_slow_load_blocks_neither_the_loop_nor_another_model(
    pools: Callable[..., ModelPool],
) -> None:
    gate = threading.Event()
    slow, fast = Factory(gate), Factory()
    pool = pools({"slow": slow, "fast": fast})
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        waiting = [
            asyncio.create_task(post(client, "/v1/completions", {**TEXT, "model": "slow"}))
            for _ in range(4)
        ]
        while not slow.started.is_set():
            await asyncio.sleep(0.01)
        listed = (await client.get("/v1/models")).json()["data"]
        assert listed[0]["status"]["value"] == "loading"
        for _ in range(3):  # served while slow loads
            assert (await post(client, "/v1/completions", {**TEXT, "model": "fast"})).is_success
        assert (await client.get("/health")).status_code == 200
        assert not any(task.done() for task in waiting)
        gate.set()
        replies = await asyncio.gather(*waiting)
        assert all(reply.is_success for reply in replies)

    run(app, scenario)
    assert slow.num_calls == 1  # four concurrent first requests, one load


def test_requests_waiting_for_a_load_count_against_max_queue(
    pools: Callable[..., ModelPool],
) -> None:
    gate = threading.Event()
    slow = Factory(gate)
    pool = pools({"slow": slow, "fast": Factory()})
    app = create_app(pool, max_queue=2)

    async def scenario(client: httpx.AsyncClient) -> None:
        waiting = [
            asyncio.create_task(post(client, "/v1/completions", {**TEXT, "model": "slow"}))
            for _ in range(2)
        ]
        while pool.models()[0].num_users < 2:
            await asyncio.sleep(0.01)
        full = await post(client, "/v1/completions", {**TEXT, "model": "fast"})
        assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
        gate.set()
        assert all(reply.is_success for reply in await asyncio.gather(*waiting))

    run(app, scenario)


def test_a_load_failure_is_that_requests_error_and_is_retried(
    pools: Callable[..., ModelPool],
) -> None:
    bad, good = Factory(fail=1), Factory()
    pool = pools({"bad": bad, "good": good})
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        failed = await post(client, "/v1/chat/completions", {"model": "bad", "messages": HELLO})
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "model_load_failed" and "FileNotFoundError" in error["message"]
        assert "/models/bad.gguf" not in error["message"]  # the path stays in the server log
        listed = (await client.get("/v1/models")).json()["data"]
        assert listed[0]["status"] == {
            "value": "unloaded", "last_error": "FileNotFoundError: no such file: /models/bad.gguf"
        }  # fmt: skip
        assert (await post(client, "/v1/completions", {**TEXT, "model": "good"})).is_success
        stream = {"model": "bad", "messages": HELLO, "max_tokens": 2, "stream": True}
        streamed = await post(client, "/v1/messages", stream)
        assert streamed.is_success  # the second load works
        assert (await post(client, "/tokenize", {"content": "a", "model": "bad"})).is_success

    run(app, scenario)
    assert bad.num_calls == 2 and good.num_calls == 1


def test_a_client_leaving_while_its_model_loads(pools: Callable[..., ModelPool]) -> None:
    """The client leaves once the load has begun (the factory runs), so the load is not
    withdrawn: it completes and the model stays. (A client that left after 0.3 s raced the
    loader thread: on a loaded machine the load was still queued, was withdrawn as no
    request waited for it, and the model never loaded.)"""
    gate = threading.Event()
    slow = Factory(gate)
    pool = pools({"slow": slow})
    with BackgroundServer(create_app(pool)) as server:
        body = json.dumps({**TEXT, "model": "slow", "stream": True})
        url = httpx.URL(server.url)
        conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert slow.started.wait(30), "the load never began"
        conn.close()  # the client leaves while the model loads
        wait_for(lambda: pool.models()[0].num_users == 0)  # the wait was cancelled
        gate.set()
        wait_for(lambda: states(pool) == {"slow": "loaded"})
        metrics = httpx.get(server.url + "/metrics").text
        assert 'outcome="cancelled"} 1.0' in metrics and "llamax_requests_in_flight 0.0" in metrics
        assert httpx.post(server.url + "/v1/completions", json=TEXT).is_success


def test_closing_the_pool_refuses_requests(pools: Callable[..., ModelPool]) -> None:
    pool = pools({"a": Factory()})
    app = create_app(pool)
    assert run(app, lambda client: post(client, "/v1/completions", TEXT)).is_success
    pool.close()
    refused = run(app, lambda client: post(client, "/v1/completions", TEXT))
    assert refused.status_code == 503
    assert run(app, lambda client: client.get("/health")).json()["status"] == "closed"


def test_pool_lists_adapters_and_resets_every_loaded_prefix_cache(
    pools: Callable[..., ModelPool], tmp_path: Path
) -> None:
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF fake adapter")
    a, b, c = Factory(), Factory(), Factory()
    pool = pools({"a": a, "b": b, "c": c})
    app = create_app(pool)
    assert run(
        app, lambda client: post(client, "/v1/completions", TEXT | {"model": "a"})
    ).is_success
    assert run(
        app, lambda client: post(client, "/v1/completions", TEXT | {"model": "b"})
    ).is_success
    a.made[0].load_adapter("style", adapter)
    listed = {m["id"]: m for m in run(app, lambda client: client.get("/v1/models")).json()["data"]}
    assert listed["a"]["adapters"] == [{"id": 0, "name": "style", "path": str(adapter)}]
    assert listed["b"]["adapters"] == [] and "adapters" not in listed["c"]  # c is not loaded
    assert a.made[0].stats().num_retained == b.made[0].stats().num_retained == 1
    reset = run(app, lambda client: client.post("/flush_cache"))
    assert reset.json() == {"status": "ok", "freed_sequences": 2}  # a's and b's
    assert a.made[0].stats().num_retained == b.made[0].stats().num_retained == 0
    assert c.num_calls == 0  # resetting loads nothing


def test_one_gguf_under_two_names_gets_a_disk_tier_each(
    pools: Callable[..., ModelPool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 36, item 9): the second name's load failed (500
    model_load_failed) on the first one's lock of the shared disk tier folder."""
    real_context = llamax.Context

    def load(path: str, **options: Any) -> llamax.Context:  # the same model for every path
        backend = FakeBackend(
            n_ctx=1024, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
        )
        return real_context(backend=backend, **options)

    monkeypatch.setattr(llamax, "Context", load)
    names = ["a", "b", "../odd name"]
    disk = {"prefix_disk_dir": str(tmp_path), "prefix_disk_bytes": 1 << 20}
    pool = pools(dict.fromkeys(names, "same.gguf"), **disk)
    app = create_app(pool)
    for name in names:
        reply = run(app, lambda c, n=name: post(c, "/v1/completions", TEXT | {"model": n}))
        assert reply.status_code == 200, reply.text
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders[:2] == ["a", "b"] and folders[2].startswith("model-") and len(folders) == 3
    for folder in tmp_path.iterdir():  # each its own tier, keyed inside by the model
        assert [p.name for p in folder.iterdir()] == [p.name for p in (tmp_path / "a").iterdir()]


def test_responses_name_the_model_the_request_named(pools: Callable[..., ModelPool]) -> None:
    pool = pools({"a": Factory(), "b": Factory()})
    app = create_app(pool)
    chat = {"messages": HELLO, "max_tokens": 2}

    async def scenario(client: httpx.AsyncClient) -> list[Any]:
        named = await post(client, "/v1/chat/completions", chat | {"model": "b"})
        default = await post(client, "/v1/chat/completions", chat)
        text = await post(client, "/v1/completions", TEXT | {"model": "b"})
        streamed = await post(client, "/v1/chat/completions",
                              chat | {"model": "b", "stream": True})  # fmt: skip
        messages = await post(client, "/v1/messages",
                              {"model": "b", "max_tokens": 2, "messages": HELLO})  # fmt: skip
        responses = await post(client, "/v1/responses",
                               {"model": "b", "input": "Hi", "max_output_tokens": 2})  # fmt: skip
        return [named, default, text, streamed, messages, responses]

    named, default, text, streamed, messages, responses = run(app, scenario)
    assert named.json()["model"] == "b" and default.json()["model"] == "a"
    assert text.json()["model"] == "b"
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert chunks and {c["model"] for c in chunks} == {"b"}
    assert messages.json()["model"] == "b" and responses.json()["model"] == "b"


def test_pool_and_cli_refuse_bad_configurations(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        ModelPool({})
    with pytest.raises(ValueError, match="max_loaded"):
        ModelPool({"a": Factory()}, max_loaded=0)
    with pytest.raises(ValueError, match="idle_unload_seconds"):
        ModelPool({"a": Factory()}, idle_unload_seconds=0)
    with pytest.raises(ValueError, match="max_wait_seconds"):
        ModelPool({"a": Factory()}, max_wait_seconds=0)
    with pytest.raises(ValueError, match=r"no \.gguf"):
        ModelPool.from_dir(tmp_path)
    quiet = ["--port", "0", "--log-level", "critical"]
    assert main(["--model", "no-equals-sign", *quiet]) == 2
    assert main(["--models-dir", str(tmp_path), *quiet]) == 2
    assert main(["m.gguf", "--model", "a=b.gguf", *quiet]) == 2
    assert main(["--model", "a=x.gguf", "--model", "a=y.gguf", *quiet]) == 2
    assert main(["--models-max", "2", *quiet]) == 2


def test_models_dir_names_models_by_stem(tmp_path: Path) -> None:
    for name in ["zeta.gguf", "alpha.gguf", "notes.txt"]:
        (tmp_path / name).write_text("")
    pool = ModelPool.from_dir(tmp_path)
    try:
        assert pool.names == ["alpha", "zeta"] and pool.default == "alpha"
    finally:
        pool.close()


def test_a_models_dir_has_a_bound_on_models_loaded_by_default(tmp_path: Path) -> None:
    """Regression (issue 36 item 6): with ``--models-dir`` and no ``--models-max``, one
    client naming each model loaded them all (6 models: 65 -> 1,056 MiB). The default is
    now a small constant, fewer when the largest model does not fit that often in half the
    available memory."""
    for i in range(6):
        (tmp_path / f"m{i}.gguf").write_bytes(b"GGUF" + bytes(1000 * i))
    files = sorted(tmp_path.glob("*.gguf"))
    assert ModelPool.default_max_loaded(files, available_bytes=1 << 40) == DEFAULT_MAX_LOADED == 2
    assert ModelPool.default_max_loaded(files, available_bytes=4 * 5004) == 2
    assert ModelPool.default_max_loaded(files, available_bytes=3 * 5004) == 1
    assert ModelPool.default_max_loaded(files, available_bytes=100) == 1  # at least one
    assert ModelPool.default_max_loaded(files, available_bytes=0) == 2  # unknown: the constant
    assert ModelPool.default_max_loaded([tmp_path / "gone.gguf"]) == 2
    pools = [
        _model_pool(build_parser().parse_args(["--models-dir", str(tmp_path)]), {}),
        _model_pool(build_parser().parse_args(
            ["--models-dir", str(tmp_path), "--models-max", "5", "--models-wait", "7"]), {}),
        _model_pool(build_parser().parse_args(["--model", f"a={files[0]}"]), {}),
        ModelPool.from_dir(tmp_path),
    ]  # fmt: skip
    try:
        assert [(p.max_loaded, p.max_wait_seconds) for p in pools if p is not None] == [
            (2, 60.0), (5, 7.0), (None, 60.0), (2, 60.0),
        ]  # fmt: skip
    finally:
        for pool in pools:
            assert pool is not None
            pool.close()
    with pytest.raises(ValueError, match="--models-wait"):
        _model_pool(build_parser().parse_args(["--models-dir", str(tmp_path),
                                               "--models-wait", "0"]), {})  # fmt: skip


# --- two real models through the openai client ------------------------------------------------


@pytest.fixture(scope="module")
def real_pool(model_path: Path) -> Iterator[ModelPool]:
    """SmolLM2 as ``smol-a`` and ``smol-b``, and a bad path; small contexts, one thread."""
    models = {"smol-a": model_path, "smol-b": model_path, "broken": "/no/such/model.gguf"}
    pool = ModelPool(models, idle_unload_seconds=2.0, n_ctx=512, n_seq_max=2, n_threads=1,
                     calibrate=False)  # fmt: skip
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def real_server(real_pool: ModelPool) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(real_pool)) as running:
        yield running


@pytest.fixture
def client(real_server: BackgroundServer, real_pool: ModelPool) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
    assert_pool_idle(real_pool)


@pytest.mark.model
@pytest.mark.integration
def test_two_real_models_interleaved(client: openai.OpenAI, real_pool: ModelPool) -> None:
    def ask(model: str) -> str:
        reply = client.chat.completions.create(
            model=model,
            messages=HELLO,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content or ""

    answers: dict[str, list[str]] = {"smol-a": [], "smol-b": []}
    threads = [threading.Thread(target=lambda m=m: answers[m].append(ask(m)))
               for m in ["smol-a", "smol-b"] * 3]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers["smol-a"]) == len(answers["smol-b"]) == 3
    assert set(answers["smol-a"]) == set(answers["smol-b"]) and answers["smol-a"][0]  # greedy
    listed = {m.id: m.model_extra for m in client.models.list()}
    assert list(listed) == ["smol-a", "smol-b", "broken"]
    assert listed["smol-a"]["status"]["value"] == "loaded"  # type: ignore[index]
    assert listed["broken"]["status"]["value"] == "unloaded"  # type: ignore[index]
    contexts = [info.context for info in real_pool.models()[:2]]
    assert contexts[0] is not contexts[1]  # each model its own context
    for ctx in contexts:  # three models, no bound: each a third of the RAM tier's default
        assert ctx is not None and ctx.config.prefix_ram_share == pytest.approx(1 / 3)
        assert 0 < ctx.stats().prefix_ram_budget_bytes <= (8 << 30) // 3 + 1


@pytest.mark.model
@pytest.mark.integration
def test_a_bad_path_leaves_the_others_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="broken", prompt="Hi", max_tokens=2)
    assert failed.value.code == "model_load_failed"
    reply = client.completions.create(model="smol-b", prompt="Hi", max_tokens=2)
    assert reply.choices[0].text is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)


@pytest.mark.model
@pytest.mark.integration
def test_real_models_swap_fairly_under_traffic(model_path: Path) -> None:
    """Issue 36 item 6 on SmolLM2 over HTTP: with one model loaded at a time, a request for
    ``quiet`` is answered while two clients keep asking ``busy``, and ``busy`` answers
    again after it (its requests meanwhile waited for its reload, none failed)."""
    pool = ModelPool({"busy": model_path, "quiet": model_path}, max_loaded=1,
                     max_wait_seconds=120, n_ctx=512, n_seq_max=2, n_threads=1,
                     calibrate=False)  # fmt: skip
    stop = threading.Event()
    outcomes: list[str] = []
    try:
        with BackgroundServer(create_app(pool)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

            def keep_asking() -> None:
                while not stop.is_set():
                    reply = client.completions.create(
                        model="busy", prompt="Once", max_tokens=8, temperature=0
                    )
                    outcomes.append(reply.choices[0].text)

            workers = [threading.Thread(target=keep_asking) for _ in range(2)]
            for worker in workers:
                worker.start()
            wait_for(lambda: len(outcomes) >= 2, timeout=120)
            started = time.monotonic()
            quiet = client.completions.create(
                model="quiet", prompt="Once", max_tokens=4, temperature=0
            )
            waited = time.monotonic() - started
            served_before = len(outcomes)
            wait_for(lambda: len(outcomes) >= served_before + 2, timeout=120)
            stop.set()
            for worker in workers:
                worker.join(120)
        assert quiet.choices[0].text is not None and waited < 120
        assert pool.models()[0].num_users == 0 and len(set(outcomes)) == 1  # greedy, same
        assert_pool_idle(pool)
    finally:
        stop.set()
        pool.close()


@pytest.mark.model
@pytest.mark.integration
def test_a_real_model_unloads_when_idle(client: openai.OpenAI, real_pool: ModelPool) -> None:
    client.completions.create(model="smol-a", prompt="Hi", max_tokens=2)
    loaded = real_pool.loaded("smol-a")
    assert loaded is not None
    wait_for(lambda: real_pool.models()[0].state.value == "unloaded", timeout=60)
    assert loaded.closed
    listed = {m.id: m.model_extra for m in client.models.list()}
    assert listed["smol-a"]["status"]["value"] == "unloaded"  # type: ignore[index]
    client.completions.create(model="smol-a", prompt="Hi", max_tokens=2)  # loads again


@pytest.mark.model
@pytest.mark.integration
def test_one_real_gguf_under_two_names_with_a_disk_tier(model_path: Path, tmp_path: Path) -> None:
    """Regression (issue 36, item 9): ``--prefix-disk-dir`` with one GGUF under two names
    gave the second name 500 ``model_load_failed`` (the tier folder's lock)."""
    pool = ModelPool({"smol-a": model_path, "smol-b": model_path}, n_ctx=512, n_seq_max=2,
                     n_threads=1, calibrate=False, prefix_disk_dir=str(tmp_path),
                     prefix_disk_bytes=64 << 20)  # fmt: skip
    try:
        app = create_app(pool)
        texts = []
        for name in ("smol-a", "smol-b"):
            reply = run(app, lambda c, n=name: post(c, "/v1/completions", TEXT | {"model": n}))
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
        assert texts[0] == texts[1]  # greedy, the same weights
        assert sorted(p.name for p in tmp_path.iterdir()) == ["smol-a", "smol-b"]
        assert_pool_idle(pool)
    finally:
        pool.close()
