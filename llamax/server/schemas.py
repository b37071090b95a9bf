"""Request bodies: the JSON object checks every route shares (:func:`parse_object`), and the
pydantic models of the routes that are not completions (embeddings, tokenize, detokenize),
which refuse unknown fields and wrong types strictly (``"3"`` is not a number, ``1`` is not
``true``). Chat and text completions are parsed by their pure codec
(:mod:`llamax.dialects.openai_parse`), with the same strictness and the same 400s.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llamax import InvalidParameterError
from llamax.dialects.anthropic import MESSAGES
from llamax.dialects.fields import FieldTable, accept_fields
from llamax.dialects.openai import EMBEDDINGS, ROUTES

from .errors import APIError

__all__ = [
    "DetokenizeRequest",
    "EmbeddingRequest",
    "TokenizeRequest",
    "parse_body",
    "parse_object",
    "without_unknown",
]

RequestT = TypeVar("RequestT", bound=BaseModel)

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a body may have (a JSON schema rarely needs 10)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``."""

    input: str | list[str] = Field(min_length=1)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    dimensions: int | None = Field(default=None, ge=1)
    """Keep the first ``dimensions`` components, renormalised to length 1."""


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (llama-server's shape)."""

    content: str
    add_special: bool = False
    """BOS and the like (llama-server's default: none)."""
    parse_special: bool = True
    """Special-token text becomes special tokens (``False``: plain text)."""
    with_pieces: bool = False
    model: str | None = None
    """Which model's tokenizer, when the server has several (docs/models.md)."""


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_object(raw: bytes) -> dict[str, Any]:
    """A JSON object body, checked as :func:`parse_body` checks one (JSON, depth, text),
    without a model: for requests whose fields another layer checks (``/v1/messages``).

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
    return data


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


def parse_body(model: type[RequestT], raw: bytes, *, lenient: bool = False) -> RequestT:
    """Parse and validate a JSON request body.

    Args:
        model: The request model.
        raw: The body's bytes.
        lenient: Drop (and log) top-level fields the model's route table does not name,
            instead of refusing them (:func:`without_unknown`).

    Returns:
        The validated request.

    Raises:
        APIError: 400, for malformed JSON, a body that is not an object, nesting deeper
            than :data:`MAX_JSON_DEPTH`, a string holding a lone surrogate (``"\\ud800"``
            is valid JSON but not Unicode text), an unknown field (named in ``param``) or
            a field of the wrong type.
    """
    data = parse_object(raw)
    table = _TABLES.get(model)
    if table is not None:
        if lenient:
            data = without_unknown(data, table, _PATHS[model])
        try:
            data = accept_fields(table, data)
        except InvalidParameterError as exc:
            message = str(exc)
            code = "unsupported_parameter" if " is not supported: " in message else "invalid_value"
            raise APIError(400, message, param=exc.param, code=code) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


_TABLES: dict[type[BaseModel], FieldTable] = {EmbeddingRequest: EMBEDDINGS}
"""Each OpenAI request model's field table (:mod:`llamax.dialects.openai`)."""
_PATHS: dict[type[BaseModel], str] = {EmbeddingRequest: "/v1/embeddings"}

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


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    location = ".".join(str(part) for part in first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field {location!r}", param=param, code="unknown_field")
    if first["type"] == "missing":
        return APIError(400, f"missing field {param!r}", param=param, code="missing_field")
    return APIError(400, f"{location}: {first['msg']}", param=param, code="invalid_type")
