"""Fault injection through the fake backend: decode statuses and exceptions at random
steps, failing tokenizers and samplers, under many requests from several threads.

Every request must end with a result, a cancellation or a typed error (never hang), and
the engine must either survive (NO_SLOT is retried; a failing sampler or tokenizer fails
one request) or fail every pending request cleanly (context closed, every future settled,
new requests refused with ContextClosedError).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from adversaries import FlakyProcessor
from vision_files import pixels, png

import llamax
from llamax import SamplingParams
from llamax.backend.base import DecodeStatus
from llamax.testing import FAULT_POINTS, FakeBackend, assert_idle

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


def test_a_failed_engine_shows_no_running_sequence_once_a_request_settles(
    make_fake: MakeFake,
) -> None:
    """A request failed by a fatal step settles only once the stats say no sequence runs
    or waits and the backend is closed: a thread woken by the settled future reads the
    engine as it is (the stats were republished only at teardown, after the futures, so a
    reader could see the last step's running sequences; CI saw ``num_running=6,
    num_waiting=103``; and the backend was freed after the futures settled, so a reader
    under load once saw a closed context whose backend was still open)."""
    ctx, backend = make_fake(n_ctx=512, n_seq_max=4, n_batch=16)  # stepped here: no race
    Injector(backend, 7, fatal_at=5, fatal="raise")
    seen: list[tuple[int, int, bool]] = []

    def look(_: object) -> None:  # runs as the future settles
        stats = ctx.stats()
        seen.append((stats.num_running, stats.num_waiting, backend.closed))

    handles = [
        ctx.add_request(f"prompt {i}", llamax.SamplingParams(max_tokens=20)) for i in range(8)
    ]
    for handle in handles:
        handle.future.add_done_callback(look)
    with pytest.raises(llamax.EngineError):
        for _ in range(200):
            ctx.process()
    assert _outcomes(handles) == {"EngineError": 8}
    assert seen == [(0, 0, True)] * 8
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


def _assert_failed_cleanly(
    ctx: llamax.Context, backend: FakeBackend, *, leaked_samplers_ok: bool = False
) -> None:
    assert ctx.closed
    with pytest.raises(llamax.ContextClosedError):
        ctx.add_request("after the failure")
    with pytest.raises(llamax.ContextClosedError):
        ctx.session()
    stats = ctx.stats()
    assert stats.num_unsettled == 0, stats
    assert stats.num_running == stats.num_waiting == 0, stats
    assert backend.closed
    assert leaked_samplers_ok or backend.num_live_samplers == 0


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


# ---------------------------------------------------------------------------------------
# Every backend call, under a mixed load: sessions, n > 1, grammars, logits processors,
# speculation, relayouts and cancels from several threads.

MIXED_TIMEOUT = 60.0
"""Bound on how long any one request may take to settle (the load needs ~1 s)."""


class InjectedFault(Exception):
    """What a :class:`PointInjector` raises: told apart from the fake's own assertions."""


class PointInjector:
    """A seeded ``FakeBackend.fault`` for one fault point: after ``warmup`` calls there,
    each call fails with ``chance`` (at most ``limit`` times), by raising
    :class:`InjectedFault` or, with ``status``, by returning it (a failing decode status,
    or False from ``seq_rm``/``state_seq_set``)."""

    def __init__(
        self,
        where: str,
        seed: int,
        *,
        status: object = None,
        warmup: int = 0,
        chance: float = 0.05,
        limit: int = 1_000_000,
    ) -> None:
        self.where, self.rng, self.status = where, random.Random(seed), status
        self.warmup, self.chance, self.limit = warmup, chance, limit
        self.calls = 0
        self.injected = 0

    def __call__(self, where: str) -> object:
        if where != self.where:
            return None
        self.calls += 1
        if self.calls <= self.warmup or self.injected >= self.limit:
            return None
        if self.rng.random() >= self.chance:
            return None
        self.injected += 1
        if self.status is None:
            raise InjectedFault(f"injected failure in {where} (call {self.calls})")
        return self.status


ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def mixed_params(rng: random.Random, *, max_output: int = 24, max_n: int = 4) -> SamplingParams:
    """Random params using every feature the engine has that the fake honours."""
    grammar = None
    if rng.random() < 0.2:
        grammar = rng.choice(["root ::= [a-m]{0,6}", "root ::= [b-z]+", "root ::= [ab]{0,3}"])
    processors = (FlakyProcessor(rng.randint(5, 40)),) if rng.random() < 0.15 else ()
    return SamplingParams(
        max_tokens=rng.randint(1, max_output),
        temperature=rng.choice([0.0, 0.0, 0.8]),
        n=rng.choice([1, 1, 2, max_n]),
        seed=rng.randrange(1000),
        stop=rng.choice([(), ("q",), ("xyz",)]),
        logprobs=rng.choice([None, None, 2]),
        ignore_eos=rng.random() < 0.3,
        grammar=grammar,
        logits_processors=processors,
        speculative=rng.choice([None, True, False]),
    )


def mixed_prompt(rng: random.Random, tag: str) -> str:
    """Shared prefixes (prefix cache), alphabet runs (prompt lookup drafts), and prompts of
    up to ~150 tokens (streams of 128 cells: relayouts)."""
    start = rng.randrange(26)
    run = (ALPHABET[start:] + ALPHABET)[: rng.randint(0, 40)]
    return rng.choice(["", "shared system prompt. ", "x" * rng.randint(0, 110)]) + run + tag


@dataclass
class MixedRun:
    """What a mixed load did."""

    handles: list[llamax.RequestHandle] = field(default_factory=list)
    refused: list[BaseException] = field(default_factory=list)
    session_errors: Counter[str] = field(default_factory=Counter)
    session_turns: int = 0
    unexpected: list[BaseException] = field(default_factory=list)


def mixed_load(
    ctx: llamax.Context,
    seed: int,
    tmp: Path,
    *,
    num_threads: int = 4,
    per_thread: int = 40,
    max_output: int = 24,
    max_n: int = 4,
    cancel_chance: float = 0.25,
    images: bool | None = None,
) -> MixedRun:
    """Requests and session operations from ``num_threads`` threads at once; on a context
    that sees images (default: whether ``ctx`` does), some prompts hold one."""
    images = ctx.sees_images if images is None else images
    run = MixedRun()
    lock = threading.Lock()

    def note(exc: BaseException) -> None:
        with lock:
            if isinstance(exc, (llamax.LlamaxError, InjectedFault)):
                run.session_errors[type(exc).__name__] += 1
            else:
                run.unexpected.append(exc)

    def session_turn(rng: random.Random, session: llamax.Session, k: int) -> llamax.Session:
        """One turn on ``session`` plus a random KV operation; returns the session to use
        next (a loaded copy replaces a saved one)."""
        history = "".join(map(chr, (t - 1 for t in session.token_ids if 0 < t < 257)))
        params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0, ignore_eos=True)
        handle = session.add_request(
            history + f" turn {k} " + ALPHABET[: rng.randint(0, 12)], params
        )
        with lock:
            run.handles.append(handle)
            run.session_turns += 1
        with contextlib.suppress(llamax.LlamaxError):  # counted with the other handles
            handle.result(timeout=MIXED_TIMEOUT)
        action = rng.choice(["rewind", "fork", "shift", "save", "save"])
        held = len(session.token_ids)
        if action == "rewind" and held:
            session.rewind(rng.randint(0, held))
        elif action == "fork":
            with session.fork() as fork:
                if rng.random() < 0.5:
                    fork.rewind(min(held, 3))
                elif held:  # saved at once: between streams its copy is still queued
                    fork.save(tmp / f"f{k}-{rng.randrange(10**9)}.llamax")
        elif action == "shift" and held > 4:
            session.shift(1, rng.randint(2, held - 1))
        elif action == "save" and held:
            path = tmp / f"s{k}-{rng.randrange(10**9)}.llamax"
            session.save(path)
            loaded = llamax.Session.load(ctx, path)
            session.close()
            return loaded
        return session

    def work(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        session: llamax.Session | None = None
        try:
            for i in range(per_thread):
                if rng.random() < 0.3:
                    try:
                        if session is None or session.closed:
                            session = ctx.session()
                        session = session_turn(rng, session, i)
                    except BaseException as exc:  # sorted by note()
                        note(exc)
                    continue
                prompt: str | list[str | llamax.Image] = mixed_prompt(rng, f" t{index} r{i}")
                if images and rng.random() < 0.15:  # an image, often one of three (hits)
                    which = rng.randrange(3) if rng.random() < 0.5 else rng.randrange(10**6)
                    image = llamax.Image(png(pixels(which, 4, 5)))
                    prompt = [str(prompt), image, f" what is it? {i}"]
                try:
                    handle = ctx.add_request(
                        prompt, mixed_params(rng, max_output=max_output, max_n=max_n)
                    )
                except llamax.LlamaxError as exc:
                    with lock:
                        run.refused.append(exc)
                    continue
                with lock:
                    run.handles.append(handle)
                if rng.random() < cancel_chance:
                    handle.cancel()
        finally:
            if session is not None:
                try:
                    session.close()
                except BaseException as exc:  # sorted by note()
                    note(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(MIXED_TIMEOUT)
        assert not thread.is_alive(), (
            "a submitting thread hung (a request or an operation never returned)"
        )
    return run


def settle(handles: list[llamax.RequestHandle]) -> tuple[Counter[str], list[BaseException]]:
    """Wait (bounded) for every handle; count how each ended and keep the errors."""
    counts: Counter[str] = Counter()
    errors: list[BaseException] = []
    for handle in handles:
        try:
            done = handle.result(timeout=MIXED_TIMEOUT)
        except TimeoutError:
            pytest.fail(f"{handle!r} never settled")
        except llamax.LlamaxError as exc:
            counts[type(exc).__name__] += 1
            errors.append(exc)
            continue
        reasons = {choice.finish_reason for choice in done.choices}
        assert reasons <= {"length", "stop", "cancelled"}, reasons
        counts["cancelled" if "cancelled" in reasons else "done"] += 1
    return counts, errors


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def _is_injected(exc: BaseException, status: object) -> bool:
    """Whether an engine failure was caused by the injected fault (not by a bookkeeping
    error that the fake caught, such as a decode at the wrong position)."""
    for cause in _causes(exc):
        if isinstance(cause, InjectedFault):
            return True
        if isinstance(cause, AssertionError):
            return False
    return status is not None  # a failing status: the engine's own error names it


# (where, status): None raises; a value is returned as the failing status
# fill_cells is called only by the calibration at load (tests/test_calibration.py's faults)
SKIPPED_POINTS = ("close", "tokenize", "fill_cells")
FAULT_CASES = [(where, None) for where in FAULT_POINTS if where not in SKIPPED_POINTS] + [
    ("decode", -3),
    ("decode", DecodeStatus.ABORTED),
    ("seq_rm", False),
    ("state_seq_set", False),
]
MUST_SURVIVE = {"sample", "new_sampler"}
"""Faults that end one request (docs/testing.md): a sampler that cannot be built or run."""


def _mixed_context(
    make_fake: MakeFake,
    request: pytest.FixtureRequest,
    *,
    batch_hook: bool = False,
    kv_layout: str = "auto",
) -> tuple[llamax.Context, FakeBackend]:
    """An auto-layout context with speculation; with ``batch_hook`` a batch logits
    processor too (the only user of ``batch_logits``; it turns drafting off)."""
    options = {
        "n_ctx": 1024,
        "n_seq_max": 8,
        "n_batch": 64,
        "kv_layout": kv_layout,
        "image_tokens": 8,  # the fake's projector: some prompts hold images
    }
    if not batch_hook:
        return make_fake(autostart=True, speculative=llamax.PromptLookup(), **options)
    backend = FakeBackend(**options)  # type: ignore[arg-type]
    ctx = llamax.Context(backend=backend, batch_logits_processor=_batch_hook)

    def finish() -> None:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()

    request.addfinalizer(finish)
    return ctx, backend


def _batch_hook(rows: object, logits: np.ndarray) -> None:
    logits[:, 0] -= 0.5  # a little less end of generation: changes nothing greedy here


@pytest.mark.parametrize(("where", "status"), FAULT_CASES, ids=lambda v: str(v))
def test_fault_at_every_backend_call(
    make_fake: MakeFake,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    where: str,
    status: object,
) -> None:
    """Faults at ``where`` under a mixed load: every request settles in bounded time with
    a result, a cancellation or a typed error; the engine survives with a clean audit, or
    fails every pending request with EngineError caused by the fault itself. Faults must
    have fired and most requests must have completed before them."""
    ctx, backend = _mixed_context(
        make_fake,
        request,
        batch_hook=where == "batch_logits",
        # in streams every fork is a queued copy, which a fork saved at once must run
        kv_layout="streams" if where == "run_queued_copies" else "auto",
    )
    ctx._engine.scheduler.drafts.priced = False  # verify every proposal: drafts every step
    # A run where everything is merely refused proves nothing: a third of the load runs
    # first without faults, and a fault that may end the engine fires once, somewhere in
    # the first half of the calls the rest would make there; the others fire often.
    warm = mixed_load(ctx, 1, tmp_path, per_thread=20)
    often = where in MUST_SURVIVE or (status is not None and where != "decode")
    calls = backend.fault_calls[where]
    injector = PointInjector(
        where,
        seed=len(where),
        status=status,
        warmup=0 if often else random.Random(where).randint(0, calls // 2),
        chance=0.3 if often else 1.0,
        limit=1_000 if often else 1,
    )
    backend.fault = injector
    run = mixed_load(ctx, 2, tmp_path)
    # a point the load calls only now and then (run_queued_copies: a fork saved at once)
    # may see fewer calls in this run than the warm-up's draw skips: more of the same
    # load until the one fault has fired (a fresh-clone run once ended with 1 call here)
    for seed in range(3, 6):
        if injector.injected or ctx.closed:
            break
        more = mixed_load(ctx, seed, tmp_path)
        run.handles.extend(more.handles)
        run.unexpected.extend(more.unexpected)
        run.refused.extend(more.refused)
    counts, errors = settle(warm.handles + run.handles)
    backend.fault = None
    assert not warm.unexpected + run.unexpected, warm.unexpected + run.unexpected
    assert backend.fault_calls[where] > 0, f"{where} was never called"
    assert injector.injected > 0, f"no fault fired in {injector.calls} calls of {where}"
    assert counts["done"] >= 40, counts  # real work happened, not only refusals
    allowed = {"done", "cancelled", "RequestFailedError", "EngineError"}
    assert set(counts) <= allowed, counts
    if ctx.closed:  # the engine failed: every pending request with the fault's EngineError
        assert where not in MUST_SURVIVE, f"a fault in {where} killed the engine: {errors[-1]!r}"
        engine_errors = [e for e in errors if isinstance(e, llamax.EngineError)]
        bad = [e for e in engine_errors if not _is_injected(e, status)]
        assert not bad, f"the engine died of something else than the fault: {bad[0]!r} <- " + repr(
            _causes(bad[0])[1:]
        )
        assert all(isinstance(e, llamax.ContextClosedError) for e in run.refused), run.refused
        _assert_failed_cleanly(ctx, backend, leaked_samplers_ok=where == "free_sampler")
        return
    # the engine survived: nothing leaked and it still serves
    assert counts["EngineError"] == 0, counts
    assert ctx.audit() == []
    done = ctx.add_request("abc", SamplingParams(max_tokens=4, temperature=0, n=2)).result(TIMEOUT)
    assert [c.text for c in done.choices] == ["defg", "defg"]
    assert_idle(ctx)
    assert backend.num_live_samplers == 0


@pytest.mark.parametrize("where", ["tokenize"])
def test_fault_in_tokenize_refuses_one_request(
    make_fake: MakeFake, tmp_path: Path, where: str
) -> None:
    ctx, backend = make_fake(autostart=True, n_ctx=1024, n_seq_max=8, n_batch=64)
    backend.fault = injector = PointInjector(where, 5, chance=0.1)
    run = mixed_load(ctx, 3, tmp_path)
    counts, _ = settle(run.handles)
    backend.fault = None
    assert injector.injected > 0 and run.refused
    assert all(isinstance(e, llamax.RequestFailedError) for e in run.refused), run.refused
    assert counts["done"] >= 40, counts
    assert not ctx.closed
    assert_idle(ctx)


@pytest.mark.parametrize("drain", [False, True])
def test_fault_in_teardown_still_closes(make_fake: MakeFake, tmp_path: Path, drain: bool) -> None:
    """``backend.close`` raising while requests and sessions are pending: ``close()``
    returns or raises in bounded time, every request settles, the context is closed."""
    ctx, backend = make_fake(autostart=True, n_ctx=1024, n_seq_max=8, n_batch=64)
    backend.fault = PointInjector("close", 0, chance=1.0)
    # the session first: opened after the load starts, it found every one of the 8 ids
    # held by the load's requests and sessions on a busy machine (SessionError)
    session = ctx.session()
    run = mixed_load(ctx, 4, tmp_path, per_thread=10)
    pending = [ctx.add_request(f"late {i}", SamplingParams(max_tokens=200)) for i in range(6)]
    closer = threading.Thread(target=_close_quietly, args=(ctx, drain))
    closer.start()
    closer.join(MIXED_TIMEOUT)
    assert not closer.is_alive(), "close() hung after backend.close raised"
    counts, _ = settle(run.handles + pending)
    assert counts["done"] > 0, counts
    assert ctx.closed and ctx.stats().state in ("closed", "failed"), ctx.stats().state
    assert ctx.stats().num_unsettled == 0
    session.close()
    _close_quietly(ctx, drain)  # idempotent, and quick


def _close_quietly(ctx: llamax.Context, drain: bool) -> None:
    with contextlib.suppress(InjectedFault):
        ctx.close(drain=drain, timeout=MIXED_TIMEOUT)
