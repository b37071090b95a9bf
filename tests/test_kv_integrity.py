"""KV integrity on the fake backend: a request reads only KV computed from its own tokens,
under its own adapters, by its own model.

The fake is no kinder than llama.cpp: a copy between streams fills the destination's
buffer only at the next decode, state reads and writes act at once, and every decode
checks each cell's provenance (llamax.testing). The first tests show the fake catches
each wrong read; the rest drive the engine through the orders that used to produce one
(see tests/test_model_kv_integrity.py for the same orders on SmolLM2), and a random mix of
every feature that moves KV.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.engine.kv.kvcache import KVCache
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
Make = Callable[..., llamax.Context]


def item(seq_id: int, tokens: list[int], start: int = 0) -> BatchItem:
    return BatchItem(seq_id, tuple(tokens), start, (len(tokens) - 1,))


def text(s: str) -> list[int]:
    return [b + 1 for b in s.encode()]


# ---------------------------------------------------------------------- the fake itself
def test_a_state_read_before_the_queued_copy_ran_is_garbage() -> None:
    backend = FakeBackend(n_ctx=256, n_seq_max=4, kv_layout="streams")
    assert backend.decode([item(0, text("hello world"))]) == 0
    backend.seq_cp(0, 1)
    stale = backend.state_seq_get(1)  # the copy is queued: seq 1's buffer is empty
    backend.run_queued_copies()
    fresh = backend.state_seq_get(1)
    assert json.loads(stale)[0]["x"] and not json.loads(fresh)[0]["x"]
    assert backend.state_seq_set(2, stale)
    with pytest.raises(AssertionError, match="not computed from its own tokens"):
        backend.decode([item(2, text("!"), 11)])
    assert backend.state_seq_set(3, fresh)
    assert backend.decode([item(3, text("!"), 11)]) == 0


def test_a_state_written_into_a_copy_source_reaches_the_copy() -> None:
    backend = FakeBackend(n_ctx=256, n_seq_max=4, kv_layout="streams")
    other = FakeBackend(n_ctx=256, n_seq_max=4, kv_layout="streams")
    assert other.decode([item(0, text("other words"))]) == 0
    assert backend.decode([item(0, text("hello world"))]) == 0
    backend.seq_cp(0, 1)
    backend.seq_rm(0)
    assert backend.state_seq_set(0, other.state_seq_get(0))  # before the decode that copies
    with pytest.raises(AssertionError, match="another history"):
        backend.decode([item(1, text("!"), 11)])


def test_a_state_written_into_a_copy_destination_is_overwritten() -> None:
    backend = FakeBackend(n_ctx=256, n_seq_max=4, kv_layout="streams")
    assert backend.decode([item(0, text("hello world"))]) == 0
    assert backend.decode([item(2, text("other words"))]) == 0
    saved = backend.state_seq_get(2)
    backend.seq_cp(0, 1)
    backend.seq_rm(1)
    assert backend.state_seq_set(1, saved)  # the queued copy lands on it at the decode
    with pytest.raises(AssertionError, match="another history"):
        backend.decode([item(1, text("!"), 11)])


def test_kv_of_other_weights_or_adapters_is_caught(tmp_path: Path) -> None:
    backend = FakeBackend(n_ctx=256, n_seq_max=2)
    retrained = FakeBackend(n_ctx=256, n_seq_max=2, weights="w1")
    assert retrained.decode([item(0, text("hello"))]) == 0
    assert backend.state_seq_set(0, retrained.state_seq_get(0))  # llama.cpp takes it too
    with pytest.raises(AssertionError, match="computed by model 'w1'"):
        backend.decode([item(0, text("!"), 5)])
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF")
    backend.load_adapter("a", str(adapter))
    backend.set_adapters((("a", 1.0),))
    assert backend.decode([item(1, text("hello"))]) == 0
    backend.set_adapters(())
    with pytest.raises(AssertionError, match="adapters"):
        backend.decode([item(1, text("!"), 5)])


def test_a_shift_keeps_the_shifted_cells_but_not_cells_another_sequence_holds() -> None:
    backend = FakeBackend(n_ctx=256, n_seq_max=2)
    assert backend.decode([item(0, text("abcdefgh"))]) == 0
    assert backend.seq_rm(0, 2, 4) and backend.seq_add(0, 4, -1, -2) is None
    assert backend.decode([item(0, text("!"), 6)]) == 0  # a deliberate approximation
    backend.seq_cp(0, 1, 0, 7)
    backend.seq_rm(0, 1, 3)
    with pytest.raises(AssertionError, match="another sequence holds"):
        backend.seq_add(0, 3, -1, -2)


# ---------------------------------------------------------------------- the engine
@pytest.fixture
def make() -> Iterator[Make]:
    made: list[llamax.Context] = []

    def build(backend: FakeBackend, **options: Any) -> llamax.Context:
        ctx = llamax.Context(backend=backend, autostart=False, **options)
        made.append(ctx)
        return ctx

    yield build
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def run(ctx: llamax.Context, *handles: llamax.RequestHandle) -> list[llamax.Completion]:
    while not all(h.done() for h in handles):
        ctx.process()
    return [h.result(0) for h in handles]


def queue_runs(ctx: llamax.Context) -> int:
    return ctx._engine.scheduler.kv.num_queue_runs  # type: ignore[no-any-return]


LIST_A = "List A: apple river candle tiger violin mountain pencil ocean garden rocket. "
LIST_B = "List B: orange desert hammer falcon guitar valley marker island castle comet. "


@pytest.fixture(params=["guarded", "unguarded"])
def guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """With "unguarded" the KV cache never runs the memory's queue: the fake must then
    catch the wrong read (what the engine did before the fix)."""
    if request.param == "unguarded":
        monkeypatch.setattr(KVCache, "_run_queue", lambda self: None)
    return request.param == "guarded"


def expect(guarded: bool, body: Callable[[], None]) -> None:
    if guarded:
        body()
        return
    with pytest.raises((AssertionError, llamax.EngineError)):
        body()


def test_a_tier_restore_runs_the_queue_before_overwriting_a_copy_source(
    make: Make, guard: bool
) -> None:
    ctx = make(FakeBackend(n_ctx=1024, n_seq_max=2, kv_layout="streams"), prefix_ram_bytes=1 << 20)
    run(ctx, ctx.add_request(LIST_B + "Repeat B:", GREEDY))
    run(ctx, ctx.add_request(LIST_A + "Repeat A:", GREEDY))
    run(ctx, ctx.add_request("Zebras have stripes.", GREEDY))  # list B's slot to RAM

    def body() -> None:
        # copies A from its slot (it parts inside A's prompt: "Repeat A: apple", a next
        # turn parting in A's reply, would take A's slot over and copy nothing)
        x = ctx.add_request(LIST_A + "Repeat A! apple", GREEDY)
        y = ctx.add_request(LIST_B + "Repeat B: orange", GREEDY)  # restored over that slot
        done = run(ctx, x, y)
        assert done[0].usage.cached_tokens > 40
        assert ctx.stats().num_prefix_ram_restores == 1
        assert queue_runs(ctx) == 1

    expect(guard, body)
    if not guard:
        ctx.close()


def test_n_choices_survive_a_layout_move_before_their_copy_ran(make: Make, guard: bool) -> None:
    ctx = make(FakeBackend(n_ctx=1024, n_seq_max=4, kv_layout="auto"))
    assert ctx.kv_layout == "streams"

    def body() -> None:
        both = ctx.add_request("count: ab", llamax.SamplingParams(max_tokens=6, n=2, temperature=0))
        ctx.process()  # the prefill and the fork
        long = ctx.add_request("x" * 400, llamax.SamplingParams(max_tokens=2))
        done = run(ctx, both, long)
        assert ctx.stats().num_relayouts >= 1
        assert [c.text for c in done[0].choices] == ["cdefgh", "cdefgh"]

    expect(guard, body)
    if not guard:
        ctx.close()


def test_a_fork_saved_at_once_holds_the_forks_kv(make: Make, guard: bool, tmp_path: Path) -> None:
    ctx = make(FakeBackend(n_ctx=1024, n_seq_max=4, kv_layout="streams"))

    def body() -> None:
        with ctx.session() as session:
            run(ctx, session.add_request(LIST_A, GREEDY))
            with session.fork() as fork:
                fork.save(tmp_path / "fork.session")
        with llamax.Session.load(ctx, tmp_path / "fork.session") as loaded:
            done = run(ctx, loaded.add_request(LIST_A + "Repeat: abc", GREEDY))
        assert done[0].text == "defghi"

    expect(guard, body)
    if not guard:
        ctx.close()


# ---------------------------------------------------------------------- scarce ids
CHAT_HEAD = "<|im_start|>system\n"


def chat(i: int) -> str:
    return CHAT_HEAD + f"You are assistant {i}. " + "Answer briefly and politely. " * 3


@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_a_tier_restores_even_when_the_only_id_gives_a_shorter_prefix(
    make: Make, kv_layout: str
) -> None:
    # every chat prompt shares the template's head with the one retained slot; that slot
    # was protected as the "source", so with one sequence id the tier never restored
    ctx = make(FakeBackend(n_ctx=512, n_seq_max=1, kv_layout=kv_layout), prefix_ram_bytes=1 << 20)
    run(ctx, ctx.add_request(chat(0) + "Q1", GREEDY))
    run(ctx, ctx.add_request(chat(1) + "Q2", GREEDY))  # chat(0) to RAM
    before = ctx.stats()
    done = run(ctx, ctx.add_request(chat(0) + "Q3", GREEDY))[0]
    after = ctx.stats()
    assert after.num_prefix_ram_restores - before.num_prefix_ram_restores == 1
    assert done.usage.cached_tokens == len(chat(0)) + 1  # all but the question
    assert done.text == "abcdef"


def test_a_tier_restores_when_every_other_id_is_busy(make: Make) -> None:
    ctx = make(FakeBackend(n_ctx=1024, n_seq_max=2), prefix_ram_bytes=1 << 20)
    run(ctx, ctx.add_request(chat(0) + "Q1", GREEDY))  # id 0
    run(ctx, ctx.add_request(chat(1) + "Q2", GREEDY))  # id 1
    run(ctx, ctx.add_request(chat(2) + "Q3", GREEDY))  # chat(1) to RAM (chat(0) gave its head)
    busy = ctx.add_request(chat(3) + "Q4", llamax.SamplingParams(max_tokens=40, ignore_eos=True))
    ctx.process()  # holds id 1; id 0 keeps chat(0), which shares only the template's head
    assert ctx.stats().num_running == 1 and ctx.stats().num_retained == 1
    again = ctx.add_request(chat(1) + "Q5", GREEDY)
    done = run(ctx, again, busy)[0]
    assert ctx.stats().num_prefix_ram_restores == 1
    assert done.usage.cached_tokens == len(chat(1)) + 1


# ---------------------------------------------------------------------- everything at once
ADAPTERS: list[dict[str, float] | None] = [None, {"a": 1.0}, {"b": 0.5}]


def expected_text(
    prompt: str, lora: dict[str, float] | None, max_tokens: int, adapter: Path
) -> str:
    """What a cold run gives (the adapters loaded in the same order)."""
    backend = FakeBackend(n_ctx=2048, n_seq_max=1)
    ctx = llamax.Context(backend=backend, autostart=False, prefix_cache=False)
    try:
        for name in ("a", "b"):
            ctx.load_adapter(name, str(adapter))
        params = llamax.SamplingParams(max_tokens=max_tokens, temperature=0, lora=lora)
        return run(ctx, ctx.add_request(prompt, params))[0].text
    finally:
        ctx.close()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kv_layout", ["unified", "streams", "auto"])
def test_every_kv_move_in_random_orders_reads_only_its_own_kv(
    make: Make, tmp_path: Path, seed: int, kv_layout: str
) -> None:
    """Restores (RAM and disk), forks, n>1, relayouts, sessions saved and loaded, adapter
    sets and clear_cache in a random order, at sizes that split steps: every decode passes
    the fake's provenance check, and every greedy output is the one a cold run gives."""
    rng = random.Random(seed)
    n_seq_max = 4
    n_ctx = 1024 if kv_layout != "streams" else 256 * n_seq_max
    backend = FakeBackend(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=32, kv_layout=kv_layout)
    ctx = make(
        backend,
        prefix_ram_bytes=rng.choice([0, 6_000, 1 << 20]),
        prefix_disk_dir=str(tmp_path / "disk") if rng.random() < 0.5 else None,
    )
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"GGUF")
    for name in ("a", "b"):
        ctx.load_adapter(name, str(adapter))
    heads = [f"{h}) shared head number {h}. " * 3 for h in "PQR"]
    checks: list[tuple[llamax.RequestHandle, str, dict[str, float] | None, int]] = []
    sessions: list[llamax.Session] = []
    for step in range(40):
        action = rng.choice(["request", "request", "burst", "session", "fork", "clear", "long"])
        if action in ("request", "burst", "long"):
            for _ in range(1 if action != "burst" else rng.randint(2, 4)):
                lora = rng.choice(ADAPTERS)
                body = "x" * 150 if action == "long" and kv_layout == "auto" else ""
                prompt = rng.choice(heads) + body + f"q{step} " + "abcdefg"[: rng.randint(1, 7)]
                max_tokens = rng.randint(1, 8)
                n = rng.choice([1, 1, 2, 3])
                params = llamax.SamplingParams(max_tokens=max_tokens, n=n, temperature=0, lora=lora)
                handle = ctx.add_request(prompt, params)
                checks.append((handle, prompt, lora, max_tokens))
            for _ in range(rng.randint(0, 3)):
                ctx.process()
        elif action == "session" and len(sessions) < 2:
            try:
                session = ctx.session()
            except llamax.SessionError:
                continue  # no free sequence id now
            sessions.append(session)
            run(ctx, session.add_request(rng.choice(heads) + "session", GREEDY))
        elif action == "fork" and sessions:
            source = rng.choice(sessions)
            if source.token_ids and ctx.stats().num_running == 0:
                try:
                    fork = source.fork()
                except llamax.SessionError:
                    continue  # no free sequence id now
                path = tmp_path / f"fork{step}.session"
                fork.save(path)
                fork.close()
                loaded = llamax.Session.load(ctx, path)
                history = "".join(chr(t - 1) for t in loaded.token_ids)
                done = run(ctx, loaded.add_request(history + " more", GREEDY))[0]
                assert done.text == expected_text(history + " more", None, 6, adapter)
                loaded.close()
        elif action == "clear" and ctx.stats().num_running == 0:
            ctx.clear_cache()
    while ctx.has_work():
        ctx.process()
    for session in sessions:
        session.close()
    for handle, prompt, lora, max_tokens in checks:
        want = expected_text(prompt, lora, max_tokens, adapter)
        assert all(c.text == want for c in handle.result(0).choices), (prompt, lora)


@pytest.mark.parametrize("kv_layout", ["unified", "streams"])
def test_split_steps_with_every_kv_move_read_only_their_own_kv(
    make: Make, tmp_path: Path, kv_layout: str
) -> None:
    """The same mix with 70 requests at once: their decode rows are split over several
    decodes a step (CPU attention's 64-row tiles), and every decode passes provenance."""
    rng = random.Random(7)
    backend = FakeBackend(
        n_ctx=8192 if kv_layout == "unified" else 128 * 80,
        n_seq_max=80,
        n_batch=256,
        cpu_attention=True,
        kv_layout=kv_layout,
    )
    ctx = make(backend, prefix_ram_bytes=1 << 20, prefix_disk_dir=str(tmp_path / "disk"))
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"GGUF")
    for name in ("a", "b"):
        ctx.load_adapter(name, str(adapter))
    heads = [f"{h}) shared head number {h}. " * 3 for h in "PQR"]
    session = ctx.session()
    run(ctx, session.add_request(heads[0] + "session", GREEDY))
    fork = session.fork()  # its copy is queued when the burst arrives (with streams)
    checks = []
    for k in range(70):  # the base set's steps hold 64 rows and more (the sets take turns)
        lora = rng.choice(ADAPTERS[1:]) if k % 10 == 9 else None
        prompt = rng.choice(heads) + f"q{k} " + "abcdefg"[: rng.randint(1, 7)]
        params = llamax.SamplingParams(
            max_tokens=12, n=rng.choice([1, 1, 2]), temperature=0, lora=lora, ignore_eos=True
        )
        checks.append((ctx.add_request(prompt, params), prompt, lora))
    fork.save(tmp_path / "fork.session")
    steps_before = ctx.stats().num_steps
    decodes_before = len(backend.decode_log)
    while ctx.has_work():
        ctx.process()
    if kv_layout == "unified":  # llamax splits unified steps; streams have no shared span
        assert len(backend.decode_log) - decodes_before > ctx.stats().num_steps - steps_before
    for handle, prompt, lora in checks:
        want = expected_text(prompt, lora, 12, adapter)
        # ignore_eos: a cold run of 12 tokens gives the same letters
        assert all(c.text == want for c in handle.result(0).choices), (prompt, lora)
    fork.close()
    session.close()
