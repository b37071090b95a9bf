"""A GBNF grammar that only lets the model write valid tool calls (or, under auto, text).

The calls use the Hermes markup every helper here speaks::

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>

Each function's ``arguments`` rule comes from llama-cpp-python's JSON-schema converter
(:func:`llamax.grammar.schema_to_gbnf`); its rules are renamed with a per-function prefix
so that several schemas live in one grammar. Under ``"auto"`` the reply is free text that
never contains the call marker, optionally followed by calls: the text rules are the states
of a matcher for the marker, with the state that would complete it left out.
"""

from __future__ import annotations

import json
import re

from ..errors import GrammarError
from ..grammar import MAX_GRAMMAR_BYTES, schema_to_gbnf
from .spec import ToolFunction, ToolPlan

__all__ = ["CALL_CLOSE", "CALL_OPEN", "MAX_PARALLEL_CALLS", "tool_call_grammar"]

MAX_PARALLEL_CALLS = 16
"""Most calls one reply may hold: a small model can repeat a call until the context fills."""

CALL_OPEN = "<tool_call>"
"""The marker that starts a call in the model's output."""

CALL_CLOSE = "</tool_call>"
"""The marker that ends a call."""

_RULE_LINE = re.compile(r"([a-zA-Z0-9-]+)\s*::=")
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[a-zA-Z0-9-]+|\s+|.')


def tool_call_grammar(plan: ToolPlan) -> str | None:
    """The GBNF grammar constraining a reply under ``plan``, or None when it calls nothing.

    ``"required"`` (or a named ``tool_choice``) allows exactly one call, or one or more
    separated by newlines when ``plan.parallel``; ``"auto"`` allows text without the call
    marker, optionally followed by such calls. Every call's ``arguments`` match its
    function's JSON schema. At most :data:`MAX_PARALLEL_CALLS` calls are allowed.

    Raises:
        GrammarError: the functions' grammars pass
            :data:`~llamax.grammar.MAX_GRAMMAR_BYTES` in all (checked after each).

    Args:
        plan: The checked tool options (from :func:`prepare_tools`).

    Returns:
        The grammar text (start rule ``root``), or None for ``mode == "none"``.
    """
    functions = plan.callable_functions
    if not functions:
        return None
    calls = f'call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if plan.parallel else "call"
    root = f"root ::= text-0 ({calls})?" if plan.mode == "auto" else f"root ::= {calls}"
    lines = [root]
    names = " | ".join(f"fn-{index}" for index in range(len(functions)))
    lines.append(f'call ::= "{_literal(CALL_OPEN)}\\n" ( {names} ) "\\n{_literal(CALL_CLOSE)}"')
    num_bytes = 0
    for index, function in enumerate(functions):
        rules = _function_rules(index, function)
        num_bytes += sum(len(rule) + 1 for rule in rules)
        if num_bytes > MAX_GRAMMAR_BYTES:
            raise GrammarError(
                f"the tools' grammar would exceed its limit of {MAX_GRAMMAR_BYTES} bytes "
                f"(at function {function.name!r})",
                param="tools",
            )
        lines.extend(rules)
    if plan.mode == "auto":
        lines.extend(_text_rules(CALL_OPEN))
    return "\n".join(lines) + "\n"


def _function_rules(index: int, function: ToolFunction) -> list[str]:
    """``fn-i ::= '{"name": "<name>", "arguments": ' <args> '}'`` plus the schema's rules."""
    prefix = f"fn-{index}-"
    header = _literal(f'{{"name": {json.dumps(function.name)}, "arguments": ')
    rules = [f'fn-{index} ::= "{header}" {prefix}root "}}"']
    rules.extend(_prefixed(schema_to_gbnf(json.dumps(dict(function.parameters))), prefix))
    return rules


def _prefixed(grammar: str, prefix: str) -> list[str]:
    """The grammar's rules with every rule name (definitions and references) prefixed."""
    defined = {match.group(1) for match in _RULE_LINE.finditer(grammar)}
    lines = []
    for line in grammar.splitlines():
        if not line.strip():
            continue
        tokens = _GBNF_TOKEN.findall(line)
        lines.append("".join(prefix + t if t in defined else t for t in tokens))
    return lines


def _text_rules(marker: str) -> list[str]:
    """``text-0``: any text that does not contain ``marker``.

    ``text-k`` means the text so far ends with the first ``k`` characters of the marker;
    the transition that would complete it is missing. Correct when the marker's first
    character does not occur again inside it (true of ``<tool_call>``).
    """
    first = marker[0]
    if first in marker[1:]:
        raise ValueError(f"the marker {marker!r} repeats its first character")
    rules = [f'text-0 ::= ( [^{_class_char(first)}] text-0 | "{_literal(first)}" text-1 )?']
    for k in range(1, len(marker)):
        expected = marker[k]
        alternatives = []
        if k + 1 < len(marker):
            alternatives.append(f'"{_literal(expected)}" text-{k + 1}')
        alternatives.append(f'"{_literal(first)}" text-1')
        alternatives.append(f"[^{_class_char(expected)}{_class_char(first)}] text-0")
        rules.append(f"text-{k} ::= ( {' | '.join(alternatives)} )?")
    return rules


def _literal(text: str) -> str:
    """``text`` escaped for a GBNF string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _class_char(char: str) -> str:
    """``char`` escaped for a GBNF character class."""
    return "\\" + char if char in "\\]^-[" else char
