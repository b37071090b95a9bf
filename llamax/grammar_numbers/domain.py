"""What a numeric schema allows: its bounds and multiple, and the digit caps of the form."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

__all__ = ["MAX_FRACTION_DIGITS", "MAX_SIGNIFICANT_DIGITS", "Bound", "NumberDomain"]

MAX_SIGNIFICANT_DIGITS = 15
"""Digits from the first non-zero one: 15 decimal digits survive a round trip through a
double, so a value in range stays in range for a client that reads doubles."""

MAX_FRACTION_DIGITS = 16
"""Fraction digits written (as llama.cpp's ``decimal-part``), unless a bound needs more."""

@dataclass(frozen=True, slots=True)
class Bound:
    """One side of a range."""

    value: Decimal
    """The bound."""
    inclusive: bool
    """Whether the bound itself is in the range."""


@dataclass(frozen=True, slots=True)
class NumberDomain:
    """The values a numeric schema allows."""

    low: Bound | None = None
    """The lower bound, or None."""
    high: Bound | None = None
    """The upper bound, or None."""
    multiple: Decimal | None = None
    """``multipleOf`` (positive), or None."""
    integral: bool = False
    """Integers only (no fraction part)."""

    def __post_init__(self) -> None:
        for bound in (self.low, self.high):
            if bound is not None and not bound.value.is_finite():
                raise ValueError(f"a bound must be finite, got {bound.value}")
        if self.multiple is not None and not (self.multiple.is_finite() and self.multiple > 0):
            raise ValueError(f"multipleOf must be above 0, got {self.multiple}")
