"""Validate OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` into a plan."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import GrammarError, InvalidParameterError
from ..grammar import MAX_GRAMMAR_BYTES, schema_to_gbnf

__all__ = ["ToolChoiceMode", "ToolFunction", "ToolPlan", "prepare_tools"]

ToolChoiceMode = Literal["none", "auto", "required"]

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's rule for function names (matched in full)."""

_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_MODES: tuple[ToolChoiceMode, ...] = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """One callable function, as checked from an OpenAI ``tools`` entry.

    Attributes:
        name: The function name (``^[a-zA-Z0-9_-]{1,64}$``).
        description: What the function does, shown to the model (may be empty).
        parameters: The JSON schema its ``arguments`` object must validate against.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The ``{"type": "function", "function": {...}}`` dict templates expect."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request asked of tool calling, validated.

    Attributes:
        functions: Every declared function, in request order.
        mode: ``"none"`` (no calls), ``"auto"`` (text or calls) or ``"required"``.
        forced_name: The function a named ``tool_choice`` forces (``mode == "required"``).
        parallel: Whether a reply may hold more than one call.
    """

    functions: tuple[ToolFunction, ...] = ()
    mode: ToolChoiceMode = "none"
    forced_name: str | None = None
    parallel: bool = True

    @property
    def is_active(self) -> bool:
        """Whether the model is offered tools (and its output parsed for calls)."""
        return self.mode != "none" and bool(self.functions)

    @property
    def callable_functions(self) -> tuple[ToolFunction, ...]:
        """The functions a call may name: the forced one, all, or none."""
        if not self.is_active:
            return ()
        if self.forced_name is not None:
            return tuple(f for f in self.functions if f.name == self.forced_name)
        return self.functions


def prepare_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan:
    """Check OpenAI's tool options and return the plan the other helpers follow.

    Like OpenAI, ``tool_choice`` defaults to ``"auto"`` when there are tools and
    ``parallel_tool_calls`` to ``True``; both are refused without tools.

    Args:
        tools: OpenAI ``tools``: ``[{"type": "function", "function": {"name", "description",
            "parameters", "strict"}}]``, or None.
        tool_choice: ``"none"``, ``"auto"``, ``"required"`` or
            ``{"type": "function", "function": {"name": ...}}``.
        parallel_tool_calls: Whether one reply may hold several calls.

    Returns:
        The validated :class:`ToolPlan` (``mode="none"`` and no functions without tools).

    Raises:
        InvalidParameterError: naming the offending field, e.g. ``tools[1].function.name``.
    """
    functions = _functions(tools)
    if not functions:
        if tool_choice not in (None, "none"):
            raise InvalidParameterError(
                "tool_choice is only allowed when tools are given", param="tool_choice"
            )
        if parallel_tool_calls is not None:
            raise InvalidParameterError(
                "parallel_tool_calls is only allowed when tools are given",
                param="parallel_tool_calls",
            )
        return ToolPlan()
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidParameterError(
            f"parallel_tool_calls must be a bool, got {type(parallel_tool_calls).__name__}",
            param="parallel_tool_calls",
        )
    mode, forced = _choice(tool_choice, [f.name for f in functions])
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolPlan(functions, mode, forced, parallel)


def _functions(tools: Any) -> tuple[ToolFunction, ...]:
    if tools is None:
        return ()
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidParameterError(
            f"tools must be a list, got {type(tools).__name__}", param="tools"
        )
    if not tools:
        raise InvalidParameterError(
            "tools must hold at least one function (or be left out)", param="tools"
        )
    functions = _within_budget(tools)
    seen: set[str] = set()
    for index, function in enumerate(functions):
        if function.name in seen:
            raise InvalidParameterError(
                f"tools[{index}].function.name {function.name!r} is declared twice",
                param=f"tools[{index}].function.name",
            )
        seen.add(function.name)
    return functions


def _within_budget(tools: Sequence[Any]) -> tuple[ToolFunction, ...]:
    """Each tool's function, while their grammars make at most
    :data:`~llamax.grammar.MAX_GRAMMAR_BYTES` in all (checked after each: one heavy schema
    per tool would otherwise be built as often as tools are given)."""
    functions, num_bytes = [], 0
    for index, tool in enumerate(tools):
        function, size = _function(index, tool)
        num_bytes += size
        if num_bytes > MAX_GRAMMAR_BYTES:
            raise InvalidParameterError(
                f"tools[{index}].function.parameters: the tools' grammars would exceed "
                f"their limit of {MAX_GRAMMAR_BYTES} bytes in all",
                param=f"tools[{index}].function.parameters",
            )
        functions.append(function)
    return tuple(functions)


def _function(index: int, tool: Any) -> tuple[ToolFunction, int]:
    """The tool's function, and the size of its arguments' grammar."""
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping):
        raise InvalidParameterError(
            f"{where} must be a dict, got {type(tool).__name__}", param=where
        )
    _no_unknown_keys(where, tool, _TOOL_KEYS)
    if tool.get("type") != "function":
        raise InvalidParameterError(
            f"{where}.type must be 'function', got {tool.get('type')!r}", param=f"{where}.type"
        )
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidParameterError(
            f"{where}.function must be a dict, got {type(function).__name__}",
            param=f"{where}.function",
        )
    where += ".function"
    _no_unknown_keys(where, function, _FUNCTION_KEYS)
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidParameterError(
            f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", param=f"{where}.name"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParameterError(
            f"{where}.description must be a str, got {type(description).__name__}",
            param=f"{where}.description",
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParameterError(
            f"{where}.strict must be a bool, got {strict!r}", param=f"{where}.strict"
        )
    parameters, size = _parameters(
        f"{where} ({name!r})", function.get("parameters"), path=f"{where}.parameters"
    )
    return ToolFunction(name, description or "", parameters), size


def _parameters(where: str, parameters: Any, *, path: str) -> tuple[Mapping[str, Any], int]:
    """The arguments' schema (an object schema the grammar converter accepts), and the
    size of its grammar; ``path`` is the field's path (the errors' ``param``)."""
    if parameters is None:
        return {"type": "object", "properties": {}}, 0
    if not isinstance(parameters, Mapping):
        raise InvalidParameterError(
            f"{where}.parameters must be a JSON schema dict, got {type(parameters).__name__}",
            param=path,
        )
    schema = dict(parameters)
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise InvalidParameterError(
            f"{where}.parameters must describe an object (type 'object'), got type {kind!r}",
            param=path,
        )
    try:
        size = len(schema_to_gbnf(json.dumps(schema)))
    except (GrammarError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidParameterError(f"{where}.parameters: {exc}", param=path) from exc
    return schema, size


def _choice(tool_choice: Any, names: list[str]) -> tuple[ToolChoiceMode, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        for mode in _MODES:
            if tool_choice == mode:
                return mode, None
    elif isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidParameterError(
                "tool_choice as a dict must be "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {dict(tool_choice)!r}',
                param="tool_choice",
            )
        if name not in names:
            raise InvalidParameterError(
                f"tool_choice names the function {name!r}, which is not in tools {names}",
                param="tool_choice",
            )
        return "required", name
    raise InvalidParameterError(
        "tool_choice must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
        param="tool_choice",
    )


def _no_unknown_keys(where: str, mapping: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(str(key) for key in mapping if key not in allowed)
    if unknown:
        raise InvalidParameterError(
            f"{where} has unknown keys {unknown}; allowed: {sorted(allowed)}", param=where
        )
