"""Mixed soak: every feature at once, from many threads, for thousands of requests.

Sessions are opened, forked, rewound, saved and loaded mid-run; requests use grammars
(some reach a dead end), speculation (prompt lookup), logits processors that fail, n up
to 8, two LoRA adapters in four sets, outputs up to 256 tokens, and a quarter are
cancelled; steps hold enough decode rows to be split, and prefixes move through the
host-RAM and disk tiers. A sample of greedy replies is compared with cold runs (exactly on
the fake, whose every decode also checks that each sequence reads only its own KV; up to
llama.cpp's near ties on the model). Nothing may be lost or leak: every request settles
within a bound (a result, a cancellation, or a typed error that its own features
explain), ``audit()`` is clean, the context ends idle, and resident memory grows by at
most a few KiB per request after a warm-up.

The default suite runs 1,000 requests on the fake backend; ``pytest -m soak
tests/test_soak.py`` runs 500 short ones on the real model and 10,000 of each, with outputs
up to 256 tokens (``LLAMAX_SOAK_REQUESTS`` overrides the count).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from adversaries import FlakyProcessor
from near_tie import assert_regrets_below, forced_regrets

import llamax
from llamax.backend.base import BatchItem
from llamax.testing import FakeBackend, assert_idle

SETTLE_S = 300.0
"""Bound on how long one request may take to settle (they need well under a second)."""
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "light", "garden", "window"]


GRAMMARS = ["root ::= [a-m]{0,6}", "root ::= [ab]{0,3}", "root ::= [a-z ]+"]
LORA_SETS: list[dict[str, float] | None] = [None, None, {"a": 1.0}, {"b": 0.5}, {"a": 0.5, "b": 1}]
"""The adapter sets requests pick from (a context with adapters "a" and "b" loaded)."""
SOAK_LORA_STRENGTH = 0.1
"""The model soak's random adapters move SmolLM2 as a fine-tune would: at 0.1 they change
the greedy reply of 64-85% of requests under them, and batch composition moves a reply's
teacher-forced regret by at most 0.12 nats (192 replies, prefix cache on and off). At
strength 1.0 the random adapters make the model chaotic: batch composition alone (prefix
cache off) parted replies from their cold runs in 19 of 48 requests, by up to 1.5 nats,
so no tolerance separates noise from wrong KV there (issue 36's closing note)."""
SOAK_REGRET_NATS = 2.0
"""What a soak reply's token may lose against the cold probe's best pick (auto layout).
Beside one busy process replies lost up to 1.18 nats (4 of 115 over 0.3 in one
2,000-request run, some with no cached token): the unified layout's batch noise, which a
busy service meets more often. With no KV shared at all (prefix cache off), 96 requests
batched unified part from their cold runs by up to 0.45 nats on the base model and 0.75
under these adapters, in streams by 0.0 and 0.32 (``benchmarks/results/issue36/``); the
same 2,000-request soak beside the same load pinned to streams kept all 115 replies under
0.3. 2.0 is above the noise and below what a reply computed on another prompt's KV loses
(1.6-17 nats, 15 of 16 over 2); adapter marks are checked exactly by the fake's provenance
and the LoRA regression tests. Every reply over 0.3 nats is printed."""
SOAK_STREAMS_REGRET_NATS = 0.5
"""The same bound in the streams layout, where batch noise stayed under 0.33 nats (quiet,
prefix cache off) and under 0.3 in the soak beside one busy process (cache and tiers on):
a tighter net for wrong KV (``test_mixed_soak_model_streams``)."""
NUM_SAMPLES = int(os.environ.get("LLAMAX_SOAK_SAMPLES", 24))
"""Greedy replies kept for the comparison with cold runs (a fixed number: not a leak)."""


_MALLINFO2_FIELDS = ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks"]
_MALLINFO2_FIELDS += ["fsmblks", "uordblks", "fordblks", "keepcost"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


SOAK_RAM_TIER = 1 << 20
FAKE_SOAK_RAM_TIER = SOAK_RAM_TIER // 4
"""The soaks' host-RAM prefix tier budget (bytes): bounded, within the growth allowance, and
filled before anything is measured (:func:`warm_ram_tier`). On SmolLM2 one entry of the
shortest stored prefix (32 tokens) is ~0.7 MiB, so a smaller budget would store nothing."""


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc 2.33+: RSS alone
        return None


_LIBC = _libc()


@dataclass(frozen=True)
class Memory:
    """One reading of the process's memory.

    ``rss`` is VmRSS in KiB after ``malloc_trim(0)``; ``live`` what ``malloc`` has handed
    out and not had back, in KiB (``mallinfo2().uordblks + hblkhd``: llama.cpp's buffers,
    sampler chains and grammars, numpy arrays, Python objects over 512 bytes); ``blocks``
    Python's small objects (``sys.getallocatedblocks()``). RSS also holds what glibc's
    arenas keep after a free, which fragments under 33 threads: on SmolLM2, over 2,000
    requests after the warm-up, the arenas' free lists grew 47 -> 99 MiB and RSS with them,
    while ``live`` grew 0.2 MiB. A leak grows ``live`` or ``blocks``; without glibc
    ``live`` is RSS."""

    rss: int
    live: int
    blocks: int


def memory() -> Memory:
    """Read :class:`Memory` now."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    live = rss
    if _LIBC is not None:
        info = _LIBC.mallinfo2()
        live = (info.uordblks + info.hblkhd) // 1024
    return Memory(rss, live, sys.getallocatedblocks())


@dataclass(frozen=True)
class Sample:
    """A greedy single-choice reply of the soak, for the comparison with cold runs."""

    prompt: str
    lora: dict[str, float] | None
    ignore_eos: bool
    tokens: tuple[int, ...]
    usage: llamax.Usage | None = None
    """How the reply was computed (cached and drafted tokens), for a failure's message."""


@dataclass
class Tally:
    """What a soak did (counters only: keeping handles would look like a leak)."""

    submitted: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    session_ops: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    """Greedy single-choice replies, for the comparison with cold runs."""
    max_samples: int = NUM_SAMPLES
    """The most :attr:`samples` kept."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, key: str, *, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[key] += 1
            if problem is not None and len(self.problems) < 20:
                self.problems.append(problem)

    def __repr__(self) -> str:  # the samples (token ids) would bury a failure's message
        return (
            f"Tally(submitted={self.submitted}, settled={sum(self.outcomes.values())}, "
            f"outcomes={dict(self.outcomes)}, session_ops={dict(self.session_ops)}, "
            f"problems={self.problems}, samples={len(self.samples)})"
        )


def output_length(rng: random.Random, max_output: int) -> int:
    """Mostly short outputs, a tenth up to ``max_output`` tokens."""
    if rng.random() < 0.1:
        return rng.randint(max_output // 2, max_output)
    return rng.randint(1, max(1, max_output // 8))


def soak_params(
    rng: random.Random, max_output: int, *, lora: bool = False
) -> tuple[llamax.SamplingParams, bool]:
    """Random params with every feature (LoRA sets with ``lora``); also whether its
    features may fail it."""
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
        lora=rng.choice(LORA_SETS) if lora else None,
    )
    return params, grammar is not None or bool(processors)


def soak_prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    start = rng.randrange(26)
    run = (ALPHABET[start:] + ALPHABET)[: rng.randint(0, 30)]  # prompt lookup finds drafts
    return rng.choice(["", "You are a helpful assistant. "]) + words + " " + run


def settle(
    tally: Tally,
    handle: llamax.RequestHandle,
    may_fail: bool,
    cancel: bool,
    sample: tuple[str, dict[str, float] | None, bool] | None = None,
) -> None:
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
    if sample is not None and "cancelled" not in reasons:
        with tally.lock:
            if len(tally.samples) < tally.max_samples:
                tally.samples.append(Sample(*sample, tuple(done.token_ids), done.usage))


def submit(tally: Tally, add: Callable[[], llamax.RequestHandle]) -> llamax.RequestHandle | None:
    """``add()``, a session's submission after its last request settled: an error there
    (busy, closed) is a problem, tallied as the request's outcome so that every submitted
    request still settles in the count."""
    try:
        return add()
    except llamax.LlamaxError as exc:
        tally.note(type(exc).__name__, problem=f"session submission refused: {exc!r}")
        return None


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
    handle = submit(tally, lambda: session.add_request(history + turn, params))
    if handle is not None:
        settle(tally, handle, False, rng.random() < 0.1)
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
            handle = submit(tally, lambda: fork.add_request([*fork.token_ids, *turn], more))
            if handle is not None:
                settle(tally, handle, False, False)
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
600 tokens, 38 of them pinned 7,928 of the fake's 8,192 cells, its size then, and the soak
wedged with 94 sequences waiting and nothing running: issue 22, item 3.)"""


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
    lora: bool = False,
    num_samples: int = NUM_SAMPLES,
) -> Tally:
    """Run ``num_requests`` requests (session turns included) from ``num_threads``; half of
    them also hold a session. Beside them, one more thread sends ``bursts`` bursts of
    :data:`BURST` requests at once (counted in the total), so steps split amid the mix."""
    tally = Tally(max_samples=num_samples)

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
                    except llamax.SessionBusyError as exc:  # every request had settled
                        with tally.lock:
                            tally.problems.append(f"session operation refused: {exc!r}")
                    except llamax.SessionError as exc:  # every sequence id is held
                        with tally.lock:
                            tally.session_ops[type(exc).__name__] += 1
                    continue
                params, may_fail = soak_params(rng, max_output, lora=lora)
                with tally.lock:
                    tally.submitted += 1
                prompt = soak_prompt(rng)
                handle = ctx.add_request(prompt, params, priority=rng.randint(-1, 1))
                plain = params.is_greedy and params.n == 1 and not may_fail
                kept = plain and not params.stop
                sample = (prompt, params.lora, params.ignore_eos) if kept else None
                settle(tally, handle, may_fail, rng.random() < 0.25, sample)
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


def closing_burst(ctx: llamax.Context, tally: Tally, decodes: DecodeCounter, *, seed: int) -> None:
    """:data:`BURST` requests at once on the engine the soak has left idle, none cancelled,
    each generating :data:`CLOSING_BURST_TOKENS`, submitted while ``decodes`` are held: all
    are decoding before the first ends, so steps hold ``BURST`` decode rows, past the 64-row
    tile, in the fake's unified cache, whose used span is then many times what a row attends
    to; they split by construction.

    Submitted without the hold, the burst trickled in: the fake's steps are quick, so the
    engine ran the first requests' decodes while the rest were still being added (a fresh
    fake engine reached at most 45 decode rows a step; with the submitter slowed 20 ms a
    request, 2), and one CI run measured no split step at all.

    The bursts amid the mix usually split too (47-79 split steps in 16 runs beside a busy
    process), but not always: a quiet fresh-clone run measured 4,868 decodes in 4,868 steps
    (cause not pinned down: the workers' sequences, ``n > 1`` choices and sessions hold ids
    and cells the bursts then wait for)."""
    rng = random.Random(seed * 1000 - 2)
    # speculation off: a row with drafts feeds several tokens, and only single-token decode
    # rows are split (the soak's prompts end in alphabet runs that prompt lookup drafts
    # from, so with it on a CI run measured 4,453 decodes in 4,453 steps, burst included)
    params = llamax.SamplingParams(
        max_tokens=CLOSING_BURST_TOKENS, ignore_eos=True, temperature=0.7, speculative=False
    )
    with tally.lock:
        tally.submitted += BURST
    steps, calls = ctx.stats().num_steps, decodes.calls
    with decodes.held():
        prompts = [soak_prompt(rng)[:CLOSING_BURST_PROMPT] for _ in range(BURST)]
        handles = [ctx.add_request(prompt, params) for prompt in prompts]
    for handle in handles:
        settle(tally, handle, False, False)
    steps, calls = ctx.stats().num_steps - steps, decodes.calls - calls
    assert calls > steps, (
        f"the closing burst split no step: {calls} decodes in {steps} steps "
        f"({ctx.stats().sequences.num_preemptions} preemptions so far)"
    )


CLOSING_BURST_TOKENS = 128
"""Many more than the steps the burst's prefills take (:data:`CLOSING_BURST_PROMPT`), so
every request of the burst is decoding before the first ends."""
CLOSING_BURST_PROMPT = 24
"""Characters of each closing-burst prompt (the fake: a token each). With whole soak
prompts (11-199 tokens, 8,156 in all: 32 or more steps of ``n_batch`` = 256, more where
the step budget gives decoding rows the time) the first requests could finish decoding
before the last had finished their prefill, and the burst ran in waves: a fresh-clone
run (2026-12-03) measured 333 decodes in 333 steps, no step split, and with 64 tokens
instead of 128, 2 runs of 9 failed so. 72 prompts of 24 tokens take 7 steps or more."""


class DecodeCounter:
    """Wraps a backend's ``decode`` to count calls: more decodes than steps means steps
    were split. :meth:`held` holds every decode back while a burst is submitted."""

    def __init__(self, backend: Any) -> None:
        self.calls = 0
        self._decode = backend.decode
        self._open = threading.Event()
        self._open.set()
        backend.decode = self

    def __call__(self, items: Any) -> int:
        self._open.wait()
        self.calls += 1
        status: int = self._decode(items)
        return status

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No decode runs inside the block (the engine waits in the one it began), so
        the requests submitted there all wait together when it ends."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()


KIB_PER_REQUEST = 4.0
FULL_MODEL_KIB_PER_REQUEST = 8.0
"""The real model's bound over the full soak (10,000 requests after a 1,000-request warm-up,
outputs up to 256): measured 4.86 KiB a request (+48,600 KiB in all) on a 2-core Xeon; RSS
sampled every 30 s rose 575 -> 600 MiB over the first half, stayed within 1 MiB for 10
minutes, then stepped +20 MiB once (the output buffer) and +3 MiB (arenas). A leaked sampler
chain or grammar (several KiB of native memory a request) fails it.

The short model soak (1,000 requests after 200) checks no RSS bound: there RSS grew 10-45
KiB a request, all of it high-water marks bounded by the configuration, not by the request
count, and reached or not within 1,000 requests by chance (``/proc/PID/smaps``,
``mallinfo2``): the KV and compute buffers (one 285 MiB mapping, touched lazily as more
cells are used), the output buffer, which llama.cpp regrows to the most logits rows one
decode has asked for (32 MiB for 167 rows, the whole allowance at once; a fresh clone
failed with +45 MiB), and the free lists of glibc's 16 arenas, fragmenting under 33
threads (47 -> 99 MiB free over 2,000 requests while ``live`` grew 0.2 MiB). It checks
what a leak grows instead, ``live`` and ``blocks`` (:class:`Memory`), against bounds a
leaked sampler chain, grammar or request breaks."""
"""Resident growth allowed per request after the warm-up. Measured on the fake after a
1,000-request warm-up: +1.2 to +2.1 MiB over the next 1,000 requests, and then flat
(six rounds of 1,000: within +-0.1 MiB of each other): allocator noise, not growth. A
real leak is larger: one leaked request with its events and completion is ~5-20 KiB (the
fake's own decode log, before ``log_decodes=False``, was ~9 KiB a request and failed this
bound), a leaked sampler chain or grammar several KiB of native memory. With the fixed
slack below that allows 6 MiB over 1,000 requests (the old bound was 64 MiB)."""
LIVE_KIB_PER_REQUEST = 4.0
"""``malloc``'d and not freed growth allowed per request after the warm-up (every soak):
measured +0.11-0.16 KiB a request on SmolLM2 and the fake. A leaked sampler chain or
grammar is several KiB of it a request."""
BLOCKS_PER_REQUEST = 20.0
"""Python small-object growth allowed per request after the warm-up (every soak): measured
+1,610 and +9,123 blocks over 1,000 requests on the fake, +78 and +385 on SmolLM2. One
leaked request (its handle, events, tokens and completion) is far more than 20."""
RSS_SLACK_KIB = 2048
"""Fixed slack for one-off growth (a thread stack, an arena) independent of the count."""


def fill_output_buffer(ctx: llamax.Context) -> None:
    """Reach llama.cpp's output-buffer high-water mark before anything is measured.

    llama.cpp regrows its logits buffer to the most output rows one decode has asked for,
    and the kernel maps its pages as they are first written. So the first step with more
    rows than any before raises RSS once by up to ``rows x n_vocab x 4`` bytes (32 MiB for
    167 rows of SmolLM2), wherever in the run it happens: in a 1,000-request window that is
    the whole allowance. One decode here asks for the most a decode can carry (``n_batch``
    rows, spread over fresh sequences of at most a stream each) on the idle engine, so the
    buffer is as large, and as resident, as it will ever be. A leak still grows past it.
    """
    engine = ctx._engine
    with engine._step_lock:  # the engine is idle: no step runs beside this
        kv, backend = engine.scheduler.kv, engine.backend
        per_seq = min(kv.cells_per_seq, backend.n_batch)
        slots, items, offset = [], [], 0
        while offset < backend.n_batch:
            slot = kv.allocate()
            assert slot is not None, "no free sequence id for the output-buffer fill"
            num = min(per_seq, backend.n_batch - offset)
            tokens = [backend.facts.bos_token_id or 0] * num
            items.append(BatchItem(slot.seq_id, tokens, 0, tuple(range(offset, offset + num))))
            kv.append(slot, tokens)
            slots.append(slot)
            offset += num
        try:
            assert backend.decode(items) == 0
            backend.batch_logits(offset).sum()  # read every row
        finally:
            for slot in slots:
                kv.release(slot)
    assert ctx.audit() == []


def warm_ram_tier(
    ctx: llamax.Context, *, max_output: int, num_threads: int, chunk: int, lora: bool = False
) -> None:
    """Run more warm-up rounds (``chunk`` requests each, at most 8) until the host-RAM
    prefix tier has been full: it has dropped an entry to stay within its budget.

    The tier fills its budget by design, bounded by the configuration and not by the request
    count. On the fake, 1,000 requests stored ~300 KiB, so a 1 MiB tier kept filling through
    the measured window: ``live`` grew by the tier's ~1 MiB, and RSS by that plus the heap
    fragmentation of churning its states through 48 threads' arenas (a CI run: +8.4 MiB,
    past the 6 MiB allowance; 2.3-3.8 MiB here). Once it has been full it holds within one
    entry of its budget, less what restores took back into KV, and what grows past that is
    a leak again."""
    ram = ctx._engine.scheduler.prefix.ram
    rounds = 0
    while ram.is_enabled and ram.stats().num_dropped == 0:
        assert rounds < 8, f"the RAM tier did not fill in {rounds} warm-up rounds: {ctx.stats()}"
        rounds += 1
        soak(
            ctx, chunk, max_output=max_output, num_threads=num_threads, seed=100 + rounds, lora=lora
        )


def run_soak(
    ctx: llamax.Context,
    num_requests: int,
    *,
    max_output: int,
    num_threads: int,
    warm: int,
    require_split: bool = True,
    kib_per_request: float | None = KIB_PER_REQUEST,
    fill_outputs: bool = False,
    lora: bool = False,
    cold: Callable[[Sample], None] | None = None,
    num_samples: int = NUM_SAMPLES,
) -> tuple[Tally, float]:
    """Warm up with ``warm`` requests (the prefix cache, the allocator's arenas and the
    samplers reach their steady size), then run ``num_requests`` and check everything:
    RSS growth against ``kib_per_request`` (None: not RSS, see
    :data:`FULL_MODEL_KIB_PER_REQUEST`), and allocated memory and Python objects always."""
    if fill_outputs:
        fill_output_buffer(ctx)
    decodes = DecodeCounter(ctx._engine.backend)
    # verify every proposal: under full batches the pricing would skip most drafts, and
    # the soak is about their bookkeeping (rollbacks in sessions, splits, cancels)
    ctx._engine.scheduler.drafts.priced = False
    # the warm-up runs the same mix (LoRA sets included: llama.cpp's graph and compute
    # buffers under adapters reach their size there, not in the measured window)
    soak(ctx, warm, max_output=max_output, num_threads=num_threads, seed=0, lora=lora)
    warm_ram_tier(ctx, max_output=max_output, num_threads=num_threads, chunk=warm, lora=lora)
    gc.collect()
    before = memory()
    steps_before, decodes_before = ctx.stats().num_steps, decodes.calls
    started = time.monotonic()
    tally = soak(
        ctx,
        num_requests,
        max_output=max_output,
        num_threads=num_threads,
        seed=1,
        bursts=3 if require_split else 0,
        lora=lora,
        num_samples=num_samples,
    )
    if require_split:
        closing_burst(ctx, tally, decodes, seed=1)
    seconds = time.monotonic() - started
    gc.collect()
    after = memory()
    grown, live = after.rss - before.rss, after.live - before.live
    blocks = after.blocks - before.blocks
    assert not tally.problems, f"{tally.outcomes}: " + "; ".join(tally.problems)
    assert sum(tally.outcomes.values()) == tally.submitted, f"a request did not settle: {tally}"
    assert tally.outcomes["done"] > num_requests // 2, tally.outcomes
    assert tally.outcomes["cancelled"] > num_requests // 10, tally.outcomes
    for op in ("rewind", "fork", "save"):
        assert tally.session_ops[op] > 0, tally.session_ops
    assert ctx.audit() == []
    stats = ctx.stats()
    assert stats.num_drafted_tokens > 0, stats
    split = decodes.calls - decodes_before > stats.num_steps - steps_before
    assert split or not require_split, (
        f"no step was split into several decodes ({decodes.calls - decodes_before} decodes "
        f"in {stats.num_steps - steps_before} steps): {tally}"
    )
    assert kib_per_request is None or grown <= RSS_SLACK_KIB + kib_per_request * num_requests, (
        f"RSS grew by {grown} KiB over {num_requests} requests "
        f"({grown / num_requests:.2f} KiB per request; {before} -> {after})"
    )
    assert live <= RSS_SLACK_KIB + LIVE_KIB_PER_REQUEST * num_requests, (
        f"allocated memory grew by {live} KiB over {num_requests} requests "
        f"({live / num_requests:.2f} KiB per request; {before} -> {after})"
    )
    assert blocks <= BLOCKS_PER_REQUEST * num_requests, (
        f"Python objects grew by {blocks} blocks over {num_requests} requests "
        f"({blocks / num_requests:.2f} per request; {before} -> {after})"
    )
    assert_idle(ctx, timeout=120)
    if cold is not None:  # every sampled reply is what a cold run gives
        assert len(tally.samples) >= num_samples // 2, len(tally.samples)
        assert not lora or {s.lora is not None for s in tally.samples} == {True, False}
        for sample in tally.samples:
            cold(sample)
    print(  # the soak's numbers, for the closing note (run with -s)
        f"\nsoak: {num_requests} requests in {seconds:.1f} s, RSS +{grown} KiB "
        f"({grown / num_requests:.2f} KiB/request), live +{live} KiB, blocks +{blocks}, "
        f"{tally.outcomes}, {tally.session_ops}"
    )
    return tally, seconds


def fake_context() -> tuple[llamax.Context, FakeBackend]:
    """Unified layout with CPU attention and 160 sequences: steps of 64 decode rows or more
    are split; 16,384 cells so outputs of 256 tokens fit beside each other.

    With 80 sequences the split was luck: the 24 sessions pin a sequence each between
    turns and the other workers hold one or more, so a burst of :data:`BURST` found ~30
    free and reached 64 decode rows only when it met the workers' own decodes. Under a
    loaded CI machine no measured step of the soak held 64 rows (1 run in 3 with two busy
    loops beside it; histograms of rows per step in the commit)."""
    backend = FakeBackend(
        n_ctx=16384, n_seq_max=160, n_batch=256, cpu_attention=True, log_decodes=False
    )
    # the host-RAM prefix tier holds up to its budget by design: a 1 MiB one fits in the
    # growth allowance, so what the soak measures is still a leak
    # a quarter of the model soak's: 1,000 requests fill it (~300 KiB), so the warm-up is
    # one round; with 1 MiB it took 2-4 more, and 2 of 14 runs then measured no split step
    # (8 of 8 split with 256 KiB; cause not pinned down: the bursts meet a fuller tier)
    disk = Path(tempfile.mkdtemp(prefix="llamax-soak-disk-"))
    ctx = llamax.Context(
        backend=backend,
        speculative=llamax.PromptLookup(),
        prefix_ram_bytes=FAKE_SOAK_RAM_TIER,
        prefix_disk_dir=str(disk),
        prefix_disk_bytes=4 << 20,
    )
    adapter = disk / "adapter.gguf"
    adapter.write_bytes(b"GGUF")  # the fake takes any such file: "b" moves letters 2 places
    for name in ("a", "b"):
        ctx.load_adapter(name, str(adapter))
    return ctx, backend


def fake_cold(sample: Sample) -> None:
    """The fake is batch-invariant: a reply equals the cold run's exactly."""
    prompt, lora, tokens = sample.prompt, sample.lora, sample.tokens
    probe = llamax.Context(
        backend=FakeBackend(n_ctx=2048, n_seq_max=1), autostart=False, prefix_cache=False
    )
    with probe, tempfile.TemporaryDirectory() as folder:
        adapter = Path(folder) / "adapter.gguf"
        adapter.write_bytes(b"GGUF")
        for name in ("a", "b"):
            probe.load_adapter(name, str(adapter))
        params = llamax.SamplingParams(
            max_tokens=len(tokens), temperature=0, lora=lora, ignore_eos=sample.ignore_eos
        )
        handle = probe.add_request(prompt, params)
        while probe.has_work():
            probe.process()
        got = tuple(handle.result(0).token_ids)
        assert got[: len(tokens)] == tokens, (prompt, lora, tokens, got)


def _requests(default: int) -> int:
    return int(os.environ.get("LLAMAX_SOAK_REQUESTS", default))


@pytest.mark.timeout(600)
def test_mixed_soak_fake() -> None:
    # In an interpreter of its own: RSS then measures this soak, not the heap that the
    # suite's earlier tests left fragmented (in one suite process it grew 8.4 MiB in CI,
    # and past the bound once more here, where alone it grows -0.7 to +1.8 MiB).
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_soak; test_soak.fake_soak(1_000)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=540, check=False
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def fake_soak(num_requests: int) -> None:
    """The fake soak: ``num_requests`` after a 1,000-request warm-up (see :func:`run_soak`)."""
    ctx, _ = fake_context()
    with ctx:
        run_soak(
            ctx, num_requests, max_output=256, num_threads=48, warm=1_000, lora=True, cold=fake_cold
        )


@pytest.mark.soak
@pytest.mark.timeout(7200)
def test_mixed_soak_fake_full() -> None:
    ctx, _ = fake_context()
    with ctx:
        run_soak(
            ctx,
            _requests(10_000),
            max_output=256,
            num_threads=48,
            warm=1_000,
            lora=True,
            cold=fake_cold,
        )


def _real(
    make_real: Callable[..., llamax.Context], tmp: Path, *, layout: str = "auto"
) -> tuple[llamax.Context, Callable[[Sample], None]]:
    """The model soak's context (auto layout, the default: streams of 102 cells, unified and
    split steps beyond) with two random LoRA adapters of :data:`SOAK_LORA_STRENGTH` and the
    disk tier, and the cold check of its sampled replies: teacher-forced on a probe with the
    same adapters, every token within :data:`SOAK_REGRET_NATS` of the probe's best pick.
    With ``layout="streams"``: streams of 256 cells only, and the tighter
    :data:`SOAK_STREAMS_REGRET_NATS`."""
    adapters = {
        name: str(_write_adapter(tmp / f"{name}.gguf", seed=k, strength=SOAK_LORA_STRENGTH))
        for k, name in enumerate("ab")
    }
    streams = layout == "streams"
    ctx = make_real(
        n_ctx=80 * 256 if streams else 8192,
        kv_layout=layout,
        n_seq_max=80,
        n_batch=512,
        n_threads=2,
        prefix_ram_bytes=SOAK_RAM_TIER,
        prefix_disk_dir=str(tmp / "disk"),
        prefix_disk_bytes=256 << 20,
        lora=adapters,
    )
    probe = make_real(n_ctx=1024, n_seq_max=1, n_threads=2, prefix_cache=False, lora=adapters)
    backend = probe._engine.backend
    eog = [t for t in range(backend.facts.n_vocab) if backend.is_eog(t)]

    def cold(sample: Sample) -> None:
        regrets = forced_regrets(
            probe,
            probe.tokenize(sample.prompt),
            sample.tokens,
            lora=sample.lora,
            banned=eog if sample.ignore_eos else (),
        )
        if max(regrets, default=0.0) >= 0.3:
            print(f"soak reply over 0.3 nats: {[round(r, 3) for r in regrets]} {sample}")
        try:
            nats = SOAK_STREAMS_REGRET_NATS if streams else SOAK_REGRET_NATS
            assert_regrets_below(regrets, sample.tokens, nats=nats, lora=sample.lora)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (prompt {sample.prompt!r}; {sample.usage})") from None

    return ctx, cold


def _write_adapter(path: Path, seed: int, strength: float = 1.0) -> Path:
    from script_modules import load_script

    module = load_script("make_lora_adapter")
    written: Path = module.write_lora_adapter(path, seed=seed, strength=strength)
    return written


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(900)
def test_mixed_soak_model(make_real: Callable[..., llamax.Context], tmp_path: Path) -> None:
    # outputs this short (to fit the suite's time) rarely put 64 rows in one step: the
    # split is checked by the fake's soak and by the full one. 500 requests: 1,000 took
    # 217 s of the default run on an AVX2 EPYC (the `soak` marker's runs are longer)
    _short_model_soak(make_real, tmp_path, 500)


def _short_model_soak(
    make_real: Callable[..., llamax.Context],
    tmp: Path,
    num_requests: int,
    *,
    layout: str = "auto",
    num_samples: int = NUM_SAMPLES,
) -> None:
    """The short model soak: 16-token outputs, 32 client threads, 200 warm-up requests,
    LoRA and the cold check; no RSS bound (see :data:`FULL_MODEL_KIB_PER_REQUEST`)."""
    ctx, cold = _real(make_real, tmp, layout=layout)
    run_soak(
        ctx,
        num_requests,
        max_output=16,
        num_threads=32,
        warm=200,
        require_split=False,
        kib_per_request=None,
        fill_outputs=True,
        lora=True,
        cold=cold,
        num_samples=num_samples,
    )


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(3600)
def test_mixed_soak_model_streams(make_real: Callable[..., llamax.Context], tmp_path: Path) -> None:
    """The short model soak, twice as long, pinned to the streams layout (every KV-sharing
    path but the unified one: copies between streams, the RAM and disk tiers, sessions,
    ``n > 1``, LoRA), where batch noise is small enough to check 200 replies against their
    cold runs at :data:`SOAK_STREAMS_REGRET_NATS`."""
    _short_model_soak(make_real, tmp_path, 2_000, layout="streams", num_samples=200)


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(14400)
def test_mixed_soak_model_full(make_real: Callable[..., llamax.Context], tmp_path: Path) -> None:
    ctx, cold = _real(make_real, tmp_path)
    run_soak(
        ctx,
        _requests(10_000),
        max_output=256,
        num_threads=32,
        warm=1_000,
        kib_per_request=FULL_MODEL_KIB_PER_REQUEST,
        fill_outputs=True,
        lora=True,
        cold=cold,
    )
