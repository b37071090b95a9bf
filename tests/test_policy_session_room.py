"""What idle open sessions leave other sequences (:mod:`llamax.engine.kv.session_room`), on
plain numbers."""

from __future__ import annotations

from llamax.engine.kv.session_room import SessionRoom

ROOM = SessionRoom(n_ctx=1024, n_ctx_seq=1024, n_seq_max=4)


def test_in_a_unified_cache_idle_sessions_cells_come_off_the_capacity() -> None:
    assert ROOM.capacity(0, unified=True, stream_cells=256, can_relayout=False) == 1024
    assert ROOM.capacity(300, unified=True, stream_cells=256, can_relayout=False) == 724


def test_the_capacity_never_exceeds_n_ctx_seq() -> None:
    room = SessionRoom(n_ctx=1024, n_ctx_seq=512, n_seq_max=4)
    assert room.capacity(100, unified=True, stream_cells=256, can_relayout=False) == 512


def test_fixed_streams_give_one_stream_whatever_sessions_hold() -> None:
    for held in (0, 500, 1000):
        assert ROOM.capacity(held, unified=False, stream_cells=256, can_relayout=False) == 256


def test_auto_streams_give_at_least_a_stream_and_what_a_move_would_give() -> None:
    assert ROOM.capacity(0, unified=False, stream_cells=256, can_relayout=True) == 1024
    assert ROOM.capacity(900, unified=False, stream_cells=256, can_relayout=True) == 256


def test_sessions_hold_every_id_only_at_n_seq_max() -> None:
    assert not ROOM.are_ids_held(3)
    assert ROOM.are_ids_held(4)


def _reason(**kwargs: object) -> str:
    args: dict[str, object] = {
        "session_ids": [1, 2],
        "num_held": 700,
        "capacity": 324,
        "is_session": False,
        "fixed_stream_cells": None,
        "relayout_failure": None,
    }
    args.update(kwargs)
    return ROOM.no_room_reason(400, **args)  # type: ignore[arg-type]


def test_the_reason_names_the_sessions_and_their_cells() -> None:
    assert _reason() == (
        "the request needs 400 KV cells, but open sessions (sessions 1, 2) hold 700 of the "
        "cache's 1024, leaving 324; close a session or raise n_ctx"
    )


def test_the_reason_when_sessions_hold_every_id() -> None:
    reason = _reason(session_ids=[1, 2, 3, 4])
    assert reason == (
        "every one of the 4 sequence ids is held by an open session (sessions 1, 2, 3, 4); "
        "close a session or raise n_seq_max"
    )
    assert "sequence ids" not in _reason(session_ids=[1, 2, 3, 4], is_session=True)


def test_the_reason_in_fixed_streams_says_why_the_layout_is_fixed() -> None:
    assert _reason(fixed_stream_cells=256) == "the request needs 400 KV cells, one stream holds 256"
    failed = _reason(fixed_stream_cells=256, relayout_failure="the move failed")
    assert failed.endswith("one stream holds 256, and the move failed")


def test_the_stream_reason_names_the_failure_of_a_move() -> None:
    assert ROOM.stream_reason(300, 256, "the move failed") == (
        "the request needs 300 KV cells, one stream holds 256, and the move failed"
    )
