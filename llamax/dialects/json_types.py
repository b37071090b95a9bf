"""A request body's fields checked against their JSON types, strictly: ``"3"`` is not a
number, ``1`` is not ``true``, an integer is a number (and becomes a float), an unknown
field is refused. The first problem found is raised as a :class:`FieldError` with the
location and words the server's pydantic models used (``stop.str: Input should be a valid
string``), so clients see the same 400s; value ranges are checked elsewhere
(:class:`~llamax.SamplingParams`).

The types are plain annotations: ``bool``, ``int``, ``float``, ``str``, ``Any``, ``None``,
``list[T]``, ``dict[str, T]``, unions, ``Literal`` of strings and a ``TypedDict`` (a nested
object of booleans that default to false, such as ``stream_options``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from typing_extensions import is_typeddict

from ..errors import InvalidParameterError, InvalidRequestError
from .fields import FieldError, FieldTable, accept_fields

__all__ = ["FieldError", "read_fields"]

Loc = tuple[str | int, ...]
Problem = tuple[str, Loc, str]
"""``(kind, location, message)``: pydantic's error ``type``, ``loc`` and ``msg``."""

_SCALARS: dict[type, tuple[str, str]] = {
    bool: ("bool_type", "a valid boolean"),
    int: ("int_type", "a valid integer"),
    float: ("float_type", "a valid number"),
    str: ("string_type", "a valid string"),
}


def read_fields(
    body: Mapping[str, Any],
    fields: Mapping[str, Any],
    table: FieldTable = (),
    required: str | None = None,
    non_empty: bool = False,
) -> dict[str, Any]:
    """A body's fields that are not null: its hints dropped once checked and its refused
    fields refused, as the route's ``table`` says (:func:`~llamax.dialects.fields.
    accept_fields`), then each checked against its type in ``fields`` (an integer given
    for a number becomes a float); the ``required`` field must be there (``non_empty``: and
    hold an item).

    Raises:
        InvalidRequestError: the body is not an object.
        FieldError: a refused field (``unsupported_parameter``), a hint's bad value
            (``invalid_value``), else the first unknown field, nested or not
            (``unknown_field``), else the first problem in the order of ``fields``: the
            required field missing (``missing_field``) or a value of the wrong type
            (``invalid_type``).
    """
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request must be an object")
    try:
        body = accept_fields(table, body)
    except InvalidParameterError as exc:
        message = str(exc)
        code = "unsupported_parameter" if " is not supported: " in message else "invalid_value"
        raise FieldError(message, param=exc.param, code=code) from exc
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    for name, hint in fields.items():
        if name not in body:
            if name == required:
                problems.append(("missing", (name,), "Field required"))
            continue
        value, found = _check(body[name], hint, (name,))
        if non_empty and name == required and not found and not value:
            kind = "List" if typing.get_origin(hint) is list else "Value"
            found = [("too_short", (name,), f"{kind} should have at least 1 item after "
                      "validation, not 0")]  # fmt: skip
        problems += found
        if value is not None:
            values[name] = value
    problems += [("extra_forbidden", (name,), "") for name in body if name not in fields]
    if problems:
        raise _error(next((p for p in problems if p[0] == "extra_forbidden"), problems[0]))
    return values


def _error(problem: Problem) -> FieldError:
    kind, loc, message = problem
    where, param = ".".join(str(part) for part in loc), str(loc[0])
    if kind == "extra_forbidden":
        return FieldError(f"unknown field {where!r}", param=param, code="unknown_field")
    if kind == "missing":
        return FieldError(f"missing field {param!r}", param=param, code="missing_field")
    return FieldError(f"{where}: {message}", param=param, code="invalid_type")


def _check(value: Any, hint: Any, loc: Loc) -> tuple[Any, list[Problem]]:
    """``value`` as ``hint`` types it, and what is wrong with it (pydantic's problems)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value, []
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if value is None and len(members) < len(args):
            return None, []
        if len(members) == 1:
            return _check(value, members[0], loc)
        problems: list[Problem] = []
        for member in members:  # the first that takes it (JSON's types are disjoint)
            result, found = _check(value, member, (*loc, _name(member)))
            if not found:
                return result, []
            problems += found
        return value, problems
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value, []
        *rest, last = (repr(a) for a in args)
        words = f"{', '.join(rest)} or {last}" if rest else last
        return value, [("literal_error", loc, f"Input should be {words}")]
    if origin is list:
        if not isinstance(value, list):
            return value, [("list_type", loc, "Input should be a valid list")]
        return _items(enumerate(value), args[0], loc, list)
    if origin is dict or is_typeddict(hint):
        if not isinstance(value, dict):
            if origin is dict:
                return value, [("dict_type", loc, "Input should be a valid dictionary")]
            message = f"Input should be a valid dictionary or instance of {hint.__name__}"
            return value, [("model_type", loc, message)]
        if origin is dict:
            return _items(value.items(), args[1], loc, dict)
        keys = typing.get_type_hints(hint)
        result, problems = _items(((k, value.get(k, False)) for k in keys), bool, loc, dict)
        extra = [("extra_forbidden", (*loc, k), "") for k in value if k not in keys]
        return result, problems + extra
    kind, words = _SCALARS[hint]
    ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value), []
        except OverflowError:
            ok = False
    return value, [] if ok else [(kind, loc, f"Input should be {words}")]


def _items(
    items: typing.Iterable[tuple[Any, Any]], hint: Any, loc: Loc, kind: type
) -> tuple[Any, list[Problem]]:
    pairs, problems = [], []
    for key, item in items:
        value, found = _check(item, hint, (*loc, key))
        pairs.append((key, value))
        problems += found
    return (dict(pairs) if kind is dict else [v for _, v in pairs]), problems


def _name(hint: Any) -> str:
    """A union member's name in a problem's location, as pydantic writes it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "any"
    if origin in (Union, types.UnionType):
        return f"union[{','.join(_name(a) for a in args)}]"
    if origin in (list, dict):
        return f"{origin.__name__}[{','.join(_name(a) for a in args)}]"
    return str(hint.__name__)
