"""The KV layout policy on plain numbers (:mod:`llamax.engine.kv.layout_policy`), and the
layout's state machine in :class:`llamax.engine.kv.kvcache.KVCache`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llamax.engine.kv.kvcache import LAYOUT_MOVES, KVCache, LayoutState
from llamax.engine.kv.layout_policy import (
    COPIED_TOKEN_COST,
    RELAYOUT_COOLDOWN_STEPS,
    RELAYOUT_MIN_DECODING,
    LayoutPolicy,
)
from llamax.errors import RequestFailedError
from llamax.testing import FakeBackend


def cooled(stream_cells: int = 64) -> LayoutPolicy:
    policy = LayoutPolicy(stream_cells)
    for _ in range(RELAYOUT_COOLDOWN_STEPS):
        policy.count_step()
    return policy


def test_a_sequence_beyond_its_stream_asks_for_the_unified_layout() -> None:
    policy = LayoutPolicy(64)
    assert not policy.should_unify([10, 64, 3])
    assert policy.should_unify([10, 65])
    assert not policy.should_unify([])


def test_cells_to_come_are_a_quarter_stream_or_what_max_tokens_leaves() -> None:
    policy = LayoutPolicy(64)
    assert policy.cells_to_come(30, 0, None) == 30 + 16
    assert policy.cells_to_come(30, 5, 10) == 30 + 5
    assert policy.cells_to_come(30, 12, 10) == 30  # past max_tokens: no growth


def may_split(policy: LayoutPolicy, **kwargs: int) -> bool:
    """Four decoding sequences that fit a stream, and a small session."""
    return policy.should_split(num_decoding=4, cells_to_come=[40, 50], session_cells=[20], **kwargs)


def test_back_to_streams_only_after_the_cooldown() -> None:
    policy = LayoutPolicy(64)
    for _ in range(RELAYOUT_COOLDOWN_STEPS - 1):
        policy.count_step()
        assert not may_split(policy)
    policy.count_step()
    assert may_split(policy)
    policy.restart_count()  # a move: the cooldown starts again
    assert not may_split(policy)
    assert may_split(LayoutPolicy(64, num_steps_in_layout=2), cooldown_steps=2)


def test_back_to_streams_needs_decoders_and_room_to_grow() -> None:
    policy = cooled(64)
    few = RELAYOUT_MIN_DECODING - 1
    assert not policy.should_split(num_decoding=few, cells_to_come=[10], session_cells=[])
    assert not policy.should_split(num_decoding=4, cells_to_come=[10, 65], session_cells=[])
    assert not policy.should_split(num_decoding=4, cells_to_come=[10], session_cells=[65])
    assert policy.should_split(num_decoding=4, cells_to_come=[64], session_cells=[64])


def test_the_growth_check_is_lazy_until_the_cooldown_is_over() -> None:
    """The unified layout's every step must not walk every sequence before it may move."""

    def never() -> Iterator[int]:
        raise AssertionError("read during the cooldown")
        yield 0

    policy = LayoutPolicy(64)
    assert not policy.should_split(num_decoding=4, cells_to_come=never(), session_cells=[])


def test_layout_moves_are_explicit() -> None:
    assert LAYOUT_MOVES[LayoutState.FIXED] == frozenset()
    assert LAYOUT_MOVES[LayoutState.STUCK] == frozenset()
    assert LAYOUT_MOVES[LayoutState.STREAMS] == {LayoutState.UNIFIED, LayoutState.STUCK}
    assert LAYOUT_MOVES[LayoutState.UNIFIED] == {LayoutState.STREAMS, LayoutState.STUCK}


def test_the_cache_walks_the_layout_states() -> None:
    assert KVCache(FakeBackend(kv_layout="unified"), 4).layout is LayoutState.FIXED
    assert KVCache(FakeBackend(kv_layout="streams"), 4).layout is LayoutState.FIXED
    backend = FakeBackend(n_ctx=256, n_seq_max=4, kv_layout="auto")
    kv = KVCache(backend, 4)
    assert kv.layout is LayoutState.STREAMS and kv.can_relayout and not kv.is_unified
    kv.relayout(True)
    assert kv.layout is LayoutState.UNIFIED and kv.is_unified
    kv.relayout(False)
    assert kv.layout is LayoutState.STREAMS and kv.relayout_failure is None

    def refuse(where: str) -> None:
        if where == "relayout":
            raise RequestFailedError("no memory")

    backend.fault = refuse
    with pytest.raises(RequestFailedError):
        kv.relayout(True)
    assert kv.layout is LayoutState.STREAMS and not kv.is_unified  # a failed move: no change
    kv.fail_relayout("the unified layout could not be made: no memory")
    assert kv.layout is LayoutState.STUCK and not kv.can_relayout
    assert kv.relayout_failure == "the unified layout could not be made: no memory"
    backend.fault = None
    with pytest.raises(RuntimeError, match="cannot move from stuck to unified"):
        kv.relayout(True)
    with pytest.raises(RuntimeError, match="cannot move from stuck to stuck"):
        kv.fail_relayout("again")


def test_a_fixed_layout_never_moves() -> None:
    kv = KVCache(FakeBackend(kv_layout="streams"), 4)
    with pytest.raises(RuntimeError, match="cannot move from fixed to unified"):
        kv.relayout(True)
    with pytest.raises(RuntimeError, match="cannot move from fixed to stuck"):
        kv.fail_relayout("why")
    assert kv.layout is LayoutState.FIXED and kv.relayout_failure is None


def test_next_layout_unifies_streams_only_for_a_sequence_beyond_its_stream() -> None:
    policy = LayoutPolicy(stream_cells=100)
    counted: list[int] = []

    def decoding() -> int:
        counted.append(1)
        return 4

    def move(unified: bool, *seqs: tuple[int, int, int | None]) -> bool | None:
        return policy.next_layout(
            unified=unified,
            can_split=True,
            sequences=iter(seqs),
            num_decoding=decoding,
            session_cells=[],
            cooldown_steps=0,
        )

    assert move(False, (100, 0, None)) is None
    assert move(False, (50, 0, None), (101, 0, None)) is True
    assert counted == []  # streams never count the decoding sequences
    assert move(True, (20, 0, None), (30, 5, 10)) is False  # all fit a stream with room
    assert move(True, (90, 0, None)) is None  # a quarter stream of growth would not fit
    no_split = policy.next_layout(
        unified=True,
        can_split=False,
        sequences=[],
        num_decoding=decoding,
        session_cells=[],
        cooldown_steps=0,
    )
    assert no_split is None and len(counted) == 2


def test_waiting_sequences_that_would_copy_one_long_prefix_ask_for_the_unified_layout() -> None:
    policy = LayoutPolicy(64)  # a prefix of 16 tokens or more counts
    assert policy.shared_prefix_min == 16
    shared = list(range(20))
    one, two, three = [*shared, 100], [*shared, 101], [*shared, 102]
    # two waiting sequences: the first computes the prefix, the second copies it once
    assert not policy.should_unify_to_share([one, two], held=[])
    assert policy.should_unify_to_share([one, two, three], held=[])
    # a slot holds it already: two copies
    assert policy.should_unify_to_share([one, two], held=[shared])
    assert not policy.should_unify_to_share([one], held=[shared])
    # a prefix shorter than a quarter stream is cheap to copy
    short = list(range(15))
    assert not policy.should_unify_to_share([[*short, i] for i in range(8)], held=[])
    # a prompt that is only the prefix has nothing to compute after the copy, and
    # prompts that part before 16 tokens share nothing
    assert not policy.should_unify_to_share([shared[:16]] * 2 + [one], held=[])
    assert not policy.should_unify_to_share([[i, *shared] for i in range(8)], held=[])
    assert not policy.should_unify_to_share([], held=[shared])


def test_the_unified_layout_stays_while_sequences_share_their_cells() -> None:
    policy = cooled(64)

    def split(num_tokens: int, num_cells: int) -> bool:
        return policy.should_split(
            num_decoding=4,
            cells_to_come=[40],
            session_cells=[],
            sharing=lambda: (num_tokens, num_cells),
        )

    assert not split(300, 200)  # 1.5x: a move would copy what they share
    assert split(299, 200)
    assert split(0, 0)  # nothing held yet
    calls: list[int] = []

    def counted() -> tuple[int, int]:
        calls.append(1)
        return 0, 0

    young = LayoutPolicy(64)  # the cooldown is not over: sharing is not even counted
    assert not young.should_split(
        num_decoding=4, cells_to_come=[40], session_cells=[], sharing=counted
    )
    assert not policy.should_split(
        num_decoding=4, cells_to_come=[65], session_cells=[], sharing=counted
    )
    assert calls == []


def test_next_layout_unifies_streams_for_a_shared_prefix_only_when_nothing_outgrew() -> None:
    policy = LayoutPolicy(stream_cells=100)
    asked: list[int] = []

    def to_share() -> bool:
        asked.append(1)
        return True

    def move(*seqs: tuple[int, int, int | None]) -> bool | None:
        return policy.next_layout(
            unified=False,
            can_split=True,
            sequences=iter(seqs),
            num_decoding=lambda: 4,
            session_cells=[],
            to_share=to_share,
        )

    assert move((101, 0, None)) is True and asked == []
    assert move((50, 0, None)) is True and asked == [1]


def test_sharing_unifies_only_when_the_copies_cost_more_than_the_move() -> None:
    policy = LayoutPolicy(64)
    shared = list(range(40))
    waiting = [[*shared, 100 + i] for i in range(5)]  # 4 copies of 40 tokens
    gain = 4 * 40 * 0.003 * COPIED_TOKEN_COST
    assert policy.should_unify_to_share(waiting, [], token_s=0.003, move_s=gain * 0.9)
    assert not policy.should_unify_to_share(waiting, [], token_s=0.003, move_s=gain * 1.1)
    # the gain counts the tokens the group really shares, not only the quarter stream
    parted = [[*shared[:16], 200 + i, *shared[16:]] for i in range(5)]
    assert not policy.should_unify_to_share(parted, [], token_s=0.003, move_s=gain * 0.9)
