"""Command-line flags for llamax's options: one ``--flag`` per option of
:class:`~llamax.ContextConfig` or :class:`~llamax.SamplingParams` that asks for one.

``llamax serve``, ``llamax bench`` and the Ray launcher build their flags with this, so an
option added to a config class gets its flag, its ``--help`` text and its parsing in one
place; an application's own command line can do the same::

    from llamax.flags import add_option_flags, option_values

    parser = argparse.ArgumentParser()
    add_option_flags(parser, llamax.ContextConfig)
    options = option_values(parser.parse_args(), llamax.ContextConfig)
    ctx = llamax.Context(model, **options)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from .optionspec import OptionSpec, byte_size, flag_of, nested_options, spec

__all__ = [
    "OptionSpec",
    "add_option_flags",
    "byte_size",
    "nested_options",
    "option_values",
    "spec",
]
"""``spec``, ``OptionSpec``, ``byte_size`` and ``nested_options`` are
:mod:`llamax.optionspec`'s, here for the layers above the core that declare options of
their own (``llamax.server.ServerConfig``)."""


class _FlagTarget(Protocol):
    """What flags are added to: an ``argparse`` parser or one of its argument groups."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


def add_option_flags(
    parser: _FlagTarget,
    options: type,
    *,
    skip: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add a flag for each option of ``options`` whose spec asks for one (``--n-ctx`` for
    ``n_ctx``; a bool gets ``--name``/``--no-name``; a ``tuple[str, ...]`` a repeatable
    flag), with the option's doc as its help.
    An option's older spellings are accepted too, hidden from ``--help``. Read the values
    back with :func:`option_values`.

    Args:
        parser: The parser (or argument group) to add the flags to.
        options: ``llamax.ContextConfig`` or ``llamax.SamplingParams`` (or a subclass).
        skip: Options to leave out (one a command sets itself).
        defaults: Flag defaults that differ from the options' own.
    """
    hints = typing.get_type_hints(options)
    defaults = defaults or {}
    for f in dataclasses.fields(options):
        spec = f.metadata.get("llamax")  # an option's spec (llamax.optionspec)
        if spec is None or not spec.flag or f.name in skip:
            continue
        inner = nested_options(hints[f.name])
        if inner is not None:  # an option dataclass (ServerConfig.images): its own flags
            add_option_flags(parser, inner)
            continue
        shown = (
            str(defaults[f.name])
            if f.name in defaults
            else spec.flag_default_doc or spec.default_doc or str(f.default)
        )
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": defaults.get(f.name),
            "help": _plain(f"{spec.doc} (default: {shown})"),
            **_flag_kind(spec.flag_type, hints[f.name]),
        }
        if spec.metavar:
            kwargs["metavar"] = spec.metavar
        names = (spec.short_flag, flag_of(f.name, spec))
        parser.add_argument(*(name for name in names if name), **kwargs)
        for alias in spec.aliases:
            parser.add_argument(
                alias, **{**kwargs, "help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
            )


def option_values(ns: argparse.Namespace, options: type) -> dict[str, Any]:
    """The options given by the flags of :func:`add_option_flags` (those left out are not
    in the result, so the options' own defaults apply), as keyword arguments of ``options``;
    a nested option dataclass's (``ServerConfig.images``) as a mapping of the fields given
    (absent when none is).

    Raises:
        OSError: a flag names a file (``--chat-template FILE``) that cannot be read.
    """
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        spec = f.metadata.get("llamax")
        if spec is None or not spec.flag:
            continue
        inner = nested_options(hints[f.name])
        if inner is not None:
            if nested := option_values(ns, inner):
                values[f.name] = nested
            continue
        value = getattr(ns, f.name, None)
        if value is None:
            continue
        values[f.name] = spec.from_flag(value) if spec.from_flag else value
    return values


def _flag_kind(flag_type: Any, hint: Any) -> dict[str, Any]:
    """argparse's ``type``/``action``/``choices`` for an option of type ``hint``."""
    if typing.get_origin(hint) is tuple and flag_type is None:  # a repeatable flag
        item, *rest = typing.get_args(hint)
        if rest == [Ellipsis] and item in (int, float, str):
            return {"action": "append", "type": item}
    if flag_type is not None:
        return {"type": flag_type}
    parts = [p for p in typing.get_args(hint) or (hint,) if p is not type(None)]
    if str in parts:  # a path-like option's flag is the path's text
        parts = [p for p in parts if (typing.get_origin(p) or p) is not os.PathLike]
    if typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    if len(parts) == 1 and typing.get_origin(parts[0]) is Literal:  # a Literal or None
        return {"choices": typing.get_args(parts[0])}
    if parts == [bool]:
        return {"action": argparse.BooleanOptionalAction}
    if len(parts) == 1 and parts[0] in (int, float, str):
        return {"type": parts[0]}
    raise TypeError(f"an option of type {hint} needs a flag_type to be a flag")


def _plain(text: str) -> str:
    """Markdown doc text as ``--help`` shows it."""
    return text.replace("`", "").replace("%", "%%")
