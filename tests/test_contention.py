"""Threads that follow a busy machine, on the fake backend's simulated clock.

The fake's step costs depend on the threads the engine gave it: one thread is 1.8x slower
than two on a quiet machine, and while a simulated busy process holds a core a step at two
threads is 20x slower (its workers spin at barriers), at one thread no slower than quiet.
Unless a test says otherwise the simulated OS does not tell how many tasks are runnable
(the engine judges by step times alone, as on a machine without ``/proc/loadavg``); with
``tells_load`` it does, as Linux does: this process's threads, plus one while busy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

import llamax
from llamax.backend import BatchItem
from llamax.engine.timing.contention import (
    DOWN_PROBE_GAP,
    MIN_PROBE_GAP,
    NUM_SLOW_STEPS,
    PROBE_SHARE,
)
from llamax.testing import FakeBackend

QUIET_S = 0.004  # a 2-thread step's fixed cost
TOKEN_S = 0.0005
ONE_THREAD = 1.8  # a 1-thread step costs this many times a 2-thread one, quiet
SPIN = 20.0  # a 2-thread step beside a busy process


@dataclass
class BusyMachine:
    """``step_seconds``: busy for steps ``busy_from <= step < busy_until``."""

    busy_from: int = 10**9
    busy_until: int = 10**9
    spin: float = SPIN
    """How many times slower a 2-thread step runs while busy."""
    one_thread: float = ONE_THREAD
    """How many times slower a 1-thread step runs than a quiet 2-thread one."""
    num_busy: int = 1
    """Busy processes while busy."""
    backend: FakeBackend | None = None
    num_steps: int = 0
    threads: list[int] = field(default_factory=list)
    """The thread count of every step, in order."""

    def __call__(self, items: Sequence[BatchItem]) -> float:
        assert self.backend is not None
        n = self.backend.n_threads
        seconds = QUIET_S + TOKEN_S * sum(len(i.token_ids) for i in items)
        busy = self.busy_from <= self.num_steps < self.busy_until
        if n == 1:
            seconds *= self.one_thread
        elif busy:
            seconds *= self.spin
        self.threads.append(n)
        self.num_steps += 1
        return seconds

    def runnable_tasks(self) -> int:
        """What the OS would say right after the last step: this process's threads, and
        the busy process while it runs."""
        assert self.backend is not None
        busy = self.busy_from <= self.num_steps - 1 < self.busy_until
        return self.backend.n_threads + self.num_busy * busy


def busy_fake(
    machine: BusyMachine,
    *,
    tells_load: bool = False,
    runnable_tasks: Callable[[], int] | None = None,
) -> FakeBackend:
    """A fake whose steps take ``machine``'s seconds; the OS's runnable count is the
    machine's (``tells_load``), ``runnable_tasks``, or not told."""
    backend = FakeBackend(
        n_ctx=1024,
        n_seq_max=4,
        n_batch=64,
        n_threads=2,
        step_seconds=machine,
        runnable_tasks=machine.runnable_tasks if tells_load else runnable_tasks,
    )
    machine.backend = backend
    return backend


def decode_steps(ctx: llamax.Context, num_steps: int) -> None:
    """Keep 4 streams decoding for ``num_steps`` steps."""
    params = llamax.SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.0)
    handles = [ctx.add_request([2 + s, 3, 4], params) for s in range(4)]
    for _ in range(num_steps):
        ctx.process()
    for handle in handles:
        handle.cancel()
    ctx.process()


def test_contention_is_detected_within_a_few_steps_and_threads_return_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    machine = BusyMachine(busy_from=40, busy_until=200)
    backend = busy_fake(machine)
    with (
        caplog.at_level(logging.WARNING, logger="llamax"),
        llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx,
    ):
        decode_steps(ctx, 60)
        stats = ctx.stats()
        assert stats.is_contended and stats.n_threads == 1
        decode_steps(ctx, 400)
        stats = ctx.stats()
    threads = machine.threads
    assert threads[:40].count(1) <= 1  # quiet: full threads (but for a down-probe)
    # detected within the slow steps in a row it needs (the step after them runs 1 thread)
    assert threads[40 : 40 + NUM_SLOW_STEPS] == [2] * NUM_SLOW_STEPS
    assert threads[40 + NUM_SLOW_STEPS] == 1
    # while busy, almost every step runs one thread (probes excepted)
    busy = threads[40 + NUM_SLOW_STEPS : 200]
    assert busy.count(2) <= len(busy) // MIN_PROBE_GAP + 1
    # after it ends, back to full threads within a probe's spacing (a failed probe costs
    # SPIN steps, and probes take at most PROBE_SHARE of the time), and there to stay
    back = 200 + next(i for i, n in enumerate(threads[200:]) if n == 2)
    assert back - 200 <= MIN_PROBE_GAP + SPIN / (PROBE_SHARE * ONE_THREAD) + 1
    assert all(n == 2 for n in threads[back:])
    assert not stats.is_contended and stats.n_threads == 2
    assert stats.num_thread_changes == backend.thread_log.__len__() >= 2
    warnings = [r for r in caplog.records if "another process holds a core?" in r.message]
    assert len(warnings) == 1  # a log line once


def test_adapting_beats_fixed_threads_beside_a_process_busy_from_the_start() -> None:
    """The reference learns contended steps as the norm; a down-probe finds it out."""

    def busy_seconds(**options: object) -> float:
        machine = BusyMachine(busy_from=0, busy_until=10**9)
        backend = busy_fake(machine)
        with llamax.Context(backend=backend, autostart=False, adapt_threads=True, **options) as ctx:  # type: ignore[arg-type]
            start = backend.clock()
            decode_steps(ctx, 300)
            return backend.clock() - start

    adaptive, fixed = busy_seconds(), busy_seconds(n_threads=2)
    assert adaptive < fixed / 5


def test_an_explicit_n_threads_is_never_changed() -> None:
    machine = BusyMachine(busy_from=20, busy_until=10**9)
    backend = busy_fake(machine)
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True, n_threads=2) as ctx:
        decode_steps(ctx, 100)
        stats = ctx.stats()
    assert backend.thread_log == [] and set(machine.threads) == {2}
    assert not stats.is_contended and stats.num_thread_changes == 0 and stats.n_threads == 2


def test_a_quiet_machine_keeps_full_threads() -> None:
    machine = BusyMachine()
    backend = busy_fake(machine)
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        decode_steps(ctx, 600)
        stats = ctx.stats()
    assert machine.threads.count(1) <= 1 + 600 // DOWN_PROBE_GAP  # rare down-probes
    assert not stats.is_contended and stats.n_threads == 2


def test_metrics_show_the_threads_and_the_contention() -> None:
    import asyncio

    import httpx

    from llamax.server import create_app

    machine = BusyMachine(busy_from=20, busy_until=10**9)
    backend = busy_fake(machine)
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        decode_steps(ctx, 40)
        app = create_app(ctx)

        async def scrape() -> str:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return (await client.get("/metrics")).text

        text = asyncio.run(scrape())
        changes = ctx.stats().num_thread_changes
    assert "llamax_threads 1.0" in text
    assert "llamax_contended 1.0" in text
    assert changes >= 1 and f"llamax_thread_changes_total {changes:.1f}" in text


def test_a_slow_logits_callback_is_not_contention() -> None:
    """Sampling and callbacks run on the engine's own thread after the decode: a callback
    that takes 25x a quiet step is the request's own cost, not another process; the
    threads are judged by the decode alone."""
    machine = BusyMachine()
    backend = busy_fake(machine)

    def slow(token_ids: Sequence[int], logits: object) -> None:
        backend.pass_time(0.1)

    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        params = llamax.SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.0)
        handles = [ctx.add_request([2 + s, 3, 4], params) for s in range(3)]
        for _ in range(40):
            ctx.process()
        slow_params = llamax.SamplingParams(
            max_tokens=10_000, ignore_eos=True, temperature=0.0, logits_processors=[slow]
        )
        handles.append(ctx.add_request([9, 3, 4], slow_params))
        for _ in range(60):
            ctx.process()
        stats = ctx.stats()
        for handle in handles:
            handle.cancel()
        ctx.process()
    assert machine.threads[40:].count(1) <= 1  # a down-probe at most
    assert not stats.is_contended and stats.n_threads == 2


@pytest.mark.parametrize("tells_load", [False, True])
def test_contention_is_handled_whether_or_not_the_os_tells(tells_load: bool) -> None:
    machine = BusyMachine(busy_from=40, busy_until=200)
    backend = busy_fake(machine, tells_load=tells_load)
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        decode_steps(ctx, 60)
        stats = ctx.stats()
        assert stats.is_contended and stats.n_threads == 1
        decode_steps(ctx, 400)
        stats = ctx.stats()
    threads = machine.threads
    assert threads[40 + NUM_SLOW_STEPS] == 1
    assert all(n == 2 for n in threads[-100:])
    assert not stats.is_contended


def test_a_quiet_machine_that_says_so_never_changes_threads() -> None:
    """No down-probe either: a thread count changes llama.cpp's sums in some shapes, so on
    a quiet machine the outputs stay those of one thread count."""
    machine = BusyMachine()
    backend = busy_fake(machine, tells_load=True)
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        decode_steps(ctx, 600)
        stats = ctx.stats()
    assert backend.thread_log == [] and set(machine.threads) == {2}
    assert not stats.is_contended and stats.num_thread_changes == 0


def test_slow_steps_on_a_machine_that_is_not_crowded_are_not_contention() -> None:
    """Steps 20x slower with no other task runnable (swapping, a throttled CPU, a
    reference that mispredicts): fewer threads would not help, so none are taken away."""
    machine = BusyMachine(busy_from=40, busy_until=200)
    backend = busy_fake(machine, runnable_tasks=lambda: 2)  # the OS sees only our threads
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        decode_steps(ctx, 300)
        stats = ctx.stats()
    assert backend.thread_log == [] and stats.num_thread_changes == 0


def test_a_crowded_machine_that_slows_steps_3x_gets_fewer_threads() -> None:
    """Measured on 2 cores beside one busy process: 2-thread steps 2.9x their quiet cost,
    1-thread steps no slower than quiet. Under the 3x bar of
    a machine that does not tell its load; the OS saying it is crowded lowers the bar."""

    def busy_seconds(**options: object) -> float:
        machine = BusyMachine(busy_from=20, busy_until=10**9, spin=2.9)
        backend = busy_fake(machine, tells_load=True)
        with llamax.Context(backend=backend, autostart=False, **options) as ctx:  # type: ignore[arg-type]
            start = backend.clock()
            decode_steps(ctx, 300)
            return backend.clock() - start

    adaptive, fixed = busy_seconds(adapt_threads=True), busy_seconds(n_threads=2)
    assert adaptive < fixed * 0.75


@pytest.mark.parametrize(
    ("env", "given", "n_threads", "adapts"),
    [
        (None, None, None, True),  # the default: on
        ("0", None, None, False),
        ("off", None, None, False),
        ("YES", None, None, True),
        ("0", True, None, True),  # given wins over the variable
        ("1", False, None, False),
        ("1", True, 2, False),  # a number of threads is used as given
    ],
)
def test_adapt_threads_default_and_its_variable(
    monkeypatch: pytest.MonkeyPatch,
    env: str | None,
    given: bool | None,
    n_threads: int | None,
    adapts: bool,
) -> None:
    if env is None:
        monkeypatch.delenv("LLAMAX_ADAPT_THREADS", raising=False)
    else:
        monkeypatch.setenv("LLAMAX_ADAPT_THREADS", env)
    config = llamax.ContextConfig("m.gguf", adapt_threads=given, n_threads=n_threads)
    assert config.adapts_threads is adapts


def test_a_bad_adapt_threads_variable_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAX_ADAPT_THREADS", "maybe")
    with pytest.raises(llamax.InvalidParameterError, match="LLAMAX_ADAPT_THREADS"):
        llamax.Context(backend=FakeBackend(n_threads=2), autostart=False)


def test_a_machine_the_others_fill_keeps_every_thread() -> None:
    """Two busy processes on 2 cores: each thread is a share of the machine, so fewer
    threads only get less of it (measured: 125 tok/s at 2 threads, 81 at 1). The old rule
    (crowded: more runnable tasks than cores) dropped to one thread there."""
    machine = BusyMachine(busy_from=20, busy_until=10**9, spin=2.0, one_thread=3.0, num_busy=2)
    backend = busy_fake(machine, tells_load=True)
    with llamax.Context(backend=backend, autostart=False, adapt_threads=True) as ctx:
        decode_steps(ctx, 300)
        stats = ctx.stats()
    assert backend.thread_log == [] and set(machine.threads) == {2}
    assert not stats.is_contended


@pytest.mark.parametrize(
    ("runnable", "n_threads", "crowded"),
    [(2, 2, False), (3, 2, True), (4, 2, False), (2, 1, False), (5, 4, True), (8, 4, False)],
)
def test_is_crowded(runnable: int, n_threads: int, crowded: bool) -> None:
    from llamax.engine.timing.threads import is_crowded

    cores = 2 if n_threads <= 2 else 4
    assert is_crowded(runnable, n_threads, cores) is crowded
