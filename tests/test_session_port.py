"""A Session reaches its context only through a :class:`~llamax.session.SessionPort`.

These tests build a Session on a recording port (no context, no engine), so they show
what a session asks of its context and nothing more; tests/test_session.py covers the
same behaviour on a real Context with the fake backend.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, TypeVar

import pytest

import llamax
from llamax.engine.kv.kvops import (
    ForkSession,
    KVOp,
    ReadSession,
    ReleaseSession,
    RewindSession,
    SaveSession,
)
from llamax.handle import RequestHandle
from llamax.session import Session, SessionPort

T = TypeVar("T")


class RecordingPort:
    """A SessionPort that answers from a script and records every call."""

    def __init__(self) -> None:
        self.ops: list[KVOp[Any]] = []
        self.submitted: list[tuple[object, object, int]] = []
        self.ended = False
        self.model_identity: dict[str, object] = {"name": "recording"}
        self.adapter_weights: dict[str, str] = {"tuned": "f00d"}
        self.projector_identity: dict[str, object] | None = None
        self.answers: dict[type, object] = {
            ReadSession: (1, 2, 3),
            ForkSession: 7,
            SaveSession: ((1, 2), b"state", (("tuned", 0.5),)),
        }

    def run(self, op: KVOp[T]) -> T:
        self.ops.append(op)
        return self.answers.get(type(op))  # type: ignore[return-value]

    def submit(self, prompt: Any, params: Any, *, session_id: int) -> RequestHandle:
        self.submitted.append((prompt, params, session_id))
        return RequestHandle("req-recorded")


def test_a_recording_port_is_a_session_port() -> None:
    port: SessionPort = RecordingPort()  # mypy checks the protocol here
    assert port.model_identity == {"name": "recording"}


def test_every_session_method_goes_through_the_port(tmp_path: Path) -> None:
    port = RecordingPort()
    session = Session(port, 3)
    assert session.token_ids == (1, 2, 3)
    handle = session.add_request("hi")
    assert port.submitted == [("hi", None, 3)]
    with pytest.raises(llamax.SessionBusyError):  # its request is still running
        session.rewind(1)
    handle.future.cancel()  # the engine would settle it; here the test does
    session.rewind(1)
    fork = session.fork()
    assert repr(fork) == "<llamax.Session 7>"
    session.save(tmp_path / "s.bin")
    assert (tmp_path / "s.bin").read_bytes().endswith(b"state")
    assert b'"recording"' in (tmp_path / "s.bin").read_bytes()
    assert (
        b'{"name": "tuned", "scale": 0.5, "weights": "f00d"}' in (tmp_path / "s.bin").read_bytes()
    )
    session.close()
    assert session.closed
    assert port.ops == [
        ReadSession(3),
        RewindSession(3, 1),
        ForkSession(3),
        SaveSession(3),
        ReleaseSession(3),
    ]


def test_a_session_is_closed_when_the_port_says_the_context_ended() -> None:
    port = RecordingPort()
    session = Session(port, 0)
    assert not session.closed
    port.ended = True
    assert session.closed
    with pytest.raises(llamax.ContextClosedError):
        session.token_ids  # noqa: B018
    assert port.ops == []


def test_session_touches_no_private_member_of_a_context() -> None:
    """Regression (issue 23): Session read ``ctx._engine`` 7 times, ``ctx._submit`` and
    ``ctx._backend`` once each."""
    tree = ast.parse(inspect.getsource(llamax.session))
    private = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        on_ctx = isinstance(node.value, ast.Name) and node.value.id == "ctx"
        if on_ctx or node.attr in {"_engine", "_backend", "_submit", "_ctx"}:
            private.append(f"line {node.lineno}: .{node.attr}")
    assert not private, private
