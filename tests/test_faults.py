"""Fault injection through the fake backend: decode statuses and exceptions at random
steps, failing tokenizers and samplers, under many requests from several threads.

Every request must end with a result, a cancellation or a typed error (never hang), and
the engine must either survive (NO_SLOT is retried; a failing sampler or tokenizer fails
one request) or fail every pending request cleanly (context closed, every future settled,
new requests refused with ContextClosedError).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
TIMEOUT = 30.0


class Injector:
    """A seeded ``FakeBackend.fault``: with ``chance`` per call of ``where``, do ``fault``
    (a decode status to return, or ``"raise"``); ``fatal_at`` fires once on that call."""

    def __init__(
        self,
        backend: FakeBackend,
        seed: int,
        *,
        where: str = "decode",
        chance: float = 0.0,
        fault: int | str = 1,
        fatal_at: int | None = None,
        fatal: int | str = -1,
    ) -> None:
        self.backend, self.rng, self.where = backend, random.Random(seed), where
        self.chance, self.fault, self.fatal_at, self.fatal = chance, fault, fatal_at, fatal
        self.calls = 0
        self.injected = 0
        backend.fault = self

    def __call__(self, where: str) -> None:
        if where != self.where:
            return
        self.calls += 1
        if self.calls == self.fatal_at:
            self._do(self.fatal)
        elif self.rng.random() < self.chance:
            self._do(self.fault)

    def _do(self, fault: int | str) -> None:
        self.injected += 1
        if fault == "raise":
            raise RuntimeError(f"injected failure in {self.where}")
        assert isinstance(fault, int)
        self.backend.forced_statuses.append(fault)


def _params(rng: random.Random) -> llamax.SamplingParams:
    return llamax.SamplingParams(
        max_tokens=rng.randint(1, 12),
        temperature=rng.choice([0.0, 0.7]),
        n=rng.choice([1, 1, 2]),
        seed=rng.randrange(1000),
        stop=rng.choice([(), ("q",)]),
        logprobs=rng.choice([None, 2]),
    )


def _load(
    ctx: llamax.Context, seed: int, *, num_threads: int = 6, per_thread: int = 30
) -> tuple[list[llamax.RequestHandle], list[BaseException]]:
    """Submit from ``num_threads`` threads, cancelling a quarter at random."""
    handles: list[llamax.RequestHandle] = []
    refused: list[BaseException] = []
    lock = threading.Lock()

    def work(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        for i in range(per_thread):
            prompt = rng.choice(["shared prefix ", "", "other "]) + f"t{index} r{i}"
            try:
                handle = ctx.add_request(prompt, _params(rng), priority=rng.randint(-1, 1))
            except llamax.LlamaxError as exc:
                with lock:
                    refused.append(exc)
                continue
            with lock:
                handles.append(handle)
            if rng.random() < 0.25:
                handle.cancel()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "a submitting thread hung"
    return handles, refused


def _outcomes(handles: list[llamax.RequestHandle]) -> Counter[str]:
    """Wait for every handle (bounded); count how each ended. Untyped errors fail the test."""
    counts: Counter[str] = Counter()
    for handle in handles:
        try:
            done = handle.result(timeout=TIMEOUT)
        except TimeoutError:
            pytest.fail(f"{handle!r} never settled")
        except llamax.LlamaxError as exc:
            counts[type(exc).__name__] += 1
            continue
        reasons = {choice.finish_reason for choice in done.choices}
        assert reasons <= {"length", "stop", "cancelled"}, reasons
        counts["cancelled" if "cancelled" in reasons else "done"] += 1
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_slot_at_random_steps_is_retried(make_fake: MakeFake, seed: int) -> None:
    ctx, backend = make_fake(autostart=True, n_ctx=512, n_seq_max=6, n_batch=32)
    injector = Injector(backend, seed, chance=0.3, fault=1)
    handles, refused = _load(ctx, seed)
    counts = _outcomes(handles)
    assert not refused
    assert injector.injected > 10
    assert set(counts) <= {"done", "cancelled"}, counts
    assert counts["done"] > 0
    assert not ctx.closed
    assert_idle(ctx)
    assert backend.num_live_samplers == 0


@pytest.mark.parametrize("fatal", [2, -1, -3, "raise"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fatal_decode_fails_every_pending_request(
    make_fake: MakeFake, fatal: int | str, seed: int
) -> None:
    ctx, backend = make_fake(autostart=True, n_ctx=512, n_seq_max=6, n_batch=32)
    fatal_at = random.Random(seed).randint(3, 40)
    Injector(backend, seed, chance=0.2, fault=1, fatal_at=fatal_at, fatal=fatal)
    handles, refused = _load(ctx, seed)
    counts = _outcomes(handles)
    assert set(counts) <= {"done", "cancelled", "EngineError"}, counts
    assert counts["EngineError"] > 0 or refused
    assert all(isinstance(exc, llamax.ContextClosedError) for exc in refused), refused
    _assert_failed_cleanly(ctx, backend)


@pytest.mark.parametrize("fatal", [-1, "raise"])
def test_fatal_decode_in_manual_process(make_fake: MakeFake, fatal: int | str) -> None:
    ctx, backend = make_fake(n_ctx=512, n_seq_max=4, n_batch=16)
    Injector(backend, 7, fatal_at=5, fatal=fatal)
    handles = [
        ctx.add_request(f"prompt {i}", llamax.SamplingParams(max_tokens=20)) for i in range(8)
    ]
    with pytest.raises(llamax.EngineError):
        for _ in range(200):
            ctx.process()
    counts = _outcomes(handles)
    assert counts == {"EngineError": 8}
    _assert_failed_cleanly(ctx, backend)
    with pytest.raises(llamax.ContextClosedError):
        ctx.process()


def _assert_failed_cleanly(ctx: llamax.Context, backend: FakeBackend) -> None:
    assert ctx.closed
    with pytest.raises(llamax.ContextClosedError):
        ctx.add_request("after the failure")
    with pytest.raises(llamax.ContextClosedError):
        ctx.session()
    stats = ctx.stats()
    assert stats.num_unsettled == 0, stats
    assert stats.num_running == stats.num_waiting == 0, stats
    assert backend.closed
    assert backend.num_live_samplers == 0


@pytest.mark.parametrize("where", ["new_sampler", "tokenize"])
def test_failing_sampler_or_tokenizer_fails_one_request(make_fake: MakeFake, where: str) -> None:
    ctx, backend = make_fake(autostart=True, n_ctx=512, n_seq_max=6, n_batch=32)
    injector = Injector(backend, 3, where=where, chance=0.2, fault="raise")
    handles, refused = _load(ctx, 3)
    counts = _outcomes(handles)
    assert injector.injected > 0
    if where == "tokenize":
        assert refused and all(isinstance(e, llamax.RequestFailedError) for e in refused)
        assert set(counts) <= {"done", "cancelled"}, counts
    else:
        assert not refused
        assert set(counts) <= {"done", "cancelled", "RequestFailedError"}, counts
        assert counts["RequestFailedError"] > 0
    backend.fault = None
    assert not ctx.closed
    ctx.add_request("still serving", llamax.SamplingParams(max_tokens=3)).result(TIMEOUT)
    assert_idle(ctx)
    assert backend.num_live_samplers == 0


def test_faults_in_sessions_and_cancels_keep_bookkeeping(make_fake: MakeFake) -> None:
    """NO_SLOT and sampler failures while sessions fork and rewind; the audit stays clean."""
    ctx, backend = make_fake(n_ctx=512, n_seq_max=5, n_batch=16)
    rng = random.Random(11)
    decode = Injector(backend, 11, chance=0.3, fault=1)
    handles: list[llamax.RequestHandle] = []
    with ctx.session() as session:
        for i in range(20):
            backend.fault = decode if rng.random() < 0.7 else _sampler_failure
            handles.append(session.add_request(f"turn {i} ", llamax.SamplingParams(max_tokens=4)))
            handles.append(ctx.add_request(f"side {i}", llamax.SamplingParams(max_tokens=6)))
            if rng.random() < 0.3:
                handles[-1].cancel()
            while ctx.has_work():
                ctx.process()
            assert ctx.audit() == []
            if session.token_ids and rng.random() < 0.3:
                session.rewind(rng.randint(0, len(session.token_ids)))
    backend.fault = None
    counts = _outcomes(handles)
    assert set(counts) <= {"done", "cancelled", "RequestFailedError"}, counts
    assert_idle(ctx)


def _sampler_failure(where: str) -> None:
    if where == "new_sampler":
        raise RuntimeError("injected sampler failure")


def _raising_processor(token_ids: object, logits: object) -> None:
    raise ValueError("injected logits processor failure")


@pytest.mark.parametrize("kind", ["logits_processor", "sampler"])
def test_failed_session_request_leaves_no_unrecorded_cells(make_fake: MakeFake, kind: str) -> None:
    """Regression: a session request failing while its row was sampled left the decoded
    prompt cells in the backend, unrecorded by the session's pinned slot (audit mismatch,
    and the next decode of the session would start at the wrong position)."""
    ctx, backend = make_fake()
    with ctx.session() as session:
        session.add_request("ab", llamax.SamplingParams(max_tokens=2)).result()
        if kind == "sampler":
            backend.fault = _sampler_failure
            params = llamax.SamplingParams(max_tokens=3)
        else:
            params = llamax.SamplingParams(max_tokens=3, logits_processors=[_raising_processor])
        with pytest.raises(llamax.RequestFailedError):
            session.add_request("cd", params).result()
        backend.fault = None
        assert ctx.audit() == []
        done = session.add_request("ef", llamax.SamplingParams(max_tokens=3)).result()
        assert done.choices[0].finish_reason == "length"
        assert ctx.audit() == []
