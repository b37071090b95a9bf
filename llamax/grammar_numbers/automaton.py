"""The minimal automaton of the allowed values, explored from the product machine, and each
of its states as one GBNF rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .domain import MAX_SIGNIFICANT_DIGITS, NumberDomain
from .machine import ALPHABET, Machine, State

__all__ = [
    "MAX_EXPLORED",
    "MAX_NUMBER_RULES",
    "AutomatonTooLarge",
    "NumberAutomaton",
    "number_automaton",
]

MAX_NUMBER_RULES = 2048
"""Most rules (automaton states) one field's grammar may have; beyond, the schema is refused."""

MAX_EXPLORED = 16 * MAX_NUMBER_RULES
"""Most product states one field explores before giving up (bounds the build time)."""


class AutomatonTooLarge(ValueError):
    """The automaton would pass the rules or the exploration it was allowed."""


@dataclass(frozen=True, slots=True)
class _Node:
    """A state of the minimal automaton."""

    accepting: bool
    edges: tuple[tuple[str, int], ...]
    """(characters, target node) pairs; the characters of one pair share the target."""


@dataclass(frozen=True, slots=True)
class NumberAutomaton:
    """The minimal automaton of the allowed values, as GBNF rules.

    ``nodes`` are in an order where every node comes after the nodes it goes to; the start
    node is the last and nothing goes to it.
    """

    nodes: tuple[_Node, ...]
    explored: int
    """Product states explored to find them (what the build cost)."""

    def is_final(self, node: int) -> bool:
        """Whether ``node`` accepts only the empty string (it needs no rule)."""
        return self.nodes[node].accepting and not self.nodes[node].edges

    def body(self, node: int, names: Sequence[str]) -> str:
        """The GBNF alternatives of ``node`` (a leading empty one when it may end), with
        ``names[k]`` the rule of node ``k`` (ignored for a final node)."""
        alternatives = [""] if self.nodes[node].accepting else []
        for chars, target in self.nodes[node].edges:
            rest = "" if self.is_final(target) else " " + names[target]
            alternatives.append(_chars(chars) + rest)
        return " | ".join(alternatives).strip()


def _chars(chars: str) -> str:
    """``chars`` as a GBNF literal or class (``-`` first, where it is literal; digit runs
    as ranges)."""
    if chars in ("-", "."):
        return f'"{chars}"'
    parts = [c for c in "-." if c in chars]
    digits = sorted(c for c in chars if c.isdigit())
    start = 0
    for end in range(1, len(digits) + 1):
        if end == len(digits) or ord(digits[end]) != ord(digits[end - 1]) + 1:
            first, last = digits[start], digits[end - 1]
            parts.append(first if first == last else f"{first}-{last}")
            start = end
    return f"[{''.join(parts)}]"


def number_automaton(
    domain: NumberDomain,
    *,
    max_rules: int = MAX_NUMBER_RULES,
    max_explored: int = MAX_EXPLORED,
) -> NumberAutomaton:
    """The minimal automaton of the plain decimals (the form in the package's docstring)
    that ``domain`` allows.

    Raises:
        AutomatonTooLarge: the automaton would have more than ``max_rules`` states, or
            explore more than ``max_explored``.
        ValueError: no such decimal exists.
    """
    machine = Machine.of(domain)
    ids: dict[_Node, int] = {}
    memo: dict[State, int | None] = {}
    too_large = f"their grammar would exceed the limit of {max_rules} rules"

    def visit(state: State) -> int | None:
        if state in memo:
            return memo[state]
        if len(memo) >= max_explored or len(ids) > max_rules:
            raise AutomatonTooLarge(too_large)
        targets: dict[int, str] = {}
        for char in ALPHABET:
            after = machine.step(state, char)
            target = None if after is None else visit(after)
            if target is not None:
                targets[target] = targets.get(target, "") + char
        accepting = machine.accepts(state)
        found = None
        if accepting or targets:
            node = _Node(accepting, tuple((chars, t) for t, chars in targets.items()))
            found = ids.setdefault(node, len(ids))
        memo[state] = found
        return found

    if visit(machine.start()) is None:
        raise ValueError(
            f"no number of at most {MAX_SIGNIFICANT_DIGITS} significant digits meets them"
        )
    if len(ids) > max_rules:
        raise AutomatonTooLarge(too_large)
    return NumberAutomaton(tuple(sorted(ids, key=ids.__getitem__)), len(memo))
