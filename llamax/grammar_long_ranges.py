"""GBNF for the integers in a range whose bounds have many digits, in rules whose total size
grows linearly with the digits (:func:`llamax.grammar_ranges.int_range_rule`, llama.cpp's
construction, grows as their square: a 450-digit bound made 5 MB of GBNF and gigabytes in
llama.cpp's parser).

Design note. A magnitude of ``n`` digits at least ``L`` (``L`` of ``n`` digits) is read left
to right: the first digit equal to ``L``'s leaves the rest at least ``L``'s rest; a larger
one leaves any ``n - 1`` digits. So "at least the suffix of ``L`` from digit ``j``" is one
rule per ``j`` (``ge-j ::= [L_j] ge-(j+1) | [L_j+1 - 9] any-(n-j-1)``), "any ``k`` digits" is
one rule per ``k`` (``any-k ::= [0-9] any-(k-1)``), and "at most ``H``" is the mirror
(``le-j``). Lengths strictly between the bounds' are ``[1-9]`` then ``a`` digits then up to
``b - a - 2`` more (``opt-m ::= ([0-9] opt-(m-1))?``). Each rule is a few symbols, so
llama.cpp's parsed grammar is linear too (no ``{n}`` that it would expand). Exact: no
leading zeros, no ``+``, never ``-0``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MAX_INTEGER_DIGITS", "OPEN_SIDE_DIGITS", "long_int_range_rule"]

MAX_INTEGER_DIGITS = 1000
"""Most digits an integer bound may have (about 6 rules per digit of the longer bound)."""

OPEN_SIDE_DIGITS = 16
"""Digits an open side allows, as :mod:`llamax.grammar_ranges` (llama.cpp's
``decimals_left``): an open side is ``10**16 - 1`` in magnitude."""


class _Chains:
    """The shared ``any-k`` and ``opt-m`` rules of one range, added on first use."""

    def __init__(self, add_rule: Callable[[str, str], str], name: str) -> None:
        self.add_rule, self.name = add_rule, name
        self._any: list[str] = []
        self._opt: list[str] = []

    def any(self, count: int) -> str:
        """A reference to exactly ``count`` digits (``count`` >= 1)."""
        while len(self._any) < count:
            body = "[0-9]" + (f" {self._any[-1]}" if self._any else "")
            self._any.append(self.add_rule(f"{self.name}-any-{len(self._any) + 1}", body))
        return self._any[count - 1]

    def opt(self, count: int) -> str:
        """A reference to 0 to ``count`` digits (``count`` >= 1)."""
        while len(self._opt) < count:
            body = "[0-9]" + (f" {self._opt[-1]}" if self._opt else "")
            self._opt.append(self.add_rule(f"{self.name}-opt-{len(self._opt) + 1}", f"({body})?"))
        return self._opt[count - 1]

    def then_any(self, count: int) -> str:
        """`` any-count`` (with its space), or nothing for 0."""
        return f" {self.any(count)}" if count else ""


def _digits(first: str, last: str) -> str:
    return f"[{first}]" if first == last else f"[{first}-{last}]"


def _suffix_chain(chains: _Chains, bound: str, tag: str, at_least: bool, start: int) -> list[str]:
    """``refs[j]``: the digit strings of ``len(bound) - j`` digits at least (or at most)
    ``bound[j:]``, for ``j >= start`` (the others unused); built from the last digit up."""
    size = len(bound)
    refs = [""] * (size + 1)
    for j in range(size - 1, start - 1, -1):
        d = bound[j]
        if j == size - 1:
            body = _digits(d, "9") if at_least else _digits("0", d)
        else:
            alts = [f"[{d}] {refs[j + 1]}"]
            rest = chains.then_any(size - j - 1)
            if at_least and d < "9":
                alts.append(_digits(chr(ord(d) + 1), "9") + rest)
            if not at_least and d > "0":
                alts.insert(0, _digits("0", chr(ord(d) - 1)) + rest)
            body = " | ".join(alts)
        refs[j] = chains.add_rule(f"{chains.name}-{tag}-{j}", body)
    return refs


def _same_length(chains: _Chains, low: str, high: str, tag: str) -> str:
    """The magnitudes from ``low`` to ``high``, both of one length."""
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    if i == len(low):
        return f'"{low}"'
    prefix = f'"{low[:i]}" ' if i else ""
    if i == len(low) - 1:
        return prefix + _digits(low[i], high[i])
    ge = _suffix_chain(chains, low, f"{tag}ge", True, i + 1)
    le = _suffix_chain(chains, high, f"{tag}le", False, i + 1)
    alts = [f"[{low[i]}] {ge[i + 1]}"]
    if ord(high[i]) - ord(low[i]) > 1:
        between = _digits(chr(ord(low[i]) + 1), chr(ord(high[i]) - 1))
        alts.append(between + chains.then_any(len(low) - i - 1))
    alts.append(f"[{high[i]}] {le[i + 1]}")
    return prefix + "(" + " | ".join(alts) + ")"


def _magnitudes(chains: _Chains, low: int, high: int, tag: str) -> str:
    """The magnitudes (no sign) from ``low`` to ``high`` (``0 <= low <= high``)."""
    lo, hi = str(low), str(high)
    if len(lo) == len(hi):
        return _same_length(chains, lo, hi, tag)
    alts = [_same_length(chains, lo, "9" * len(lo), tag + "a")]
    if len(hi) - len(lo) >= 2:
        middle = f"[1-9] {chains.any(len(lo))}"
        if len(hi) - len(lo) > 2:
            middle += f" {chains.opt(len(hi) - len(lo) - 2)}"
        alts.append(middle)
    alts.append(_same_length(chains, "1" + "0" * (len(hi) - 1), hi, tag + "b"))
    return " | ".join(f"({alt})" for alt in alts)


def long_int_range_rule(
    low: int | None, high: int | None, add_rule: Callable[[str, str], str], name: str
) -> str:
    """A GBNF expression matching the decimal integers in ``[low, high]`` (an open side:
    :data:`OPEN_SIDE_DIGITS` digits at most), its rules added as ``add_rule(name, body) ->
    name used`` under names made from ``name``.

    Raises:
        ValueError: no integer is in the range, or a bound has more than
            :data:`MAX_INTEGER_DIGITS` digits.
    """
    for bound in (low, high):
        if bound is not None and len(str(abs(bound))) > MAX_INTEGER_DIGITS:
            raise ValueError(f"an integer bound may have at most {MAX_INTEGER_DIGITS} digits")
    widest = 10**OPEN_SIDE_DIGITS - 1
    low = -widest if low is None else low
    high = widest if high is None else high
    if low > high:
        raise ValueError(f"no integer of at most {OPEN_SIDE_DIGITS} digits is in the range")
    chains = _Chains(add_rule, name)
    if high < 0:
        return f'"-" ({_magnitudes(chains, -high, -low, "n")})'
    positive = _magnitudes(chains, max(low, 0), high, "p")
    if low >= 0:
        return positive
    return f'"-" ({_magnitudes(chains, 1, -low, "n")}) | {positive}'
