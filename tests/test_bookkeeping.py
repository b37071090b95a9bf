"""Randomised add / cancel / step / no-slot / evict / session sequences with shared prefixes
and n > 1, checking KV cells, sequence ids, refcounts and samplers after every operation,
and liveness: every request settles within a bounded number of steps, unless it waits for
room that the sessions the machine holds keep (and then only if it could not run beside
them).

``SplitMachine`` runs at sizes where a step holds 64 decode rows or more, so the unified
layout with CPU attention splits it into several decodes, with n up to 8, failing logits
processors and grammars that reach a dead end. ``pytest -m soak tests/test_bookkeeping.py``
runs every machine ten times longer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import pytest
from adversaries import FlakyProcessor
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import llamax
from llamax.engine.kv import relayout as relayout_module
from llamax.testing import FakeBackend, assert_idle

PREFIXES = ["", "system prompt one. ", "system prompt two, longer than one. "]

LIVENESS_SLACK = 50
"""Steps added to every liveness bound. The bound on a request is this plus twice the
steps that it and every request that may go before it would need one after another, on
one sequence (:attr:`Tracked.work`): an engine that makes progress needs far fewer, one
that spins or starves exceeds it."""


@dataclass
class Tracked:
    """A request the machine submitted."""

    handle: llamax.RequestHandle
    cells: int
    """Prompt tokens plus every choice's new tokens: what it needs to finish alone."""
    submitted: int
    """The machine's step count at submission."""
    may_fail: bool
    """It has a failing processor or a grammar that may reach a dead end."""
    session: llamax.Session | None
    work: int
    """Steps it needs alone on one sequence: each choice's prompt chunks and new tokens."""
    backlog: int
    """The work of the requests unsettled when it was submitted."""
    checked: bool = False


class EngineMachine(RuleBasedStateMachine):
    backend_options: ClassVar[dict[str, object]] = {"n_ctx": 160, "n_seq_max": 5, "n_batch": 16}
    max_n: ClassVar[int] = 3
    max_tokens: ClassVar[int] = 20
    burst_size: ClassVar[int] = 3
    with_failures: ClassVar[bool] = False
    """Add requests with failing processors and dead-end grammars too."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = FakeBackend(**self.backend_options)  # type: ignore[arg-type]
        self.ctx = llamax.Context(backend=self.backend, autostart=False)
        self.tracked: list[Tracked] = []
        self.sessions: list[llamax.Session] = []
        self.steps = 0
        self.num_split_steps = 0

    # ------------------------------------------------------------------ helpers
    def _process(self) -> bool:
        decodes = self.backend.fault_calls["decode"]
        computed = self.ctx.process()
        self.steps += 1
        if self.backend.fault_calls["decode"] - decodes > 1:
            self.num_split_steps += 1
        return computed

    def _submit(
        self,
        prompt: str,
        params: llamax.SamplingParams,
        *,
        priority: int = 0,
        session: llamax.Session | None = None,
    ) -> None:
        if session is None:
            handle = self.ctx.add_request(prompt, params, priority=priority)
        else:
            handle = session.add_request(prompt, params)
        num = len(prompt.encode())
        cells = num + params.n * (params.max_tokens or 0)
        chunks = -(-num // self.backend.n_batch)
        work = params.n * (chunks + (params.max_tokens or 0) + 1)
        may_fail = bool(params.logits_processors) or params.grammar is not None
        backlog = sum(t.work for t in self.tracked if not t.handle.done())
        self.tracked.append(Tracked(handle, cells, self.steps, may_fail, session, work, backlog))

    def _bound(self, t: Tracked) -> int:
        """Steps within which ``t`` must settle: everything that may go before it (those
        unsettled at its submission, and every later one: priorities) one after another."""
        later = sum(u.work for u in self.tracked if u.submitted >= t.submitted)
        return LIVENESS_SLACK + 2 * (t.backlog + later)

    def _params(self, data: st.DataObject, n: int, max_tokens: int) -> llamax.SamplingParams:
        processors: tuple[FlakyProcessor, ...] = ()
        grammar = None
        ignore_eos = False
        if self.with_failures:
            kind = data.draw(st.sampled_from(["plain", "plain", "processor", "grammar"]))
            if kind == "processor":
                processors = (FlakyProcessor(data.draw(st.integers(2, 40))),)
            elif kind == "grammar":  # [ab]{0,3} with ignore_eos: a dead end after 3 tokens
                grammar = data.draw(st.sampled_from(["root ::= [ab]{0,3}", "root ::= [a-z]+"]))
                ignore_eos = data.draw(st.booleans())
        return llamax.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.5,
            seed=1,
            n=n,
            logits_processors=processors,
            grammar=grammar,
            ignore_eos=ignore_eos,
            keep_prefix=data.draw(st.booleans()),  # hinted slots are evicted last
        )

    # ------------------------------------------------------------------ rules
    @rule(
        data=st.data(),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.text(alphabet="xyz", min_size=1, max_size=12),
        priority=st.integers(-1, 1),
    )
    def add(self, data: st.DataObject, prefix: str, suffix: str, priority: int) -> None:
        n = data.draw(st.integers(1, self.max_n))
        max_tokens = data.draw(st.integers(1, self.max_tokens))
        self._submit(prefix + suffix, self._params(data, n, max_tokens), priority=priority)

    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES))
    def burst(self, data: st.DataObject, prefix: str) -> None:
        """Several requests at once, most with the largest n: many decode rows."""
        for i in range(self.burst_size):
            n = data.draw(st.sampled_from([self.max_n, self.max_n, 1]))
            params = self._params(data, n, data.draw(st.integers(1, self.max_tokens)))
            self._submit(f"{prefix}burst {i} {len(self.tracked)}", params)

    @precondition(lambda self: self.tracked)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        self.tracked[index % len(self.tracked)].handle.cancel()

    @rule(num=st.sampled_from([1, 1, 4, 16]))
    def step(self, num: int) -> None:
        for _ in range(num):
            self._process()

    @rule()
    def drain(self) -> None:
        """Run up to the liveness bound; every request that could run must have settled."""
        self._drain_and_check_liveness()

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
        self._submit(prefix + suffix, params, session=session)

    @precondition(lambda self: self.sessions)
    @rule(index=st.integers(0, 10), size=st.integers(1, 120))
    def grow_session(self, index: int, size: int) -> None:
        """A turn that makes a session hold up to most of a small cache."""
        session = self.sessions[index % len(self.sessions)]
        try:
            history = "".join(chr(t - 1) for t in session.token_ids if 0 < t < 257)
            params = llamax.SamplingParams(max_tokens=4, temperature=0)
            self._submit(history + "w" * size, params, session=session)
        except (llamax.SessionBusyError, llamax.InvalidRequestError):
            pass  # its request still runs, or the conversation outgrew n_ctx

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

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting_matches_backend(self) -> None:
        assert self.ctx.audit() == []  # ids, extents, contents, cells and samplers
        stats = self.ctx.stats()
        assert self.backend.num_cells_used == stats.kv_cells_used <= self.backend.facts.n_ctx

    @invariant()
    def requests_settle_in_bounded_steps(self) -> None:
        """No request stays unsettled for more than LIVENESS_STEPS of the machine's steps,
        unless the sessions it holds keep the room it needs."""
        late = [
            t
            for t in self.tracked
            if not t.handle.done() and self.steps - t.submitted > self._bound(t)
        ]
        if late:
            self._check_blocked(late, "unsettled after its bound of steps")

    @invariant()
    def outcomes_are_allowed(self) -> None:
        for t in self.tracked:
            if t.handle.done():
                self._check_outcome(t)

    # ------------------------------------------------------------------ liveness
    def _drain_bound(self) -> int:
        return LIVENESS_SLACK + 2 * sum(t.work for t in self.tracked if not t.handle.done())

    def _drain_and_check_liveness(self) -> None:
        bound = self._drain_bound()
        for _ in range(bound):
            if not self.ctx.has_work():
                break
            self._process()
        unsettled = [t for t in self.tracked if not t.handle.done()]
        if unsettled:
            self._check_blocked(unsettled, f"unsettled after a drain of {bound} steps")

    def _check_blocked(self, unsettled: list[Tracked], why: str) -> None:
        """Each of ``unsettled`` may only be waiting for room that the open sessions hold:
        every sequence id is a session's, or it needs more cells than the sessions leave
        (in a unified cache). A request that fits beside them must not be held up, and
        while only such waiting requests are left the engine must not compute (spin).
        Waiting requests start a new bound."""
        unified = self.backend.is_unified
        held = {session: len(session.token_ids) for session in self.sessions}
        pinned = sum(held.values()) if unified else 0  # forks share cells: counted twice
        free_ids = self.backend.facts.n_seq_max - len(self.sessions)
        room = self.backend.facts.n_ctx if unified else self.backend.facts.n_ctx_seq

        def blocked(t: Tracked) -> bool:
            if not self.sessions:
                return False
            if t.session is not None:  # its own session's cells are its own
                return t.cells > room - (pinned - held.get(t.session, 0) if unified else 0)
            return free_ids == 0 or t.cells > room - pinned

        held_up = [t for t in unsettled if not blocked(t)]
        assert not held_up, (
            f"{why}: {len(held_up)} requests that fit beside the {len(self.sessions)} "
            f"sessions ({pinned} cells, {free_ids} free ids) are held up: "
            + ", ".join(f"{t.handle!r} needing {t.cells} cells" for t in held_up[:4])
        )
        if self.ctx.stats().num_running == 0:
            assert not self._process(), f"{why}: the engine computes while nothing can run"
        backlog = sum(t.work for t in self.tracked if not t.handle.done())
        for t in unsettled:
            t.submitted, t.backlog = self.steps, backlog

    def _check_outcome(self, t: Tracked) -> None:
        """A settled request ended as allowed (checked once: its event stream is read)."""
        if t.checked:
            return
        t.checked = True
        try:
            done = t.handle.result(0)
        except llamax.LlamaxError as exc:
            # a failing processor or grammar; or (issue 22, item 3) a request that cannot
            # fit beside the pinned sessions, with a typed error that names them
            explained = t.may_fail and isinstance(exc, llamax.RequestFailedError)
            assert explained or "session" in str(exc), f"{t.handle!r} ended with {exc!r}"
            return
        for choice in done.choices:
            assert choice.finish_reason in ("length", "stop", "cancelled"), choice
            if not t.may_fail:
                assert choice.finish_reason in ("length", "cancelled"), choice
        assert done.text == "".join(e.text for e in t.handle if e.index == 0)

    def teardown(self) -> None:
        try:
            self.backend.forced_statuses.clear()
            self._drain_and_check_liveness()  # with the sessions still open
            for session in self.sessions:
                session.close()
            self.sessions = []
            for _ in range(self._drain_bound()):
                if not self.ctx.has_work():
                    break
                self._process()
            for t in self.tracked:
                assert t.handle.done(), f"{t.handle!r} never settled after its sessions closed"
                self._check_outcome(t)
            assert_idle(self.ctx, timeout=0)
        finally:
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
        self._cooldown = relayout_module.RELAYOUT_COOLDOWN_STEPS
        relayout_module.RELAYOUT_COOLDOWN_STEPS = 2

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            relayout_module.RELAYOUT_COOLDOWN_STEPS = self._cooldown


class FailureMachine(EngineMachine):
    """The small unified cache with failing processors and dead-end grammars."""

    with_failures = True


class SplitMachine(EngineMachine):
    """Steps of 64 decode rows or more: the unified layout with CPU attention splits them
    into several decodes (:meth:`llamax.engine.sched.scheduler.Scheduler.split`). Bursts of requests
    with n up to 8, failing processors and dead-end grammars, so a request fails in one
    part of a split step while its siblings are in another."""

    backend_options: ClassVar[dict[str, object]] = {
        "n_ctx": 4096,
        "n_seq_max": 80,
        "n_batch": 128,
        "cpu_attention": True,
    }
    max_n = 8
    max_tokens = 24
    burst_size = 10
    with_failures = True


LONG = os.environ.get("LLAMAX_LONG_BOOKKEEPING") == "1"
_scale = 10 if LONG else 1
EngineMachine.TestCase.settings = settings(
    max_examples=100 * _scale, stateful_step_count=40, deadline=None
)
StreamsMachine.TestCase.settings = settings(
    max_examples=60 * _scale, stateful_step_count=40, deadline=None
)
AutoMachine.TestCase.settings = settings(
    max_examples=60 * _scale, stateful_step_count=40, deadline=None
)
FailureMachine.TestCase.settings = settings(
    max_examples=60 * _scale, stateful_step_count=40, deadline=None
)
SplitMachine.TestCase.settings = settings(
    max_examples=25 * _scale, stateful_step_count=25, deadline=None
)
TestEngineMachine = EngineMachine.TestCase
TestStreamsMachine = StreamsMachine.TestCase
TestAutoMachine = AutoMachine.TestCase
TestFailureMachine = FailureMachine.TestCase
TestSplitMachine = SplitMachine.TestCase


def test_split_machine_sizes_split_steps() -> None:
    """The SplitMachine's sizes do split steps: a burst of n=8 requests decodes in parts."""
    backend = FakeBackend(**SplitMachine.backend_options)  # type: ignore[arg-type]
    ctx = llamax.Context(backend=backend, autostart=False)
    try:
        params = llamax.SamplingParams(max_tokens=24, temperature=0.5, seed=1, n=8)
        handles = [ctx.add_request(f"burst {i}", params) for i in range(10)]
        most = 0
        while ctx.has_work():
            before = backend.fault_calls["decode"]
            ctx.process()
            most = max(most, backend.fault_calls["decode"] - before)
        assert most >= 2, "no step of 80 decode rows was split"
        assert all(len(h.result(0).choices) == 8 for h in handles)
        assert_idle(ctx, timeout=0)
    finally:
        ctx.close()


@pytest.mark.soak
def test_long_bookkeeping_runs_in_a_child() -> None:
    """``-m soak``: every machine at ten times the examples (LLAMAX_LONG_BOOKKEEPING=1)."""
    import subprocess
    import sys

    env = dict(os.environ, LLAMAX_LONG_BOOKKEEPING="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-m",
            "not soak",
        ],
        env=env,
        check=False,
        timeout=3600,
    )
    assert done.returncode == 0
