"""Backend sampling: llama.cpp runs a sequence's sampler chain inside the decode's graph.

With ``ContextConfig(backend_sampling=True)`` a plain request's chain (logit bias,
penalties, top-k, top-p, min-p, temperature, then ``dist`` or ``greedy``) is attached to
the sequence id its rows are decoded under (``llama_set_sampler``); the decode then
samples those rows on the device that computed the logits, and when every output row of
a micro-batch is sampled so, llama.cpp copies no logits to the host. The token is read
with ``llama_sampler_sample`` on the attached chain, which returns the graph's token and
accepts it (the penalties' counts; the context is made with one output a sequence, where
llama.cpp runs penalties in the graph and ``dist`` draws once per decode), or, where the
device ran only a prefix of the chain, finishes it on the host.

llama.cpp's rules, each of which aborts the process when broken (measured in
``benchmarks/results/issue62/backend-sampling-cpu``), and how they are kept here:

* a chain is attached once in its life, and never sampled on the host after: a chain
  detached (its sequence moved to another id, or its row needed on the host this step) is
  replaced by a clone of itself (:meth:`NativeSampler.renew
  <llamax.backend.native.NativeSampler.renew>`), which carries the generator and the
  penalties on;
* a sequence id must hold the chain of the sequence whose rows it decodes, or none: before
  every decode, :meth:`GraphChains.bind` makes each item with rows hold exactly the chain its
  :class:`~llamax.backend.base.BatchItem` names (none for a row sampled on the host, whose
  logits llama.cpp then copies), so a chain left on an id by a preempted sequence never
  samples another sequence's row;
* a chain attached to a context is detached before the chain is freed, and before the
  context is (a layout move makes a new context: the chains are renewed for it).

Every change of the attached set makes llama.cpp reserve its graph again (a new graph on a
GPU): one a sequence's admission and one a release, as in llama-server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import RequestFailedError
from .base import BatchItem
from .native import NativeSampler

__all__ = ["GraphChains"]


class GraphChains:
    """Which chain each sequence id of one llama.cpp context holds, and which of the last
    decode's rows the graph sampled."""

    __slots__ = ("C", "_attached", "_rows", "num_attaches", "num_draws")

    def __init__(self, C: Any) -> None:
        self.C = C
        self._attached: dict[int, NativeSampler] = {}
        self._rows: dict[int, NativeSampler] = {}
        self.num_attaches = 0
        """Chains attached so far (each makes llama.cpp reserve its graph again)."""
        self.num_draws = 0
        """Rows read through an attached chain so far."""

    @property
    def num_attached(self) -> int:
        """Chains attached now (for leak checks)."""
        return len(self._attached)

    def bind(self, ctx: Any, items: Sequence[BatchItem]) -> None:
        """Before a decode of ``items``: every item with rows holds its ``sampler``'s chain
        if that is a graph chain and the item wants one row, else none."""
        self._rows.clear()
        for item in items:
            if not item.rows:
                continue
            want = item.sampler
            if not isinstance(want, NativeSampler) or not want.graph or len(item.rows) != 1:
                want = None
            have = self._attached.get(item.seq_id)
            if have is not want:
                if have is not None:
                    self._detach(ctx, have)
                if want is not None:
                    self._attach(ctx, item.seq_id, want)
            if want is not None and want.seq_id == item.seq_id:
                self._rows[item.rows[0]] = want

    def _attach(self, ctx: Any, seq_id: int, sampler: NativeSampler) -> None:
        if sampler.seq_id is not None:  # the sequence moved: its chain leaves the old id
            self._detach(ctx, sampler)
        if self.C.llama_set_sampler(ctx, seq_id, sampler.chain):
            sampler.seq_id = seq_id
            self._attached[seq_id] = sampler
            self.num_attaches += 1
        else:  # llama.cpp cannot run this chain in the graph: the host samples it
            sampler.graph = False

    def _detach(self, ctx: Any, sampler: NativeSampler, *, renew: bool = True) -> None:
        seq_id = sampler.seq_id
        assert seq_id is not None and self._attached.get(seq_id) is sampler
        self.C.llama_set_sampler(ctx, seq_id, None)
        del self._attached[seq_id]
        if renew:
            sampler.renew()
        else:
            sampler.seq_id = None

    def release(self, ctx: Any, sampler: NativeSampler) -> None:
        """Detach ``sampler``'s chain if it is attached, before it is freed (not renewed:
        nothing samples with it again)."""
        if sampler.seq_id is not None:
            self._detach(ctx, sampler, renew=False)
        self._rows = {row: s for row, s in self._rows.items() if s is not sampler}

    def release_all(self, ctx: Any) -> None:
        """Detach every chain (before ``ctx`` is freed); each is renewed for the next."""
        for sampler in list(self._attached.values()):
            self._detach(ctx, sampler)
        self._rows.clear()

    def sampled(self, ctx: Any, sampler: NativeSampler, row: int) -> int | None:
        """The token of ``row`` drawn by ``sampler``'s attached chain (accepted into it), or
        None when the row was not decoded with that chain attached.

        ``llama_sampler_sample`` on the attached chain returns the token the graph drew; on a
        device that ran only a prefix of the chain (a sampler whose ops it lacks), it runs
        the rest on the host from what the graph left, as llama-server does.

        Raises:
            RequestFailedError: llama.cpp returned no token.
        """
        if self._rows.get(row) is not sampler:
            return None
        del self._rows[row]
        token = int(self.C.llama_sampler_sample(sampler.chain, ctx, row))
        if token < 0:
            raise RequestFailedError(f"llama.cpp sampled no token for row {row}")
        self.num_draws += 1
        return token

    def host_ready(self, ctx: Any, sampler: NativeSampler) -> None:
        """Make ``sampler``'s chain one the host may sample: detached and renewed if it is
        attached (a row of its sequence sampled on the host)."""
        if sampler.seq_id is not None:
            self._detach(ctx, sampler)
