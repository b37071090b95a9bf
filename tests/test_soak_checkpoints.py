"""Checkpoint soak (issue 40): mixed traffic on memories that cannot be cut.

On the random hybrid model (LFM2, ``scripts/make_memory_model.py``) and on the fake's
recurrent memory (``FakeBackend(recurrent=True)``, which checks at every decode that each
sequence's state is the one its own tokens lead to), several threads send at once:

- plain requests on a few shared system prompts, some extending an earlier prompt with its
  reply (a next turn), so prefixes are served from checkpoints, ``n`` up to 3;
- sessions: a turn, then a fork (rewound, continued), a rewind to the last turn's
  checkpoint, a save/load round trip through a file, or a refused history shift;
- ``ctx.chat()`` conversations outgrowing their ``max_context`` (the shift is refused on
  these memories: the turn recomputes);
- cancels while waiting or prefilling and after the first token;
- a small host-RAM prefix tier, so checkpoints are trimmed to its budget and evicted
  prefixes spill to it and come back.

Checked: every request settles, ``audit()`` is clean and the context ends idle
(``assert_idle``), checkpoint bytes (sampled all along) never exceed the budget, memory
grows by at most a few KiB a request over the second half, and greedy replies served from
checkpoints agree with cold runs: exactly on the (batch-invariant) fake; on the model,
within llama.cpp's batch noise (:func:`near_tie.forced_regrets`), and after the soak, where
the batch composition can be the same, exactly (logprobs to the bit).

The default suite runs 1,000 requests on the fake in each layout; ``pytest -m soak
tests/test_soak_checkpoints.py`` runs 400 on the model (unified) and 5,000 on each in each
layout (``LLAMAX_SOAK_REQUESTS`` overrides the count). The default run's checkpoints on the
model are tests/test_model_checkpoints.py's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import memory_model_files
import numpy as np
import pytest
from near_tie import forced_regrets
from test_soak import BLOCKS_PER_REQUEST, LIVE_KIB_PER_REQUEST, RSS_SLACK_KIB, memory

import llamax
from llamax.engine.kv import checkpoints
from llamax.testing import FakeBackend, assert_idle

INTERVAL = 32
"""The soak's checkpoint interval (the default, 1,024, is longer than its prompts)."""
SETTLE_S = 120.0
WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "light", "garden", "window"]
SYSTEMS = ["You are a helpful assistant. Answer briefly and precisely. " * k for k in (1, 2, 3)]
"""The chats' system prompts."""
HEAD_TOKENS = (24, 56, 100)
"""The plain requests' shared heads, in tokens: several checkpoint intervals, so a prompt
that parts from another inside one is cut at an interval's checkpoint."""
TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SOAK_RAM_BYTES = {"fake": 6 << 10, "hybrid": 64 << 10}
"""The RAM tier's budget, and so the checkpoints': a few saved prefixes (the hybrid model's
state is ~0.6 KiB a token) and fewer checkpoints than the slots would keep (the hybrid
model's are 1.1 KiB, at most 8 in each of 16 slots), so both are trimmed and spilled all
along."""
KIB_PER_REQUEST = 8.0
"""RSS growth allowed per request over the second half (besides :data:`RSS_SLACK_KIB`)."""
REGRET_NATS = 0.3
"""What a soak reply's token may lose against the cold probe's best pick on the model (a
reply computed on another sequence's state loses several nats on random weights)."""


@dataclass
class Tally:
    """What the soak did, counters only."""

    submitted: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    samples: list[tuple[array[int], array[int], int]] = field(default_factory=list)
    """Greedy single replies: (prompt, reply, cached tokens); arrays, not tuples of ints,
    which would grow Python's small objects as a leak does."""
    max_checkpoint_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[key] += 1
            if problem is not None and len(self.problems) < 20:
                self.problems.append(problem)

    def op(self, key: str) -> None:
        with self.lock:
            self.ops[key] += 1

    def count(self, num: int = 1) -> None:
        with self.lock:
            self.submitted += num

    def __repr__(self) -> str:
        return (
            f"Tally(submitted={self.submitted}, settled={sum(self.outcomes.values())}, "
            f"outcomes={dict(self.outcomes)}, ops={dict(self.ops)}, problems={self.problems})"
        )


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def settle(
    tally: Tally,
    handle: llamax.RequestHandle,
    cancel: str | None,
    prompt: list[int] | None = None,
) -> llamax.Completion | None:
    """Wait for ``handle`` (cancelled first: ``"early"`` at once, ``"late"`` after its first
    event); a greedy single reply of ``prompt`` is kept as a sample."""
    if cancel == "late":
        with contextlib.suppress(StopIteration, llamax.LlamaxError):
            next(iter(handle))
    if cancel is not None:
        handle.cancel()
    try:
        done = handle.result(timeout=SETTLE_S)
    except TimeoutError:
        tally.note("hung", f"{handle!r} did not settle in {SETTLE_S} s")
        return None
    except llamax.LlamaxError as exc:
        tally.note(type(exc).__name__, f"{handle!r}: {exc!r}")
        return None
    reasons = {choice.finish_reason for choice in done.choices}
    if not reasons <= {"stop", "length", "cancelled"}:
        tally.note("bad", f"{handle!r}: finish reasons {reasons}")
    cancelled = "cancelled" in reasons
    tally.note("cancelled" if cancelled else "done")
    if prompt is not None and not cancelled and done.usage.cached_tokens:
        with tally.lock:
            if len(tally.samples) < 400:
                tally.samples.append(
                    (array("i", prompt), array("i", done.token_ids), done.usage.cached_tokens)
                )
    return done


def cancel_mode(rng: random.Random) -> str | None:
    return rng.choice([None] * 6 + ["early", "late"])


def shared_head(ctx: llamax.Context, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of a long system prompt."""
    return ctx.tokenize(SYSTEMS[0] * 20)[:num_tokens]


def plain_request(
    ctx: llamax.Context, rng: random.Random, tally: Tally, turns: list[list[int]]
) -> None:
    """A prompt on a shared head, or a next turn of an earlier one (its prompt and reply)."""
    room = ctx.n_ctx_seq - 100  # twelve words and ten reply tokens must still fit a sequence
    with tally.lock:
        fitting = [turn for turn in turns if len(turn) <= room]
        earlier = rng.choice(fitting) if fitting and rng.random() < 0.3 else None
    head = earlier if earlier is not None else shared_head(ctx, rng.choice(HEAD_TOKENS))
    prompt = head + ctx.tokenize(" " + words(rng, 1, 12), add_special=False)
    n = rng.choice([1, 1, 1, 1, 2, 3])
    greedy = rng.random() < 0.7
    params = llamax.SamplingParams(
        max_tokens=rng.randint(1, 10),
        temperature=0.0 if greedy else 0.8,
        n=n,
        seed=rng.randrange(2**31),
        ignore_eos=True,
    )
    cancel = cancel_mode(rng)
    tally.count()
    handle = ctx.add_request(prompt, params)
    kept = prompt if greedy and n == 1 else None
    done = settle(tally, handle, cancel, kept)
    if done is not None and done.choices[0].finish_reason != "cancelled":
        with tally.lock:
            turns.append(prompt + list(done.choices[0].token_ids))
            del turns[:-16]


def session_turn(
    ctx: llamax.Context, rng: random.Random, session: llamax.Session, tally: Tally, tmp: Path
) -> llamax.Session:
    """A turn, then one KV operation: a fork (rewound and continued), a rewind (anywhere, or
    to the turn's checkpoint: the next turns then grow the session again across positions
    it took checkpoints at before), a save/load round trip, a history shift (refused), or
    none."""
    history = list(session.token_ids)
    if len(history) > 240:
        session.rewind(len(history) - rng.randint(0, 120))
        history = list(session.token_ids)
    prompt = history + ctx.tokenize(" " + words(rng, 2, 14), add_special=not history)
    params = llamax.SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0, ignore_eos=True)
    tally.count()
    cancel = rng.choice([None] * 9 + ["late"])
    settle(tally, session.add_request(prompt, params), cancel, prompt)
    action = rng.choice(["fork", "rewind", "save", "shift", "none"])
    tally.op(action)
    held = len(session.token_ids)
    if action == "fork":
        with session.fork() as fork:
            if held:
                fork.rewind(rng.randint(0, held))
            more = [*fork.token_ids, *ctx.tokenize(" " + words(rng, 1, 6), add_special=False)]
            tally.count()
            settle(tally, fork.add_request(more, params), None, more)
    elif action == "rewind" and rng.random() < 0.5:  # to the last checkpoint before it
        session.rewind(rng.randint(0, held))
        tally.op("rewound anywhere")
    elif action == "rewind" and held > len(prompt) - 1 > 0:
        session.rewind(held - (len(prompt) - 1))  # to the prompt's checkpoint, if it is kept
        tally.op(
            "rewound to a checkpoint"
            if len(session.token_ids) == len(prompt) - 1
            else "rewound before"
        )
    elif action == "save" and held:
        path = tmp / f"{threading.get_ident()}-{rng.randrange(10**9)}.llamax"
        session.save(path)
        loaded = llamax.Session.load(ctx, path)
        path.unlink()
        if loaded.token_ids != session.token_ids:
            tally.note("load", f"a loaded session holds {len(loaded.token_ids)} of {held} tokens")
        session.close()
        return loaded
    elif action == "shift" and held > 20:
        if session.shift(4, 12):
            tally.note("shift", "a history shift was taken on a memory that cannot be cut")
        if len(session.token_ids) != held:
            tally.note("shift", "a refused shift changed the session")
    return session


def chat_turn(chat: llamax.Chat, rng: random.Random, tally: Tally) -> None:
    params = llamax.SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0)
    tally.count()
    try:
        chat.send(words(rng, 3, 20), params)
    except llamax.LlamaxError as exc:
        tally.note(type(exc).__name__, f"chat turn: {exc!r}")
        return
    tally.note("done")
    dropped = chat.last_turn is not None and chat.last_turn.dropped_messages
    tally.op("chat turn dropped messages" if dropped else "chat turn")


def chat_context(ctx: llamax.Context, system: str) -> int:
    """A chat's ``max_context``: its system prompt and about two turns, so that older turns
    are dropped from the third or so on."""
    longest = len(ctx.tokenize(" ".join([max(WORDS, key=len)] * 20), add_special=False))
    return len(ctx.tokenize(system)) + 2 * longest + 60


def soak(ctx: llamax.Context, num_requests: int, *, num_threads: int, seed: int) -> Tally:
    """``num_requests`` requests (session and chat turns included) from ``num_threads``
    threads, with a monitor of the checkpoints' bytes beside them."""
    tally = Tally()
    turns: list[list[int]] = []
    tmp = Path(tempfile.mkdtemp(prefix="llamax-ck-soak-"))
    running = threading.Event()
    running.set()

    def monitor() -> None:
        last_audit = time.monotonic()
        while running.is_set():
            tally.max_checkpoint_bytes = max(
                tally.max_checkpoint_bytes, ctx.stats().checkpoint_bytes
            )
            if time.monotonic() - last_audit > 0.2:  # between steps, amid the traffic
                for problem in ctx.audit():
                    tally.note("audit", problem)
                last_audit = time.monotonic()
            time.sleep(0.005)

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        session: llamax.Session | None = None
        chat: llamax.Chat | None = None
        try:
            while True:
                with tally.lock:
                    if tally.submitted >= num_requests:
                        break
                roll = rng.random()
                if k % 3 == 0 and roll < 0.35:
                    try:
                        if session is None or session.closed:
                            session = ctx.session()
                        session = session_turn(ctx, rng, session, tally, tmp)
                        if rng.random() < 0.2:
                            session.close()
                    except llamax.SessionBusyError as exc:
                        tally.note("busy", f"session operation refused: {exc!r}")
                    except llamax.SessionError:  # every sequence id is held just now
                        tally.op("no sequence id")
                elif k % 3 == 1 and roll < 0.25:
                    if chat is None or rng.random() < 0.1:
                        if chat is not None:
                            chat.close()
                            chat = None
                        system = rng.choice(SYSTEMS)
                        try:
                            chat = ctx.chat(system=system, max_context=chat_context(ctx, system))
                        except llamax.SessionError:  # every sequence id is held just now
                            tally.op("no sequence id")
                            continue
                    chat_turn(chat, rng, tally)
                else:
                    plain_request(ctx, rng, tally, turns)
        except BaseException as exc:
            tally.note("crashed", f"worker {k}: {exc!r}")
        finally:
            if session is not None:
                session.close()
            if chat is not None:
                chat.close()

    watcher = threading.Thread(target=monitor)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SETTLE_S * 10)
    running.clear()
    watcher.join()
    assert not any(t.is_alive() for t in threads), "a soak worker hung"
    for path in tmp.iterdir():
        path.unlink()
    tmp.rmdir()
    return tally


def run_soak(
    ctx: llamax.Context, num_requests: int, *, num_threads: int, cold: Callable[[Tally], int]
) -> None:
    """Half the requests as a warm-up, then the other half measured; then every check."""
    budget = ctx.stats().prefix_ram_budget_bytes
    started = time.monotonic()
    first = soak(ctx, num_requests // 2, num_threads=num_threads, seed=1)
    gc.collect()
    before = memory()
    second = soak(ctx, num_requests - num_requests // 2, num_threads=num_threads, seed=2)
    seconds = time.monotonic() - started
    gc.collect()
    after = memory()
    stats = ctx.stats()
    for tally in (first, second):
        assert not tally.problems, f"{tally.outcomes}: " + "; ".join(tally.problems)
        assert sum(tally.outcomes.values()) == tally.submitted, f"a request did not settle: {tally}"
        assert tally.max_checkpoint_bytes <= budget, (tally.max_checkpoint_bytes, budget)
    ops = first.ops + second.ops
    outcomes = first.outcomes + second.outcomes
    for op in ("fork", "rewind", "save", "shift", "chat turn dropped messages"):
        assert ops[op] > 0, ops
    assert outcomes["cancelled"] > num_requests // 20, outcomes
    assert ctx.audit() == []
    assert_idle(ctx, timeout=60)
    assert stats.num_checkpoint_restores > num_requests // 10, stats
    assert stats.num_prefix_ram_restores > 0 and stats.num_prefix_ram_stores > 0, stats
    half = num_requests - num_requests // 2
    grown, live = after.rss - before.rss, after.live - before.live
    blocks = after.blocks - before.blocks
    assert grown <= RSS_SLACK_KIB + KIB_PER_REQUEST * half, (before, after)
    assert live <= RSS_SLACK_KIB + LIVE_KIB_PER_REQUEST * half, (before, after)
    assert blocks <= BLOCKS_PER_REQUEST * half, (before, after)
    compared = cold(first) + cold(second)
    most = max(first.max_checkpoint_bytes, second.max_checkpoint_bytes)
    print(  # the soak's numbers, for the closing note (run with -s)
        f"\ncheckpoint soak: {num_requests} requests in {seconds:.1f} s; "
        f"{stats.num_checkpoints} checkpoints, {stats.num_checkpoint_restores} restores, "
        f"{stats.num_prefix_ram_stores} RAM stores, {stats.num_prefix_ram_restores} RAM restores, "
        f"{stats.num_cached_tokens} cached of {stats.num_cached_tokens + stats.num_prefill_tokens} "
        f"prompt tokens; checkpoint bytes at most {most} "
        f"of {budget}; second half RSS {before.rss} -> {after.rss} KiB ({grown:+d}), "
        f"live {live:+d} KiB, blocks {blocks:+d}; {compared} replies compared cold; "
        f"{dict(outcomes)}; {dict(ops)}"
    )


def _requests(default: int) -> int:
    return int(os.environ.get("LLAMAX_SOAK_REQUESTS", default))


@pytest.fixture
def short_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoints, "CHECKPOINT_INTERVAL", INTERVAL)


# ---------------------------------------------------------------------- the fake
def fake_context(kv_layout: str) -> llamax.Context:
    n_seq_max = 24
    backend = FakeBackend(
        n_ctx=8192 if kv_layout == "unified" else 512 * n_seq_max,
        n_seq_max=n_seq_max,
        n_batch=128,
        recurrent=True,
        kv_layout=kv_layout,
        log_decodes=False,
        special_tokens={"<|im_start|>": 300, "<|im_end|>": 301},
    )
    return llamax.Context(
        backend=backend, prefix_ram_bytes=SOAK_RAM_BYTES["fake"], chat_template=TEMPLATE
    )


def fake_cold(tally: Tally) -> int:
    """The fake is batch-invariant: every sampled reply equals a cold run's exactly."""
    backend = FakeBackend(n_ctx=2048, n_seq_max=1, recurrent=True)
    with llamax.Context(backend=backend, autostart=False, prefix_cache=False) as probe:
        for prompt, reply, _ in tally.samples:
            params = llamax.SamplingParams(max_tokens=len(reply), temperature=0, ignore_eos=True)
            handle = probe.add_request(list(prompt), params)
            while probe.has_work():
                probe.process()
            assert list(handle.result(0).token_ids) == reply.tolist(), (prompt, reply)
    return len(tally.samples)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_checkpoint_soak_fake(short_interval: None, kv_layout: str) -> None:
    with fake_context(kv_layout) as ctx:
        run_soak(ctx, 1_000, num_threads=12, cold=fake_cold)


@pytest.mark.soak
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_checkpoint_soak_fake_full(short_interval: None, kv_layout: str) -> None:
    with fake_context(kv_layout) as ctx:
        run_soak(ctx, _requests(5_000), num_threads=16, cold=fake_cold)


# ---------------------------------------------------------------------- the hybrid model
@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    pytest.importorskip("gguf")
    return memory_model_files.write(tmp_path_factory.mktemp("soak_hybrid"), "hybrid", model_path)


def model_options(kv_layout: str) -> dict[str, Any]:
    return {
        "n_ctx": 8192 if kv_layout == "unified" else 512 * 10,
        "n_seq_max": 10,
        "n_batch": 256,
        "n_threads": 2,
        "kv_layout": kv_layout,
        "prefix_ram_bytes": SOAK_RAM_BYTES["hybrid"],
    }


def model_cold(path: Path) -> Callable[[Tally], int]:
    """Sampled replies against a probe with nothing cached, teacher-forced: every token
    within :data:`REGRET_NATS` of the probe's best pick (the soak batched them with others)."""

    def check(tally: Tally) -> int:
        with llamax.Context(
            path, n_ctx=2048, n_seq_max=1, n_threads=2, prefix_cache=False
        ) as probe:
            worst = 0.0
            for prompt, reply, cached in tally.samples:
                regrets = forced_regrets(probe, prompt.tolist(), reply.tolist())
                worst = max(worst, *regrets)
                assert max(regrets) < REGRET_NATS, (regrets, cached, len(prompt))
            print(f"\nworst regret of {len(tally.samples)} soak replies: {worst:.3f} nats")
        return len(tally.samples)

    return check


def exact_after(ctx: llamax.Context, path: Path, kv_layout: str) -> None:
    """On the idle soak context, a fresh prompt run twice (the second served from its
    checkpoint, its last token computed alone) and a next turn on it give the logprobs of a
    fresh context running the same requests: the batch composition is the same, so exactly."""
    fresh = llamax.Context(path, **{**model_options(kv_layout), "prefix_ram_bytes": 1 << 20})
    rng = np.random.default_rng(7)
    params = llamax.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(context: llamax.Context, prompt: list[int]) -> tuple[tuple[int, ...], list[float], int]:
        done = context.add_request(prompt, params).result(timeout=SETTLE_S)
        picks = [lp.logprob for lp in done.choices[0].logprobs or ()]
        return tuple(done.token_ids), picks, done.usage.cached_tokens

    with fresh:
        for k in range(3):
            prompt = rng.integers(100, 40_000, 70 + 20 * k).tolist()
            turn = [*prompt, *rng.integers(100, 40_000, 9).tolist()]
            got = [run(ctx, p) for p in (prompt, prompt, turn)]
            want = [run(fresh, p) for p in (prompt, prompt, turn)]
            cached = [0, len(prompt) - 1, len(prompt) - 1]
            assert [g[2] for g in got] == [w[2] for w in want] == cached
            assert [g[:2] for g in got] == [w[:2] for w in want]


def model_soak(path: Path, num_requests: int, kv_layout: str) -> None:
    with llamax.Context(path, **model_options(kv_layout)) as ctx:
        run_soak(ctx, num_requests, num_threads=8, cold=model_cold(path))
        exact_after(ctx, path, kv_layout)
        assert_idle(ctx)


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(600)
def test_checkpoint_soak_hybrid(short_interval: None, hybrid_model: Path) -> None:
    model_soak(hybrid_model, 400, "unified")


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_checkpoint_soak_hybrid_full(
    short_interval: None, hybrid_model: Path, kv_layout: str
) -> None:
    model_soak(hybrid_model, _requests(5_000), kv_layout)
