"""The field checks the option dataclasses share (:class:`~llamax.SamplingParams`,
:class:`~llamax.ContextConfig`): each refuses a bad value with
:class:`~llamax.errors.InvalidParameterError`, naming the field."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from .errors import InvalidParameterError
from .optionspec import KEY as OPTION_KEY

__all__ = [
    "Check",
    "field_checks",
    "is_endpoint_list",
    "is_int",
    "is_pathlike",
    "is_real",
    "iterable",
    "real",
    "refuse_huge_ints",
    "require",
    "where",
]


def require(ok: bool, message: str, param: str | None = None) -> None:
    """Raise :class:`~llamax.errors.InvalidParameterError` with ``message`` (about the
    field ``param``) unless ``ok``."""
    if not ok:
        raise InvalidParameterError(message, param=param)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


def is_pathlike(value: object) -> bool:
    return isinstance(value, (str, os.PathLike)) and os.fspath(value) != ""


def is_endpoint_list(servers: object) -> bool:
    if not isinstance(servers, str):
        return False
    for endpoint in servers.split(","):
        host, _, port = endpoint.strip().rpartition(":")
        if not host or not port.isdigit():
            return False
    return True


_MAX_INT_BITS = 63
"""No parameter means anything past a signed 64-bit int; larger ints are refused before any
check converts (``float()`` raises OverflowError) or shows them (``repr`` raises ValueError
past 4,300 digits)."""


def refuse_huge_ints(owner: object, names: Sequence[str]) -> None:
    """Raise InvalidParameterError, naming the field, if a field of ``owner`` in ``names``
    is (or holds, as a list item or a dict key or value) an int of more than 63 bits."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, Mapping):
            items: list[Any] = [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        for item in items:
            if is_int(item) and item.bit_length() > _MAX_INT_BITS:
                raise InvalidParameterError(
                    f"{name} is out of range: it holds an int of {item.bit_length()} bits "
                    f"(at most {_MAX_INT_BITS})",
                    param=name,
                )


def iterable(name: str, value: Any) -> tuple[Any, ...]:
    require(
        isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (bytes, Mapping)),
        f"{name} must be a list, got {type(value).__name__}",
        name,
    )
    return tuple(value)


Check: TypeAlias = "Callable[[str, Any], Any]"
"""``check(name, value) -> stored value`` (see :attr:`~llamax.optionspec.OptionSpec.check`)."""


def where(ok: Callable[[Any], bool], must: str, *, show_type: bool = False) -> Check:
    """A check that refuses a value unless ``ok(value)``: "``name`` ``must``, got ``value``".

    With ``show_type`` the message names the refused value's type instead of showing it.
    """

    def check(name: str, value: Any) -> Any:
        got = type(value).__name__ if show_type else repr(value)
        require(ok(value), f"{name} {must}, got {got}", name)
        return value

    return check


def real(ok: Callable[[Any], bool], must: str) -> Check:
    """A check for a number field: a number (not a bool), then ``ok(value)``."""

    def check(name: str, value: Any) -> Any:
        require(is_real(value), f"{name} must be a number, got {value!r}", name)
        require(ok(value), f"{name} must be {must}, got {value}", name)
        return value

    return check


def field_checks(cls: type) -> tuple[tuple[str, Check], ...]:
    """``(name, check)`` of each field of ``cls`` whose spec has a check, in field order."""
    found = []
    for f in dataclasses.fields(cls):
        option = f.metadata.get(OPTION_KEY)
        if option is not None and option.check is not None:
            found.append((f.name, option.check))
    return tuple(found)
