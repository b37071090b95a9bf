"""The LoRA adapter set a request, a KV slot or a stored prefix was computed under."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NO_ADAPTERS", "AdapterSet"]


class AdapterSet(tuple[tuple[str, float], ...]):
    """``(name, scale)`` pairs, sorted by name, scale 0 left out; empty: the base model.

    Frozen and hashable (a tuple), so it keys the prefix tiers and marks KV slots: two
    prefixes may share cells only when their sets are equal. It compares equal to the
    plain tuple of the same pairs.
    """

    __slots__ = ()

    @classmethod
    def of(cls, scales: Iterable[tuple[str, float]]) -> AdapterSet:
        """The set of these ``(name, scale)`` pairs: sorted by name, zero scales dropped."""
        return cls(sorted((name, float(scale)) for name, scale in scales if scale != 0))


NO_ADAPTERS = AdapterSet()
"""The base model's set."""
