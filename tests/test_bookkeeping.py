"""Randomised add / cancel / step / no-slot sequences, checking KV and id accounting each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import llamax
from llamax.testing import FakeBackend, assert_idle


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.backend = FakeBackend(n_ctx=96, n_seq_max=4, n_batch=16)
        self.ctx = llamax.Context(backend=self.backend, autostart=False)
        self.handles: list[llamax.RequestHandle] = []

    @rule(
        prompt_len=st.integers(1, 40),
        max_tokens=st.integers(1, 30),
        priority=st.integers(-1, 1),
    )
    def add(self, prompt_len: int, max_tokens: int, priority: int) -> None:
        params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0)
        self.handles.append(self.ctx.add_request("q" * prompt_len, params, priority=priority))

    @precondition(lambda self: self.handles)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        self.handles[index % len(self.handles)].cancel()

    @rule()
    def step(self) -> None:
        self.ctx.process()

    @rule(status=st.just(1))
    def refuse_next_decode(self, status: int) -> None:
        self.backend.forced_statuses.append(status)

    @invariant()
    def accounting_matches_backend(self) -> None:
        scheduler = self.ctx._engine.scheduler
        assert self.backend.num_cells_used == scheduler.num_cells_in_use
        assert scheduler.num_cells_in_use <= self.backend.n_ctx
        assert scheduler.num_running + scheduler.num_free_seq_ids == self.backend.n_seq_max
        for seq in scheduler.all_sequences():
            if seq.seq_id is None:
                assert seq.num_computed == 0
            else:
                assert len(self.backend.cells[seq.seq_id]) == seq.num_computed
        assert self.backend.num_live_samplers == scheduler.num_running + sum(
            1 for s in scheduler.all_sequences() if s.seq_id is None and s.sampler is not None
        )

    def teardown(self) -> None:
        self.backend.forced_statuses.clear()
        while self.ctx.has_work():
            self.ctx.process()
        assert all(h.done() for h in self.handles)
        for handle in self.handles:
            done = handle.result(0)
            assert done.finish_reason in ("length", "cancelled")
            assert done.text == "".join(e.text for e in handle)
        assert_idle(self.ctx, timeout=0)
        self.ctx.close()


EngineMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestEngineMachine = EngineMachine.TestCase
