"""The two automata a decimal's digits drive: the comparison with a bound, and the
remainder modulo a multiple."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

__all__ = ["SAT", "BoundDigits", "MultipleDigits"]

SAT = 2
"""A comparison already decided in the bound's favour."""


@dataclass(frozen=True, slots=True)
class BoundDigits:
    """A bound on the magnitude (the value without its sign), as digits."""

    whole: str
    """The integer part: no leading zeros, ``"0"`` below 1."""
    fraction: str
    """The fraction: no trailing zeros."""
    inclusive: bool
    is_lower: bool

    @classmethod
    def of(cls, value: Decimal, inclusive: bool, is_lower: bool) -> BoundDigits:
        whole, _, fraction = f"{value:f}".partition(".")
        return cls(whole.lstrip("0") or "0", fraction.rstrip("0"), inclusive, is_lower)

    def verdict(self, rel: int) -> int | None:
        """``rel`` (the value against the bound, once final) as SAT, 0 (equal) or None."""
        if rel == 0:
            return 0
        return SAT if (rel > 0) == self.is_lower else None

    def whole_digit(self, rel: int, count: int, digit: str) -> int | None:
        """After the ``count + 1``-th integer digit: SAT, None (out) or the comparison so far."""
        if rel == SAT:
            return SAT
        if count >= len(self.whole):  # more integer digits than the bound
            return SAT if self.is_lower else None
        return rel if rel != 0 else _compare(digit, self.whole[count])

    def whole_end(self, rel: int, count: int) -> int | None:
        """At the end of an integer part of ``count`` digits."""
        if rel == SAT:
            return SAT
        return self.verdict(-1 if count < len(self.whole) else rel)

    def fraction_digit(self, rel: int, index: int, digit: str) -> int | None:
        """After fraction digit ``index`` (``rel`` is SAT or 0 in the fraction)."""
        if rel == SAT:
            return SAT
        bound_digit = self.fraction[index] if index < len(self.fraction) else "0"
        return self.verdict(_compare(digit, bound_digit))

    def accepts_end(self, rel: int, index: int) -> bool:
        """Whether a fraction ending after ``index`` digits meets the bound."""
        if rel == SAT:
            return True
        if index < len(self.fraction):  # the bound has non-zero digits left: value < bound
            return self.verdict(-1) is not None
        return self.inclusive


def _compare(a: str, b: str) -> int:
    return (a > b) - (a < b)


class MultipleDigits:
    """``multipleOf == (s * t) / 10**places``, with ``s`` made of 2s and 5s and ``t``
    prime to 10: a value is a multiple when its digits to the ``places``-th fraction digit,
    read as a whole number ``M`` (the hundredths for 0.25), are 0 modulo ``s * t``.

    The automaton keeps ``M`` modulo ``s`` and modulo ``t`` for the digits read so far.
    Modulo ``t`` every remainder counts. Modulo ``s`` only the last ``k`` digits of ``M``
    do (``s`` divides ``10**k``), and two remainders that no ending of ``L`` more digits
    (``L`` at least the places still to come) tells apart are one: without that, ``1000`` or
    ``0.0625`` would explore a state per remainder and per digit count. And a remainder that
    no ending of the digits left can bring to 0 is dropped at once (:meth:`can_end`): without
    that, the multiples of 999983 up to 5e6 would explore every prefix of 7 digits."""

    __slots__ = ("_class_of", "_classes", "_inverse", "k", "places", "s", "t")
    s: int
    t: int
    k: int
    """``s`` divides ``10**k``."""
    places: int

    def __init__(self, multiple: Decimal) -> None:
        _, digits, exponent = multiple.normalize().as_tuple()
        modulus = int("".join(map(str, digits))) * 10 ** max(int(exponent), 0)
        self.places = max(-int(exponent), 0)
        twos = fives = 0
        while modulus % 2 == 0:
            modulus, twos = modulus // 2, twos + 1
        while modulus % 5 == 0:
            modulus, fives = modulus // 5, fives + 1
        self.s, self.t, self.k = 2**twos * 5**fives, modulus, max(twos, fives)
        self._classes: dict[tuple[int, tuple[int, ...]], int] = {}
        self._class_of: dict[tuple[int, int], int] = {}
        self._inverse = pow(self.s, -1, self.t) if self.t > 1 else 0

    def digit(self, rem_s: int, rem_t: int, digit: str, decimals: int) -> tuple[int, int]:
        """The remainders after ``digit``, which leaves ``decimals`` fraction digits read
        (0 in the integer part; at most ``places``)."""
        rem_s = (rem_s * 10 + int(digit)) % self.s
        fewest = self.places - decimals  # digits of M still to come
        found = self._class_of.get((fewest, rem_s))
        if found is None:
            key = tuple(
                (-rem_s * 10**more) % self.s if (-rem_s * 10**more) % self.s < 10**more else -1
                for more in range(fewest, self.k)
            )
            found = self._classes.setdefault((fewest, key), rem_s)
            self._class_of[fewest, rem_s] = found
        return found, (rem_t * 10 + int(digit)) % self.t

    def can_end(self, rem_s: int, rem_t: int, fewest: int, most: int) -> bool:
        """Whether ``M`` can still be a multiple once between ``fewest`` and ``most`` more
        digits end it (a necessary condition: the bounds and the form aside)."""
        modulus = self.s * self.t
        rem = rem_s + self.s * ((rem_t - rem_s) * self._inverse % self.t)  # modulo s * t
        for more in range(fewest, most + 1):
            span = 10**more
            if span >= modulus or (-rem * span) % modulus < span:
                return True
        return False

    def ends(self, rem_s: int, rem_t: int, decimals: int) -> bool:
        """Whether the value ends a multiple after ``decimals`` fraction digits (at most
        ``places``; the rest of ``M``'s digits are zeros)."""
        pad = int(10 ** (self.places - decimals))
        return rem_s * pad % self.s == 0 and rem_t * pad % self.t == 0
