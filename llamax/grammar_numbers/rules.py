"""The GBNF rules of one schema's numeric fields, added through the JSON-schema converter."""

from __future__ import annotations

from collections.abc import Callable

from .automaton import MAX_EXPLORED, MAX_NUMBER_RULES, AutomatonTooLarge, number_automaton
from .domain import NumberDomain

__all__ = ["MAX_SCHEMA_NUMBER_RULES", "NumberRules"]

MAX_SCHEMA_NUMBER_RULES = 8 * MAX_NUMBER_RULES
"""Most rules the numeric fields of one schema may have in all: a field's rules grow a
thousandfold over its text, so a long schema of heavy fields would otherwise make a grammar
of gigabytes."""

_MAX_SCHEMA_EXPLORED = 4 * MAX_EXPLORED
"""Most product states the numeric fields of one schema explore in all (the build time)."""


class NumberRules:
    """One schema's numeric rules: an automaton per distinct domain (fields alike share
    their rules) within the schema's budget.

    Args:
        add_rule: The converter's ``(name, body) -> name actually used``.
    """

    def __init__(self, add_rule: Callable[[str, str], str]) -> None:
        self._add_rule = add_rule
        self._starts: dict[NumberDomain, str] = {}
        self._rules_left = MAX_SCHEMA_NUMBER_RULES
        self._explored_left = _MAX_SCHEMA_EXPLORED

    def start(self, domain: NumberDomain, name: str) -> str:
        """The GBNF expression matching ``domain``'s values; its state rules (the first
        time) are added under names made from ``name``.

        Raises:
            ValueError: no value meets the domain, or its rules would pass the field's
                limit or what is left of the schema's (the message says which).
        """
        known = self._starts.get(domain)
        if known is not None:
            return known
        max_rules = min(MAX_NUMBER_RULES, self._rules_left)
        max_explored = min(MAX_EXPLORED, self._explored_left)
        try:
            automaton = number_automaton(domain, max_rules=max_rules, max_explored=max_explored)
        except AutomatonTooLarge as exc:
            if (max_rules, max_explored) == (MAX_NUMBER_RULES, MAX_EXPLORED):
                raise
            raise AutomatonTooLarge(
                "the schema's numeric fields would exceed their limit of "
                f"{MAX_SCHEMA_NUMBER_RULES} rules in all"
            ) from exc
        self._rules_left -= len(automaton.nodes)
        self._explored_left -= automaton.explored
        names: list[str] = []
        for node in range(len(automaton.nodes) - 1):
            body = automaton.body(node, names)
            names.append("" if automaton.is_final(node) else self._add_rule(f"{name}-{node}", body))
        start = automaton.body(len(names), names)
        self._starts[domain] = start
        return start
