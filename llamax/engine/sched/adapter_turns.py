"""LoRA adapter sets take turns: llama.cpp applies adapters to a whole context, so a step
carries one set.

The sets with work take turns, one step each, starting after the last one served: none
starves, and the next set is tried when one has nothing it can run. The first request in
queue order that lacked room on its set's turn holds that room: no later request of
another set takes it on its own turns before that one is admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...adapters import AdapterSet
from ..sequence import Sequence as Seq

__all__ = ["AdapterTurns"]


class AdapterTurns:
    """Whose turn it is among the LoRA adapter sets with work."""

    def __init__(self) -> None:
        self._last: AdapterSet | None = None
        """The adapter set the last step ran."""
        self._room_waiter: Seq | None = None
        """The first request in queue order that lacked room on its set's turn."""

    def order(self, sequences: Iterable[Seq]) -> list[AdapterSet | None]:
        """The adapter sets to try this step, in turn (``[None]``: one set, no filter)."""
        sets = {seq.request.adapters for seq in sequences}
        if len(sets) <= 1:
            return [None]
        order = sorted(sets)
        last = self._last
        start = next((i for i, key in enumerate(order) if last is not None and key > last), 0)
        return [*order[start:], *order[:start]]

    def served(self, group: AdapterSet | None) -> None:
        """The step runs the sequences of ``group``."""
        self._last = group

    def blocker(self, group: AdapterSet | None, waiting: Sequence[Seq]) -> Seq | None:
        """The request of another adapter set than ``group`` that lacked room and still
        waits in ``waiting``, or None. Without it a set's newcomers could take, on its
        turns, the room that an earlier request of another set waits for, again and again."""
        waiter = self._room_waiter
        if waiter is None:
            return None
        if not any(seq is waiter for seq in waiting):  # admitted, or gone
            self._room_waiter = None
            return None
        return waiter if group is not None and waiter.request.adapters != group else None

    def lacked_room(self, seq: Seq, group: AdapterSet | None) -> None:
        """``seq`` of ``group`` found no room on its set's turn."""
        waiter = self._room_waiter
        if group is not None and (waiter is None or seq.sort_key < waiter.sort_key):
            self._room_waiter = seq
