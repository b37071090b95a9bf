"""One sequence's saved KV state, rewritten for another stream count. Pure Python.

``llama_state_seq_get_data`` writes, for a plain attention KV cache::

    u32 magic | i32 seq_id | u32 n_stream | n_stream blocks

where a block is ``u32 cell_count`` followed, when the count is not zero, by the cells'
metadata and K/V rows. A sequence lives in one stream, so exactly one block is not empty.
Inside it (``[ext]``: an M-RoPE model's 8-byte extra position)::

    cell_count x (i32 pos | u32 n_seq_id = 1 | [ext] | i32 seq_id)
    u32 v_trans | u32 n_layer
    n_layer x (i32 k_type | u64 k_row_bytes | cell_count x k_row_bytes)
    v_trans 0: n_layer x (i32 v_type | u64 v_row_bytes | cell_count x v_row_bytes)
    v_trans 1: n_layer x (i32 v_type | u32 v_el_bytes | u32 n_embd_v | rows x n_embd_v x v_el)

:func:`cell_positions` walks all of it, so a state can be checked before llama.cpp reads it.
``llama_state_seq_set_data`` refuses a state whose ``n_stream`` differs from its context's
("n_stream mismatch"), and, restoring one sequence, writes that block into the sequence's
own stream whatever its index. So moving a sequence between a unified cache (one stream)
and one stream per sequence needs only a new header and the empty blocks around it.

A hybrid model's state (attention and recurrent layers, no sliding window) holds the
attention cache's section as above, then the recurrent state's, which has no streams:
``restream(..., tail=True)`` rewrites the first and keeps the second as it is. A sliding-
window model's state holds two KV sections and a recurrent-only model's none; those are
never rewritten.
"""

from __future__ import annotations

import struct

__all__ = ["cell_positions", "kv_section_end", "restream", "tile"]

_HEADER = struct.Struct("<IiI")
_EMPTY = b"\0\0\0\0"
_U32 = struct.Struct("<I")
_CELL_SIZES = (12, 20)  # pos, n_seq_id, seq_id; with an M-RoPE model's extra position


def cell_positions(data: bytes) -> list[int]:
    """The positions of the cells in ``data`` (one sequence's state of a plain KV cache),
    after checking that the whole state is well formed.

    Raises:
        ValueError: ``data`` is truncated, has bytes left over, holds cells in more than one
            stream or cells shared with other sequences, or is not such a state at all.
    """
    if len(data) < _HEADER.size:
        raise ValueError(f"a sequence state of {len(data)} bytes is too short")
    _magic, _seq_id, n_stream = _HEADER.unpack_from(data)
    if not 1 <= n_stream <= (len(data) - _HEADER.size) // 4:
        raise ValueError(f"a sequence state with {n_stream} streams")
    offset = _HEADER.size
    for index in range(n_stream):
        (count,) = _U32.unpack_from(data, offset)
        offset += 4
        if count:  # the one stream with cells; every later one must be empty
            end = len(data) - 4 * (n_stream - index - 1)
            if any(data[end:]):
                raise ValueError("a sequence state whose cells are in more than one stream")
            return _block(data, offset, count, end)
    if offset != len(data):
        raise ValueError(f"a sequence state with {len(data) - offset} bytes left over")
    return []


def _block(data: bytes, offset: int, count: int, end: int) -> list[int]:
    """Parse one stream's cells and K/V rows, which must end exactly at ``end``."""
    problem = ""
    for cell_size in _CELL_SIZES:
        try:
            return _cells(data, offset, count, cell_size, end)
        except (ValueError, struct.error) as exc:
            problem = problem or str(exc)
    raise ValueError(problem)


def _cells(data: bytes, offset: int, count: int, cell_size: int, end: int) -> list[int]:
    positions, offset = _walk(data, offset, count, cell_size, end)
    if offset != end:
        raise ValueError(f"a sequence state with {end - offset} bytes left over")
    return positions


def _walk(data: bytes, offset: int, count: int, cell_size: int, end: int) -> tuple[list[int], int]:
    """Parse one stream's cells and K/V rows within ``data[:end]``: their positions and
    where they end."""
    if count * cell_size > end - offset:
        raise ValueError(f"a sequence state that lists {count} cells is too short")
    positions = []
    for i in range(count):
        pos, n_seq = struct.unpack_from("<iI", data, offset + i * cell_size)
        if n_seq != 1:
            raise ValueError(f"a cell that belongs to {n_seq} sequences")
        positions.append(pos)
    offset += count * cell_size
    v_trans, n_layer = struct.unpack_from("<II", data, offset)
    offset += 8
    if v_trans > 1 or n_layer * 24 > end - offset:
        raise ValueError("a sequence state whose K/V header is damaged")
    for _ in range(n_layer):  # K rows
        _type, row = struct.unpack_from("<iQ", data, offset)
        offset += 12 + row * count
        if offset > end:
            raise ValueError("a truncated sequence state")
    for _ in range(n_layer):  # V rows, or V columns when transposed
        if v_trans:
            _type, elem, n_embd = struct.unpack_from("<iII", data, offset)
            offset += 12 + elem * n_embd * count
        else:
            _type, row = struct.unpack_from("<iQ", data, offset)
            offset += 12 + row * count
        if offset > end:
            raise ValueError("a truncated sequence state")
    return positions, offset


def kv_section_end(data: bytes) -> int:
    """Where the attention cache's section of ``data`` (one sequence's state) ends: its
    header and ``n_stream`` blocks, parsed; a hybrid model's recurrent state follows.

    Raises:
        ValueError: ``data`` does not start with such a section, or its cells are in more
            than one stream.
    """
    if len(data) < _HEADER.size + 4:
        raise ValueError(f"a sequence state of {len(data)} bytes is too short")
    _magic, _seq_id, n_stream = _HEADER.unpack_from(data)
    if not 1 <= n_stream <= (len(data) - _HEADER.size) // 4:
        raise ValueError(f"a sequence state with {n_stream} streams")
    offset, found = _HEADER.size, False
    for _ in range(n_stream):
        (count,) = _U32.unpack_from(data, offset)
        offset += 4
        if not count:
            continue
        if found:
            raise ValueError("a sequence state whose cells are in more than one stream")
        found = True
        offset = _block_end(data, offset, count)
    return offset


def _block_end(data: bytes, offset: int, count: int) -> int:
    """Where a stream's block of ``count`` cells starting at ``offset`` ends (the cell
    size is whichever parses: with or without an M-RoPE position)."""
    problem = ""
    for cell_size in _CELL_SIZES:
        try:
            return _walk(data, offset, count, cell_size, len(data))[1]
        except (ValueError, struct.error) as exc:
            problem = problem or str(exc)
    raise ValueError(problem)


def restream(data: bytes, n_stream: int, *, tail: bool = False) -> bytes:
    """``data`` (one sequence's state) as a context with ``n_stream`` streams expects it.

    Args:
        data: The state.
        n_stream: The streams of the context that will read it.
        tail: ``data`` is a hybrid model's: the attention section is parsed to find its
            end, and what follows it (the recurrent state) is kept as it is.

    Raises:
        ValueError: ``data`` is not one sequence of a plain KV cache (or, with ``tail``,
            does not start with one).
    """
    if tail:
        end = kv_section_end(data)
        return restream(data[:end], n_stream) + data[end:]
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


def tile(data: bytes, num_cells: int) -> bytes:
    """``data`` (one sequence's state of a plain KV cache) grown to ``num_cells`` cells at
    positions ``0..num_cells-1``, each cell's K/V rows those of a cell of ``data`` (taken in
    turn): filler whose attention costs what real cells' does, for timing steps over a long
    context without computing one (:mod:`llamax.engine.timing.calibration`). Its values mean
    nothing.

    Raises:
        ValueError: ``data`` is not one sequence of a plain KV cache with cells.
    """
    cell_positions(data)  # checks the whole state
    magic, seq_id, n_stream = _HEADER.unpack_from(data)
    offset = _HEADER.size
    index = 0
    while data[offset : offset + 4] == _EMPTY:
        index, offset = index + 1, offset + 4
    (count,) = _U32.unpack_from(data, offset)
    offset += 4
    end = len(data) - 4 * (n_stream - index - 1)
    for cell_size in _CELL_SIZES:
        try:
            _cells(data, offset, count, cell_size, end)
            break
        except (ValueError, struct.error):
            continue
    picks = [i % count for i in range(num_cells)]
    out = [_HEADER.pack(magic, seq_id, n_stream), _EMPTY * index, _U32.pack(num_cells)]
    cells = [data[offset + i * cell_size : offset + (i + 1) * cell_size] for i in range(count)]
    for pos, pick in enumerate(picks):
        out.append(struct.pack("<i", pos) + cells[pick][4:])
    offset += count * cell_size
    v_trans, n_layer = struct.unpack_from("<II", data, offset)
    out.append(data[offset : offset + 8])
    offset += 8

    def rows(width: int) -> None:
        nonlocal offset
        block = data[offset : offset + width * count]
        out.append(b"".join(block[p * width : (p + 1) * width] for p in picks))
        offset += width * count

    for _ in range(n_layer):  # K rows
        _type, row = struct.unpack_from("<iQ", data, offset)
        out.append(data[offset : offset + 12])
        offset += 12
        rows(row)
    for _ in range(n_layer):  # V rows, or V columns when transposed
        if v_trans:
            _type, elem, n_embd = struct.unpack_from("<iII", data, offset)
            out.append(data[offset : offset + 12])
            offset += 12
            for _ in range(n_embd):
                rows(elem)
        else:
            _type, row = struct.unpack_from("<iQ", data, offset)
            out.append(data[offset : offset + 12])
            offset += 12
            rows(row)
    out.append(_EMPTY * (n_stream - index - 1))
    return b"".join(out)
