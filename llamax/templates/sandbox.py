"""The Jinja sandbox chat templates run in, with a time and size budget per render.

Design note: a chat template is code from a downloaded model file. Jinja's immutable sandbox
keeps it away from Python internals and from mutating its inputs, but not from looping for
ever or building a gigabyte string. :class:`BudgetedSandbox` adds a budget:

* time: the deadline is checked on every ``for`` iteration (each loop's iterable is wrapped
  when the template is compiled), every call (macros, methods, globals), every filter, every
  ``range`` step, and by the caller on every output chunk;
* size: no string, list or dict a template builds may exceed ``max_output_chars``. The
  operators and methods that multiply sizes (``*``, ``**``, ``+``, ``%``, ``join``,
  ``replace``, padding widths, format widths) are checked *before* they run; every other
  filter, call and ``~`` result is checked after.

Constant folding is off, so no template code runs at compile time, outside any budget. The
budget of the render in progress lives in a :class:`~contextvars.ContextVar`: concurrent
renders on other threads each see their own, and templates cannot reach it.
"""

from __future__ import annotations

import functools
import math
import re
import string
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn

import jinja2.ext
import jinja2.parser
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["MAX_RANGE_ITEMS", "BudgetExceeded", "BudgetedSandbox", "RenderBudget", "active_budget"]

MAX_RANGE_ITEMS = 100_000
"""Longest ``range`` a template may build (Jinja's own sandbox limit)."""

_MAX_INT_BITS = 1 << 16
"""Largest integer ``*`` and ``**`` may build, in bits (about 19,700 decimal digits)."""

# Names that cannot be written in a template, so templates cannot call these filters.
_ITER_FILTER = "llamax.budgeted_iter"
_SIZE_FILTER = "llamax.budgeted_size"

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class BudgetExceeded(Exception):
    """A render went over its time or size budget."""


WALL_FACTOR = 10
"""A render also stops once this many times its budget has passed on the wall clock (a
backstop: the budget itself counts the rendering thread's CPU time)."""


@dataclass(frozen=True, slots=True)
class RenderBudget:
    """The limits of one render: the CPU time and the wall time it may take, and the
    largest value or output.

    The time budget counts the CPU time of the thread that renders (``time.thread_time``),
    which is what a hostile template can burn: on a busy machine a render of a few
    milliseconds may wait seconds for a core or for the GIL, and a wall-clock budget then
    refused ordinary requests (a forced tool's schema rendered under a test suite beside
    other processes took over 1 s). :data:`WALL_FACTOR` times the budget on the wall clock
    stops it too; a check from another thread than the one that started it reads the wall
    clock alone.
    """

    max_render_seconds: float
    max_output_chars: int
    deadline: float
    """The wall-clock (monotonic) deadline."""
    cpu_deadline: float = 0.0
    """The starting thread's CPU-time deadline."""
    thread_id: int = 0
    """The thread that started the budget."""

    @classmethod
    def start(cls, max_render_seconds: float, max_output_chars: int) -> RenderBudget:
        """A budget whose clocks start now, on this thread."""
        return cls(
            max_render_seconds,
            max_output_chars,
            time.monotonic() + WALL_FACTOR * max_render_seconds,
            time.thread_time() + max_render_seconds,
            threading.get_ident(),
        )

    def check_time(self) -> None:
        """Raise :class:`BudgetExceeded` once the render has used its CPU time (or, from
        another thread, its wall time), or :data:`WALL_FACTOR` times it on the wall clock."""
        if threading.get_ident() == self.thread_id:
            if time.thread_time() > self.cpu_deadline:
                raise BudgetExceeded(
                    f"chat template rendering took longer than {self.max_render_seconds:g} s"
                )
        elif time.monotonic() > self.deadline - (WALL_FACTOR - 1) * self.max_render_seconds:
            raise BudgetExceeded(
                f"chat template rendering took longer than {self.max_render_seconds:g} s"
            )
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(
                "chat template rendering took longer than "
                f"{WALL_FACTOR * self.max_render_seconds:g} s on the wall clock"
            )

    def check_size(self, size: int, what: str) -> None:
        """Raise :class:`BudgetExceeded` if ``size`` (characters or items) is over the limit."""
        if size > self.max_output_chars:
            raise BudgetExceeded(
                f"chat template {what} would hold {size:,} characters or items,"
                f" more than max_output_chars={self.max_output_chars:,}"
            )


_ACTIVE_BUDGET: ContextVar[RenderBudget] = ContextVar("llamax_chat_render_budget")


@contextmanager
def active_budget(budget: RenderBudget) -> Iterator[None]:
    """Make ``budget`` the one the sandbox enforces while the block runs (this context only)."""
    token = _ACTIVE_BUDGET.set(budget)
    try:
        yield
    finally:
        _ACTIVE_BUDGET.reset(token)


def _weight(value: Any) -> int:
    """Items in a container plus the characters of its string members (0 if not sized)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):
        members: Any = (*value.keys(), *value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        members = value
    else:
        return 0
    return len(value) + sum(len(member) for member in members if isinstance(member, str))


def _checked_weight(value: Any, what: str) -> Any:
    _ACTIVE_BUDGET.get().check_size(_weight(value), what)
    return value


def _check_int_args(args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str) -> None:
    budget = _ACTIVE_BUDGET.get()
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int):
            budget.check_size(abs(arg), what)


def _check_int_bits(num_bits: int, operator: str) -> None:
    if num_bits > _MAX_INT_BITS:
        raise BudgetExceeded(
            f"chat template '{operator}' would build an integer of about {num_bits:,} bits,"
            f" more than {_MAX_INT_BITS:,}"
        )


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``*``, ``**``, ``+`` and ``%`` whose result would be over the budget."""
    budget = _ACTIVE_BUDGET.get()
    both_ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*":
        if both_ints:
            _check_int_bits(left.bit_length() + right.bit_length(), "*")
        for seq, count in ((left, right), (right, left)):
            if isinstance(count, int) and not isinstance(seq, int):
                budget.check_size(_weight(seq) * count, "repetition ('*')")
    elif operator == "**" and both_ints and right > 0 and abs(left) > 1:
        _check_int_bits(math.ceil(right * math.log2(abs(left))), "**")
    elif operator == "+" and not both_ints:
        budget.check_size(_weight(left) + _weight(right), "concatenation ('+')")
    elif operator == "%" and isinstance(left, str):
        _check_percent_format(left, right)


def _check_percent_format(fmt: str, values: Any) -> None:
    """Refuse a printf-style format whose widths and precisions add up to over the budget."""
    total = len(fmt)
    starred = False
    for match in _PERCENT_SPEC.finditer(fmt):
        for group in match.groups():
            starred = starred or group == "*"
            total += int(group) if group and group.isdigit() else 0
    budget = _ACTIVE_BUDGET.get()
    budget.check_size(total, "format widths")
    if starred:
        _check_int_args(values if isinstance(values, tuple) else (values,), {}, "'*' width")


def _check_brace_format(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a ``str.format`` string whose widths add up to over the budget."""
    total = len(fmt)
    nested = False
    for _literal, _field, spec, _conversion in string.Formatter().parse(fmt):
        if spec:
            nested = nested or "{" in spec
            total += sum(int(digits) for digits in _DIGITS.findall(spec))
    _ACTIVE_BUDGET.get().check_size(total, "format widths")
    if nested:
        mappings = [arg for arg in args if isinstance(arg, Mapping)]
        values = (*args, *(value for mapping in mappings for value in mapping.values()))
        _check_int_args(values, kwargs, "nested format width")


def _check_join(separator: Any, items: Any) -> None:
    if isinstance(items, (list, tuple)):
        num_seps = max(len(items) - 1, 0)
        sep_chars = len(separator) if isinstance(separator, str) else 0
        _ACTIVE_BUDGET.get().check_size(_weight(items) + sep_chars * num_seps, "join")


def _check_replace(text: Any, old: Any, new: Any, count: Any) -> None:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return
    num_matches = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        num_matches = min(num_matches, count)
    growth = num_matches * max(len(new) - len(old), 0)
    _ACTIVE_BUDGET.get().check_size(len(text) + growth, "replace")


def _arg(rest: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    return rest[index] if len(rest) > index else kwargs.get(name)


def _check_indent(text: Any, rest: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    width = _arg(rest, kwargs, 0, "width")
    if isinstance(text, str) and isinstance(width, (int, str)):
        pad = width if isinstance(width, int) else len(width)
        num_lines = text.count("\n") + 1
        _ACTIVE_BUDGET.get().check_size(len(text) + pad * num_lines, "indent")


# Checks run before a filter, given (value, positional arguments after it, keyword arguments).
_FILTER_PRECHECKS: dict[str, Callable[[Any, tuple[Any, ...], Mapping[str, Any]], None]] = {
    "join": lambda value, rest, kw: _check_join(_arg(rest, kw, 0, "d"), value),
    "replace": lambda value, rest, kw: _check_replace(
        value, _arg(rest, kw, 0, "old"), _arg(rest, kw, 1, "new"), _arg(rest, kw, 2, "count")
    ),
    "indent": _check_indent,
    "format": lambda value, rest, kw: _check_percent_format(str(value), rest or kw),
}


def _check_str_method(method: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse string methods whose result would be over the budget (padding, join, replace)."""
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return
    name = getattr(method, "__name__", "")
    if name == "join" and args:
        _check_join(text, args[0])
    elif name == "replace" and len(args) >= 2:
        _check_replace(text, args[0], args[1], _arg(args, kwargs, 2, "count"))
    elif name == "expandtabs":
        tabsize = _arg(args, kwargs, 0, "tabsize")
        if isinstance(tabsize, int):
            _ACTIVE_BUDGET.get().check_size(len(text) + text.count("\t") * tabsize, "expandtabs")
    else:
        _check_int_args(args, kwargs, f"str.{name} argument")


def _budgeted_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a filter with the budget checks (``functools.wraps`` keeps Jinja's pass_* marks)."""
    value_index = 1 if hasattr(fn, "jinja_pass_arg") else 0
    precheck = _FILTER_PRECHECKS.get(name)

    @functools.wraps(fn)
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        _ACTIVE_BUDGET.get().check_time()
        rest = args[value_index + 1 :]
        _check_int_args(rest, kwargs, f"'{name}' filter argument")
        if precheck is not None:
            precheck(args[value_index], rest, kwargs)
        return _checked_weight(fn(*args, **kwargs), f"'{name}' filter result")

    return budgeted


class _BudgetedIterable:
    """An iterable that checks the deadline before each item; ``len`` and indexing pass through."""

    __slots__ = ("_items",)

    def __init__(self, items: Any) -> None:
        self._items = items

    def __iter__(self) -> Iterator[Any]:
        budget = _ACTIVE_BUDGET.get()
        for item in self._items:
            budget.check_time()
            yield item

    def __reversed__(self) -> Iterator[Any]:
        return iter(_BudgetedIterable(reversed(self._items)))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __contains__(self, item: Any) -> bool:
        return item in self._items

    def __repr__(self) -> str:
        return repr(self._items)


def _budgeted_range(*args: int) -> _BudgetedIterable:
    """``range`` for templates: at most :data:`MAX_RANGE_ITEMS` items, deadline-checked."""
    items = range(*args)
    try:
        num_items = len(items)
    except OverflowError:
        num_items = MAX_RANGE_ITEMS + 1
    if num_items > MAX_RANGE_ITEMS:
        raise BudgetExceeded(
            f"chat template range() of {num_items:,} items is longer than {MAX_RANGE_ITEMS:,}"
        )
    return _BudgetedIterable(items)


class _Instrumenter(NodeTransformer):
    """Wrap every ``for`` iterable and every ``~`` concatenation in a budget filter."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _ITER_FILTER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, _SIZE_FILTER, [], [], None, None, lineno=node.lineno)


class _GenerationTag(jinja2.ext.Extension):
    """Accept Hugging Face's ``{% generation %}...{% endgeneration %}`` and render its body."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's Extension declares this as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, configured like Hugging Face's, plus the render budget.

    Unsafe attribute access raises :class:`~jinja2.sandbox.SecurityError` at once instead of
    producing an undefined value, so an injection attempt fails loudly. ``lipsum`` is removed
    (it can build unbounded text and no chat template uses it). Render only inside
    :func:`active_budget`.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            optimized=False,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        )
        self.globals["range"] = _budgeted_range
        del self.globals["lipsum"]
        self.filters = {name: _budgeted_filter(name, fn) for name, fn in self.filters.items()}
        self.filters[_ITER_FILTER] = _BudgetedIterable
        self.filters[_SIZE_FILTER] = lambda value: _checked_weight(value, "'~' result")

    def compile_template(self, source: str) -> jinja2.Template:
        """Parse ``source``, instrument its loops and concatenations, and compile it."""
        tree = _Instrumenter().visit(self.parse(source))
        tree.set_environment(self)
        return self.from_string(tree)

    def add_filter(self, name: str, fn: Callable[..., Any]) -> None:
        """Register a filter, wrapped with the budget checks."""
        self.filters[name] = _budgeted_filter(name, fn)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        """Run an intercepted operator after checking the size of its result."""
        _check_binop(operator, left, right)
        result = self.binop_table[operator](left, right)
        return _checked_weight(result, f"'{operator}' result")

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Call from sandboxed code: deadline first, size checks before and after."""
        _ACTIVE_BUDGET.get().check_time()
        _check_str_method(obj, args, kwargs)
        result = super().call(context, obj, *args, **kwargs)
        return _checked_weight(result, "call result")

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        """Raise at once on an unsafe attribute, rather than rendering an empty string."""
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """Jinja's sandboxed ``str.format``, with the format widths checked first."""
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        fmt: str = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_brace_format(fmt, args, kwargs)
            return sandboxed(*args, **kwargs)

        return checked
