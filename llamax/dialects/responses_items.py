"""A response's input items as ``GET /v1/responses/{id}/input_items`` lists them: the
request's ``input`` as OpenAI's item objects (each with an ``id``), and one page of them.

The items of a response are those of the whole conversation it answered, as with OpenAI: a
follow-up through ``previous_response_id`` lists the earlier inputs and outputs before its
own input. ``instructions`` are not items.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidParameterError
from .openai import check_include

__all__ = ["MAX_PAGE_ITEMS", "input_items", "page_of_items"]

MAX_PAGE_ITEMS = 100
"""The most items one page holds (OpenAI's bound on ``limit``)."""

_ITEM_KINDS = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def input_items(value: Any, prefix: str) -> list[dict[str, Any]]:
    """A (valid) request ``input`` as item objects: a string is one user message, text
    content becomes ``input_text`` parts (``output_text`` in an assistant's), and an item
    without an ``id`` gets ``{kind}_{prefix}_in{index}``."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for index, given in enumerate(value):
        kind = given.get("type", "message")
        item: dict[str, Any] = {"id": f"{_ITEM_KINDS.get(kind, 'item')}_{prefix}_in{index}"}
        item.update(given)
        item["type"] = kind
        if kind == "message":
            item["content"] = _parts(item.get("content"), item.get("role") == "assistant")
        if kind != "reasoning":
            item.setdefault("status", "completed")
        items.append(item)
    return items


def _parts(content: Any, is_output: bool) -> list[dict[str, Any]]:
    if not isinstance(content, str):
        return [dict(part) for part in content]
    if is_output:
        return [{"type": "output_text", "text": content, "annotations": []}]
    return [{"type": "input_text", "text": content}]


def page_of_items(
    items: Sequence[Mapping[str, Any]], query: Mapping[str, str], include: Sequence[str] = ()
) -> dict[str, Any]:
    """One page of ``items`` (chronological) as OpenAI's list object, for the query
    parameters ``order`` (``desc``, the default, or ``asc``), ``after`` (an item id: the page
    starts past it), ``limit`` (1 to 100, default 20) and ``include`` (checked as the
    create request's ``include``: it names outputs llamax never produces).

    Raises:
        InvalidParameterError: a bad ``order`` or ``limit``, or an ``after`` that names no
            item of the list.
    """
    check_include("include", list(include))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidParameterError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    raw_limit = query.get("limit", "20")
    limit = int(raw_limit) if raw_limit.isdigit() else 0
    if not 1 <= limit <= MAX_PAGE_ITEMS:
        raise InvalidParameterError(
            f"limit must be an integer from 1 to {MAX_PAGE_ITEMS}, got {raw_limit!r}", param="limit"
        )
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidParameterError(
                f"after: no input item of this response has id {after!r}", param="after"
            )
        ordered = ordered[ids.index(after) + 1 :]
    data = [dict(item) for item in ordered[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }
