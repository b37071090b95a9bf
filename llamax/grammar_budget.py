"""What a request's grammar may cost, checked before and while it is built.

Design note. A request causes a grammar by its JSON schema (``response_format``,
``json_schema``, Anthropic's ``output_config``, a tool's ``parameters``) or by GBNF text
(``grammar``). The converter's output can grow far faster than the schema: a ``maxLength``
of ``10**9`` is ten bytes that it would write as a billion nested groups, and llama.cpp's
parser expands each ``x{n}`` of a GBNF into ``n`` copies of ``x``. So: a schema is walked
first (:func:`check_schema_size`: its depth, and each repetition's count and estimated text),
every rule the converter adds is charged to a :class:`GrammarBudget` as it is added (the
build stops at the first rule over the limit, not after), and a grammar's text is measured
before llama.cpp parses it (:func:`gbnf_problem`: its size, what its repetitions expand to,
how deep its groups nest).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import GrammarError

__all__ = [
    "MAX_GBNF_NESTING",
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_RULES",
    "MAX_REPEATED_BYTES",
    "MAX_RULE_ADDS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_REPETITION",
    "GrammarBudget",
    "GrammarCache",
    "check_schema_size",
    "gbnf_problem",
]

MAX_GRAMMAR_BYTES = 4 << 20
"""Most bytes of GBNF one request's grammar may have (a schema's, or all its tools' in all):
above what a schema's numeric fields may take (16,384 rules, about 90 bytes each)."""

MAX_GRAMMAR_RULES = 32_768
"""Most rules one schema's grammar may have."""

MAX_RULE_ADDS = 8 * MAX_GRAMMAR_RULES
"""Most rules the converter may add or look up while building one schema's grammar (its
work: an object's optional properties are looked up once per pair)."""

MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and lists in a schema."""

MAX_SCHEMA_REPETITION = 10_000
"""Largest ``minItems``/``maxItems``/``minLength``/``maxLength`` and pattern quantifier: the
converter writes each repetition out."""

MAX_REPEATED_BYTES = MAX_GRAMMAR_BYTES
"""Most bytes a GBNF's ``{m,n}`` repetitions may expand to in llama.cpp's parser (each
repeated symbol counted by its text; llama.cpp keeps 8 bytes a character)."""

MAX_GBNF_NESTING = 256
"""Deepest nesting of groups in a GBNF (llama.cpp's parser recurses on each)."""

_REPEATS = ("minItems", "maxItems", "minLength", "maxLength")
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


class GrammarBudget:
    """The rules, bytes and work one grammar's build may still spend.

    Args:
        max_bytes: Bytes of GBNF allowed (names and bodies).
        max_rules: Rules allowed.
        max_adds: Rule additions (and look-ups of rules already added) allowed.
    """

    def __init__(
        self,
        max_bytes: int = MAX_GRAMMAR_BYTES,
        max_rules: int = MAX_GRAMMAR_RULES,
        max_adds: int = MAX_RULE_ADDS,
    ) -> None:
        self.max_bytes, self.max_rules, self.max_adds = max_bytes, max_rules, max_adds
        self.num_bytes = self.num_rules = self.num_adds = 0

    def charge(self, what: str, num_bytes: int, *, is_new: bool = True) -> None:
        """Spend a rule step on ``what``, and when it adds a rule (``is_new``) the rule and
        its ``num_bytes``.

        Raises:
            GrammarError: the grammar would pass a limit; the message names ``what``.
        """
        self.num_adds += 1
        if is_new:
            self.num_rules += 1
        self.reserve(what, num_bytes if is_new else 0)

    def reserve(self, what: str, num_bytes: int) -> None:
        """Spend ``num_bytes`` on ``what`` (an estimate, before it is built).

        Raises:
            GrammarError: as :meth:`charge`.
        """
        self.num_bytes += num_bytes
        if self.num_bytes > self.max_bytes:
            raise GrammarError(
                f"the grammar would exceed its limit of {self.max_bytes} bytes (at {what})"
            )
        if self.num_rules > self.max_rules:
            raise GrammarError(
                f"the grammar would exceed its limit of {self.max_rules} rules (at {what})"
            )
        if self.num_adds > self.max_adds:
            raise GrammarError(
                f"building the grammar would take over {self.max_adds} rule steps (at {what})"
            )


class GrammarCache:
    """The grammars of the schemas seen last, at most ``max_bytes`` of them in all (a count
    alone would let 64 grammars of the largest size pin 256 MiB). Safe from any thread.

    Args:
        build: ``schema text -> grammar``.
        max_bytes: Bytes of grammar kept (keys and values).
    """

    def __init__(self, build: Callable[[str], str], max_bytes: int) -> None:
        self._build, self._max_bytes = build, max_bytes
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def __call__(self, schema_json: str) -> str:
        """The grammar of ``schema_json``: kept, or built (outside the lock) and kept."""
        with self._lock:
            found = self._grammars.get(schema_json)
            if found is not None:
                self._grammars.move_to_end(schema_json)
                return found
        grammar = self._build(schema_json)
        size = len(schema_json) + len(grammar)
        with self._lock:
            if size <= self._max_bytes // 4 and schema_json not in self._grammars:
                self._grammars[schema_json] = grammar
                self._num_bytes += size
                while self._num_bytes > self._max_bytes:
                    key, value = self._grammars.popitem(last=False)
                    self._num_bytes -= len(key) + len(value)
        return grammar


def check_schema_size(schema: Any, budget: GrammarBudget) -> None:
    """Walk ``schema`` (iteratively) before it is converted: its nesting depth, and each
    repetition keyword's count and estimated text (charged to ``budget``).

    Raises:
        GrammarError: nested deeper than :data:`MAX_SCHEMA_DEPTH`, a count over
            :data:`MAX_SCHEMA_REPETITION`, or the estimates over the budget (names the place).
    """
    stack: list[tuple[Any, _Place, int]] = [(schema, _Place("", 0), 0)]
    while stack:
        node, place, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            where = place.path or "the schema"
            raise GrammarError(f"{where} is nested deeper than the limit of {MAX_SCHEMA_DEPTH}")
        if isinstance(node, Mapping):
            _charge_repeats(node, place, budget)
            stack.extend((v, place.child(str(k)), depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, place.child(f"[{i}]", ""), depth + 1) for i, v in enumerate(node))


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a node is: its path for messages (its last 200 characters), and the length of
    the rule name the converter makes of it (every key in full, as it writes them)."""

    path: str
    num_name_chars: int

    def child(self, key: str, dot: str = ".") -> _Place:
        path = f"{self.path}{dot}{key}" if self.path else key
        path = path if len(path) <= 200 else "..." + path[-197:]
        return _Place(path, self.num_name_chars + len(key) + 1)


def _charge_repeats(node: Mapping[str, Any], place: _Place, budget: GrammarBudget) -> None:
    """Charge what the converter writes for ``node``'s repetitions: each repeated item is a
    rule name (as long as the node's) or one character, and some syntax."""
    item_bytes = place.num_name_chars + 32
    for key in _REPEATS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _charge_count(_join(place.path, key), value, item_bytes, budget)
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        for match in _QUANTIFIER.finditer(pattern):
            count = max(_count(n) for n in match.groups())
            where = f"{_join(place.path, 'pattern')} {match.group(0)[:40]}"
            _charge_count(where, count, item_bytes, budget)


def _count(digits: str | None) -> int:
    """A quantifier's count (0 for none); one of more than 9 digits as 10**9."""
    return 0 if not digits else 10**9 if len(digits) > 9 else int(digits)


def _charge_count(where: str, count: float, item_bytes: int, budget: GrammarBudget) -> None:
    if count > MAX_SCHEMA_REPETITION:
        shown = count if count < 10**12 else f"{count:.3g}"
        raise GrammarError(f"{where} is {shown}, over the limit of {MAX_SCHEMA_REPETITION}")
    budget.reserve(where, int(max(count, 0)) * item_bytes)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_GBNF_TOKEN = re.compile(
    r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|\{[^}]*\}|::=|[a-zA-Z0-9_-]+|\s+|.', re.S
)


def gbnf_problem(grammar: str) -> str | None:
    """Why a GBNF text is too costly to hand to llama.cpp's parser, or None: over
    :data:`MAX_GRAMMAR_BYTES`, repetitions expanding past :data:`MAX_REPEATED_BYTES`, or
    groups nested deeper than :data:`MAX_GBNF_NESTING`. Linear in the text."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        return f"the grammar has {len(grammar)} bytes, over the limit of {MAX_GRAMMAR_BYTES}"
    repeated = depth = num_name_chars = 0
    last = ""  # the symbol a repetition applies to ("(" for a group)
    for token in _GBNF_TOKEN.findall(grammar):
        if token == "::=":  # each optional copy is a rule named after this one
            num_name_chars = len(last)
        elif token == "(":
            depth += 1
            if depth > MAX_GBNF_NESTING:
                return f"the grammar nests groups deeper than {MAX_GBNF_NESTING}"
        elif token == ")":
            depth = max(depth - 1, 0)
            token = "("
        elif token.startswith("{"):
            match = _QUANTIFIER.fullmatch(token)
            counts = [_count(n) for n in (match.groups() if match else ())]
            repeated += max(counts, default=1) * (len(last) + num_name_chars + 8)
            if repeated > MAX_REPEATED_BYTES:
                return f"its repetitions would expand past {MAX_REPEATED_BYTES} bytes"
            continue
        if not token.isspace() and not token.startswith("#"):
            last = token
    return None
