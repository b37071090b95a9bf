"""A Hypothesis state machine over add / cancel / process / session open, fork, rewind,
shift and close / context close, checking the scheduler's invariants after every step:
``ctx.audit() == []`` and no leaked sequence id
(``num_running + num_retained + num_sessions + num_free_seq_ids == n_seq_max``, where a
running session request holds its session's id, so each busy session may count twice);
at teardown every handle has settled."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import llamax
from llamax.testing import FakeBackend, assert_idle

#: Errors a rule may meet on purpose: a busy or full session table, an out-of-range span.
EXPECTED = (llamax.SessionError, llamax.InvalidParameterError, llamax.ContextLengthError)


class SessionMachine(RuleBasedStateMachine):
    backend_options: ClassVar[dict[str, object]] = {"n_ctx": 200, "n_seq_max": 5, "n_batch": 16}

    def __init__(self) -> None:
        super().__init__()
        self.backend = FakeBackend(**self.backend_options)  # type: ignore[arg-type]
        self.ctx = llamax.Context(backend=self.backend, autostart=False)
        self.handles: list[llamax.RequestHandle] = []
        self.session_handles: list[llamax.RequestHandle] = []
        self.sessions: list[llamax.Session] = []
        self.closed = False

    def _live_sessions(self) -> list[llamax.Session]:
        return [s for s in self.sessions if not s.closed]

    @precondition(lambda self: not self.closed)
    @rule(
        prompt=st.text(alphabet="abc", min_size=1, max_size=10),
        max_tokens=st.integers(1, 8),
        n=st.integers(1, 2),
    )
    def add(self, prompt: str, max_tokens: int, n: int) -> None:
        params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0.5, seed=3, n=n)
        self.handles.append(self.ctx.add_request("shared " + prompt, params))

    @precondition(lambda self: not self.closed and self._live_sessions())
    @rule(index=st.integers(0, 100), text=st.text(alphabet="xy", min_size=1, max_size=6))
    def session_request(self, index: int, text: str) -> None:
        live = self._live_sessions()
        try:
            handle = live[index % len(live)].add_request(text, llamax.SamplingParams(max_tokens=4))
        except EXPECTED:
            return
        self.handles.append(handle)
        self.session_handles.append(handle)

    @precondition(lambda self: self.handles)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        self.handles[index % len(self.handles)].cancel()

    @precondition(lambda self: not self.closed)
    @rule()
    def process(self) -> None:
        self.ctx.process()

    @precondition(lambda self: not self.closed)
    @rule()
    def open_session(self) -> None:
        with contextlib.suppress(EXPECTED):
            self.sessions.append(self.ctx.session())

    @precondition(lambda self: not self.closed and self._live_sessions())
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        live = self._live_sessions()
        with contextlib.suppress(EXPECTED):
            self.sessions.append(live[index % len(live)].fork())

    @precondition(lambda self: not self.closed and self._live_sessions())
    @rule(index=st.integers(0, 100), num=st.integers(0, 30))
    def rewind(self, index: int, num: int) -> None:
        live = self._live_sessions()
        with contextlib.suppress(EXPECTED):
            live[index % len(live)].rewind(num)

    @precondition(lambda self: not self.closed and self._live_sessions())
    @rule(index=st.integers(0, 100), start=st.integers(0, 20), length=st.integers(0, 10))
    def shift(self, index: int, start: int, length: int) -> None:
        live = self._live_sessions()
        with contextlib.suppress(EXPECTED):
            live[index % len(live)].shift(start, start + length)

    @precondition(lambda self: self._live_sessions())
    @rule(index=st.integers(0, 100))
    def close_session(self, index: int) -> None:
        live = self._live_sessions()
        live[index % len(live)].close()

    @precondition(lambda self: not self.closed)
    @rule()
    def refuse_next_decode(self) -> None:
        self.backend.forced_statuses.append(1)

    @precondition(lambda self: not self.closed)
    @rule()
    def close_context(self) -> None:
        self.backend.forced_statuses.clear()
        self.ctx.close()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule()
    def add_after_close(self) -> None:
        try:
            self.ctx.add_request("late")
        except llamax.ContextClosedError:
            return
        raise AssertionError("a closed context accepted a request")

    @invariant()
    def bookkeeping_holds(self) -> None:
        if self.closed:
            return
        assert self.ctx.audit() == []
        stats = self.ctx.stats()
        held = stats.num_running + stats.num_retained + stats.num_sessions
        busy_sessions = sum(not h.done() for h in self.session_handles)
        assert held - busy_sessions <= self.ctx.n_seq_max - stats.num_free_seq_ids <= held, stats
        if not busy_sessions:
            assert held + stats.num_free_seq_ids == self.ctx.n_seq_max, stats
        assert self.backend.num_cells_used == stats.kv_cells_used <= self.backend.n_ctx

    def teardown(self) -> None:
        self.backend.forced_statuses.clear()
        if not self.closed:
            while self.ctx.has_work():
                self.ctx.process()
        for handle in self.handles:
            assert handle.done(), f"{handle!r} never settled"
            try:
                done = handle.result(0)
            except llamax.RequestFailedError:
                continue
            for choice in done.choices:
                assert choice.finish_reason in ("length", "stop", "cancelled")
        for session in self.sessions:
            session.close()
        if not self.closed:
            assert_idle(self.ctx, timeout=0)
        self.ctx.close()
        assert self.ctx.stats().num_unsettled == 0


SessionMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSessionMachine = pytest.mark.skip(
    reason="hangs intermittently (found 2026-11-23, not yet diagnosed): run by hand with "
    "-o faulthandler_timeout=30 to see where; see the misuse branch report"
)(SessionMachine.TestCase)
