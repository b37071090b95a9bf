"""Cross-stream copies that llama.cpp has queued but not yet run. Pure Python.

With one KV stream per sequence, ``llama_memory_seq_cp`` between two streams updates the
destination's cell metadata at once but only *queues* the buffer copy: llama.cpp runs it
at the start of the next ``llama_decode`` (its memory update), copying whatever the source
stream's buffer holds *then*. State reads and writes (``llama_state_seq_get_data`` /
``_set_data``) act at once. So between a cross-stream copy and the next decode:

- reading the destination's state reads a buffer the copy has not filled yet;
- writing the destination's state is overwritten when the queued copy runs;
- writing the source's state changes what the queued copy will give the destination;
- a move to a new context (a relayout) reads stale destinations, and the old context's
  queue never runs.

:class:`~llamax.engine.kv.kvcache.KVCache`, the one place that emits memory calls, records each
queued copy here and, before such a call, asks :meth:`QueuedCopies.blocks_read` /
:meth:`~QueuedCopies.blocks_write` and has the memory run its queue first
(``KVMemory.run_queued_copies``: llama.cpp has no call for that but a decode). Every
memory call then acts at once as far as any later one can observe, and the rest of the
engine never sees the deferral. Copies run in the order queued, so chains of copies need
no care; cell metadata calls (``seq_rm``, ``seq_add``) change no buffer and need none.
"""

from __future__ import annotations

__all__ = ["QueuedCopies"]


class QueuedCopies:
    """The ``(source, destination)`` sequence ids of the copies queued since the memory
    last ran its update."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: list[tuple[int, int]] = []

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, src: int, dst: int) -> None:
        """A cross-stream copy ``src -> dst`` was queued."""
        self._queue.append((src, dst))

    def ran(self) -> None:
        """The memory update ran (a decode reached it): nothing is queued any more."""
        self._queue.clear()

    def blocks_read(self, seq_id: int) -> bool:
        """Whether reading ``seq_id``'s state now would miss a queued copy into it."""
        return any(dst == seq_id for _, dst in self._queue)

    def blocks_write(self, seq_id: int) -> bool:
        """Whether writing ``seq_id``'s state now would be overwritten by a queued copy
        (it is a destination) or change what one gives (it is a source)."""
        return any(seq_id in pair for pair in self._queue)
