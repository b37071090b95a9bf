"""What llamax changes in llama-cpp-python's schema converter so that every string a
schema's grammar accepts is JSON that meets the schema (issue 56): a mixin placed before
``SchemaConverter`` in the subclass :func:`llamax.grammar.schema_to_gbnf` uses.

- rule bodies that let invalid JSON through (raw control characters in strings, lone
  surrogate escapes, a pattern's ``.``, infinite numbers) are swapped for JSON-safe ones
  (:mod:`llamax.grammar_strings`);
- a pattern's negated classes (``[^,]``) leave out what a JSON string cannot hold raw;
- literals escape the backslash (``enum``, ``const`` and property names with escapes);
- object properties keep the schema's order (:mod:`llamax.grammar_objects`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .grammar_objects import ordered_object_rule
from .grammar_strings import JSON_SAFE_RULES, gbnf_literal

__all__ = ["JsonSafeRules", "json_safe_pattern_rule"]

_GBNF_PIECE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[^"\[]+')
_NOT_RAW_IN_JSON = '"\\\\\\x7F\\x00-\\x1F'


def json_safe_pattern_rule(body: str) -> str:
    """A rule written from a ``pattern`` with each negated class (``[^,]``) also leaving
    out ``"``, ``\\`` and control characters, which a JSON string cannot hold raw."""
    pieces = _GBNF_PIECE.findall(body)
    if "".join(pieces) != body:  # not GBNF this reader knows: leave it as it is
        return body
    return "".join(
        "[^" + _NOT_RAW_IN_JSON + piece[2:] if piece.startswith("[^") else piece for piece in pieces
    )


class JsonSafeRules:
    """Overrides of ``SchemaConverter``'s rule writers; mix in before it."""

    _is_in_pattern = False

    def _add_rule(self, name: str, rule: str) -> str:
        if rule in JSON_SAFE_RULES:
            rule = JSON_SAFE_RULES[rule]
        elif self._is_in_pattern:
            rule = json_safe_pattern_rule(rule)
        return str(super()._add_rule(name, rule))  # type: ignore[misc]

    def _visit_pattern(self, pattern: str, name: str) -> str:
        self._is_in_pattern = True
        try:
            return str(super()._visit_pattern(pattern, name))  # type: ignore[misc]
        finally:
            self._is_in_pattern = False

    def _format_literal(self, literal: str) -> str:
        return gbnf_literal(literal)

    def _build_object_rule(
        self, properties: list[tuple[str, Any]], required: set[str], name: str, extra: Any
    ) -> str:
        """Properties in schema order, unless the object takes additional ones (then the
        converter's own rule: required ones first, then the optional and the extra)."""
        if extra not in (None, False):
            return str(super()._build_object_rule(properties, required, name, extra))  # type: ignore[misc]
        prefix = f"{name}-" if name else ""
        kvs = []
        for key, subschema in properties:
            value = self.visit(subschema, prefix + key)  # type: ignore[attr-defined]
            body = f'{gbnf_literal(json.dumps(key))} space ":" space {value}'
            kvs.append((self._add_rule(f"{prefix}{key}-kv", body), key in required))
        return ordered_object_rule(self._add_rule, name, kvs)
