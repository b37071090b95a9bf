"""Routing keys and the hash ring: which replica most likely holds a request's prefix.

Pure Python (no Ray), so the policy is tested without a cluster. The ingress has no
tokenizer, so "the first blocks of the prompt" are measured in characters of the prompt
text (or in token ids when the prompt is a token list): a stable stand-in for the tokens
they become, as the same text always tokenizes the same way.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["HashRing", "routing_key"]

PREFIX_CHARS = 1024
"""Characters of a prompt (without a system turn) that pick its replica (~256 tokens)."""
PREFIX_TOKENS = 256
"""Token ids of a token-list prompt that pick its replica."""
SESSION_HEADERS = ("x-llamax-session", "x-session-id")
"""Headers that pin a conversation to one replica, strongest signal first."""


def routing_key(path: str, body: bytes, headers: Mapping[str, str]) -> str | None:
    """The affinity key of one OpenAI request, or ``None`` when it has none.

    Strongest signal first: a session header (``X-Llamax-Session`` / ``X-Session-Id``),
    the body's ``user``, the chat's system turn (else its first message), the first
    :data:`PREFIX_CHARS` characters of a completion prompt (or :data:`PREFIX_TOKENS` ids).

    Args:
        path: The URL path (``/v1/chat/completions``, ``/v1/completions`` ...).
        body: The raw request body.
        headers: Request headers, lower-case names.

    Returns:
        A string to hash onto the ring; ``None`` for requests without a prompt (GET
        routes, bodies that are not JSON objects), which any replica may serve.
    """
    for name in SESSION_HEADERS:
        if headers.get(name):
            return "session:" + headers[name]
    if not body:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    user = payload.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    if path.endswith("/chat/completions"):
        return _chat_key(payload.get("messages"))
    if path.endswith("/completions"):
        return _prompt_key(payload.get("prompt"))
    return None


def _chat_key(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return None
    first = messages[0]
    text = _content_text(first.get("content"))
    if first.get("role") in ("system", "developer"):
        return "system:" + text
    return "chat:" + text[:PREFIX_CHARS]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _prompt_key(prompt: Any) -> str | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return "prompt:" + prompt[:PREFIX_CHARS]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "tokens:" + ",".join(map(str, prompt[:PREFIX_TOKENS]))
    return None


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: a key maps to the same member while the
    membership holds, and a member leaving or joining moves only ~1/N of the keys.

    Args:
        members: The initial members (replica ids).
        num_virtual_nodes: Points per member on the ring (more: a more even spread).

    Raises:
        ValueError: ``num_virtual_nodes`` is not positive.
    """

    def __init__(self, members: Iterable[str] = (), num_virtual_nodes: int = 64) -> None:
        if num_virtual_nodes < 1:
            raise ValueError(f"num_virtual_nodes must be >= 1, got {num_virtual_nodes}")
        self.num_virtual_nodes = num_virtual_nodes
        self._members: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []
        self.set_members(members)

    @property
    def members(self) -> frozenset[str]:
        """The members on the ring."""
        return self._members

    def set_members(self, members: Iterable[str]) -> None:
        """Replace the membership (a no-op when it is unchanged)."""
        new = frozenset(members)
        if new == self._members:
            return
        ring = sorted(
            (_hash(f"{member}#{i}"), member)
            for member in new
            for i in range(self.num_virtual_nodes)
        )
        self._members = new
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def ranked(self, key: str) -> list[str]:
        """Every member once, in ring order from ``key``: the owner first, then fallbacks.

        Args:
            key: A routing key.

        Returns:
            The members ranked for ``key`` (empty when the ring is empty).
        """
        if not self._points:
            return []
        start = bisect.bisect_right(self._points, _hash(key))
        ranked: list[str] = []
        for offset in range(len(self._points)):
            owner = self._owners[(start + offset) % len(self._points)]
            if owner not in ranked:
                ranked.append(owner)
                if len(ranked) == len(self._members):
                    break
        return ranked
