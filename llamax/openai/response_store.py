"""The :class:`ResponseStore` that ``previous_response_id`` reads, and where the Responses
API's encoder (:mod:`llamax.dialects.responses_encode`) keeps a finished response. The
request's side is :mod:`llamax.openai.responses_api`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import NotFoundError
from ..images import Image

__all__ = ["ResponseStore"]


@dataclass(frozen=True, slots=True)
class _Stored:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    items: tuple[dict[str, Any], ...]
    size: int


def _chars(value: Any) -> int:
    """The characters of a stored object (its strings, keys included, nested; an image's
    bytes; 8 for any other leaf), counted without serializing it: a store on the server's
    event loop stays cheap."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    if isinstance(value, Image):  # an input image in a stored conversation
        return value.num_bytes
    return 8


class ResponseStore:
    """A bounded, thread-safe store of recent responses, for ``previous_response_id``.

    Least recently used entries go first once there are more than ``max_responses`` or
    they hold more than ``max_chars`` characters. An entry is counted whole: its
    ``response`` object (``metadata``, ``user``, ``instructions``, ``tools`` ... as echoed),
    its conversation and its input items (each entry keeps its whole conversation, so a long
    chain costs what its longest member holds); every string counts its characters, keys
    too, and any other value 8.

    Args:
        max_responses: Most responses kept.
        max_chars: Most characters kept, over all stored responses and conversations.

    Raises:
        ValueError: a bound is not positive.
    """

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 << 20) -> None:
        if max_responses < 1 or max_chars < 1:
            raise ValueError("max_responses and max_chars must be >= 1")
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_chars(self) -> int:
        """The characters counted over every stored entry (at most ``max_chars``)."""
        with self._lock:
            return self._chars

    def get(self, response_id: str) -> dict[str, Any]:
        """The stored ``response`` object.

        Raises:
            NotFoundError: no response has that id (never stored, deleted or evicted).
        """
        return dict(self._entry(response_id).response)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages up to and including the response's output (without its
        ``instructions``).

        Raises:
            NotFoundError: no response has that id.
        """
        return [dict(m) for m in self._entry(response_id).conversation]

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        """The response's input items (``GET /v1/responses/{id}/input_items``), oldest
        first: those of the conversation it continued, its outputs, then its own input.

        Raises:
            NotFoundError: no response has that id.
        """
        return [dict(item) for item in self._entry(response_id).items]

    def follow_up(self, response_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """What a follow-up of the response starts with, read at once: its conversation
        (as :meth:`conversation`) and its items (its input items, then its output).

        Raises:
            NotFoundError: no response has that id.
        """
        entry = self._entry(response_id)
        items = [dict(item) for item in (*entry.items, *entry.response["output"])]
        return [dict(m) for m in entry.conversation], items

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._chars -= entry.size
            return entry is not None

    def put(
        self,
        response: Mapping[str, Any],
        conversation: Sequence[Mapping[str, Any]],
        items: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Keep ``response`` (by its ``id``) with its conversation and input items, evicting
        the least recently used entries past the bounds. An entry larger than ``max_chars``
        alone is not kept."""
        kept = dict(response)
        frozen = tuple(dict(m) for m in conversation)
        frozen_items = tuple(dict(item) for item in items)
        size = _chars(kept) + sum(_chars(m) for m in (*frozen, *frozen_items))
        if size > self.max_chars:
            return
        with self._lock:
            old = self._entries.pop(str(response["id"]), None)
            if old is not None:
                self._chars -= old.size
            self._entries[str(response["id"])] = _Stored(kept, frozen, frozen_items, size)
            self._chars += size
            while len(self._entries) > self.max_responses or self._chars > self.max_chars:
                _, evicted = self._entries.popitem(last=False)
                self._chars -= evicted.size

    def _entry(self, response_id: str) -> _Stored:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise NotFoundError(
                    f"no stored response has id {response_id!r} "
                    "(it was never stored, was deleted, or the store evicted it)"
                )
            self._entries.move_to_end(response_id)
            return entry
