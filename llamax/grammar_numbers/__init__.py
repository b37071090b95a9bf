"""GBNF for the decimals a JSON schema's numeric keywords allow: ``minimum``, ``maximum``,
their exclusive forms and ``multipleOf`` on a ``number`` (and ``multipleOf`` on an
``integer``), enforced exactly.

Design note. Those values, written as plain decimals, are a regular language over the
characters ``-.0123456789``, and each keyword is a small automaton reading a decimal left to
right (``digits.py``). A bound compares the integer part's length with the bound's, then
digit by digit (past the bound's last digit, its digits are zeros). ``multipleOf p/10**q``
keeps the digits read up to the ``q``-th fraction digit modulo ``p``, and wants zeros after
it. Their product (``machine.py``) is explored from the start and minimised as it goes
(``automaton.py``): the language is finite (the digits are capped), so the automaton has no
cycles, and two states are equal exactly when they accept alike and go to equal states on
each character. Each state is one right-linear GBNF rule (``s ::= | [0-4] t | "." u``),
which llama.cpp's grammar engine follows with a single stack. The automaton grows with the
multiple's digits prime to 10 (a state per remainder and digit count): past
:data:`MAX_NUMBER_RULES` states for a field, or :data:`MAX_SCHEMA_NUMBER_RULES` for a
schema's numeric fields in all (fields alike share their rules), the schema is refused.

The form written: an optional ``-``, an integer part without leading zeros, an optional
fraction (trailing zeros allowed), no exponent, never ``-0``. At most
:data:`MAX_SIGNIFICANT_DIGITS` digits from the first non-zero one: a client that parses the
value as a double (pydantic, JavaScript) then compares it with the bound as the decimals
compare. At most :data:`MAX_FRACTION_DIGITS` fraction digits, or more where a bound or the
multiple has more.
"""

from __future__ import annotations

from .automaton import MAX_NUMBER_RULES, NumberAutomaton, number_automaton
from .domain import MAX_FRACTION_DIGITS, MAX_SIGNIFICANT_DIGITS, Bound, NumberDomain
from .rules import MAX_SCHEMA_NUMBER_RULES, NumberRules

__all__ = [
    "MAX_FRACTION_DIGITS",
    "MAX_NUMBER_RULES",
    "MAX_SCHEMA_NUMBER_RULES",
    "MAX_SIGNIFICANT_DIGITS",
    "Bound",
    "NumberAutomaton",
    "NumberDomain",
    "NumberRules",
    "number_automaton",
]
