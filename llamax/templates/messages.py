"""Check and normalise OpenAI-style chat messages before a template renders them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ImageError, InvalidMessageError
from ..images import Image

__all__ = [
    "ROLES",
    "Content",
    "InvalidMessageError",
    "content_texts",
    "has_images",
    "validate_messages",
]

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
"""The roles a message may have."""
IMAGE_DETAILS = frozenset({"auto", "low", "high"})
"""OpenAI's ``image_url.detail`` values (a hint: the projector decides the resolution)."""
Content = str | list[dict[str, str] | Image] | None
"""A validated message's content."""


def has_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether validated ``messages`` hold an image."""
    return any(isinstance(m.get("content"), list) for m in messages)


def content_texts(content: Content) -> list[str]:
    """The text of a validated message's content, part by part (images left out)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content if not isinstance(part, Image)]


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return normalised copies.

    Each message is a mapping with a ``role`` from :data:`ROLES` and a ``content`` that is a
    string or a list of parts: OpenAI text parts ``{"type": "text", "text": ...}``, which are
    concatenated as they are, and, in a user message, images: OpenAI's
    ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (``detail``
    ``auto``, ``low`` or ``high`` is accepted as a hint) or a :class:`llamax.Image`.
    ``content`` may be missing or ``None`` only in an assistant message with ``tool_calls``
    (it stays ``None``). ``name`` is an optional string. Other keys (``tool_calls``,
    ``tool_call_id`` ...) are copied through unchanged.

    Args:
        messages: A non-empty list of message mappings.

    Returns:
        New dicts, one per message, with ``content`` as a ``str`` (or ``None``, see above),
        or, for a message with images, a list of text parts and :class:`llamax.Image` s in
        order (consecutive text joined into one part).

    Raises:
        InvalidMessageError: The message list or a message is malformed (content or name
            holding a lone surrogate included); the error names the message index and the
            field. An image part's URL must be a base64 ``data:image/...`` URL (remote
            URLs are not fetched here).
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
    content = _content(index, message)
    _check_unicode(index, "name", name)
    for text in content_texts(content):
        _check_unicode(index, "content", text)
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


def _content(index: int, message: Mapping[str, Any]) -> Content:
    """The message's content as one string (``None`` for a tool-calling assistant turn), or
    as text and images in order."""
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
        parts: list[str | Image] = []
        run: list[str] = []  # text since the last image, joined once (linear, not +=)
        for part_index, part in enumerate(content):
            value = _part(index, part_index, part)
            if isinstance(value, str):
                run.append(value)
                continue
            if message["role"] != "user":
                raise InvalidMessageError(
                    f"messages[{index}].content[{part_index}] is an image; only user "
                    f"messages may hold images, not {message['role']} messages",
                    index=index,
                    field="content",
                )
            if run:
                parts.append("".join(run))
                run.clear()
            parts.append(value)
        if not parts:
            return "".join(run)
        if run:
            parts.append("".join(run))
        return [part if isinstance(part, Image) else {"type": "text", "text": part}
                for part in parts]  # fmt: skip
    raise InvalidMessageError(
        f"messages[{index}].content must be a str or a list of content parts,"
        f" got {type(content).__name__}",
        index=index,
        field="content",
    )


def _part(index: int, part_index: int, part: Any) -> str | Image:
    where = f"messages[{index}].content[{part_index}]"
    if isinstance(part, Image):
        return part
    if not isinstance(part, Mapping):
        raise InvalidMessageError(
            f"{where} must be a content part dict, got {type(part).__name__}",
            index=index,
            field="content",
        )
    kind = part.get("type")
    if kind == "image_url":
        return _image_part(index, where, part)
    if kind != "text":
        raise InvalidMessageError(
            f"{where} has type {kind!r}; content parts are 'text' and 'image_url'",
            index=index,
            field="content",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidMessageError(
            f"{where}.text must be a str, got {type(text).__name__}", index=index, field="content"
        )
    return text


def _image_part(index: int, where: str, part: Mapping[str, Any]) -> Image:
    """An OpenAI ``image_url`` part's image (a base64 ``data:`` URL)."""
    spec = part.get("image_url")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("url"), str):
        raise InvalidMessageError(
            f'{where}.image_url must be an object with a "url" string', index=index,
            field="content",
        )  # fmt: skip
    unknown = sorted(set(spec) - {"url", "detail"})
    if unknown:
        raise InvalidMessageError(
            f"{where}.image_url has unknown field {unknown[0]!r}", index=index, field="content"
        )
    detail = spec.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise InvalidMessageError(
            f"{where}.image_url.detail must be 'auto', 'low' or 'high', got {detail!r}",
            index=index,
            field="content",
        )
    url: str = spec["url"]
    if url.startswith(("http://", "https://")):
        problem = (
            "remote image URLs are not fetched here; send the image as a data: URL "
            "(data:image/png;base64,...) or a llamax.Image (llamax serve fetches them with "
            "--allow-image-urls)"
        )
    else:
        try:
            return Image.from_data_url(url)
        except ImageError as exc:
            problem = str(exc)
    raise InvalidMessageError(f"{where}.image_url.url: {problem}", index=index, field="content")
