"""JSON schema → GBNF, through llama-cpp-python's converter (we do not write our own), with
llama.cpp's integer ranges added (:mod:`llamax.grammar_ranges`) and the numeric keywords
it leaves out enforced (:mod:`llamax.grammar_numbers`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from .errors import GrammarError
from .grammar_budget import MAX_GRAMMAR_BYTES, GrammarBudget, GrammarCache, check_schema_size
from .grammar_json import JsonSafeRules
from .grammar_long_ranges import long_int_range_rule
from .grammar_numbers import Bound, NumberDomain, NumberRules
from .grammar_ranges import int_range_rule

__all__ = [
    "JSON_OBJECT_SCHEMA",
    "MAX_GRAMMAR_BYTES",
    "MAX_REPETITION",
    "check_repetitions",
    "check_schema_shape",
    "integer_bounds",
    "number_bounds",
    "schema_to_gbnf",
]

MAX_REPETITION = 10_000
"""Largest ``{m,n}`` bound accepted: llama.cpp's parser expands repetitions eagerly, and
``{2,1}`` makes it allocate without limit."""

_BOUNDS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

JSON_OBJECT_SCHEMA = {"type": "object"}
"""What ``response_format={"type": "json_object"}`` constrains to: any JSON object."""


_NUMERIC_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COMBINATORS = ("$ref", "oneOf", "anyOf", "const", "enum")
"""Keywords the converter reads before ``type``: a schema with one is left to it."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _decimal(key: str, value: int | float) -> Decimal:
    """``value`` as written (a float's shortest repr, so ``0.1`` is one tenth)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise GrammarError(f"{key} must be a finite number, got {value}")
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def number_bounds(schema: Mapping[str, Any]) -> tuple[Bound | None, Bound | None]:
    """The tightest lower and upper bounds of ``minimum``/``maximum`` and
    ``exclusiveMinimum``/``exclusiveMaximum`` (numbers, or draft 4's booleans that make
    ``minimum``/``maximum`` exclusive), exactly as written; ``None`` for an open side.

    Raises:
        GrammarError: a bound is not finite.
    """
    lows: list[Bound] = []
    highs: list[Bound] = []
    for key, exclusive, side in (
        ("minimum", "exclusiveMinimum", lows),
        ("maximum", "exclusiveMaximum", highs),
    ):
        if _is_number(schema.get(key)):
            side.append(Bound(_decimal(key, schema[key]), schema.get(exclusive) is not True))
        if _is_number(schema.get(exclusive)):
            side.append(Bound(_decimal(exclusive, schema[exclusive]), False))
    low = max(lows, key=lambda b: (b.value, not b.inclusive)) if lows else None
    high = min(highs, key=lambda b: (b.value, b.inclusive)) if highs else None
    return low, high


def integer_bounds(schema: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The inclusive ``[low, high]`` of an integer schema's bounds (:func:`number_bounds`;
    a fractional bound rounds inwards), as llama.cpp's converter reads them; ``None`` for
    an open side.

    Raises:
        GrammarError: no integer satisfies the bounds.
    """
    lower, upper = number_bounds(schema)
    low = high = None
    if lower is not None:
        low = math.ceil(lower.value) if lower.inclusive else math.floor(lower.value) + 1
    if upper is not None:
        high = math.floor(upper.value) if upper.inclusive else math.ceil(upper.value) - 1
    if low is not None and high is not None and low > high:
        raise GrammarError(f"no integer is between the schema's bounds ({low} > {high})")
    return low, high


def _multiple(schema: Mapping[str, Any]) -> Decimal | None:
    value = schema.get("multipleOf")
    if value is None:
        return None
    if not _is_number(value) or value <= 0:
        raise GrammarError(f"multipleOf must be a number above 0, got {value!r}")
    return _decimal("multipleOf", value)


_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
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
    for key in _NUMBER_KEYWORDS:  # a bound the converter would skip is not a bound
        value = node.get(key)
        draft4 = key.startswith("exclusive") and isinstance(value, bool)
        if value is not None and not draft4 and not _is_number(value):
            what = "a number above 0" if key == "multipleOf" else "a number"
            raise GrammarError(f"{_join(path, key)} must be {what}, got {value!r}")
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


def schema_to_gbnf(schema_json: str) -> str:
    """Convert a JSON schema (as JSON text) to a GBNF grammar; the last ones are cached
    (:class:`~llamax.grammar_budget.GrammarCache`, 16 MiB in all).

    llama-cpp-python's converter, with JSON-safe strings and objects in schema order
    (:mod:`llamax.grammar_json`), integer ranges (``minimum``, ``maximum`` and their
    exclusive forms on an ``integer``) enforced as llama.cpp's own converter does (bounds
    of over 18 digits by :mod:`llamax.grammar_long_ranges`, in rules linear in the digits;
    at most 1,000 digits), and the bounds of a ``number`` and ``multipleOf`` (on either)
    enforced by rules of :mod:`llamax.grammar_numbers`: values are then written as plain
    decimals (no exponent) of at most 15 significant digits.

    Raises:
        GrammarError: the schema or its grammar passes a limit of
            :mod:`llamax.grammar_budget` (the message names it and the place; checked
            before and while it is built), the schema is malformed (the message names the
            place), its numeric keywords admit no value or need a grammar over
            :data:`~llamax.grammar_numbers.MAX_NUMBER_RULES` rules (the message names the
            field), or the converter rejected it.
    """
    return _cache(schema_json)


def _schema_to_gbnf(schema_json: str) -> str:
    """:func:`schema_to_gbnf` uncached; every error a :class:`GrammarError`."""
    budget = GrammarBudget()
    try:
        schema = json.loads(schema_json)
        check_schema_size(schema, budget)  # first: iterative, and bounds the depth
        check_schema_shape(schema)
        return _convert(schema, budget)
    except GrammarError:
        raise
    except RecursionError as exc:
        raise GrammarError("the JSON schema is nested too deeply to convert") from exc
    except Exception as exc:  # the converter raises assorted errors for bad schemas
        raise GrammarError(f"cannot convert the JSON schema to a grammar: {exc}") from exc


_cache = GrammarCache(_schema_to_gbnf, 4 * MAX_GRAMMAR_BYTES)


def _convert(schema: Any, budget: GrammarBudget) -> str:
    from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, RESERVED_NAMES, SchemaConverter

    numbers = NumberRules(lambda name, body: str(converter._add_rule(name, body)))
    keys: dict[tuple[str, str], str] = {}
    next_index: dict[str, int] = {}

    class _Budgeted(SchemaConverter):
        def _add_rule(self, name: str, rule: str) -> str:
            """The converter's, charged to the budget, and a name's next free index
            remembered (the converter's own scans every index: quadratic)."""
            base = INVALID_RULE_CHARS_RE.sub("-", name)
            key = keys.get((base, rule))
            budget.charge(f"rule {base!r}", len(base) + len(rule) + 6, is_new=key is None)
            if key is None:
                key, i = base, next_index.get(base, 0)
                while key in self._rules and self._rules[key] != rule:
                    key, i = f"{base}{i}", i + 1
                next_index[base] = i
                keys[base, rule] = key
                self._rules[key] = rule
            return key

    class _Converter(JsonSafeRules, _Budgeted):  # JSON-safe rules, then charged
        def visit(self, schema: Any, name: str) -> Any:
            if isinstance(schema, dict) and not any(key in schema for key in _COMBINATORS):
                kind = schema.get("type")
                if isinstance(kind, list) and _has_numeric_keywords(schema, kind):
                    return super().visit({"anyOf": _split_types(schema, kind)}, name)  # type: ignore[no-untyped-call]
                if kind in ("integer", "number"):
                    rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                    rule = _numeric_rule(self, numbers, schema, kind, rule_name)
                    if rule is not None:
                        return rule
            return super().visit(schema, name)  # type: ignore[no-untyped-call]

    converter: Any = _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)  # type: ignore[no-untyped-call]
    schema = converter.resolve_refs(schema, "stdin")
    converter.visit(schema, "")
    return str(converter.format_grammar())


def _has_numeric_keywords(schema: Mapping[str, Any], kinds: list[Any]) -> bool:
    return any(k in ("integer", "number") for k in kinds) and any(
        key in schema for key in _NUMERIC_KEYWORDS
    )


def _split_types(schema: Mapping[str, Any], kinds: list[Any]) -> list[dict[str, Any]]:
    """``{"type": ["number", "null"], "minimum": 0}`` as ``anyOf`` branches, the numeric
    keywords kept on the numeric ones (the converter drops every keyword from a type list)."""
    numeric = {key: schema[key] for key in _NUMERIC_KEYWORDS if key in schema}
    return [{"type": k, **(numeric if k in ("integer", "number") else {})} for k in kinds]


def _numeric_rule(
    converter: Any, numbers: NumberRules, schema: Mapping[str, Any], kind: str, name: str
) -> str | None:
    """The rule enforcing a numeric schema's bounds and ``multipleOf``, or None for the
    converter's own (none given).

    Raises:
        GrammarError: no value meets them, or their grammar is too large (names the field).
    """
    multiple = _multiple(schema)
    if kind == "integer" and multiple is None:
        low, high = integer_bounds(schema)
        if low is None and high is None:
            return None
        expression = _int_range(converter, schema, low, high, name)
        return str(converter._add_rule(name, f"({expression}) space"))
    lower, upper = number_bounds(schema)
    if lower is None and upper is None and multiple is None:
        return None
    try:
        start = numbers.start(NumberDomain(lower, upper, multiple, kind == "integer"), name)
    except ValueError as exc:
        given = ", ".join(f"{k}={schema[k]}" for k in _NUMERIC_KEYWORDS if k in schema)
        field = "the schema" if name == "root" else f"field {name!r}"
        raise GrammarError(f"{field} ({kind}, {given}): {exc}") from exc
    return str(converter._add_rule(name, f"({start}) space"))


def _int_range(
    converter: Any, schema: Mapping[str, Any], low: int | None, high: int | None, name: str
) -> str:
    """llama.cpp's range rule for bounds of up to :data:`_SHORT_DIGITS` digits (its
    output, quadratic in the digits), else :mod:`llamax.grammar_long_ranges`' (linear).

    Raises:
        GrammarError: a bound is over :data:`~llamax.grammar_long_ranges.MAX_INTEGER_DIGITS`
            digits, or no integer of the open side's digits meets them (names the field).
    """
    digits = max(len(str(abs(b))) for b in (low, high) if b is not None)
    if digits <= _SHORT_DIGITS:
        return int_range_rule(low, high)
    try:
        return long_int_range_rule(low, high, converter._add_rule, name)
    except ValueError as exc:
        given = ", ".join(f"{k}={_short(schema[k])}" for k in _NUMERIC_KEYWORDS if k in schema)
        field = "the schema" if name == "root" else f"field {name!r}"
        raise GrammarError(f"{field} (integer, {given}): {exc}") from exc


_SHORT_DIGITS = 18
"""Longest bound (in digits) written by llama.cpp's construction (a few KB at most)."""


def _short(value: Any) -> str:
    """``value`` for a message: a long number by its first digits and its length."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


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
