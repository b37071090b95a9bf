"""``backend.seq_state.restream``: one sequence's saved state, rewritten for another stream
count (pure bytes; the real round trip is in tests/test_model_kv_relayout.py)."""

from __future__ import annotations

import struct

import pytest

from llamax.backend.seq_state import kv_section_end, restream

MAGIC = 0x67677371
BLOCK = struct.pack("<I", 3) + bytes(range(1, 40)) + b"\0\0\0\0"  # may end in zeros


def state(seq_id: int, n_stream: int, stream: int | None) -> bytes:
    blocks = [b"\0\0\0\0"] * n_stream
    if stream is not None:
        blocks[stream] = BLOCK
    return struct.pack("<IiI", MAGIC, seq_id, n_stream) + b"".join(blocks)


@pytest.mark.parametrize("seq_id", [0, 3, 7])
def test_a_stream_state_becomes_unified_and_back(seq_id: int) -> None:
    streams = state(seq_id, 8, seq_id)
    unified = restream(streams, 1)
    assert unified == state(seq_id, 1, 0)
    # llama.cpp writes a restored sequence into its own stream, whatever the block's index
    assert restream(unified, 8) == state(seq_id, 8, 0)
    assert restream(restream(unified, 8), 1) == unified


def test_same_count_and_empty_states() -> None:
    data = state(2, 4, 2)
    assert restream(data, 4) is data
    assert restream(state(2, 4, None), 1) == state(2, 1, None)


def test_what_is_not_one_plain_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="too short"):
        restream(b"\0" * 8, 1)
    two = state(1, 4, 1)[:-4] + BLOCK  # cells in two streams
    with pytest.raises(ValueError, match="more than one stream"):
        restream(two, 1)
    with pytest.raises(ValueError, match="0 streams"):
        restream(struct.pack("<IiI", MAGIC, 0, 0) + b"\0\0\0\0", 1)


def parsed_block(count: int, seq_id: int) -> bytes:
    """A well-formed block: ``count`` cells, one layer of 4-byte K and V rows."""
    cells = b"".join(struct.pack("<iIi", pos, 1, seq_id) for pos in range(count))
    layer = struct.pack("<iQ", 1, 4) + bytes(range(4 * count))
    return struct.pack("<I", count) + cells + struct.pack("<II", 0, 1) + layer + layer


def hybrid_state(seq_id: int, n_stream: int, stream: int, tail: bytes) -> bytes:
    blocks = [b"\0\0\0\0"] * n_stream
    blocks[stream] = parsed_block(3, seq_id)
    return struct.pack("<IiI", MAGIC, seq_id, n_stream) + b"".join(blocks) + tail


def test_a_hybrid_state_keeps_its_recurrent_part() -> None:
    """A hybrid's state: the attention section, then the recurrent state (here non-zero
    bytes, which the plain rewrite would take for cells of another stream)."""
    tail = struct.pack("<I", 1) + bytes(range(1, 30))
    streams = hybrid_state(2, 4, 2, tail)
    with pytest.raises(ValueError, match="more than one stream"):
        restream(streams, 1)
    assert kv_section_end(streams) == len(streams) - len(tail)
    unified = restream(streams, 1, tail=True)
    assert unified == hybrid_state(2, 1, 0, tail)
    assert restream(unified, 4, tail=True) == hybrid_state(2, 4, 0, tail)
    assert restream(unified, 1, tail=True) == unified


def test_a_damaged_hybrid_state_is_refused() -> None:
    good = hybrid_state(0, 2, 0, b"\1\2\3\4")
    with pytest.raises(ValueError):
        restream(good[: 12 + 4 + 20], 1, tail=True)  # cut inside the cells
    two = struct.pack("<IiI", MAGIC, 0, 2) + parsed_block(3, 0) + parsed_block(3, 0)
    with pytest.raises(ValueError, match="more than one stream"):
        kv_section_end(two)
