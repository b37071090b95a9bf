"""One source per option list: dataclass fields that carry their own docs.

Each option of :class:`~llamax.SamplingParams` and :class:`~llamax.ContextConfig` is a
dataclass field whose metadata (made by :func:`spec`) holds an :class:`OptionSpec`: a one-line
doc, and how the option appears on the command line and in OpenAI requests. Everything else
is derived from the fields: the OpenAI request types (``llamax/dialects/openai_parse.py``), the
OpenAI mapping (``llamax/openai/options.py``), the command-line flags (``llamax/cli.py``) and
the options tables of the docs (:func:`markdown_table`, kept current by a test; regenerate
them with ``python scripts/option_tables.py``). So a new option is one field plus its doc.
The server's settings (``llamax.server.ServerConfig``) are built the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "NOT_OPENAI",
    "OptionSpec",
    "byte_size",
    "flag_of",
    "markdown_table",
    "nested_options",
    "openai_defaults",
    "options_of",
    "read_text",
    "spec",
    "zero_is_none",
]

KEY = "llamax"
"""The metadata key of a field's :class:`OptionSpec`."""


class _NotOpenAI:
    def __repr__(self) -> str:
        return "NOT_OPENAI"


NOT_OPENAI: Any = _NotOpenAI()
"""``OptionSpec.openai`` of an option OpenAI requests do not carry under its own name."""


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """How one option is documented and offered, beside its dataclass field."""

    doc: str
    """One line of Markdown: what the option does (the docs tables and ``--help`` show it)."""
    default_doc: str | None = None
    """The default as the docs say it, where the value says too little (``"all cores"``)."""
    flag: bool = False
    """Whether the command lines offer it, as ``--name-with-dashes`` (or :attr:`flag_name`).
    On a field whose type is an option dataclass (``ServerConfig.images``), the flags are
    that class's own options'."""
    flag_name: str | None = None
    """The flag where it is not the field's name with dashes (``--n-predict`` for
    ``default_max_tokens``: llama-server's spelling)."""
    short_flag: str | None = None
    """A one-letter spelling shown beside the flag in ``--help`` (``-n``)."""
    flag_type: Callable[[str], Any] | None = None
    """Parses the flag's text (default: from the field's type)."""
    metavar: str | None = None
    """The flag's value in ``--help`` (``FILE``)."""
    aliases: tuple[str, ...] = ()
    """Older spellings of the flag: still accepted, hidden from ``--help``."""
    from_flag: Callable[[Any], Any] | None = None
    """Turns the parsed flag into the field's value (``0`` into ``None``, a path into text)."""
    flag_default_doc: str | None = None
    """The flag's default as ``--help`` and the docs say it (default: :attr:`default_doc`)."""
    openai: Any = NOT_OPENAI
    """The default in OpenAI requests, which carry the option under its own name, or
    :data:`NOT_OPENAI`."""
    openai_doc: str | None = None
    """What the option means in OpenAI requests, where that differs from :attr:`doc`."""
    check: Callable[[str, Any], Any] | None = None
    """``check(name, value)`` validates the option's value when its object is built and
    returns it as stored (frozen: a tuple for a list); it raises the owner's typed error,
    naming the option, for a value it refuses."""

    @property
    def is_openai(self) -> bool:
        """Whether OpenAI requests carry the option under its own name."""
        return self.openai is not NOT_OPENAI


def spec(**fields: Any) -> dict[str, OptionSpec]:
    """Field metadata holding an :class:`OptionSpec`: ``field(default=4096,
    metadata=spec(doc="KV cells", flag=True))``.

    Args:
        **fields: The :class:`OptionSpec` fields; ``doc`` is required.

    Returns:
        The metadata mapping for ``dataclasses.field``.
    """
    return {KEY: OptionSpec(**fields)}


def zero_is_none(value: float) -> float | None:
    """A flag's ``0`` as None (``--max-step-ms 0``: no target)."""
    return value or None


def read_text(path: str) -> str:
    """The text of the file a flag names (``--chat-template FILE``)."""
    with open(path, encoding="utf-8") as f:
        return f.read()


_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """A byte count from ``"1073741824"``, ``"512M"``, ``"512MiB"``, ``"2g"`` or ``"1.5GB"``
    (``K``/``M``/``G``/``T`` are powers of 1,024, with or without ``B``/``iB``).

    Raises:
        argparse.ArgumentTypeError: not a size, or a negative one (argparse shows its text).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512M, 2G)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])


@dataclass(frozen=True, slots=True)
class Option:
    """One option as the derived artefacts see it: the field's name, type, default, spec."""

    name: str
    type: Any
    """The field's resolved type hint."""
    default: Any
    """The field's default (``dataclasses.MISSING`` for a factory or none)."""
    spec: OptionSpec

    @property
    def flag(self) -> str:
        """The command-line flag: ``--n-ctx`` for ``n_ctx`` (or the spec's ``flag_name``)."""
        return flag_of(self.name, self.spec)

    @property
    def default_text(self) -> str:
        """The default as the docs show it."""
        if self.spec.default_doc is not None:
            return self.spec.default_doc
        return _code(self.default)


def flag_of(name: str, spec: OptionSpec) -> str:
    """The flag of option ``name``: its spec's ``flag_name``, else ``--name-with-dashes``."""
    return spec.flag_name or "--" + name.replace("_", "-")


def nested_options(hint: Any) -> type | None:
    """The option dataclass a field of type ``hint`` holds (``ImagePolicy`` for
    ``ServerConfig.images``), or ``None``: its options are offered as flags of their own."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and options_of(hint):
        return hint
    return None


def options_of(cls: type) -> list[Option]:
    """The options of a dataclass, in field order (fields without a spec are left out)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(KEY)
        if isinstance(spec, OptionSpec):
            found.append(Option(f.name, hints[f.name], f.default, spec))
    return found


def openai_defaults(cls: type) -> dict[str, Any]:
    """``{name: OpenAI default}`` of the options OpenAI requests carry under their own name."""
    return {o.name: o.spec.openai for o in options_of(cls) if o.spec.is_openai}


def _code(value: Any) -> str:
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


Table = Literal["fields", "flags", "openai"]


def markdown_table(
    cls: type,
    table: Table,
    *,
    skip: tuple[str, ...] = (),
    defaults: dict[str, str] | None = None,
) -> str:
    """The docs table of ``cls``'s options.

    Args:
        cls: ``SamplingParams``, ``ContextConfig`` (or a subclass with more options).
        table: ``"fields"`` (every option, Python names and defaults), ``"flags"`` (the
            command-line flags) or ``"openai"`` (OpenAI request names and defaults).
        skip: Option names to leave out.
        defaults: Flag defaults that differ from the options' own (as the command sets them).

    Returns:
        A Markdown table, ending in a newline.
    """
    header = {"fields": "option", "flags": "flag", "openai": "option"}[table]
    rows = [f"| {header} | default | meaning |", "| --- | --- | --- |"]
    for o in options_of(cls):
        if o.name in skip:
            continue
        if table == "fields":
            rows.append(f"| `{o.name}` | {o.default_text} | {_cell(o.spec.doc)} |")
        elif table == "flags" and o.spec.flag:
            rows += _flag_rows(o, defaults or {})
        elif table == "openai" and o.spec.is_openai:
            doc = o.spec.openai_doc or o.spec.doc
            rows.append(f"| `{o.name}` | {_code(o.spec.openai)} | {_cell(doc)} |")
    return "\n".join(rows) + "\n"


def _flag_rows(o: Option, defaults: Mapping[str, str]) -> list[str]:
    """The rows of ``o``'s flag in a ``flags`` table; of its class's flags for a nested
    option dataclass."""
    inner = nested_options(o.type)
    if inner is not None:
        return [row for i in options_of(inner) if i.spec.flag for row in _flag_rows(i, {})]
    name = f"`{o.flag} {o.spec.metavar}`" if o.spec.metavar else f"`{o.flag}`"
    if o.spec.short_flag:
        name = f"`{o.spec.short_flag}`, {name}"
    default = defaults.get(o.name) or o.spec.flag_default_doc or o.default_text
    return [f"| {name} | {default} | {_cell(o.spec.doc)} |"]


_BLOCK = re.compile(
    r"(<!-- options: (?P<cls>\w+) (?P<table>\w+)(?P<args>(?: [-\w.=]+)*) -->\n)"
    r"(?P<body>.*?)(<!-- /options -->)",
    re.DOTALL,
)
"""A generated block: ``<!-- options: Class table [-skipped] [name=default] -->``, the
table, ``<!-- /options -->``."""


def _table_for(m: re.Match[str], classes: Mapping[str, type]) -> str:
    args = m["args"].split()
    skip = tuple(a[1:] for a in args if a.startswith("-"))
    defaults = {k: f"`{v}`" for k, v in (a.split("=", 1) for a in args if "=" in a)}
    table = typing.cast(Table, m["table"])
    return markdown_table(classes[m["cls"]], table, skip=skip, defaults=defaults)


def generated_blocks(text: str, classes: Mapping[str, type]) -> Iterator[tuple[str, str]]:
    """``(current, wanted)`` for each generated options block of a Markdown ``text``;
    ``classes`` maps the class names the blocks use to the classes (a block of a class not
    in it is left out: the server's settings are listed apart from the core's options)."""
    for m in _BLOCK.finditer(text):
        if m["cls"] in classes:
            yield m["body"], _table_for(m, classes)


def regenerate(text: str, classes: Mapping[str, type]) -> str:
    """``text`` with every generated options block of ``classes`` replaced by its current
    table."""
    return _BLOCK.sub(
        lambda m: m[1] + _table_for(m, classes) + m[6] if m["cls"] in classes else m[0], text
    )
