"""Randomised add / cancel / step / no-slot / evict sequences with shared prefixes and n > 1,
checking KV cells, sequence ids, refcounts and samplers after every operation."""

from __future__ import annotations

from typing import ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import llamax
from llamax import scheduler as scheduler_module
from llamax.testing import FakeBackend, assert_idle

PREFIXES = ["", "system prompt one. ", "system prompt two, longer than one. "]


class EngineMachine(RuleBasedStateMachine):
    backend_options: ClassVar[dict[str, object]] = {"n_ctx": 160, "n_seq_max": 5, "n_batch": 16}

    def __init__(self) -> None:
        super().__init__()
        self.backend = FakeBackend(**self.backend_options)  # type: ignore[arg-type]
        self.ctx = llamax.Context(backend=self.backend, autostart=False)
        self.handles: list[llamax.RequestHandle] = []
        self.sessions: list[llamax.Session] = []

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.text(alphabet="xyz", min_size=1, max_size=12),
        max_tokens=st.integers(1, 20),
        n=st.integers(1, 3),
        priority=st.integers(-1, 1),
    )
    def add(self, prefix: str, suffix: str, max_tokens: int, n: int, priority: int) -> None:
        params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0.5, seed=1, n=n)
        self.handles.append(self.ctx.add_request(prefix + suffix, params, priority=priority))

    @precondition(lambda self: self.handles)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        self.handles[index % len(self.handles)].cancel()

    @rule()
    def step(self) -> None:
        self.ctx.process()

    @rule()
    def refuse_next_decode(self) -> None:
        self.backend.forced_statuses.append(1)

    @rule()
    def clear_cache(self) -> None:
        self.ctx.clear_cache()

    @precondition(lambda self: len(self.sessions) < 2)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.text(alphabet="xyz", min_size=1, max_size=8))
    def open_session(self, prefix: str, suffix: str) -> None:
        try:
            session = self.ctx.session()
        except llamax.SessionError:  # every sequence id is held
            return
        self.sessions.append(session)
        params = llamax.SamplingParams(max_tokens=4, temperature=0)
        self.handles.append(session.add_request(prefix + suffix, params))

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 10), num=st.integers(0, 20), fork=st.booleans())
    def rewind_or_fork(self, index: int, num: int, fork: bool) -> None:
        session = self.sessions[index % len(self.sessions)]
        try:
            if fork:
                self.sessions.append(session.fork())
            else:
                session.rewind(min(num, len(session.token_ids)))
        except (llamax.SessionBusyError, llamax.SessionError):
            pass  # a request of the session still runs, or no sequence id is free

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 10))
    def close_session(self, index: int) -> None:
        self.sessions.pop(index % len(self.sessions)).close()

    @invariant()
    def accounting_matches_backend(self) -> None:
        assert self.ctx.audit() == []  # ids, extents, contents, cells and samplers
        stats = self.ctx.stats()
        assert self.backend.num_cells_used == stats.kv_cells_used <= self.backend.n_ctx

    def teardown(self) -> None:
        self.backend.forced_statuses.clear()
        for session in self.sessions:
            session.close()
        while self.ctx.has_work():
            self.ctx.process()
        for handle in self.handles:
            try:
                done = handle.result(0)
            except llamax.KVCapacityError as exc:  # sessions held every id or the room
                assert "session" in str(exc)
                continue
            for choice in done.choices:
                assert choice.finish_reason in ("length", "cancelled")
            assert done.text == "".join(e.text for e in handle if e.index == 0)
        assert_idle(self.ctx, timeout=0)
        self.ctx.close()


class StreamsMachine(EngineMachine):
    """The same with one KV stream of 160 cells per sequence."""

    backend_options: ClassVar[dict[str, object]] = {
        "n_ctx": 800,
        "n_seq_max": 5,
        "n_batch": 16,
        "kv_layout": "streams",
    }


class AutoMachine(EngineMachine):
    """The same with ``kv_layout="auto"``: streams of 32 cells, so most prompts move the
    cache to the unified layout, and (with a 2-step cooldown) back to streams often."""

    backend_options: ClassVar[dict[str, object]] = {
        "n_ctx": 160,
        "n_seq_max": 5,
        "n_batch": 16,
        "kv_layout": "auto",
    }

    def __init__(self) -> None:
        super().__init__()
        self._cooldown = scheduler_module.RELAYOUT_COOLDOWN_STEPS
        scheduler_module.RELAYOUT_COOLDOWN_STEPS = 2

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            scheduler_module.RELAYOUT_COOLDOWN_STEPS = self._cooldown


EngineMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
StreamsMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
AutoMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestEngineMachine = EngineMachine.TestCase
TestStreamsMachine = StreamsMachine.TestCase
TestAutoMachine = AutoMachine.TestCase
