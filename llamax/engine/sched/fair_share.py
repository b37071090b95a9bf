"""Fairness between requests: how many sequence ids each request may hold this step.

A "request" here is a fairness key (``Request.fair_key``): a request alone, or every
request submitted with one ``fair_key`` (the prompts of one batch call, one client), which
then hold one share together and are served first come, first served among themselves.

While other requests wait, one may hold at most its share, ``n_seq_max`` over the requests
with work (at least 1), of the sequences. A waiting request below its share that finds no
free sequence id takes one from the request holding the most above its share (the
scheduler preempts that request's sequence with the fewest computed tokens: one per
waiting request and step). A request at its share is admitted after those below theirs
and forks only the ids they leave, so no id idles. A short request beside an ``n=32`` one
starts within a step or two.

:class:`FairShare` counts; the scheduler preempts and admits.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["FairShare"]

K = TypeVar("K", bound=Hashable)


class FairShare(Generic[K]):
    """Each request's share of the sequence ids, recounted every step.

    Args:
        n_seq_max: Sequence ids in all.
    """

    def __init__(self, n_seq_max: int) -> None:
        self.n_seq_max = n_seq_max
        self.share = n_seq_max
        """The most sequences a request may hold while others wait."""
        self.held: dict[K, int] = {}
        """Running sequences per request."""
        self.deprived: list[K] = []
        """Waiting requests below their share, first come first."""
        self._deprived: set[K] = set()
        self._num_waiting: dict[K, int] = {}

    def count(self, running: Iterable[K], waiting: Iterable[K]) -> None:
        """Recount the share from the request of each running and each waiting sequence."""
        held: dict[K, int] = {}
        for request in running:
            held[request] = held.get(request, 0) + 1
        num_waiting: dict[K, int] = {}
        for request in waiting:
            num_waiting[request] = num_waiting.get(request, 0) + 1
        self._num_waiting = num_waiting
        waiters = list(num_waiting)
        num_active = len(held.keys() | set(waiters))
        self.share = max(1, self.n_seq_max // max(1, num_active))
        self.held = held
        self.deprived = [r for r in waiters if held.get(r, 0) < self.share]
        self._deprived = set(self.deprived)

    def richest(self) -> K | None:
        """The request holding the most sequences, if that is above its share."""
        richest = max(self.held, key=self.held.__getitem__, default=None)
        if richest is None or self.held[richest] <= self.share:
            return None
        return richest

    def add(self, request: K, num: int = 1) -> None:
        """``request`` got (a positive ``num``) or gave up (a negative one) sequences."""
        self.held[request] = self.held.get(request, 0) + num

    def admit(self, request: K) -> None:
        """One waiting sequence of ``request`` got an id."""
        self.add(request)
        self._num_waiting[request] = self._num_waiting.get(request, 0) - 1

    def is_over(self, request: K) -> bool:
        """Whether ``request`` holds its share while another request below its share waits:
        its sequences are then admitted after the others' (they take the ids left)."""
        if self.held.get(request, 0) < self.share:
            return False
        return any(other != request for other in self._deprived)

    def others_deprived(self, request: K) -> list[K]:
        """The deprived requests other than ``request`` that still have a waiting sequence
        (none of them admitted since the count)."""
        return [r for r in self._deprived if r != request and self._num_waiting.get(r, 0) > 0]

    def num_forkable(self, request: K, num_free_ids: int, num_others: int) -> int:
        """Sequence ids ``request`` may fork into now, of ``num_free_ids``, leaving one
        for each of ``num_others`` deprived requests still waiting (but never fewer
        than what ``request`` lacks of its share)."""
        if not num_others:
            return num_free_ids
        mine = max(0, self.share - self.held.get(request, 0))
        return min(num_free_ids, max(mine, num_free_ids - num_others))
