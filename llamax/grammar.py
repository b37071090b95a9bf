"""JSON schema → GBNF, through llama-cpp-python's converter (we do not write our own)."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from .errors import GrammarError

__all__ = ["JSON_OBJECT_SCHEMA", "MAX_REPETITION", "check_repetitions", "schema_to_gbnf"]

MAX_REPETITION = 10_000
"""Largest ``{m,n}`` bound accepted: llama.cpp's parser expands repetitions eagerly, and
``{2,1}`` makes it allocate without limit."""

_BOUNDS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

JSON_OBJECT_SCHEMA = {"type": "object"}
"""What ``response_format={"type": "json_object"}`` constrains to: any JSON object."""


_UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _unenforced_keywords(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {k for k in _UNENFORCED if isinstance(node.get(k), (int, float))}
        for value in node.values():
            found |= _unenforced_keywords(value)
        return found
    if isinstance(node, list):
        return set().union(*(_unenforced_keywords(v) for v in node)) if node else set()
    return set()


@functools.lru_cache(maxsize=64)
def schema_to_gbnf(schema_json: str) -> str:
    """Convert a JSON schema (as JSON text) to a GBNF grammar; cached per schema.

    llama-cpp-python's converter ignores numeric bounds, so a schema that uses them is
    refused rather than silently not enforced.

    Raises:
        GrammarError: the converter rejected the schema, or it uses numeric bounds.
    """
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    unenforced = _unenforced_keywords(json.loads(schema_json))
    if unenforced:
        raise GrammarError(
            f"the JSON schema uses {sorted(unenforced)}, which llama-cpp-python's schema "
            "converter cannot enforce; remove them or pass a GBNF grammar"
        )

    try:
        return str(json_schema_to_gbnf(schema_json))
    except Exception as exc:  # the converter raises assorted errors for bad schemas
        raise GrammarError(f"cannot convert the JSON schema to a grammar: {exc}") from exc


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
