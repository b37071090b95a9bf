"""GBNF for the integers in a range: a port of llama.cpp's ``build_min_max_int``
(``common/json-schema-to-grammar.cpp``), which llama-cpp-python's Python converter lacks.

``int_range_rule(5, 120)`` is a GBNF expression matching exactly the decimal integers from 5
to 120 (no leading zeros, no ``+``); either bound may be None (unbounded on that side).
"""

from __future__ import annotations

__all__ = ["int_range_rule"]

_MAX_DIGITS = 16
"""Digits an unbounded side allows (llama.cpp's ``decimals_left``)."""


def _digit_range(out: list[str], low: str, high: str) -> None:
    out.append(f"[{low}]" if low == high else f"[{low}-{high}]")


def _more_digits(out: list[str], low: int, high: int | None) -> None:
    out.append("[0-9]")
    if low == high == 1:
        return
    if low == high:
        out.append(f"{{{low}}}")
    else:
        out.append(f"{{{low},{'' if high is None else high}}}")


def _uniform_range(out: list[str], start: str, end: str) -> None:
    """Numbers of one length from ``start`` to ``end`` (digit strings of equal length)."""
    i = 0
    while i < len(start) and i < len(end) and start[i] == end[i]:
        i += 1
    if i > 0:
        out.append(f'"{start[:i]}"')
    if i < len(start) and i < len(end):
        if i > 0:
            out.append(" ")
        sub_len = len(start) - i - 1
        if sub_len > 0:
            from_sub, to_sub = start[i + 1 :], end[i + 1 :]
            zeros, nines = "0" * sub_len, "9" * sub_len
            to_reached = False
            out.append("(")
            if from_sub == zeros:
                _digit_range(out, start[i], chr(ord(end[i]) - 1))
                out.append(" ")
                _more_digits(out, sub_len, sub_len)
            else:
                out.append(f"[{start[i]}] (")
                _uniform_range(out, from_sub, nines)
                out.append(")")
                if ord(start[i]) < ord(end[i]) - 1:
                    out.append(" | ")
                    if to_sub == nines:
                        _digit_range(out, chr(ord(start[i]) + 1), end[i])
                        to_reached = True
                    else:
                        _digit_range(out, chr(ord(start[i]) + 1), chr(ord(end[i]) - 1))
                    out.append(" ")
                    _more_digits(out, sub_len, sub_len)
            if not to_reached:
                out.append(" | ")
                _digit_range(out, end[i], end[i])
                out.append(" ")
                _uniform_range(out, zeros, to_sub)
            out.append(")")
        else:
            out.append(f"[{start[i]}-{end[i]}]")


def _build(
    out: list[str], low: int | None, high: int | None, decimals: int, top_level: bool
) -> None:
    if low is not None and high is not None:
        if low < 0 and high < 0:
            out.append('"-" (')
            _build(out, -high, -low, decimals, True)
            out.append(")")
            return
        if low < 0:
            out.append('"-" (')
            _build(out, 0, -low, decimals, True)
            out.append(") | ")
            low = 0
        low_s, high_s = str(low), str(high)
        for digits in range(len(low_s), len(high_s)):
            _uniform_range(out, low_s, "9" * digits)
            low_s = "1" + "0" * digits
            out.append(" | ")
        _uniform_range(out, low_s, high_s)
        return
    fewer = max(decimals - 1, 1)
    if low is not None:
        if low < 0:
            out.append('"-" (')
            _build(out, None, -low, decimals, False)
            out.append(") | [0] | [1-9] ")
            _more_digits(out, 0, decimals - 1)
        elif low == 0:
            if top_level:
                out.append("[0] | [1-9] ")
                _more_digits(out, 0, fewer)
            else:
                _more_digits(out, 1, decimals)
        elif low <= 9:
            c = str(low)
            first = "1" if top_level else "0"
            if c > first:
                _digit_range(out, first, chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, 1, fewer)
                out.append(" | ")
            _digit_range(out, c, "9")
            out.append(" ")
            _more_digits(out, 0, fewer)
        else:
            low_s = str(low)
            c = low_s[0]
            if c > "1":
                _digit_range(out, "1" if top_level else "0", chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, len(low_s), fewer)
                out.append(" | ")
            _digit_range(out, c, c)
            out.append(" (")
            _build(out, int(low_s[1:]), None, fewer, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                _digit_range(out, chr(ord(c) + 1), "9")
                out.append(" ")
                _more_digits(out, len(low_s) - 1, fewer)
        return
    if high is not None:
        if high >= 0:
            if top_level:
                out.append('"-" [1-9] ')
                _more_digits(out, 0, fewer)
                out.append(" | ")
            _build(out, 0, high, decimals, True)
        else:
            out.append('"-" (')
            _build(out, -high, None, decimals, False)
            out.append(")")
        return
    raise ValueError("an integer range needs a minimum or a maximum")


def int_range_rule(low: int | None, high: int | None) -> str:
    """A GBNF expression matching the decimal integers in ``[low, high]``.

    Raises:
        ValueError: neither bound is given, or ``low > high``.
    """
    if low is not None and high is not None and low > high:
        raise ValueError(f"the range [{low}, {high}] is empty")
    out: list[str] = []
    _build(out, low, high, _MAX_DIGITS, True)
    return "".join(out)
