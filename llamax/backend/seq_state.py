"""One sequence's saved KV state, rewritten for another stream count. Pure Python.

``llama_state_seq_get_data`` writes, for a plain attention KV cache::

    u32 magic | i32 seq_id | u32 n_stream | n_stream blocks

where a block is ``u32 cell_count`` followed, when the count is not zero, by the cells'
metadata and K/V rows. A sequence lives in one stream, so exactly one block is not empty.
``llama_state_seq_set_data`` refuses a state whose ``n_stream`` differs from its context's
("n_stream mismatch"), and, restoring one sequence, writes that block into the sequence's
own stream whatever its index. So moving a sequence between a unified cache (one stream)
and one stream per sequence needs only a new header and the empty blocks around it.

Only for caches with one KV section: a sliding-window model's state holds two, and a
recurrent model's holds other sections; those are never rewritten.
"""

from __future__ import annotations

import struct

__all__ = ["restream"]

_HEADER = struct.Struct("<IiI")
_EMPTY = b"\0\0\0\0"


def restream(data: bytes, n_stream: int) -> bytes:
    """``data`` (one sequence's state) as a context with ``n_stream`` streams expects it.

    Raises:
        ValueError: ``data`` is not one sequence of a plain KV cache.
    """
    if len(data) < _HEADER.size + 4:
        raise ValueError(f"a sequence state of {len(data)} bytes is too short")
    magic, seq_id, n_from = _HEADER.unpack_from(data)
    if n_from < 1:
        raise ValueError(f"a sequence state with {n_from} streams")
    if n_from == n_stream:
        return data
    index, offset = 0, _HEADER.size
    while index < n_from and data[offset : offset + 4] == _EMPTY:
        index, offset = index + 1, offset + 4
    if index == n_from:  # the sequence held no cells
        return _HEADER.pack(magic, seq_id, n_stream) + _EMPTY * n_stream
    after = n_from - index - 1
    end = len(data) - 4 * after
    if end <= offset or any(data[end:]):
        raise ValueError("a sequence state whose cells are in more than one stream")
    return _HEADER.pack(magic, seq_id, n_stream) + data[offset:end] + _EMPTY * (n_stream - 1)
