"""JSON schema → GBNF, through llama-cpp-python's converter (we do not write our own), with
llama.cpp's integer ranges added (:mod:`llamax.grammar_ranges`)."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .errors import GrammarError
from .grammar_ranges import int_range_rule

__all__ = [
    "JSON_OBJECT_SCHEMA",
    "MAX_REPETITION",
    "check_repetitions",
    "check_schema_shape",
    "integer_bounds",
    "schema_to_gbnf",
]

MAX_REPETITION = 10_000
"""Largest ``{m,n}`` bound accepted: llama.cpp's parser expands repetitions eagerly, and
``{2,1}`` makes it allocate without limit."""

_BOUNDS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

JSON_OBJECT_SCHEMA = {"type": "object"}
"""What ``response_format={"type": "json_object"}`` constrains to: any JSON object."""


_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
"""Keywords the grammar cannot enforce on a ``number`` (nor ``multipleOf`` on an integer)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer_bounds(schema: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The inclusive ``[low, high]`` of an integer schema's ``minimum``/``maximum`` and
    ``exclusiveMinimum``/``exclusiveMaximum`` (a fractional bound rounds inwards), as
    llama.cpp's converter reads them; ``None`` for an open side.

    Raises:
        GrammarError: no integer satisfies the bounds.
    """
    lows, highs = [], []
    if _is_number(schema.get("minimum")):
        lows.append(math.ceil(schema["minimum"]))
    if _is_number(schema.get("exclusiveMinimum")):
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    if _is_number(schema.get("maximum")):
        highs.append(math.floor(schema["maximum"]))
    if _is_number(schema.get("exclusiveMaximum")):
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"no integer is between the schema's bounds ({low} > {high})")
    return low, high


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not")


def check_schema_shape(node: Any, path: str = "") -> None:
    """Refuse a schema whose subschemas are not schemas (``"properties": {"a": "int"}``),
    naming the place, before the converter fails on it with a Python error.

    Raises:
        GrammarError: ``properties.a must be a schema (an object), got str``.
    """
    where = path or "the schema"
    if not isinstance(node, Mapping):
        raise GrammarError(f"{where} must be a schema (an object), got {type(node).__name__}")
    for key in _SUBSCHEMA_MAPS:
        children = node.get(key)
        if children is None:
            continue
        if not isinstance(children, Mapping):
            raise GrammarError(f"{_join(path, key)} must be an object of schemas")
        for name, child in children.items():
            if not isinstance(child, bool):
                check_schema_shape(child, _join(path, f"{key}.{name}"))
    for key in _SUBSCHEMA_LISTS:
        children = node.get(key)
        if children is None:
            continue
        if not isinstance(children, list):
            raise GrammarError(f"{_join(path, key)} must be a list of schemas")
        for i, child in enumerate(children):
            check_schema_shape(child, _join(path, f"{key}[{i}]"))
    for key in _SUBSCHEMAS:
        child = node.get(key)
        if child is not None and not isinstance(child, bool):
            check_schema_shape(child, _join(path, key))
    required = node.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise GrammarError(f"{_join(path, 'required')} must be a list of property names")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@functools.lru_cache(maxsize=64)
def schema_to_gbnf(schema_json: str) -> str:
    """Convert a JSON schema (as JSON text) to a GBNF grammar; cached per schema.

    llama-cpp-python's converter, with integer ranges (``minimum``, ``maximum`` and their
    exclusive forms on an ``integer``) enforced as llama.cpp's own converter does. Bounds on
    a ``number`` and ``multipleOf`` cannot be written as a grammar: they are not enforced
    (the value has the JSON number shape, and may fall outside them), as with llama.cpp.

    Raises:
        GrammarError: the schema is malformed (the message names the place), its integer
            bounds admit no value, or the converter rejected it.
    """
    schema = json.loads(schema_json)
    check_schema_shape(schema)
    try:
        return _convert(schema)
    except GrammarError:
        raise
    except Exception as exc:  # the converter raises assorted errors for bad schemas
        raise GrammarError(f"cannot convert the JSON schema to a grammar: {exc}") from exc


def _convert(schema: Any) -> str:
    from llama_cpp.llama_grammar import SchemaConverter

    class _Converter(SchemaConverter):
        def visit(self, schema: Any, name: str) -> Any:
            if isinstance(schema, dict) and schema.get("type") == "integer":
                low, high = integer_bounds(schema)
                if low is not None or high is not None:
                    rule_name = name or "root"
                    rule = "(" + int_range_rule(low, high) + ") space"
                    return self._add_rule(rule_name, rule)  # type: ignore[no-untyped-call]
            return super().visit(schema, name)  # type: ignore[no-untyped-call]

    converter: Any = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)  # type: ignore[no-untyped-call]
    schema = converter.resolve_refs(schema, "stdin")
    converter.visit(schema, "")
    return str(converter.format_grammar())


def check_repetitions(grammar: str) -> str | None:
    """Why the ``{m,n}`` repetitions of a GBNF grammar are unsafe to parse, or None."""
    for match in _BOUNDS.finditer(grammar):
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) else low
        if match.group(2) == "":
            high = low
        if low > high:
            return f"repetition {match.group(0)} has min > max"
        if max(low, high) > MAX_REPETITION:
            return f"repetition {match.group(0)} exceeds {MAX_REPETITION}"
    return None
