"""The LoRA adapter set a request, a KV slot or a stored prefix was computed under."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

from .errors import InvalidParameterError

__all__ = ["NO_ADAPTERS", "AdapterNames", "AdapterSet"]


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


class AdapterNames:
    """The LoRA adapters a context has loaded, by name in load order: their paths and
    weights fingerprints, and a request's ``lora`` resolved to an :class:`AdapterSet`."""

    def __init__(self) -> None:
        self._paths: dict[str, str] = {}
        self._weights: dict[str, str] = {}  # name -> the file's weights fingerprint
        self._lock = threading.Lock()

    @property
    def paths(self) -> dict[str, str]:
        """Name -> path, in load order (a copy)."""
        return dict(self._paths)

    @property
    def weights(self) -> dict[str, str]:
        """Name -> the file's weights fingerprint (saved sessions record them; a copy)."""
        return dict(self._weights)

    def add(self, name: str, path: str, load: Callable[[], str]) -> None:
        """Register ``name`` once ``load()`` (which loads the file and returns its weights
        fingerprint) has succeeded; one name at a time.

        Raises:
            InvalidParameterError: ``name`` is taken.
            Exception: what ``load`` raises (nothing is registered).
        """
        with self._lock:
            if name in self._paths:
                raise InvalidParameterError(
                    f"a LoRA adapter named {name!r} is already loaded", param="name"
                )
            weights = load()
            self._paths[name] = path
            self._weights[name] = weights

    def resolve(
        self, lora: Mapping[str, float] | Mapping[int, float] | Mapping[str | int, float] | None
    ) -> AdapterSet:
        """A request's ``lora`` (names or load-order indexes -> scales) as an adapter set:
        names resolved, scale-0 entries dropped (the base model), sorted by name.

        Raises:
            InvalidParameterError: an adapter that is not loaded, or one named twice.
        """
        if not lora:
            return NO_ADAPTERS
        names = list(self._paths)
        scales: dict[str, float] = {}
        for key, scale in lora.items():
            if isinstance(key, int):
                if key >= len(names):
                    raise InvalidParameterError(
                        f"lora: no adapter with index {key}; {len(names)} loaded", param="lora"
                    )
                name = names[key]
            elif key in self._paths:
                name = key
            else:
                loaded = ", ".join(repr(n) for n in names) or "none"
                raise InvalidParameterError(
                    f"lora: no adapter named {key!r} is loaded (loaded: {loaded})", param="lora"
                )
            if name in scales:
                raise InvalidParameterError(f"lora: adapter {name!r} is given twice", param="lora")
            scales[name] = scale
        return AdapterSet.of(scales.items())
