"""Mixed soak: every feature at once, from many threads, for thousands of requests.

Sessions are opened, forked, rewound, saved and loaded mid-run; requests use grammars
(some reach a dead end), speculation (prompt lookup), logits processors that fail, n up
to 8, outputs up to 256 tokens, and a quarter are cancelled; steps hold enough decode
rows to be split. Nothing may be lost or leak: every request settles within a bound
(a result, a cancellation, or a typed error that its own features explain), ``audit()``
is clean, the context ends idle, and resident memory grows by at most a few KiB per
request after a warm-up.

The default suite runs 1,000 requests on the fake backend and 1,000 short ones on the
real model; ``pytest -m soak tests/test_soak.py`` runs 10,000 of each, with outputs up to
256 tokens (``LLAMAX_SOAK_REQUESTS`` overrides the count).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from adversaries import FlakyProcessor

import llamax
from llamax.testing import FakeBackend, assert_idle

SETTLE_S = 300.0
"""Bound on how long one request may take to settle (they need well under a second)."""
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "light", "garden", "window"]
GRAMMARS = ["root ::= [a-m]{0,6}", "root ::= [ab]{0,3}", "root ::= [a-z ]+"]


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class Tally:
    """What a soak did (counters only: keeping handles would look like a leak)."""

    submitted: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    session_ops: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, key: str, *, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[key] += 1
            if problem is not None and len(self.problems) < 20:
                self.problems.append(problem)


def output_length(rng: random.Random, max_output: int) -> int:
    """Mostly short outputs, a tenth up to ``max_output`` tokens."""
    if rng.random() < 0.1:
        return rng.randint(max_output // 2, max_output)
    return rng.randint(1, max(1, max_output // 8))


def soak_params(rng: random.Random, max_output: int) -> tuple[llamax.SamplingParams, bool]:
    """Random params with every feature; also whether its features may fail it."""
    grammar = rng.choice(GRAMMARS) if rng.random() < 0.15 else None
    processors = (FlakyProcessor(rng.randint(8, 60)),) if rng.random() < 0.05 else ()
    n = rng.choice([1] * 12 + [2, 2, 3, 4, 8])
    params = llamax.SamplingParams(
        max_tokens=output_length(rng, max_output),
        temperature=rng.choice([0.0, 0.0, 0.7, 1.2]),
        top_k=rng.choice([0, 20, 40]),
        stop=rng.choice([(), (".",), ("\n", "the")]),
        n=n,
        logprobs=rng.choice([None, None, None, 2]),
        seed=rng.randint(0, 2**31),
        ignore_eos=rng.random() < 0.2,
        grammar=grammar,
        logits_processors=processors,
        speculative=rng.choice([None, None, True]),
    )
    return params, grammar is not None or bool(processors)


def soak_prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    start = rng.randrange(26)
    run = (ALPHABET[start:] + ALPHABET)[: rng.randint(0, 30)]  # prompt lookup finds drafts
    return rng.choice(["", "You are a helpful assistant. "]) + words + " " + run


def settle(tally: Tally, handle: llamax.RequestHandle, may_fail: bool, cancel: bool) -> None:
    if cancel:
        if random.random() < 0.5:
            with contextlib.suppress(StopIteration, llamax.LlamaxError):
                next(iter(handle))  # cancel mid-stream, after the first event
        handle.cancel()
    try:
        done = handle.result(timeout=SETTLE_S)
    except TimeoutError:
        tally.note("hung", problem=f"{handle!r} did not settle in {SETTLE_S} s")
        return
    except llamax.RequestFailedError as exc:
        tally.note("failed", problem=None if may_fail else f"{handle!r}: {exc!r}")
        return
    except llamax.LlamaxError as exc:
        tally.note(type(exc).__name__, problem=f"{handle!r}: {exc!r}")
        return
    reasons = {choice.finish_reason for choice in done.choices}
    if not reasons <= {"stop", "length", "cancelled"}:
        tally.note("bad", problem=f"{handle!r}: finish reasons {reasons}")
    tally.note("cancelled" if "cancelled" in reasons else "done")


def session_turn(
    ctx: llamax.Context, rng: random.Random, session: llamax.Session, tally: Tally, tmp: Path
) -> llamax.Session:
    """One turn on ``session`` (the whole conversation as token ids), then a random KV
    operation: rewind, fork, save + load, or none. Returns the session to go on with."""
    history = list(session.token_ids)
    if len(history) > SESSION_TOKENS:  # sessions must not pin the cache (see soak())
        session.rewind(len(history) - rng.randint(0, SESSION_TOKENS // 2))
        history = list(session.token_ids)
    turn = ctx.tokenize(" " + soak_prompt(rng), add_special=not history)
    params = llamax.SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0)
    with tally.lock:
        tally.submitted += 1
    settle(tally, session.add_request(history + turn, params), False, rng.random() < 0.1)
    action = rng.choice(["rewind", "fork", "save", "none"])
    with tally.lock:
        tally.session_ops[action] += 1
    held = len(session.token_ids)
    if action == "rewind" and held:
        session.rewind(rng.randint(0, held))
    elif action == "fork":
        with session.fork() as fork:
            if held:
                fork.rewind(rng.randint(0, held))
            with tally.lock:
                tally.submitted += 1
            more = llamax.SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0)
            settle(tally, fork.add_request([*fork.token_ids, *turn], more), False, False)
    elif action == "save" and held:
        path = tmp / f"{threading.get_ident()}-{rng.randrange(10**9)}.llamax"
        session.save(path)
        loaded = llamax.Session.load(ctx, path)
        path.unlink()
        session.close()
        return loaded
    return session


SESSION_TOKENS = 64
"""A session longer than this is rewound before its next turn. Half the threads hold a
session, so sessions pin at most ~``num_threads / 2 * 140`` cells: every request always
fits beside them, and one that waits forever is a bug, not the load. (With sessions of
600 tokens, 38 of them pinned 7,928 of the fake's 8,192 cells and the soak wedged with 94
sequences waiting and nothing running: issue 22, item 3.)"""


BURST = 72
"""Requests of one burst: above ggml's 64-row tile, so their decode steps are split (the
mixed load alone puts 64 decode rows in a step only now and then, since fair admission
gives each of many waiting requests one sequence before another's ``n > 1`` choices)."""


def soak(
    ctx: llamax.Context,
    num_requests: int,
    *,
    max_output: int,
    num_threads: int,
    seed: int,
    bursts: int = 0,
) -> Tally:
    """Run ``num_requests`` requests (session turns included) from ``num_threads``; half of
    them also hold a session. Beside them, one more thread sends ``bursts`` bursts of
    :data:`BURST` requests at once (counted in the total), so steps split amid the mix."""
    tally = Tally()

    def burster() -> None:
        rng = random.Random(seed * 1000 - 1)
        try:
            for _ in range(bursts):
                params = llamax.SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7)
                with tally.lock:
                    tally.submitted += BURST
                handles = [ctx.add_request(soak_prompt(rng), params) for _ in range(BURST)]
                for handle in handles:
                    settle(tally, handle, False, rng.random() < 0.1)
        except BaseException as exc:
            tally.note("crashed", problem=f"burster: {exc!r}")

    tmp = Path(tempfile.mkdtemp(prefix="llamax-soak-"))

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        session: llamax.Session | None = None
        try:
            while True:
                with tally.lock:
                    if tally.submitted >= num_requests:
                        break
                if k % 2 == 0 and rng.random() < 0.3:
                    try:
                        if session is None or session.closed:
                            session = ctx.session()
                        session = session_turn(ctx, rng, session, tally, tmp)
                        if rng.random() < 0.3:
                            session.close()
                    except llamax.SessionLoadError as exc:  # a valid file: a loss
                        tally.note("load refused", problem=f"Session.load: {exc!r}")
                    except llamax.SessionError as exc:  # every sequence id is held
                        with tally.lock:
                            tally.session_ops[type(exc).__name__] += 1
                    continue
                params, may_fail = soak_params(rng, max_output)
                with tally.lock:
                    tally.submitted += 1
                handle = ctx.add_request(soak_prompt(rng), params, priority=rng.randint(-1, 1))
                settle(tally, handle, may_fail, rng.random() < 0.25)
        except BaseException as exc:
            tally.note("crashed", problem=f"worker {k}: {exc!r}")
        finally:
            if session is not None:
                session.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(num_threads)]
    threads.append(threading.Thread(target=burster))
    for t in threads:
        t.start()
    for t in threads:
        t.join(SETTLE_S * 4)
    assert not any(t.is_alive() for t in threads), "a soak worker hung"
    for path in tmp.iterdir():
        path.unlink()
    tmp.rmdir()
    return tally


class DecodeCounter:
    """Wraps a backend's ``decode`` to count calls: more decodes than steps means steps
    were split."""

    def __init__(self, backend: Any) -> None:
        self.calls = 0
        self._decode = backend.decode
        backend.decode = self

    def __call__(self, items: Any) -> int:
        self.calls += 1
        status: int = self._decode(items)
        return status


KIB_PER_REQUEST = 4.0
MODEL_KIB_PER_REQUEST = 32.0
"""The real model's bound for the short soak (1,000 requests after a 200-request warm-up),
where RSS grew 20-30 KiB a request. The growth is llama.cpp's and the allocator's high-water
marks, each bounded by the configuration and not by the request count (read from
``/proc/PID/smaps`` during the 10,000-request soak): the KV and compute buffers (one 285 MiB
mapping, touched lazily as more cells are used: 213 -> 218 MiB resident), the output buffer,
which llama.cpp regrows to the most logits rows a step has asked for (a 32,068 KiB mapping
appeared when a step with drafts asked for 167 rows: 167 x 49,152 x 4 bytes; at most
``n_batch`` rows), and glibc's per-thread arenas for the 32 client threads (+-15 MiB). The
Python heap stays flat (tracemalloc, object counts). Short runs are still reaching those
marks; the full soak is past them (:data:`FULL_MODEL_KIB_PER_REQUEST`)."""
FULL_MODEL_KIB_PER_REQUEST = 8.0
"""The real model's bound over the full soak (10,000 requests after a 1,000-request warm-up,
outputs up to 256): measured 4.86 KiB a request (+48,600 KiB in all) on a 2-core Xeon; RSS
sampled every 30 s rose 575 -> 600 MiB over the first half, stayed within 1 MiB for 10
minutes, then stepped +20 MiB once (the output buffer) and +3 MiB (arenas). A leaked sampler
chain or grammar (several KiB of native memory a request) fails it."""
"""Resident growth allowed per request after the warm-up. Measured on the fake after a
1,000-request warm-up: +1.2 to +2.1 MiB over the next 1,000 requests, and then flat
(six rounds of 1,000: within +-0.1 MiB of each other): allocator noise, not growth. A
real leak is larger: one leaked request with its events and completion is ~5-20 KiB (the
fake's own decode log, before ``log_decodes=False``, was ~9 KiB a request and failed this
bound), a leaked sampler chain or grammar several KiB of native memory. With the fixed
slack below that allows 6 MiB over 1,000 requests (the old bound was 64 MiB)."""
RSS_SLACK_KIB = 2048
"""Fixed slack for one-off growth (a thread stack, an arena) independent of the count."""


def run_soak(
    ctx: llamax.Context,
    num_requests: int,
    *,
    max_output: int,
    num_threads: int,
    warm: int,
    require_split: bool = True,
    kib_per_request: float = KIB_PER_REQUEST,
) -> tuple[Tally, float]:
    """Warm up with ``warm`` requests (the prefix cache, the allocator's arenas and the
    samplers reach their steady size), then run ``num_requests`` and check everything."""
    decodes = DecodeCounter(ctx._engine.backend)
    # verify every proposal: under full batches the pricing would skip most drafts, and
    # the soak is about their bookkeeping (rollbacks in sessions, splits, cancels)
    ctx._engine.scheduler.price_drafts = False
    soak(ctx, warm, max_output=max_output, num_threads=num_threads, seed=0)
    gc.collect()
    before = rss_kib()
    steps_before, decodes_before = ctx.stats().num_steps, decodes.calls
    started = time.monotonic()
    tally = soak(
        ctx,
        num_requests,
        max_output=max_output,
        num_threads=num_threads,
        seed=1,
        bursts=3 if require_split else 0,
    )
    seconds = time.monotonic() - started
    gc.collect()
    grown = rss_kib() - before
    assert not tally.problems, f"{tally.outcomes}: " + "; ".join(tally.problems)
    assert sum(tally.outcomes.values()) == tally.submitted, tally  # every request settled
    assert tally.outcomes["done"] > num_requests // 2, tally.outcomes
    assert tally.outcomes["cancelled"] > num_requests // 10, tally.outcomes
    for op in ("rewind", "fork", "save"):
        assert tally.session_ops[op] > 0, tally.session_ops
    assert ctx.audit() == []
    stats = ctx.stats()
    assert stats.num_drafted_tokens > 0, stats
    split = decodes.calls - decodes_before > stats.num_steps - steps_before
    assert split or not require_split, f"no step was split into several decodes: {tally}"
    assert grown <= RSS_SLACK_KIB + kib_per_request * num_requests, (
        f"RSS grew by {grown} KiB over {num_requests} requests "
        f"({grown / num_requests:.2f} KiB per request)"
    )
    assert_idle(ctx, timeout=120)
    print(  # the soak's numbers, for the closing note (run with -s)
        f"\nsoak: {num_requests} requests in {seconds:.1f} s, RSS +{grown} KiB "
        f"({grown / num_requests:.2f} KiB/request), {tally.outcomes}, {tally.session_ops}"
    )
    return tally, seconds


def fake_context() -> tuple[llamax.Context, FakeBackend]:
    """Unified layout with CPU attention and 80 sequences: steps of 64 decode rows or more
    are split; 8192 cells so outputs of 256 tokens fit beside each other."""
    backend = FakeBackend(
        n_ctx=8192, n_seq_max=80, n_batch=256, cpu_attention=True, log_decodes=False
    )
    ctx = llamax.Context(backend=backend, speculative=llamax.PromptLookup())
    return ctx, backend


def _requests(default: int) -> int:
    return int(os.environ.get("LLAMAX_SOAK_REQUESTS", default))


@pytest.mark.timeout(600)
def test_mixed_soak_fake() -> None:
    ctx, _ = fake_context()
    with ctx:
        run_soak(ctx, 1_000, max_output=256, num_threads=48, warm=1_000)


@pytest.mark.soak
@pytest.mark.timeout(7200)
def test_mixed_soak_fake_full() -> None:
    ctx, _ = fake_context()
    with ctx:
        run_soak(ctx, _requests(10_000), max_output=256, num_threads=48, warm=1_000)


def _real(make_real: Callable[..., llamax.Context]) -> llamax.Context:
    # auto layout (the default): streams of 102 cells, unified (and split steps) beyond
    return make_real(n_ctx=8192, n_seq_max=80, n_batch=512, n_threads=2)


@pytest.mark.model
@pytest.mark.timeout(900)
def test_mixed_soak_model(make_real: Callable[..., llamax.Context]) -> None:
    # outputs this short (to fit the suite's time) rarely put 64 rows in one step: the
    # split is checked by the fake's soak and by the full one
    run_soak(
        _real(make_real),
        1_000,
        max_output=16,
        num_threads=32,
        warm=200,
        require_split=False,
        kib_per_request=MODEL_KIB_PER_REQUEST,
    )


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(14400)
def test_mixed_soak_model_full(make_real: Callable[..., llamax.Context]) -> None:
    run_soak(
        _real(make_real),
        _requests(10_000),
        max_output=256,
        num_threads=32,
        warm=1_000,
        kib_per_request=FULL_MODEL_KIB_PER_REQUEST,
    )
