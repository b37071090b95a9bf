"""Lifecycle on the fake backend: session methods from done-callbacks while another thread
waits on the loop (no lock across a wait), sessions while the context closes, close()
inside a step, BaseExceptions from callbacks, and every public method after close().

Every scenario that could hang runs in a daemon thread joined with a timeout, and the
contexts here are closed in daemon threads too, so a regression fails instead of hanging.
Real-model crashes after close (segfaults) are in tests/test_model_lifecycle.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from adversaries import in_thread

import llamax
from llamax.chat import ChatCall, TextCall
from llamax.testing import FakeBackend, assert_idle

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
PARAMS = llamax.SamplingParams(max_tokens=4, temperature=0)
TIMEOUT = 10.0


def _close(ctx: llamax.Context, **kwargs: Any) -> None:
    in_thread(lambda: ctx.close(**kwargs))


def _fresh(*, autostart: bool, **options: Any) -> tuple[llamax.Context, FakeBackend]:
    backend = FakeBackend(**{"n_ctx": 512, "n_seq_max": 6, **options})
    return llamax.Context(backend=backend, autostart=autostart), backend


# ---------------------------------------------------------------------- issue 22, item 4
SESSION_CALLS: dict[str, Callable[[llamax.Session], object]] = {
    "close": lambda s: s.close(),
    "rewind": lambda s: s.rewind(1),
    "shift": lambda s: s.shift(0, 1),
    "fork": lambda s: s.fork().close(),
    "token_ids": lambda s: s.token_ids,
    "add_request": lambda s: s.add_request("more", PARAMS),
}


@pytest.mark.parametrize("waiting", ["rewind", "shift", "fork", "save", "token_ids"])
@pytest.mark.parametrize("call", sorted(SESSION_CALLS))
def test_session_method_from_a_done_callback_while_another_thread_waits_on_the_loop(
    tmp_path: Path, waiting: str, call: str
) -> None:
    """Regression (issue 22, item 4): thread T waited on the loop inside ``session.rewind``
    (fork, shift, save) holding the session's lock; the loop thread, in a done-callback,
    called a method of that session that wanted the lock. Both waited forever, and then
    ``ctx.close()`` too. Here the callback starts first and waits (bounded) until T is
    inside ``Engine.run``, so the old code deadlocks every time."""
    ctx, _ = _fresh(autostart=True)
    session = ctx.session()
    session.add_request("hello world", PARAMS).result(TIMEOUT)
    in_callback, t_entered = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}
    engine_run = ctx._engine.run

    def spy(op: Any) -> Any:
        if threading.current_thread() is not ctx._engine._thread:
            t_entered.set()
        return engine_run(op)

    ctx._engine.run = spy  # type: ignore[method-assign]

    def callback(_future: object) -> None:
        in_callback.set()
        t_entered.wait(TIMEOUT)
        try:
            outcome["callback"] = SESSION_CALLS[call](session)
        except llamax.LlamaxError as exc:  # busy, closed ...: an answer, not a hang
            outcome["callback"] = exc

    trigger = ctx.add_request("trigger", PARAMS)
    trigger.future.add_done_callback(callback)
    assert in_callback.wait(TIMEOUT)
    waiters = {
        "rewind": lambda: session.rewind(0),
        "shift": lambda: session.shift(0, 0),
        "fork": lambda: session.fork().close(),
        "save": lambda: session.save(tmp_path / "s.llamax"),
        "token_ids": lambda: session.token_ids,
    }
    with contextlib.suppress(llamax.SessionError):  # the callback closed it first
        in_thread(waiters[waiting])
    deadline = time.monotonic() + TIMEOUT
    while "callback" not in outcome and time.monotonic() < deadline:
        time.sleep(0.001)
    assert "callback" in outcome, "the done-callback never returned"
    if call == "add_request" and isinstance(outcome["callback"], llamax.RequestHandle):
        outcome["callback"].result(TIMEOUT)
    session.close()
    assert_idle(ctx)
    _close(ctx)


@pytest.mark.parametrize("call", sorted(SESSION_CALLS))
def test_session_method_from_a_done_callback_of_a_manual_context(call: str) -> None:
    """The same callbacks on a manual context, run by the thread that waits on a handle,
    while another thread sits in a session operation: nothing hangs."""
    ctx, _ = _fresh(autostart=False)
    session = ctx.session()
    session.add_request("hello world", PARAMS).result(TIMEOUT)
    outcome: list[object] = []

    def callback(_future: object) -> None:
        try:
            outcome.append(SESSION_CALLS[call](session))
        except llamax.LlamaxError as exc:
            outcome.append(exc)

    trigger = ctx.add_request("trigger", PARAMS)
    trigger.future.add_done_callback(callback)
    other = threading.Thread(target=lambda: _try(lambda: session.rewind(0)), daemon=True)
    other.start()
    in_thread(lambda: trigger.result(TIMEOUT))
    other.join(TIMEOUT)
    assert not other.is_alive() and len(outcome) == 1
    if isinstance(outcome[0], llamax.RequestHandle):
        in_thread(lambda: outcome[0].result(TIMEOUT))  # type: ignore[union-attr]
    session.close()
    assert_idle(ctx)
    _close(ctx)


def _try(fn: Callable[[], object]) -> None:
    with contextlib.suppress(llamax.LlamaxError):
        fn()


def test_a_session_refuses_a_request_while_one_of_its_operations_is_under_way() -> None:
    """Without the lock held across the wait, the busy check is kept by counting the
    operations in flight: a request cannot slip in between a rewind's check and its run."""
    ctx, _ = _fresh(autostart=True)
    session = ctx.session()
    session.add_request("hello", PARAMS).result(TIMEOUT)
    gate, entered = threading.Event(), threading.Event()
    engine_run = ctx._engine.run

    def slow(op: Any) -> Any:
        entered.set()
        gate.wait(TIMEOUT)
        return engine_run(op)

    ctx._engine.run = slow  # type: ignore[method-assign]
    rewinding = threading.Thread(target=lambda: session.rewind(1), daemon=True)
    rewinding.start()
    assert entered.wait(TIMEOUT)
    with pytest.raises(llamax.SessionBusyError, match="under way"):
        session.add_request("x", PARAMS)
    gate.set()
    rewinding.join(TIMEOUT)
    ctx._engine.run = engine_run  # type: ignore[method-assign]
    session.add_request("hello again", PARAMS).result(TIMEOUT)
    session.close()
    assert_idle(ctx)
    _close(ctx)


# ---------------------------------------------------------------------- sessions at close
@pytest.mark.parametrize("autostart", [True, False])
def test_session_close_while_the_context_drains_releases_it_at_once(autostart: bool) -> None:
    """Regression: ``Session.close()`` did nothing once the context was closing, so a
    session's room stayed taken for the whole drain. A done-callback during the drain
    closes one session; its release is applied before teardown."""
    ctx, _ = _fresh(autostart=autostart)
    session = ctx.session()
    session.add_request("a session that holds cells", PARAMS).result(TIMEOUT)
    seen: list[int] = []

    def callback(_future: object) -> None:
        session.close()
        seen.append(ctx.stats().num_sessions)

    def until_closing(_ids: Any, _logits: Any) -> None:
        deadline = time.monotonic() + TIMEOUT
        while ctx.stats().state != "closing" and time.monotonic() < deadline:
            time.sleep(0.001)

    params = llamax.SamplingParams(max_tokens=20, temperature=0, logits_processors=[until_closing])
    draining = ctx.add_request("drained", params)
    draining.future.add_done_callback(callback)
    _close(ctx, drain=True)
    assert draining.result().finish_reason == "length"
    assert seen == [0], seen
    assert session.closed and ctx.stats().num_sessions == 0


def test_session_close_from_another_thread_during_a_drain() -> None:
    ctx, backend = _fresh(autostart=True)
    session = ctx.session()
    session.add_request("a session that holds cells", PARAMS).result(TIMEOUT)
    held = backend.num_cells_used
    gate = threading.Event()

    def hold(_ids: Any, _logits: Any) -> None:
        gate.wait(TIMEOUT)

    params = llamax.SamplingParams(max_tokens=3, temperature=0, logits_processors=[hold])
    draining = ctx.add_request("drained", params)
    closer = threading.Thread(target=lambda: ctx.close(drain=True), daemon=True)
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while ctx.stats().state != "closing" and time.monotonic() < deadline:
        time.sleep(0.001)
    releasing = threading.Thread(target=session.close, daemon=True)
    releasing.start()
    gate.set()  # the loop steps again, and applies the release between two steps
    releasing.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert not releasing.is_alive() and not closer.is_alive()
    assert held > 0 and draining.result().finish_reason == "length"
    assert ctx.stats().num_sessions == 0 and backend.closed


@pytest.mark.parametrize("autostart", [True, False])
def test_close_releases_every_open_session(autostart: bool) -> None:
    """Regression: teardown cancelled requests but left sessions open in the bookkeeping
    (``stats().num_sessions`` stayed > 0 and ``Session.closed`` False)."""
    ctx, _ = _fresh(autostart=autostart)
    sessions = [ctx.session() for _ in range(3)]
    sessions[0].add_request("hello", PARAMS).result(TIMEOUT)
    running = sessions[1].add_request("running", llamax.SamplingParams(max_tokens=200))
    _close(ctx)
    assert ctx.stats().num_sessions == 0 and ctx.stats().kv_cells_used == 0
    assert all(s.closed for s in sessions)
    assert running.result().finish_reason in ("cancelled", "length")
    for session in sessions:
        session.close()  # still idempotent
        with pytest.raises(llamax.ContextClosedError):
            session.add_request("x")


def test_kv_operations_that_allocate_are_refused_while_closing() -> None:
    ctx, _ = _fresh(autostart=True)
    session = ctx.session()
    gate, started = threading.Event(), threading.Event()

    def hold(_ids: Any, _logits: Any) -> None:
        started.set()
        gate.wait(TIMEOUT)

    params = llamax.SamplingParams(max_tokens=2, temperature=0, logits_processors=[hold])
    draining = ctx.add_request("drained", params)
    assert started.wait(TIMEOUT)
    closer = threading.Thread(target=lambda: ctx.close(drain=True), daemon=True)
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while ctx.stats().state != "closing" and time.monotonic() < deadline:
        time.sleep(0.001)
    for refused in (ctx.session, session.fork, lambda: session.rewind(0)):
        with pytest.raises(llamax.ContextClosedError):
            refused()
    gate.set()
    closer.join(TIMEOUT)
    assert draining.result(TIMEOUT).finish_reason == "length"


# ---------------------------------------------------------------------- issue 22, item 7
@pytest.mark.parametrize("drain", [False, True])
def test_close_inside_a_logits_processor_of_a_manual_context(drain: bool) -> None:
    """Regression (item 7a): ``ctx.close()`` in a processor of a manual context waited for
    the step lock its own thread held. Now it marks the context closing; the step ends and
    ``process()`` tears down before it returns (a drain first runs what is left)."""
    ctx, backend = _fresh(autostart=False)
    calls: list[int] = []

    def closing(_ids: Any, _logits: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            ctx.close(drain=drain)

    params = llamax.SamplingParams(max_tokens=5, temperature=0, logits_processors=[closing])
    handle = ctx.add_request("abc", params)
    bystander = ctx.add_request("xyz", llamax.SamplingParams(max_tokens=5, temperature=0))
    in_thread(ctx.process)
    if drain:
        while not backend.closed:
            in_thread(ctx.process)
        assert handle.result().finish_reason == "length"
        assert bystander.result().finish_reason == "length"
    else:
        assert handle.result().finish_reason == "cancelled"
        assert bystander.result().finish_reason == "cancelled"
    assert ctx.closed and backend.closed and ctx.stats().state == "closed"
    with pytest.raises(llamax.ContextClosedError):
        ctx.process()
    _close(ctx)  # idempotent


def test_close_inside_a_logits_processor_of_the_background_loop() -> None:
    ctx, backend = _fresh(autostart=True)

    def closing(_ids: Any, _logits: Any) -> None:
        ctx.close()

    params = llamax.SamplingParams(max_tokens=5, temperature=0, logits_processors=[closing])
    handle = ctx.add_request("abc", params)
    assert in_thread(lambda: handle.result(TIMEOUT)).finish_reason == "cancelled"
    _close(ctx)
    assert backend.closed


class Custom(BaseException):
    """Not an Exception: what a library may raise to unwind."""


BASE_EXCEPTIONS = [SystemExit(3), GeneratorExit(), Custom("unwind"), KeyboardInterrupt()]


@pytest.mark.parametrize("autostart", [True, False])
@pytest.mark.parametrize("exc", BASE_EXCEPTIONS, ids=lambda e: type(e).__name__)
def test_a_base_exception_in_a_logits_processor_fails_its_request_alone(
    autostart: bool, exc: BaseException
) -> None:
    """Regression (item 7b): only ``Exception`` was caught, so ``SystemExit`` (or any
    BaseException) from a processor failed every request and closed the engine. Now its
    request fails alone. A ``KeyboardInterrupt`` on a manual context is re-raised by
    ``process()`` after the step is complete, so Ctrl-C still stops a manual loop."""
    ctx, _ = _fresh(autostart=autostart)

    def raising(_ids: Any, _logits: Any) -> None:
        raise exc

    failing = ctx.add_request(
        "abc", llamax.SamplingParams(max_tokens=5, temperature=0, logits_processors=[raising])
    )
    bystander = ctx.add_request("xyz", llamax.SamplingParams(max_tokens=5, temperature=0))
    if not autostart:
        if isinstance(exc, KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                ctx.process()
        while ctx.has_work():
            ctx.process()
    with pytest.raises(llamax.RequestFailedError) as info:
        in_thread(lambda: failing.result(TIMEOUT))
    assert info.value.__cause__ is exc
    assert in_thread(lambda: bystander.result(TIMEOUT)).finish_reason == "length"
    assert not ctx.closed
    ctx.add_request("again", PARAMS).result(TIMEOUT)
    assert_idle(ctx)
    _close(ctx)


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS[:3], ids=lambda e: type(e).__name__)
def test_a_base_exception_in_the_batch_logits_processor_fails_only_that_step(
    exc: BaseException,
) -> None:
    fail = [True]

    def hook(_rows: Any, _logits: Any) -> None:
        if fail[0]:
            fail[0] = False
            raise exc

    backend = FakeBackend(n_ctx=512, n_seq_max=4)
    ctx = llamax.Context(backend=backend, autostart=True, batch_logits_processor=hook)
    first = ctx.add_request("abc", PARAMS)
    with pytest.raises(llamax.RequestFailedError):
        in_thread(lambda: first.result(TIMEOUT))
    assert in_thread(lambda: ctx.add_request("x", PARAMS).result(TIMEOUT)).text
    assert_idle(ctx)
    _close(ctx)


def test_embed_after_close_raises_instead_of_loading_the_model_again() -> None:
    """Regression (item 7c): ``embed()`` after ``close()`` built a new Embedder (a second
    copy of the model that nothing freed). With the fake backend the old code tried to load
    ``<FakeBackend>`` and raised ModelLoadError."""
    ctx, _ = _fresh(autostart=False)
    ctx.close()
    with pytest.raises(llamax.ContextClosedError):
        ctx.embed(["hello"])
    assert ctx._embedder is None


# ---------------------------------------------------------------------- issue 22, item 5
def _context_calls(ctx: llamax.Context, tmp_path: Path) -> dict[str, Callable[[], object]]:
    messages = [{"role": "user", "content": "hi"}]
    return {
        "add_request": lambda: ctx.add_request("abc", PARAMS),
        "tokenize": lambda: ctx.tokenize("abc"),
        "detokenize": lambda: ctx.detokenize([66, 67]),
        "session": lambda: ctx.session(),
        "process": lambda: ctx.process(),
        "clear_cache": lambda: ctx.clear_cache(),
        "load_adapter": lambda: ctx.load_adapter("x", tmp_path / "x.gguf"),
        "audit": lambda: ctx.audit(),
        "chat_template": lambda: ctx.chat_template,
        "end_of_turn_token_ids": lambda: ctx.end_of_turn_token_ids,
        "can_shift": lambda: ctx.can_shift,
        "chat_prompt": lambda: ctx.chat_prompt(messages),
        "chat_prompt_parts": lambda: ctx.chat_prompt_parts(messages),
        "prompt_positions": lambda: ctx.prompt_positions([1, 2]),
        "prompt_token_ids": lambda: ctx.prompt_token_ids([1, 2]),
        "model_info": lambda: ctx.model_info(),
        "chat": lambda: ctx.chat(),
        "generate": lambda: ctx.generate(["abc"], return_exceptions=True),
        "agenerate": lambda: asyncio.run(ctx.agenerate(["abc"], return_exceptions=True)),
        "embed": lambda: ctx.embed(["abc"]),
        "completion": lambda: ctx.completion("abc"),
        "chat_completion": lambda: ctx.chat_completion(messages),
        "acompletion": lambda: asyncio.run(ctx.acompletion("abc")),
        "achat_completion": lambda: asyncio.run(ctx.achat_completion(messages)),
        "submit_chat": lambda: ctx.submit_chat(ChatCall(messages=tuple(messages))),
        "submit_text": lambda: ctx.submit_text(TextCall(prompt="abc")),
        "asubmit_chat": lambda: asyncio.run(ctx.asubmit_chat(ChatCall(messages=tuple(messages)))),
        "asubmit_text": lambda: asyncio.run(ctx.asubmit_text(TextCall(prompt="abc"))),
        "Session.load": lambda: llamax.Session.load(ctx, tmp_path / "saved.llamax"),
        "load_session": lambda: ctx.load_session(tmp_path / "saved.llamax"),
    }


# public names that keep answering after close(): facts known at load, state, close itself
STILL_ANSWER = {
    "config",
    "calibration",
    "facts",
    "n_ctx",
    "n_seq_max",
    "n_ctx_seq",
    "kv_layout",
    "n_vocab",
    "model_name",
    "fim_tokens",
    "sees_images",
    "closed",
    "is_manual",
    "stats",
    "has_work",
    "close",
    "adapters",
    "plan",  # a static method: plans a context that does not exist yet
}


def _session_calls(session: llamax.Session, tmp_path: Path) -> dict[str, Callable[[], object]]:
    return {
        "token_ids": lambda: session.token_ids,
        "add_request": lambda: session.add_request("abc", PARAMS),
        "fork": lambda: session.fork(),
        "rewind": lambda: session.rewind(0),
        "shift": lambda: session.shift(0, 0),
        "save": lambda: session.save(tmp_path / "after.llamax"),
    }


CONTEXT_CALLS = sorted(_context_calls(None, Path()))  # type: ignore[arg-type]
SESSION_METHODS = sorted(_session_calls(None, Path()))  # type: ignore[arg-type]


def test_the_tables_cover_every_public_name() -> None:
    public = {n for n in dir(llamax.Context) if not n.startswith("_")}
    assert public == (set(CONTEXT_CALLS) - {"Session.load"}) | STILL_ANSWER
    session_public = {n for n in dir(llamax.Session) if not n.startswith("_")}
    assert session_public == set(SESSION_METHODS) | {"closed", "close", "load"}


@pytest.mark.parametrize("autostart", [True, False])
@pytest.mark.parametrize("name", CONTEXT_CALLS + [f"Session.{n}" for n in SESSION_METHODS])
def test_every_public_method_raises_context_closed_after_close(
    tmp_path: Path, autostart: bool, name: str
) -> None:
    backend = FakeBackend(
        n_ctx=512,
        n_seq_max=4,
        metadata={"tokenizer.chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
    )
    ctx = llamax.Context(backend=backend, autostart=autostart)
    session = ctx.session()
    session.add_request("abc", PARAMS).result(TIMEOUT)
    session.save(tmp_path / "saved.llamax")
    _close(ctx)
    calls = _context_calls(ctx, tmp_path) | {
        f"Session.{n}": fn for n, fn in _session_calls(session, tmp_path).items()
    }
    with pytest.raises(llamax.ContextClosedError):
        in_thread(calls[name])
    assert not backend.live_samplers
    for fact in STILL_ANSWER - {"close", "stats", "has_work"}:
        getattr(ctx, fact)
    assert ctx.stats().state == "closed" and not ctx.has_work()


def test_fake_backend_refuses_text_calls_after_close() -> None:
    backend = FakeBackend()
    backend.close()
    for call in (lambda: backend.tokenize("a"), lambda: backend.token_to_piece(66)):
        with pytest.raises(llamax.ContextClosedError):
            call()


def _hammer(ctx: llamax.Context, start: threading.Barrier, errors: list[BaseException]) -> None:
    start.wait(TIMEOUT)
    for i in range(200):
        try:
            ctx.tokenize("hello world " * 10)
            ctx.add_request(f"p{i}", PARAMS)
        except llamax.ContextClosedError:
            return
        except BaseException as exc:
            errors.append(exc)
            return


def test_tokenize_racing_close_raises_or_answers() -> None:
    """Many threads tokenize and submit while another closes: each call answers or raises
    ContextClosedError, nothing else (the real-model version checks for crashes)."""
    for _ in range(5):
        ctx, _ = _fresh(autostart=True)
        errors: list[BaseException] = []
        start = threading.Barrier(9)
        threads = [
            threading.Thread(target=_hammer, args=(ctx, start, errors), daemon=True)
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        start.wait(TIMEOUT)
        time.sleep(0.002)
        _close(ctx)
        for t in threads:
            t.join(TIMEOUT)
        assert not errors, errors
        assert ctx.stats().num_unsettled == 0


def test_close_with_a_timeout_on_a_stuck_loop_then_frees_when_it_returns() -> None:
    """A callback that does not return keeps close() waiting; with ``timeout`` it raises
    TimeoutError, the context is closed to new work, and the loop frees the backend when
    the callback returns."""
    ctx, backend = _fresh(autostart=True)
    gate, started = threading.Event(), threading.Event()

    def stuck(_ids: Any, logits: Any) -> None:
        started.set()
        gate.wait(TIMEOUT)

    params = llamax.SamplingParams(max_tokens=2, temperature=0, logits_processors=[stuck])
    handle = ctx.add_request("abc", params)
    assert started.wait(TIMEOUT)
    with pytest.raises(TimeoutError, match="did not stop in time"):
        ctx.close(timeout=0.05)
    with pytest.raises(llamax.ContextClosedError):
        ctx.add_request("x")
    gate.set()
    assert in_thread(lambda: handle.result(TIMEOUT)).finish_reason == "cancelled"
    deadline = time.monotonic() + TIMEOUT
    while not backend.closed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert backend.closed
    _close(ctx)


@pytest.mark.parametrize("exc", BASE_EXCEPTIONS[:3], ids=lambda e: type(e).__name__)
def test_a_base_exception_in_a_done_callback_does_not_stop_the_loop(exc: BaseException) -> None:
    """A done-callback that raised a BaseException (Future catches only Exception) broke
    out of the loop's publishing: the other requests of that step never settled and the
    loop thread died. Now it is logged and the loop goes on."""
    ctx, _ = _fresh(autostart=True)
    registered = threading.Event()

    def gate(_ids: Any, _logits: Any) -> None:
        registered.wait(TIMEOUT)  # the request ends after its callback is added

    gated = llamax.SamplingParams(max_tokens=4, temperature=0, logits_processors=[gate])
    first = ctx.add_request("abc", gated)
    second = ctx.add_request("abd", PARAMS)

    def raising(_future: object) -> None:
        raise exc

    first.future.add_done_callback(raising)
    registered.set()
    assert in_thread(lambda: first.result(TIMEOUT)).finish_reason == "length"
    assert in_thread(lambda: second.result(TIMEOUT)).finish_reason == "length"
    assert in_thread(lambda: ctx.add_request("x", PARAMS).result(TIMEOUT)).text
    assert_idle(ctx)
    _close(ctx)


def test_a_keyboard_interrupt_in_a_done_callback_of_a_manual_context_is_re_raised() -> None:
    ctx, _ = _fresh(autostart=False)
    handle = ctx.add_request("abc", PARAMS)

    def interrupt(_future: object) -> None:
        raise KeyboardInterrupt

    handle.future.add_done_callback(interrupt)
    with pytest.raises(KeyboardInterrupt):
        while ctx.has_work():
            ctx.process()
    assert handle.result().finish_reason == "length"
    assert_idle(ctx)
    _close(ctx)
