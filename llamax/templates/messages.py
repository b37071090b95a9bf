"""Check and normalise OpenAI-style chat messages before a template renders them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidMessageError

__all__ = ["ROLES", "InvalidMessageError", "validate_messages"]

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
"""The roles a message may have."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return normalised copies.

    Each message is a mapping with a ``role`` from :data:`ROLES` and a ``content`` that is a
    string or a list of OpenAI text parts ``{"type": "text", "text": ...}``, which are
    concatenated as they are. ``content`` may be missing or ``None`` only in an assistant
    message with ``tool_calls`` (it stays ``None``). ``name`` is an optional string. Other
    keys (``tool_calls``, ``tool_call_id`` ...) are copied through unchanged.

    Args:
        messages: A non-empty list of message mappings.

    Returns:
        New dicts, one per message, with ``content`` as a ``str`` (or ``None``, see above).

    Raises:
        InvalidMessageError: The message list or a message is malformed (content or name
            holding a lone surrogate included); the error names the message index and the
            field.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidMessageError(
            f"messages must be a list of message dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidMessageError("messages must not be empty")
    return [_validate_message(index, message) for index, message in enumerate(messages)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidMessageError(
            f"messages[{index}] must be a dict, got {type(message).__name__}", index=index
        )
    normalised = dict(message)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        allowed = ", ".join(repr(name) for name in sorted(ROLES))
        problem = "is missing" if role is None else f"must be one of {allowed}, got {role!r}"
        raise InvalidMessageError(f"messages[{index}].role {problem}", index=index, field="role")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidMessageError(
            f"messages[{index}].name must be a str, got {type(name).__name__}",
            index=index,
            field="name",
        )
    content = _content_text(index, message)
    for field, text in (("name", name), ("content", content)):
        _check_unicode(index, field, text)
    normalised["content"] = content
    return normalised


def _check_unicode(index: int, field: str, text: str | None) -> None:
    """Refuse a lone surrogate (``"\\ud800"``): it cannot be encoded, so not tokenized."""
    if text is None or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(
            f"messages[{index}].{field} holds a lone surrogate ({text[exc.start]!a} at index "
            f"{exc.start}), which is not valid Unicode text",
            index=index,
            field=field,
        ) from exc


def _content_text(index: int, message: Mapping[str, Any]) -> str | None:
    """The message's content as one string (``None`` for a tool-calling assistant turn)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if message["role"] == "assistant" and message.get("tool_calls"):
            return None
        problem = "is missing" if "content" not in message else "is null"
        raise InvalidMessageError(
            f"messages[{index}].content {problem}; only an assistant message with tool_calls"
            " may omit it",
            index=index,
            field="content",
        )
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        return "".join(
            _part_text(index, part_index, part) for part_index, part in enumerate(content)
        )
    raise InvalidMessageError(
        f"messages[{index}].content must be a str or a list of text parts,"
        f" got {type(content).__name__}",
        index=index,
        field="content",
    )


def _part_text(index: int, part_index: int, part: Any) -> str:
    where = f"messages[{index}].content[{part_index}]"
    if not isinstance(part, Mapping):
        raise InvalidMessageError(
            f"{where} must be a content part dict, got {type(part).__name__}",
            index=index,
            field="content",
        )
    if part.get("type") != "text":
        raise InvalidMessageError(
            f"{where} has type {part.get('type')!r}; only text content parts are supported",
            index=index,
            field="content",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidMessageError(
            f"{where}.text must be a str, got {type(text).__name__}", index=index, field="content"
        )
    return text
