"""Check the scheduler's bookkeeping against the backend's KV memory (loop thread only).

Run through ``Context.audit()``; tests run it after every test (``llamax.testing.assert_idle``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...backend.base import Backend, GraphSampling, Inspectable
from ..sequence import Sequence as Seq
from .kvcache import KVCache, Slot, SlotState

__all__ = ["audit"]


def audit(
    backend: Backend, kv: KVCache, sequences: Sequence[Seq], session_slots: Iterable[Slot]
) -> list[str]:
    """Every inconsistency between the bookkeeping (``kv``, the waiting and running
    ``sequences``, the sessions' slots) and ``backend``'s memory, as sentences."""
    problems: list[str] = []
    slots = {slot.seq_id: slot for slot in kv.slots()}
    pinned = {slot.seq_id for slot in session_slots}
    n_seq_max = backend.facts.n_seq_max
    if len(slots) + kv.num_free_seq_ids != n_seq_max:
        problems.append(
            f"{len(slots)} held + {kv.num_free_seq_ids} free sequence ids != {n_seq_max}"
        )
    inspectable = backend if isinstance(backend, Inspectable) else None
    owners = {s.slot.seq_id for s in sequences if s.slot is not None}
    for seq_id in range(n_seq_max):
        slot = slots.get(seq_id)
        extent = backend.seq_pos_max(seq_id)
        if slot is None:
            if extent != -1:
                problems.append(f"seq {seq_id} is free but holds KV up to position {extent}")
            continue
        if slot.pinned and seq_id not in pinned:
            problems.append(f"{slot!r} is pinned but no session holds it")
        if slot.state is SlotState.ACTIVE and seq_id not in owners:
            problems.append(f"{slot!r} is active but no sequence owns it")
        stale = sorted(p for p in slot.checkpoints if not 0 < p <= len(slot.tokens))
        if stale:  # set back, one would answer from a history the slot no longer holds
            problems.append(f"{slot!r} keeps checkpoints past its tokens, at {stale}")
        if extent != len(slot.tokens) - 1:
            problems.append(f"{slot!r} but KV holds positions up to {extent}")
        elif inspectable is not None:
            held_tokens = inspectable.seq_tokens(seq_id)
            if held_tokens is not None and list(held_tokens) != slot.tokens:
                problems.append(f"{slot!r} but KV holds other tokens")
    for seq in sequences:
        if seq.slot is not None and seq.slot.tokens != seq.token_ids[: seq.num_computed]:
            problems.append(f"sequence {seq.request.request_id}/{seq.index} diverged from its slot")
    if inspectable is None:
        return problems
    cells = inspectable.num_cells_used
    if cells is not None and cells != kv.num_cells_used:
        problems.append(f"backend holds {cells} cells, the cache accounts {kv.num_cells_used}")
    samplers = inspectable.num_live_samplers
    held = sum(1 for s in sequences if s.sampler is not None)
    if samplers != held:
        problems.append(f"backend holds {samplers} samplers, sequences hold {held}")
    if isinstance(inspectable, GraphSampling) and inspectable.num_attached > held:
        problems.append(
            f"backend holds {inspectable.num_attached} samplers attached to sequence ids, "
            f"sequences hold {held} samplers"
        )
    return problems
