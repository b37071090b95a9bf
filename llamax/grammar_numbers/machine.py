"""The product of the decimal form, the bounds and the multiple, one character at a time."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import NamedTuple

from .digits import SAT, BoundDigits, MultipleDigits
from .domain import MAX_FRACTION_DIGITS, MAX_SIGNIFICANT_DIGITS, Bound, NumberDomain

__all__ = ["ALPHABET", "Branch", "Machine", "State"]

ALPHABET = "-.0123456789"
"""The characters a value is written with."""


@dataclass(frozen=True, slots=True)
class Branch:
    """The magnitudes of one sign's values (a side None: open on that side)."""

    lower: BoundDigits | None
    upper: BoundDigits | None


class State(NamedTuple):
    """Where the automaton is: what was read, as far as the rest depends on it."""

    phase: str
    """One of the ``_START``... phases below the class."""
    negative: bool
    significant: int
    """Digits read from the first non-zero one."""
    decimals: int
    """Fraction digits read."""
    low: int
    """The value against the lower bound so far: -1, 0, 1 (integer part) or SAT."""
    high: int
    """Against the upper bound."""
    rem_s: int
    """The digits' remainders (:class:`MultipleDigits`)."""
    rem_t: int


_START, _SIGN, _ZERO, _WHOLE, _POINT, _FRACTION = "s", "-", "0", "i", ".", "f"


def _whole_digit(side: BoundDigits | None, rel: int, count: int, digit: str) -> int | None:
    return SAT if side is None else side.whole_digit(rel, count, digit)


def _whole_end(side: BoundDigits | None, rel: int, count: int) -> int | None:
    return SAT if side is None else side.whole_end(rel, count)


def _fraction_digit(side: BoundDigits | None, rel: int, index: int, digit: str) -> int | None:
    return SAT if side is None else side.fraction_digit(rel, index, digit)


@dataclass(frozen=True, slots=True)
class Machine:
    """The product of the form, the bounds and the multiple, one transition at a time."""

    positive: Branch | None
    """Non-negative values (None: there are none)."""
    negative: Branch | None
    """Negative values: their magnitude is above 0, so ``-0`` is never written."""
    grid: MultipleDigits | None
    max_fraction: int
    integral: bool

    @classmethod
    def of(cls, domain: NumberDomain) -> Machine:
        low, high = domain.low, domain.high
        positive = negative = None
        if high is None or high.value >= 0:
            above_zero = low is not None and low.value >= 0
            positive = Branch(
                BoundDigits.of(low.value, low.inclusive, True) if low and above_zero else None,
                None if high is None else BoundDigits.of(high.value, high.inclusive, False),
            )
        if low is None or low.value < 0:  # -m >= low  <=>  m <= -low
            above = high if high is not None and high.value < 0 else Bound(Decimal(0), False)
            negative = Branch(
                BoundDigits.of(-above.value, above.inclusive, True),
                None if low is None else BoundDigits.of(-low.value, low.inclusive, False),
            )
        grid = None if domain.multiple is None else MultipleDigits(domain.multiple)
        places = 0 if grid is None else grid.places
        sides = [s for b in (positive, negative) if b for s in (b.lower, b.upper) if s]
        max_fraction = max([MAX_FRACTION_DIGITS, places, *(len(s.fraction) + 1 for s in sides)])
        return cls(positive, negative, grid, max_fraction, domain.integral)

    def start(self) -> State:
        """The state before the first character."""
        return State(_START, False, 0, 0, 0, 0, 0, 0)

    def step(self, state: State, char: str) -> State | None:
        """The state after ``char``, or None when no allowed value continues so."""
        if state.phase == _START:
            if char == "-":
                return state._replace(phase=_SIGN, negative=True) if self.negative else None
            if self.positive is None:
                return None
            state = state._replace(phase=_SIGN)
        branch = self.negative if state.negative else self.positive
        assert branch is not None
        if char == ".":
            return self._point(state, branch)
        if char == "-":
            return None
        if state.phase == _SIGN:
            return self._whole(state, branch, char, _ZERO if char == "0" else _WHOLE)
        if state.phase == _WHOLE:
            return self._whole(state, branch, char, _WHOLE)
        if state.phase in (_POINT, _FRACTION):
            return self._fraction(state, branch, char)
        return None

    def _whole(self, state: State, branch: Branch, char: str, phase: str) -> State | None:
        count = state.significant  # integer digits before this one
        significant = count + (phase == _WHOLE)
        if significant > MAX_SIGNIFICANT_DIGITS:
            return None
        low = _whole_digit(branch.lower, state.low, count, char)
        high = _whole_digit(branch.upper, state.high, count, char)
        if low is None or high is None:
            return None
        rem_s, rem_t = state.rem_s, state.rem_t
        if self.grid is not None:
            rem_s, rem_t = self.grid.digit(rem_s, rem_t, char, 0)
            more = 0  # integer digits that may follow
            if phase == _WHOLE:
                more = MAX_SIGNIFICANT_DIGITS - significant
                if branch.upper is not None:
                    more = min(more, len(branch.upper.whole) - significant)
            places = self.grid.places
            if not self.grid.can_end(rem_s, rem_t, places, places + more):
                return None
        return State(phase, state.negative, significant, 0, low, high, rem_s, rem_t)

    def _point(self, state: State, branch: Branch) -> State | None:
        if self.integral or state.phase not in (_ZERO, _WHOLE):
            return None
        count = 1 if state.phase == _ZERO else state.significant
        low = _whole_end(branch.lower, state.low, count)
        high = _whole_end(branch.upper, state.high, count)
        if low is None or high is None:
            return None
        return state._replace(phase=_POINT, low=low, high=high)

    def _fraction(self, state: State, branch: Branch, char: str) -> State | None:
        index, significant = state.decimals, state.significant
        if index >= self.max_fraction:
            return None
        if significant or char != "0":
            significant += 1
            if significant > MAX_SIGNIFICANT_DIGITS:
                return None
        rem_s, rem_t = state.rem_s, state.rem_t
        if self.grid is not None:
            if index < self.grid.places:
                rem_s, rem_t = self.grid.digit(rem_s, rem_t, char, index + 1)
                left = self.grid.places - index - 1
                if not self.grid.can_end(rem_s, rem_t, left, left):
                    return None
            elif char != "0" or rem_s or rem_t:  # past the multiple's last place: zeros
                return None
        low = _fraction_digit(branch.lower, state.low, index, char)
        high = _fraction_digit(branch.upper, state.high, index, char)
        if low is None or high is None:
            return None
        return State(_FRACTION, state.negative, significant, index + 1, low, high, rem_s, rem_t)

    def accepts(self, state: State) -> bool:
        """Whether the characters read so far are an allowed value."""
        if state.phase not in (_ZERO, _WHOLE, _FRACTION):
            return False
        branch = self.negative if state.negative else self.positive
        assert branch is not None
        index = state.decimals
        if self.grid is not None and not self.grid.ends(
            state.rem_s, state.rem_t, min(index, self.grid.places)
        ):
            return False
        count = 1 if state.phase == _ZERO else state.significant
        for side, rel in ((branch.lower, state.low), (branch.upper, state.high)):
            if side is None:
                continue
            if state.phase != _FRACTION:  # as a fraction of no digits
                verdict = side.whole_end(rel, count)
                if verdict is None:
                    return False
                rel = verdict
            if not side.accepts_end(rel, index):
                return False
        return True
