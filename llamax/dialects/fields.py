# ruff: noqa: E501  (the shared rows hold one-line docs)
"""The one request-field policy of every dialect: a :data:`FieldTable` per route says what
llamax does with each field, in one place.

Each field is :attr:`Support.HONOURED` (it works), :attr:`Support.HINT` (accepted, its value
checked, and it has no effect on the output: the table says why) or :attr:`Support.REFUSED`
(a 400 whose message names the field and says why; some values that change nothing, such as
``background: false``, are let through). Fields that are in no table are unknown, and still
refused: a typo must not be silently ignored.

The tables themselves are in the dialects' modules (:mod:`llamax.dialects.openai`,
:mod:`llamax.dialects.anthropic`, :mod:`llamax.dialects.llama`). The route parsers call
:func:`accept_fields` first: it drops the hints, refuses what is refused, and hands the
honoured fields (and any unknown ones, which the parser refuses in its own words) on. The
tables in ``docs/server.md`` are generated from them (:func:`markdown_table`,
:func:`regenerate`; ``python scripts/option_tables.py``), and tests pin the honoured fields
to the parsers, so a field cannot be added to one without the other.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..chat.options import check_text, one_of
from ..errors import InvalidParameterError, InvalidRequestError

__all__ = [
    "SHARED_FIELDS",
    "Check",
    "FieldError",
    "FieldTable",
    "RequestField",
    "Support",
    "accept_fields",
    "accept_request",
    "check_bool",
    "check_object",
    "generated_blocks",
    "honoured",
    "markdown_table",
    "refusal",
    "regenerate",
    "table",
]


class Support(enum.Enum):
    """What llamax does with a request field."""

    HONOURED = "honoured"
    HINT = "hint"
    REFUSED = "refused"


class FieldError(InvalidParameterError):
    """A request field a dialect's codec refuses, with the code the API answers it with
    (``unknown_field``, ``unsupported_field``, ``missing_field``, ``invalid_value`` ...);
    ``param`` names the field as the client spelled it."""

    code: str

    def __init__(self, message: str, *, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message, param=param)
        self.code = code


Check = Callable[[str, Any], None]
"""``check(name, value)`` raises :class:`~llamax.InvalidParameterError` naming the field."""


def _allow_null(value: Any, request: Mapping[str, Any]) -> bool:
    return value is None


@dataclass(frozen=True, slots=True)
class RequestField:
    """One request field of one route."""

    name: str
    support: Support
    doc: str
    """One line of Markdown: what happens to it (and why, for a hint or a refusal)."""
    check: Check | None = None
    """Validates a hint's value (a hint is still typed: ``store: "no"`` is a 400)."""
    harmless: Callable[[Any, Mapping[str, Any]], bool] = _allow_null
    """For a refused field: the values (given the whole request) that change nothing and
    are let through, such as ``null``."""
    extension: bool = False
    """Not in the API reference: a llama.cpp, vLLM or llamax extension."""
    option: str | None = None
    """For an honoured field: the :class:`~llamax.SamplingParams` field its value goes to,
    where a route maps it by name (llama-server's ``repeat_last_n`` is ``penalty_last_n``);
    ``None``: the route's parser maps it its own way."""
    refusal: str | None = None
    """For a refused field: the 400's message, where a route words it its own way (default:
    ``NAME is not supported: DOC``)."""


FieldTable = tuple[RequestField, ...]
"""One route's request fields, a row each (:func:`table` builds one): the policy
:func:`accept_fields` applies and :func:`markdown_table` documents."""


# ---------------------------------------------------------------------- value checks
def check_bool(name: str, value: Any) -> None:
    """A JSON boolean or null."""
    if value is not None and not isinstance(value, bool):
        raise InvalidParameterError(
            f"{name} must be a boolean, got {type(value).__name__}", param=name
        )


def check_object(name: str, value: Any) -> None:
    """A JSON object or null."""
    if value is not None and not isinstance(value, Mapping):
        raise InvalidParameterError(
            f"{name} must be an object, got {type(value).__name__}", param=name
        )


# ---------------------------------------------------------------------- shared rows
H, HINT, R = Support.HONOURED, Support.HINT, Support.REFUSED

_CACHE_HINT = "no effect: llamax's prefix cache reuses every shared prefix on its own"
_CACHE_KEPT = "a hint: the prompt's prefix is kept longer than unhinted ones in KV and the RAM and disk tiers (`SamplingParams.keep_prefix`); every shared prefix is reused whatever the key"
_CACHE_RETAINED = "as `prompt_cache_key`: the prompt's prefix is kept longer (`in_memory` or `24h`)"
_TIER_HINT = "no effect: one local server has one tier"
_SAFETY_HINT = "no effect: no abuse monitoring is done (a string of at most 256 characters)"

SHARED_FIELDS: dict[str, RequestField] = {
    f.name: f
    for f in (
        RequestField("model", H, "echoed; picks a model when the server has several"),
        RequestField("temperature", H, "in [0, 2]"),
        RequestField("top_p", H, "nucleus sampling"),
        RequestField("user", H, "accepted and ignored"),
        RequestField("stream", H, "the typed stream events"),
        RequestField(
            "parallel_tool_calls",
            H,
            "whether one reply may hold several calls (no effect without tools)",
        ),
        RequestField("prompt_cache_key", H, _CACHE_KEPT),
        RequestField("prompt_cache_retention", H, _CACHE_RETAINED),
        RequestField("prompt_cache_options", HINT, _CACHE_HINT, check_object),
        RequestField(
            "service_tier", HINT, _TIER_HINT, one_of("auto", "default", "flex", "scale", "priority")
        ),
        RequestField("safety_identifier", HINT, _SAFETY_HINT, check_text),
        RequestField(
            "moderation", R, "no moderation model runs here, so no moderation policy can be applied"
        ),
    )
}
"""Rows several routes share word for word (OpenAI's and Anthropic's), by name; a route
that differs gives its own row."""


def table(*rows: RequestField | str) -> FieldTable:
    """A route's table: each row as given, or named (one of :data:`SHARED_FIELDS`)."""
    return tuple(SHARED_FIELDS[row] if isinstance(row, str) else row for row in rows)


def honoured(table: FieldTable) -> frozenset[str]:
    """The names of a table's honoured fields: what the route's parser takes."""
    return frozenset(f.name for f in table if f.support is Support.HONOURED)


def accept_fields(table: FieldTable, request: Mapping[str, Any]) -> dict[str, Any]:
    """``request`` without its hints, once the hints are checked and the refused fields
    refused; honoured and unknown fields are left for the route's parser.

    Raises:
        InvalidParameterError: a refused field (the message names it and says why), or a
            hint with a bad value.
    """
    by_name = {f.name: f for f in table}
    kept: dict[str, Any] = {}
    for name, value in request.items():
        field = by_name.get(name)
        if field is None or field.support is Support.HONOURED:
            kept[name] = value
        elif field.support is Support.HINT:
            if field.check is not None:
                field.check(name, value)
        elif not field.harmless(value, request):
            raise InvalidParameterError(refusal(field), param=name)
    return kept


def accept_request(table: FieldTable, request: Any, where: str) -> dict[str, Any]:
    """:func:`accept_fields` on a ``where`` request (``messages`` ...), which must be an
    object whose every field is in ``table``; what is left are its honoured fields.

    Raises:
        InvalidRequestError: not an object, or a field the table does not name.
        InvalidParameterError: a refused field, or a hint with a bad value.
    """
    if not isinstance(request, Mapping):
        raise InvalidRequestError(f"a {where} request must be an object")
    kept = accept_fields(table, request)
    unknown = sorted(set(kept) - honoured(table))
    if unknown:
        raise InvalidRequestError(
            f"{where}: unsupported field(s): {', '.join(unknown)}", param=unknown[0]
        )
    return kept


def refusal(field: RequestField) -> str:
    """The message a refused field's 400 carries: :attr:`RequestField.refusal`, or
    ``NAME is not supported: DOC`` (the doc without its Markdown)."""
    return field.refusal or f"{field.name} is not supported: {_plain(field.doc)}"


def _plain(doc: str) -> str:
    return doc.replace("`", "")


# ---------------------------------------------------------------------- the docs
def _rows(table: FieldTable) -> Iterator[str]:
    order = {Support.HONOURED: 0, Support.HINT: 1, Support.REFUSED: 2}
    for f in sorted(table, key=lambda f: (f.extension, order[f.support])):
        support = f.support.value + (" (extension)" if f.extension else "")
        yield f"| `{f.name}` | {support} | {f.doc.replace('|', chr(92) + '|')} |"


def markdown_table(table: FieldTable) -> str:
    """A route's fields as a Markdown table (honoured, hints, refused, then extensions)."""
    return (
        "\n".join(["| field | support | what happens |", "| --- | --- | --- |", *_rows(table)])
        + "\n"
    )


_BLOCK = re.compile(
    r"(<!-- fields: (?P<route>\w+) -->\n)(?P<body>.*?)(<!-- /fields -->)", re.DOTALL
)


def generated_blocks(text: str, tables: Mapping[str, FieldTable]) -> Iterator[tuple[str, str]]:
    """``(current, wanted)`` for each ``<!-- fields: ROUTE -->`` block of a Markdown text."""
    for m in _BLOCK.finditer(text):
        yield m["body"], markdown_table(tables[m["route"]])


def regenerate(text: str, tables: Mapping[str, FieldTable]) -> str:
    """``text`` with every generated fields block replaced by its current table."""
    return _BLOCK.sub(lambda m: m[1] + markdown_table(tables[m["route"]]) + m[4], text)
