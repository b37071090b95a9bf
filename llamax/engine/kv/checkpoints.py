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
tokens before that, counted from where the prompt's computation starts (the prefix it
reused), so a prompt that shares only part of a long one recomputes at most one interval
(:func:`interval_for`: a long prompt spreads a slot's checkpoints evenly). A prompt that
adds less than an interval to what it reused (a chat's or an agent's next turn) takes no
interval checkpoint and its prompt is not cut for one: a later prompt sharing part of the
new tokens recomputes less than an interval from the reused prefix anyway. The scheduler
ends prompt chunks at these positions (:func:`next_checkpoint`) and takes each checkpoint
after the decode that reached it.

One more where prompts **branch**: a prompt that shares more tokens with a cached one
than a checkpoint lets it reuse (two chats with the same system prompt, tools and
examples part where their first user message does) takes a checkpoint where the two part
(:func:`branch_point`), so every later prompt that shares that head reuses it. The first
prompt of a head pays its prefill, and the second, which finds where they part; from the
third on the head is a hit. In a chat the point lies at a message boundary or inside the
first message that differs; no template is consulted.

And one where a prompt's **head** ends (:func:`head_point`): just past its first
end-of-turn token, the end of a chat's system message, so that a conversation shifted
later (its oldest turns dropped, its system prompt kept) and a new conversation with the
same system prompt reuse it from their first prompt on.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable, Collection, Mapping, Sequence

__all__ = [
    "CHECKPOINT_INTERVAL",
    "MAX_CHECKPOINTS",
    "MIN_BRANCH_GAIN",
    "branch_point",
    "checkpoint_positions",
    "head_point",
    "interval_for",
    "least_needed",
    "next_checkpoint",
    "pack_state",
    "planned_checkpoint",
    "unpack_state",
]

CHECKPOINT_INTERVAL = 256
"""The fewest tokens between a long prompt's checkpoints: a longer prompt spreads its
:data:`MAX_CHECKPOINTS` evenly (:func:`interval_for`).

Measured (``benchmarks/checkpoint_interval.py``, a random hybrid in LFM2-350M's shape, a
4,096-token document on 2 cores of an AMD EPYC): a checkpoint is 82 KB and taking 8 to 16
of them cost no measurable prefill time (17.7-19.7 s at every interval, noise); what
decides is coverage. Prompts sharing 30/50/70/90% of the document recomputed 613 tokens
in all at an interval of 512 (its 8 checkpoints span the document), 1,637 at 1,024,
2,866 at 2,048, and 1,637 at 256, whose 16 checkpoints did not fit a slot's 8, so the
gaps left by the dropped ones were wider than 512."""

MAX_CHECKPOINTS = 8
"""Checkpoints one slot keeps (the oldest goes first)."""


MIN_BRANCH_GAIN = 64
"""Fewest tokens a branch checkpoint must save a later prompt (a shorter shared head is
cheaper to recompute than to hold a state for)."""


def branch_point(num_reused: int, num_shared: int) -> int:
    """Where a prompt that reuses ``num_reused`` tokens but shares ``num_shared`` computed
    ones with a cached prompt takes a branch checkpoint (0: none)."""
    return num_shared if num_shared - num_reused >= MIN_BRANCH_GAIN else 0


def head_point(prompt: Sequence[int], is_eog: Callable[[int], bool], num_reused: int) -> int:
    """Where a prompt takes a **head** checkpoint (0: none): just past its first
    end-of-turn token, where a chat's first message (its system prompt) ends in every
    template that closes a message with one (ChatML's ``<|im_end|>``, Gemma's
    ``<end_of_turn>``, Llama 3's ``<|eot_id|>``). A conversation shifted or truncated later
    keeps that head and drops what followed it, and a new conversation with the same system
    prompt starts with it: both reuse the checkpoint instead of computing the head again.
    None where the head is shorter than :data:`MIN_BRANCH_GAIN` (cheaper to recompute), is
    already reused (``num_reused``), or reaches the prompt's last token but one (its own
    checkpoint). Only the first :data:`HEAD_SCAN` tokens are looked at."""
    last = len(prompt) - 1
    for index, token in enumerate(itertools.islice(prompt, min(last, HEAD_SCAN))):
        if is_eog(token):
            head = index + 1
            return head if head >= MIN_BRANCH_GAIN and num_reused < head < last else 0
    return 0


HEAD_SCAN = 16384
"""Tokens :func:`head_point` looks through for the first end-of-turn token (a system
prompt longer than this takes no head checkpoint; its interval checkpoints cover it)."""


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


def interval_for(num_prompt: int) -> int:
    """Tokens between the checkpoints of a prompt of ``num_prompt`` tokens: the smallest
    multiple of :data:`CHECKPOINT_INTERVAL` whose checkpoints (its last token but one
    counted) fit the :data:`MAX_CHECKPOINTS` a slot keeps, so they cover the whole prompt
    evenly and a prompt sharing any part of it recomputes at most one interval."""
    step = CHECKPOINT_INTERVAL
    last = num_prompt - 1
    # positions k, 2k, ... below ``last``, then ``last``: ceil(last / k) of them
    return max(1, -(-last // (MAX_CHECKPOINTS * step))) * step


def checkpoint_positions(num_prompt: int, interval: int | None = None, start: int = 0) -> list[int]:
    """Where a prompt of ``num_prompt`` tokens whose computation starts at ``start``
    tokens (the prefix it reused) takes checkpoints, in order: every ``interval`` tokens
    past ``start`` (default :func:`interval_for`), and its last token but one."""
    interval = interval or interval_for(num_prompt)
    last = num_prompt - 1
    if last < 1:
        return []
    return [*range(start + interval, last, interval), last]


def next_checkpoint(
    num_computed: int, num_prompt: int, interval: int | None = None, start: int = 0
) -> int | None:
    """The first checkpoint past ``num_computed`` tokens (None: none is left) of a prompt
    whose computation started at ``start`` tokens, where the next prompt chunk must end."""
    interval = interval or interval_for(num_prompt)
    last = num_prompt - 1
    if num_computed >= last:
        return None
    following = start + (max(num_computed - start, 0) // interval + 1) * interval
    return min(following, last)


def planned_checkpoint(
    num: int, num_prompt: int, interval: int | None = None, start: int = 0
) -> int:
    """The last checkpoint at or before ``num`` tokens that a prompt of ``num_prompt``
    tokens, computed from ``start`` tokens on, will have taken once computed (0: none)."""
    interval = interval or interval_for(num_prompt)
    last = num_prompt - 1
    if num >= last >= 1:
        return last
    steps = max(num - start, 0) // interval
    return min(start + steps * interval, max(last, 0)) if steps else 0


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
