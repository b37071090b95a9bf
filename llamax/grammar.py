"""JSON schema → GBNF, through llama-cpp-python's converter (we do not write our own)."""

from __future__ import annotations

import functools

from .errors import GrammarError

__all__ = ["JSON_OBJECT_SCHEMA", "schema_to_gbnf"]

JSON_OBJECT_SCHEMA = {"type": "object"}
"""What ``response_format={"type": "json_object"}`` constrains to: any JSON object."""


@functools.lru_cache(maxsize=64)
def schema_to_gbnf(schema_json: str) -> str:
    """Convert a JSON schema (as JSON text) to a GBNF grammar; cached per schema.

    Raises:
        GrammarError: the converter rejected the schema.
    """
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(schema_json))
    except Exception as exc:  # the converter raises assorted errors for bad schemas
        raise GrammarError(f"cannot convert the JSON schema to a grammar: {exc}") from exc
