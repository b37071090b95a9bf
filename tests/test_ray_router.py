"""PrefixAffinityRouter's ranking and run_asgi's relay, without a cluster."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from llamax.ray.asgi import ForwardedRequest, run_asgi
from llamax.ray.keys import HashRing
from llamax.ray.router import PrefixAffinityRouter


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass
class FakeReplica:
    replica_id: FakeId
    routing_stats: dict[str, Any] = field(default_factory=dict)


class FakePending:
    def __init__(self, key: str | None) -> None:
        self.args = [ForwardedRequest("POST", "/v1/completions", b"", (), b"", key)]


def make_router(**kwargs: Any) -> tuple[PrefixAffinityRouter, list[FakeReplica]]:
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # no Ray controller needed
    router.initialize_state(**kwargs)
    replicas = [FakeReplica(FakeId(name)) for name in ("r1", "r2", "r3")]
    router.ring.set_members(r.replica_id.unique_id for r in replicas)
    return router, replicas


def choose(router: PrefixAffinityRouter, replicas: list[FakeReplica], key: str | None) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, FakePending(key)))  # type: ignore[arg-type]
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def test_ranks_follow_the_ring_owner_first() -> None:
    router, replicas = make_router()
    assert choose(router, replicas, "system:S") == HashRing(["r1", "r2", "r3"]).ranked("system:S")


def test_request_without_key_may_go_anywhere() -> None:
    router, replicas = make_router()
    ranks = asyncio.run(router.choose_replicas(replicas, FakePending(None)))  # type: ignore[arg-type]
    assert len(ranks) == 1 and len(ranks[0]) == 3


def test_overloaded_owner_gives_way_to_least_loaded() -> None:
    router, replicas = make_router(imbalance_threshold=2)
    owner, second, third = choose(router, replicas, "user:u")
    by_id = {r.replica_id.unique_id: r for r in replicas}
    by_id[owner].routing_stats["num_unsettled"] = 2
    by_id[second].routing_stats["num_unsettled"] = 1
    assert choose(router, replicas, "user:u")[0] == owner  # 2 more than the idle one: stays
    by_id[owner].routing_stats["num_unsettled"] = 5
    assert choose(router, replicas, "user:u")[:2] == [third, owner]


def test_router_refuses_unknown_or_negative_options() -> None:
    with pytest.raises(ValueError, match="unknown PrefixAffinityRouter options"):
        make_router(imbalance=1)
    with pytest.raises(ValueError, match="imbalance_threshold must be >= 0"):
        make_router(imbalance_threshold=-1)


async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
    request = await receive()
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
    await send({"type": "http.response.body", "body": request["body"], "more_body": True})
    if scope["path"] == "/wait":
        assert (await receive())["type"] == "http.disconnect"
        streaming_app.disconnected = True  # type: ignore[attr-defined]
        return
    await send({"type": "http.response.body", "body": b"!", "more_body": False})


def test_run_asgi_relays_start_then_chunks() -> None:
    async def collect() -> list[Any]:
        request = ForwardedRequest("POST", "/echo", b"", (), b"hello")
        return [item async for item in run_asgi(streaming_app, request)]

    assert asyncio.run(collect()) == [(201, ((b"x-a", b"1"),)), b"hello", b"!"]


def test_closing_the_relay_tells_the_app_the_client_left() -> None:
    async def first_two() -> None:
        stream = run_asgi(streaming_app, ForwardedRequest("POST", "/wait", b"", (), b"x"))
        assert await stream.__anext__() == (201, ((b"x-a", b"1"),))
        assert await stream.__anext__() == b"x"
        await stream.aclose()

    asyncio.run(first_two())
    assert streaming_app.disconnected  # type: ignore[attr-defined]
