"""What llamax changes in llama-cpp-python's schema converter so that every string a
schema's grammar accepts is JSON that meets the schema (issue 56): a mixin placed before
``SchemaConverter`` in the subclass :func:`llamax.grammar.schema_to_gbnf` uses.

- rule bodies that let invalid JSON through (raw control characters in strings, lone
  surrogate escapes, a pattern's ``.``, infinite numbers) are swapped for JSON-safe ones
  (:mod:`llamax.grammar_strings`);
- literals escape the backslash (``enum``, ``const`` and property names with escapes);
- object properties keep the schema's order (:mod:`llamax.grammar_objects`).
"""

from __future__ import annotations

import json
from typing import Any

from .grammar_objects import ordered_object_rule
from .grammar_strings import JSON_SAFE_RULES, gbnf_literal

__all__ = ["JsonSafeRules"]


class JsonSafeRules:
    """Overrides of ``SchemaConverter``'s rule writers; mix in before it."""

    def _add_rule(self, name: str, rule: str) -> str:
        return str(super()._add_rule(name, JSON_SAFE_RULES.get(rule, rule)))  # type: ignore[misc]

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
