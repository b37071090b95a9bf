"""Request bodies: the JSON object checks every route shares (:func:`parse_object`), and the
fields of the routes that are not completions (embeddings, tokenize, detokenize), checked
strictly as the completions' codec checks its own (:mod:`llamax.dialects.json_types`:
``"3"`` is not a number, ``1`` is not ``true``, an unknown field is refused).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from llamax.dialects.anthropic import MESSAGES
from llamax.dialects.fields import FieldTable
from llamax.dialects.json_types import read_fields
from llamax.dialects.openai import EMBEDDINGS, ROUTES

from .errors import APIError, from_exception

__all__ = [
    "DETOKENIZE_FIELDS",
    "EMBEDDING_FIELDS",
    "TOKENIZE_FIELDS",
    "parse_body",
    "parse_embedding",
    "parse_object",
    "without_unknown",
]

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (a JSON schema rarely needs 10)."""

EMBEDDING_FIELDS: dict[str, Any] = {
    "input": str | list[str],
    "model": str | None,
    "encoding_format": Literal["float", "base64"],
    "user": str | None,
    "dimensions": int | None,
}
"""``POST /v1/embeddings`` (``input`` required, not empty; ``encoding_format`` by default
``float``; ``dimensions``, at least 1: keep the first components, renormalised)."""

TOKENIZE_FIELDS: dict[str, Any] = {
    "content": str,
    "add_special": bool,
    "parse_special": bool,
    "with_pieces": bool,
    "model": str | None,
}
"""``POST /tokenize`` (llama-server's shape; ``content`` required): ``add_special`` (BOS
and the like; by default false, as llama-server), ``parse_special`` (special-token text
becomes special tokens; by default true), ``with_pieces``, and ``model``: which model's
tokenizer, when the server has several (docs/models.md)."""

DETOKENIZE_FIELDS: dict[str, Any] = {"tokens": list[int], "model": str | None}
"""``POST /detokenize`` (``tokens`` required)."""


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_object(
    raw: bytes, table: FieldTable = (), route: str = "", *, lenient: bool = False
) -> dict[str, Any]:
    """A JSON object body, checked as :func:`parse_body` checks one (JSON, depth, text),
    without its fields: for requests whose fields another layer checks (``/v1/messages``);
    ``lenient`` drops the top-level fields ``table`` does not name (:func:`without_unknown`).

    Raises:
        APIError: 400, as :func:`parse_body`.
    """
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(
            400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from exc
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    _check_tree(data)
    return without_unknown(data, table, route) if lenient else data


_log = logging.getLogger("llamax.server")


def without_unknown(data: dict[str, Any], table: FieldTable, route: str) -> dict[str, Any]:
    """``data`` without the top-level fields ``table`` does not name, each logged as a
    warning: what ``--lenient`` does with a field in neither API's reference (strict, the
    default, refuses it). Hints are still checked and refused fields still refused, and
    nested objects stay strict."""
    known = {f.name for f in table}
    unknown = [name for name in data if name not in known]
    if not unknown:
        return data
    _log.warning("%s: ignored unknown field(s) %s (--lenient)", route,
                 ", ".join(repr(name) for name in unknown))  # fmt: skip
    return {name: value for name, value in data.items() if name in known}


def parse_body(
    raw: bytes,
    fields: dict[str, Any],
    required: str,
    table: FieldTable = (),
    route: str = "",
    *,
    non_empty: bool = False,
    lenient: bool = False,
) -> dict[str, Any]:
    """A JSON request body, its fields checked (:func:`~llamax.dialects.json_types.
    read_fields`, nulls left out): ``required`` must be there (``non_empty``: and not
    empty); ``table`` is
    the route's field policy, whose unknown fields ``lenient`` drops (and logs) instead of
    refusing them (:func:`without_unknown`).

    Raises:
        APIError: 400, for malformed JSON, a body that is not an object, nesting deeper
            than :data:`MAX_JSON_DEPTH`, a string holding a lone surrogate (``"\\ud800"``
            is valid JSON but not Unicode text), an unknown field (named in ``param``) or
            a field of the wrong type.
    """
    data = parse_object(raw, table, route, lenient=lenient)
    try:
        return read_fields(data, fields, table, required, non_empty)
    except Exception as exc:
        raise from_exception(exc) from exc


def parse_embedding(raw: bytes, *, lenient: bool = False) -> dict[str, Any]:
    """A ``POST /v1/embeddings`` body (:data:`EMBEDDING_FIELDS`), as :func:`parse_body`.

    Raises:
        APIError: 400, as :func:`parse_body`, or ``dimensions`` below 1.
    """
    body = parse_body(raw, EMBEDDING_FIELDS, "input", EMBEDDINGS, "/v1/embeddings",
                      non_empty=True, lenient=lenient)  # fmt: skip
    if body.get("dimensions", 1) < 1:
        raise APIError(400, "dimensions: Input should be greater than or equal to 1",
                       param="dimensions", code="invalid_type")  # fmt: skip
    return body


FIELD_TABLES: dict[str, FieldTable] = {**ROUTES, "messages": MESSAGES}
"""Every route's field table, by the name the docs blocks use (``<!-- fields: chat -->``)."""


def _check_tree(data: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings that are not Unicode
    text (lone surrogates); a walk with its own stack, so no depth can overflow it.

    Raises:
        APIError: 400 naming the place (``messages.0.content``) and the top field.
    """
    stack: list[tuple[object, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if len(path) >= MAX_JSON_DEPTH:
                raise APIError(
                    400,
                    f"the body nests deeper than {MAX_JSON_DEPTH} levels (in {path[0]!r})",
                    param=str(path[0]),
                    code="invalid_json",
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path)
                    stack.append((item, (*path, key)))
            else:
                stack.extend((item, (*path, i)) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise APIError(
            400,
            f"{_where(path) or 'a field name'} holds a lone surrogate ({bad!a} at "
            f"index {exc.start}), which is not valid Unicode text",
            param=str(path[0]) if path else None,
            code="invalid_unicode",
        ) from exc


def _where(path: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in path)
