"""The prefix-aware routing policy without a cluster: routing keys and the hash ring."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

from llamax.ray.keys import PREFIX_CHARS, HashRing, routing_key

CHAT = "/v1/chat/completions"


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_key_strength_session_then_user_then_system() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    payload = body(messages=messages, user="alice")
    assert routing_key(CHAT, payload, {"x-session-id": "s1"}) == "session:s1"
    assert routing_key(CHAT, payload, {}) == "user:alice"
    assert routing_key(CHAT, body(messages=messages), {}) == "system:S"


def test_same_system_turn_same_key_whatever_the_question() -> None:
    def chat(question: str) -> bytes:
        return body(messages=[{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": question}])  # fmt: skip

    assert routing_key(CHAT, chat("a"), {}) == routing_key(CHAT, chat("b"), {})


def test_completion_prompt_keyed_by_its_first_block() -> None:
    head = "x" * PREFIX_CHARS
    one = routing_key("/v1/completions", body(prompt=head + "tail one"), {})
    two = routing_key("/v1/completions", body(prompt=head + "other tail"), {})
    assert one == two
    tokens = routing_key("/v1/completions", body(prompt=[1, 2, 3]), {})
    assert tokens == "tokens:1,2,3"


@pytest.mark.parametrize(
    "path, payload",
    [("/v1/models", b""), (CHAT, b"not json"), (CHAT, b"[1]"), (CHAT, body(messages=[]))],
)
def test_requests_without_a_prompt_have_no_key(path: str, payload: bytes) -> None:
    assert routing_key(path, payload, {}) is None


def test_ring_is_deterministic_and_ranks_every_member_once() -> None:
    ring = HashRing(["a", "b", "c"])
    assert ring.ranked("k") == HashRing(["c", "b", "a"]).ranked("k")
    assert sorted(ring.ranked("k")) == ["a", "b", "c"]
    assert HashRing().ranked("k") == []


def test_ring_moves_only_the_keys_of_a_member_that_leaves() -> None:
    keys = [f"system:{i}" for i in range(400)]
    ring = HashRing(["a", "b", "c"])
    before = {k: ring.ranked(k)[0] for k in keys}
    ring.set_members(["a", "b"])
    after = {k: ring.ranked(k)[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")
    shares = [sum(owner == m for owner in before.values()) / len(keys) for m in "abc"]
    assert min(shares) > 0.2


def test_ring_refuses_no_virtual_nodes() -> None:
    with pytest.raises(ValueError, match="num_virtual_nodes must be >= 1"):
        HashRing(num_virtual_nodes=0)


def test_deployment_refuses_bad_arguments() -> None:
    import llamax.ray

    with pytest.raises(ValueError, match="routing must be"):
        llamax.ray.deployment(routing="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_replicas must be > 0"):
        llamax.ray.deployment(num_replicas=0)
    with pytest.raises(TypeError):
        llamax.ray.app({"num_replica": "2"})


def test_deployment_takes_the_image_policy_as_json() -> None:
    """``serve run llamax.ray:app server_options='{"images": {...}}'`` (or YAML) gives the
    replicas an ImagePolicy (issue 42); a bad field fails before any replica starts."""
    import llamax.ray
    from llamax.server import ImagePolicy, ServerConfig

    built = llamax.ray.app({"server_options": '{"images": {"max_images": 4, "allow_urls": true}}'})
    replica = built._bound_deployment.init_args[0]._bound_deployment  # type: ignore[attr-defined]
    assert replica.init_args[2].images == ImagePolicy(max_images=4, allow_urls=True)
    policy = ImagePolicy(max_images=2)
    built = llamax.ray.deployment(server_options={"images": policy, "api_key": "k"})
    replica = built._bound_deployment.init_args[0]._bound_deployment  # type: ignore[attr-defined]
    assert replica.init_args[2] == ServerConfig(images=policy, api_key="k")
    for bad in ({"max_image": 4}, {"max_images": -1}, 4):
        with pytest.raises(ValueError, match="images"):
            llamax.ray.deployment(server_options={"images": bad})
