"""Where a sequence whose memory cannot be cut takes checkpoints. Pure functions.

A recurrent or hybrid memory (Mamba, LFM2, Qwen3-Next...) cannot drop the end of a
sequence: its recurrent state holds every token it has seen. The engine cuts such a
sequence only where it took a checkpoint, a copy of that state
(``KVMemory.state_seq_get(partial=True)``) at a position: set back, it takes the sequence
back to that position exactly, the full-attention cells past it removed
(:meth:`~llamax.engine.kvcache.KVCache.truncate`).

A prompt's checkpoints are taken at its last token but one, which serves the two ways a
later prompt reuses it (the same prompt again, whose last token is computed again for its
logits, and a longer one, a chat's next turn), and every :data:`CHECKPOINT_INTERVAL`
tokens before that, so a prompt that shares only part of a long one recomputes at most one
interval. The scheduler ends prompt chunks at these positions (:func:`next_checkpoint`)
and takes each checkpoint after the decode that reached it.

One more where prompts **branch**: a prompt that shares more tokens with a cached one
than a checkpoint lets it reuse (two chats with the same system prompt, tools and
examples part where their first user message does) takes a checkpoint where the two part
(:func:`branch_point`), so every later prompt that shares that head reuses it. The first
prompt of a head pays its prefill, and the second, which finds where they part; from the
third on the head is a hit. In a chat the point lies at a message boundary or inside the
first message that differs; no template is consulted.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Mapping

__all__ = [
    "CHECKPOINT_INTERVAL",
    "MAX_CHECKPOINTS",
    "MIN_BRANCH_GAIN",
    "branch_point",
    "checkpoint_positions",
    "least_needed",
    "next_checkpoint",
    "pack_state",
    "planned_checkpoint",
    "unpack_state",
]

CHECKPOINT_INTERVAL = 1024
"""Tokens between a long prompt's checkpoints."""

MAX_CHECKPOINTS = 8
"""Checkpoints one slot keeps (the oldest goes first)."""


MIN_BRANCH_GAIN = 64
"""Fewest tokens a branch checkpoint must save a later prompt (a shorter shared head is
cheaper to recompute than to hold a state for)."""


def branch_point(num_reused: int, num_shared: int) -> int:
    """Where a prompt that reuses ``num_reused`` tokens but shares ``num_shared`` computed
    ones with a cached prompt takes a branch checkpoint (0: none)."""
    return num_shared if num_shared - num_reused >= MIN_BRANCH_GAIN else 0


def least_needed(positions: Collection[int]) -> int:
    """Which of a slot's checkpoints to drop first: of all but its first (a head other
    prompts branch from) and its last (where the sequence goes on), the one nearest the
    checkpoint before it (the fewest tokens to recompute without it; the older among
    equals). With two or fewer, the first."""
    ordered = sorted(positions)
    if len(ordered) <= 2:
        return ordered[0]
    gaps = [(ordered[i] - ordered[i - 1], ordered[i]) for i in range(1, len(ordered) - 1)]
    return min(gaps)[1]


def checkpoint_positions(num_prompt: int, interval: int | None = None) -> list[int]:
    """Where a prompt of ``num_prompt`` tokens takes checkpoints, in order: every
    ``interval`` tokens (default :data:`CHECKPOINT_INTERVAL`), and its last token but one."""
    interval = interval or CHECKPOINT_INTERVAL
    last = num_prompt - 1
    if last < 1:
        return []
    return [*range(interval, last, interval), last]


def next_checkpoint(num_computed: int, num_prompt: int, interval: int | None = None) -> int | None:
    """The first checkpoint past ``num_computed`` tokens (None: none is left), where the
    next prompt chunk must end."""
    interval = interval or CHECKPOINT_INTERVAL
    last = num_prompt - 1
    if num_computed >= last:
        return None
    following = (num_computed // interval + 1) * interval
    return min(following, last)


def planned_checkpoint(num: int, num_prompt: int, interval: int | None = None) -> int:
    """The last checkpoint at or before ``num`` tokens that a prompt of ``num_prompt``
    tokens will have taken once computed (0: none)."""
    interval = interval or CHECKPOINT_INTERVAL
    last = num_prompt - 1
    if num >= last >= 1:
        return last
    return min(num // interval * interval, max(last, 0))


_MAGIC = b"LLAMAXCK1"
_LENGTH = struct.Struct("<I")


def pack_state(state: bytes, checkpoints: Mapping[int, bytes]) -> bytes:
    """A saved sequence state with its checkpoints, as one blob (a prefix tier's entry, a
    session file): :data:`_MAGIC`, a JSON header's length and the header (the state's
    length, each checkpoint's position and length), the state, the checkpoints."""
    positions = sorted(checkpoints)
    header = json.dumps(
        {"state": len(state), "checkpoints": [[p, len(checkpoints[p])] for p in positions]}
    ).encode()
    parts = [_MAGIC, _LENGTH.pack(len(header)), header, state]
    return b"".join(parts + [checkpoints[p] for p in positions])


def unpack_state(blob: bytes) -> tuple[bytes, dict[int, bytes]]:
    """The state and checkpoints of a :func:`pack_state` blob; a blob without the mark is
    a bare state (no checkpoints).

    Raises:
        ValueError: the blob has the mark but does not parse, or its lengths do not add up.
    """
    if not blob.startswith(_MAGIC):
        return blob, {}
    try:
        start = len(_MAGIC) + _LENGTH.size
        (size,) = _LENGTH.unpack_from(blob, len(_MAGIC))
        header = json.loads(blob[start : start + size])
        offset = start + size
        state = blob[offset : offset + int(header["state"])]
        offset += len(state)
        checkpoints: dict[int, bytes] = {}
        for position, length in header["checkpoints"]:
            checkpoints[int(position)] = blob[offset : offset + int(length)]
            offset += int(length)
    except (struct.error, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"a damaged state with checkpoints: {exc}") from exc
    if offset != len(blob) or len(state) != int(header["state"]):
        raise ValueError("a damaged state with checkpoints: its lengths do not add up")
    return state, checkpoints
