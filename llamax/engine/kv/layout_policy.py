"""KV-layout adaptation for ``kv_layout="auto"``: when to move between streams and unified.

One stream per sequence while every sequence fits one: each decode attends only to its
own cells. The unified layout while one needs more: any sequence may grow to ``n_ctx``, but
each decode attends over the whole used span (docs/kv-cache.md). Streams again once all
fit with room to grow, after :data:`RELAYOUT_COOLDOWN_STEPS` steps in the unified layout
and with at least :data:`RELAYOUT_MIN_DECODING` sequences decoding (to whom streams are
faster).

Shared prefixes favour the unified layout. There a prefix hit only adds sequence ids to the
prefix's cells; between streams llama.cpp copies the whole source stream (a partial copy
aborts), and every stream then holds, and every decode reads, its own copy. A burst of 16
requests on one 1,312-token prompt took 11.6 s in streams of 2,048 cells and 8.8 s
unified (SmolLM2, 2 threads; the raw loop's ideal, 8.5 s): its 15 suffixes took 2.3 s
against 1.5 s and each decode step 0.134 s against 0.105 s. But the move itself costs a
new llama.cpp context: 0.08 s for 8,192 cells and, for 32,768 (720 MiB), 1.7-2.3 s the
first time and 0.3 s after; there the move lost more than sharing gained. So streams move
to the unified layout before waiting sequences would copy one prefix of at least a quarter
stream into :data:`SHARED_PREFIX_MIN_COPIES` streams or more, only if what the copies
would cost (:data:`COPIED_TOKEN_COST`) exceeds what a move costs: the last move this
context timed, or before any, :data:`MOVE_PRIOR_S_PER_BYTE` of the KV cache. The unified
layout then stays while the unfinished sequences hold :data:`SHARING_KEEPS_UNIFIED` times
more tokens than the cache has cells in use.

:class:`LayoutPolicy` decides on numbers (token counts); the layout's state and its moves
belong to :class:`~llamax.engine.kv.kvcache.KVCache`
(:class:`~llamax.engine.kv.kvcache.LayoutState`); :class:`~llamax.engine.kv.relayout.Relayout`
asks the policy and makes the move, the scheduler makes room before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

__all__ = [
    "COPIED_TOKEN_COST",
    "MOVE_PRIOR_S_PER_BYTE",
    "RELAYOUT_COOLDOWN_STEPS",
    "RELAYOUT_MIN_DECODING",
    "SHARED_PREFIX_MIN_COPIES",
    "SHARING_KEEPS_UNIFIED",
    "LayoutPolicy",
]

RELAYOUT_COOLDOWN_STEPS = 32
"""With ``kv_layout="auto"``, steps spent in the unified layout before moving back to streams."""
RELAYOUT_MIN_DECODING = 2
"""Decoding sequences needed to move back to streams (one sequence attends alike in both)."""
SHARED_PREFIX_MIN_COPIES = 2
"""Streams move to the unified layout before admitting waiting sequences would copy one
prefix (of a quarter stream or more) into this many streams."""
COPIED_TOKEN_COST = 0.03
"""What a prefix token copied into one more stream costs later (duplicated cells in every
suffix chunk and decode), as a fraction of computing a token: measured 0.030 and 0.035 on
SmolLM2 (16 requests on 291- and 1,312-token prefixes, 2 threads)."""
MOVE_PRIOR_S_PER_BYTE = 3e-9
"""Seconds a layout move costs per byte of KV cache before this context timed one: the
worst first move measured (32,768 cells, 720 MiB: 1.7-2.3 s). Later moves are judged by
the last one's time."""
SHARING_KEEPS_UNIFIED = 1.5
"""The unified layout stays while the unfinished sequences hold this many times more tokens
than the cache has cells in use (a move to streams would copy what they share)."""


@dataclass(slots=True)
class LayoutPolicy:
    """Decides the moves of ``kv_layout="auto"`` between streams and the unified layout."""

    stream_cells: int
    """Cells one sequence holds in its own stream."""
    num_steps_in_layout: int = 0
    """Steps since the last move."""

    def count_step(self) -> None:
        """Count one more step in the current layout."""
        self.num_steps_in_layout += 1

    def restart_count(self) -> None:
        """The layout just moved: the cooldown starts again."""
        self.num_steps_in_layout = 0

    def should_unify(self, num_tokens: Iterable[int]) -> bool:
        """Whether a sequence holding one of ``num_tokens`` tokens outgrew its stream."""
        return any(num > self.stream_cells for num in num_tokens)

    @property
    def shared_prefix_min(self) -> int:
        """Tokens a prefix must have for its copies to move streams to the unified layout."""
        return max(1, self.stream_cells // 4)

    def should_unify_to_share(
        self,
        waiting: Iterable[Tokens[int]],
        held: Iterable[Tokens[int]],
        *,
        token_s: float = 0.0,
        move_s: float = 0.0,
    ) -> bool:
        """Whether admitting ``waiting`` into streams would copy one prefix of at least
        :attr:`shared_prefix_min` tokens into :data:`SHARED_PREFIX_MIN_COPIES` streams, at
        a cost above a move's.

        Args:
            waiting: The prompts of the waiting sequences that may be admitted next.
            held: The tokens of every slot holding cells now (a source to copy from).
            token_s: Seconds computing one prompt token costs (the step-cost model's).
            move_s: Seconds a move to the unified layout is expected to cost.
        """
        size = self.shared_prefix_min
        groups: dict[tuple[int, ...], list[Tokens[int]]] = {}
        for tokens in waiting:
            if len(tokens) > size:
                groups.setdefault(tuple(tokens[:size]), []).append(tokens)
        if not groups or max(len(g) for g in groups.values()) < SHARED_PREFIX_MIN_COPIES:
            return False  # not even the waiting sequences share one
        sources = Counter(tuple(t[:size]) for t in held if len(t) >= size)
        for prefix, group in groups.items():
            num_copies = len(group) - (prefix not in sources)
            if num_copies < SHARED_PREFIX_MIN_COPIES:
                continue
            shared = _common_prefix_len(group)
            if num_copies * shared * token_s * COPIED_TOKEN_COST >= move_s:
                return True
        return False

    def cells_to_come(self, num_tokens: int, num_generated: int, max_tokens: int | None) -> int:
        """Cells a sequence will hold within a quarter stream of growth (or its
        ``max_tokens``).

        Args:
            num_tokens: Tokens it holds (prompt and output).
            num_generated: Tokens it generated.
            max_tokens: Its request's ``max_tokens``.
        """
        room = self.stream_cells // 4
        if max_tokens is not None:
            room = min(room, max(0, max_tokens - num_generated))
        return num_tokens + room

    def should_split(
        self,
        *,
        num_decoding: int,
        cells_to_come: Iterable[int],
        session_cells: Iterable[int],
        cooldown_steps: int = RELAYOUT_COOLDOWN_STEPS,
        sharing: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> bool:
        """Whether the unified cache should move back to one stream per sequence.

        Args:
            num_decoding: Sequences decoding now.
            cells_to_come: :meth:`cells_to_come` of every unfinished sequence (read only
                if the cooldown is over and enough sequences decode).
            session_cells: Tokens each open session holds (it would have to fit a stream).
            cooldown_steps: Steps to stay in the unified layout after a move.
            sharing: Gives the tokens the unfinished sequences hold and the cells in use
                (called last, only if everything else allows the move).
        """
        if self.num_steps_in_layout < cooldown_steps or num_decoding < RELAYOUT_MIN_DECODING:
            return False
        cap = self.stream_cells
        if not all(num <= cap for num in cells_to_come):
            return False
        if not all(num <= cap for num in session_cells):
            return False
        num_tokens, num_cells = sharing()
        return num_tokens < SHARING_KEEPS_UNIFIED * num_cells or num_tokens == 0

    def next_layout(
        self,
        *,
        unified: bool,
        can_split: bool,
        sequences: Iterable[tuple[int, int, int | None]],
        num_decoding: Callable[[], int],
        session_cells: Iterable[int],
        cooldown_steps: int = RELAYOUT_COOLDOWN_STEPS,
        to_share: Callable[[], bool] = lambda: False,
        sharing: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> bool | None:
        """The layout to move to now: True for unified, False for streams, None to stay.

        Args:
            unified: Whether the cache is one buffer now.
            can_split: Whether the unified cache may move back to streams.
            sequences: ``(tokens held, tokens generated, max_tokens)`` of every unfinished
                sequence (read lazily).
            num_decoding: Counts the sequences decoding now (called only if needed).
            session_cells: Tokens each open session holds.
            cooldown_steps: Steps to stay in the unified layout after a move.
            to_share: In streams, whether waiting sequences would copy a shared prefix
                (:meth:`should_unify_to_share`; called only if no sequence outgrew).
            sharing: See :meth:`should_split`.
        """
        if not unified:
            if self.should_unify(num for num, _, _ in sequences) or to_share():
                return True
            return None
        if not can_split:
            return None
        split = self.should_split(
            num_decoding=num_decoding(),
            cells_to_come=(self.cells_to_come(*s) for s in sequences),
            session_cells=session_cells,
            cooldown_steps=cooldown_steps,
            sharing=sharing,
        )
        return False if split else None


def _common_prefix_len(token_lists: list[Tokens[int]]) -> int:
    """Tokens every list starts with."""
    first = token_lists[0]
    num = min(len(t) for t in token_lists)
    for tokens in token_lists[1:]:
        i = 0
        while i < num and tokens[i] == first[i]:
            i += 1
        num = i
    return num
