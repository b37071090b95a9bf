"""The host-RAM prefix tier (llamax.engine.kv.prefix_ram) against the fake backend: evicted
prefixes are stored, restored instead of recomputed, kept within their byte budget, and a
state that does not load or does not hold what it claims is refused and recomputed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import llamax
from llamax.engine.kv.prefix_ram import MAX_DEFAULT_BYTES, PrefixRamTier, default_budget
from llamax.flags import option_values
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0)
MB = 1 << 20


def system(i: int) -> str:
    """A ~90-token system prompt (byte-level fake: one token per byte) that shares not even
    its first token with another's."""
    return (
        f"{'ABCDEFGHIJ'[i]}) You are assistant number {i}. " + "Answer briefly and politely. " * 2
    )


Make = Callable[..., tuple[llamax.Context, FakeBackend]]


@pytest.fixture(params=["unified", "streams"])
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """``(Context, FakeBackend)`` with one sequence id per ``n_seq_max`` and a RAM tier;
    each is leak-checked (tier included) and closed after the test."""
    layout = str(request.param)
    made: list[llamax.Context] = []

    def build(
        *, n_seq_max: int = 1, prefix_ram_bytes: int | None = MB, **options: Any
    ) -> tuple[llamax.Context, FakeBackend]:
        n_ctx = 512 * n_seq_max if layout == "streams" else 512
        backend = FakeBackend(n_ctx=n_ctx, n_seq_max=n_seq_max, kv_layout=layout, **options)
        ctx = llamax.Context(backend=backend, autostart=False, prefix_ram_bytes=prefix_ram_bytes)
        made.append(ctx)
        return ctx, backend

    yield build
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def complete(ctx: llamax.Context, prompt: str) -> llamax.Completion:
    handle = ctx.add_request(prompt, GREEDY)
    while ctx.has_work():
        ctx.process()
    return handle.result(0)


def cold(prompt: str) -> llamax.Completion:
    ctx = llamax.Context(
        backend=FakeBackend(n_ctx=2048, n_seq_max=1), autostart=False, prefix_ram_bytes=0
    )
    try:
        return complete(ctx, prompt)
    finally:
        ctx.close()


def computed(ctx: llamax.Context, prompt: str) -> tuple[llamax.Completion, int]:
    """Run ``prompt``; return it and the prompt tokens computed for it."""
    before = ctx.stats().num_prefill_tokens
    done = complete(ctx, prompt)
    return done, ctx.stats().num_prefill_tokens - before


# ---------------------------------------------------------------------- engine
def test_an_evicted_prefix_is_restored_instead_of_recomputed(make: Make) -> None:
    ctx, _ = make()
    complete(ctx, system(0) + "A1?")
    assert ctx.stats().prefix_ram_entries == 0  # retained in KV, not yet evicted
    complete(ctx, system(1) + "B2?")  # takes the only sequence id: system(0) goes to RAM
    stats = ctx.stats()
    assert (stats.prefix_ram_entries, stats.num_prefix_ram_stores) == (1, 1)
    assert 0 < stats.prefix_ram_bytes <= stats.prefix_ram_budget_bytes == MB
    done, num = computed(ctx, system(0) + "C3?")
    assert num == 3  # only "C3?"
    assert done.usage.cached_tokens == len(system(0))
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    stats = ctx.stats()
    assert (stats.num_prefix_ram_hits, stats.num_prefix_ram_restores) == (1, 1)
    assert stats.num_prefix_ram_refused == 0
    assert stats.num_prefix_ram_tokens == len(system(0))
    assert stats.prefix_ram_restore_seconds > 0
    # system(0) moved back into KV; system(1) was evicted to RAM to make room
    assert stats.prefix_ram_entries == 1 and stats.num_prefix_ram_stores == 2


def test_without_the_tier_the_evicted_prefix_is_recomputed(make: Make) -> None:
    ctx, _ = make(prefix_ram_bytes=0)
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    _, num = computed(ctx, system(0) + "C3?")
    assert num == len(system(0)) + 3
    stats = ctx.stats()
    assert stats.prefix_ram_budget_bytes == 0
    assert stats.num_prefix_ram_stores == stats.num_prefix_ram_hits == 0


def test_a_kv_slot_with_a_longer_match_wins_over_ram(make: Make) -> None:
    ctx, _ = make(n_seq_max=2)
    complete(ctx, system(0) + "A1?")  # id 0
    complete(ctx, system(1) + "B2?")  # id 1
    complete(ctx, system(2) + "Q")  # evicts system(0)'s slot: RAM holds system(0) + A1?...
    complete(ctx, system(0) + "A1? and more")  # restores it (id of system(1) evicted)
    hits = ctx.stats().num_prefix_ram_hits
    assert hits == 1
    # system(0) is in KV now (and no longer in RAM): a KV copy, not a restore
    _, num = computed(ctx, system(0) + "D4?")
    assert num == 3 and ctx.stats().num_prefix_ram_hits == hits


def test_entries_stay_within_the_byte_budget_least_recently_used_out(make: Make) -> None:
    ctx, backend = make(prefix_ram_bytes=1)  # measure one state first
    complete(ctx, system(0) + "x?")
    size = len(backend.state_seq_get(0))
    ctx.close()
    ctx, _ = make(prefix_ram_bytes=2 * size + size // 2)  # room for two states
    for i in range(5):
        complete(ctx, system(i) + "x?")
        stats = ctx.stats()
        assert stats.prefix_ram_bytes <= stats.prefix_ram_budget_bytes
        assert ctx.audit() == []
    assert ctx.stats().prefix_ram_entries == 2  # system(2) and system(3); 4 is in KV
    _, num = computed(ctx, system(1) + "y?")  # dropped by LRU: recomputed
    assert num == len(system(1)) + 2
    _, num = computed(ctx, system(3) + "y?")  # kept: restored
    assert num == 2


def test_the_longest_stored_prefix_is_restored(make: Make) -> None:
    ctx, _ = make(n_seq_max=1)
    base = system(7)
    complete(ctx, base + "short")
    complete(ctx, base + "a much longer shared continuation, then A")
    complete(ctx, system(8) + "?")  # evicts the longer one to RAM
    # the short one went to RAM when the long one took its slot over and cut it
    assert ctx.stats().prefix_ram_entries == 2
    done, num = computed(ctx, base + "a much longer shared continuation, then B")
    assert num == 1
    assert done.usage.cached_tokens == len(base + "a much longer shared continuation, then ")


def test_prompts_shorter_than_the_minimum_are_not_stored(make: Make) -> None:
    ctx, _ = make()
    complete(ctx, "tiny")
    complete(ctx, "other")
    assert ctx.stats().num_prefix_ram_stores == 0


def test_a_state_the_memory_refuses_is_recomputed(make: Make) -> None:
    ctx, backend = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    backend.fault = lambda where: 1 if where == "state_seq_set" else None
    done, num = computed(ctx, system(0) + "C3?")
    backend.fault = None
    assert num == len(system(0)) + 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    stats = ctx.stats()
    assert (stats.num_prefix_ram_hits, stats.num_prefix_ram_refused) == (1, 1)
    assert stats.num_prefix_ram_restores == stats.num_prefix_ram_tokens == 0
    assert stats.prefix_ram_entries == 1  # the refused entry is gone; system(1) came in


def test_a_restore_that_raises_is_recomputed(make: Make) -> None:
    ctx, backend = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")

    def fail(where: str) -> None:
        if where == "state_seq_set":
            raise RuntimeError("injected")

    backend.fault = fail
    _, num = computed(ctx, system(0) + "C3?")
    backend.fault = None
    assert num == len(system(0)) + 3 and ctx.stats().num_prefix_ram_refused == 1
    assert not ctx.closed


@pytest.mark.parametrize(
    "damage",
    [
        lambda held: held[:-1],  # fewer positions than its tokens: the extent check refuses it
        lambda held: [*held, 1],  # more positions
        lambda held: [*held[:5], None, *held[6:]],  # a removed cell: the memory refuses it
        lambda held: "not a state",
    ],
    ids=["short", "long", "hole", "garbage"],
)
def test_a_state_that_does_not_match_its_tokens_is_refused(
    make: Make, monkeypatch: pytest.MonkeyPatch, damage: Callable[[list[Any]], Any]
) -> None:
    ctx, backend = make()
    real_get = backend.state_seq_get

    def damaged_get(seq_id: int) -> bytes:
        return json.dumps(damage(json.loads(real_get(seq_id)))).encode()

    complete(ctx, system(0) + "A1?")
    monkeypatch.setattr(backend, "state_seq_get", damaged_get)
    complete(ctx, system(1) + "B2?")  # system(0) saved damaged
    monkeypatch.setattr(backend, "state_seq_get", real_get)
    done, num = computed(ctx, system(0) + "C3?")
    assert num == len(system(0)) + 3
    assert done.token_ids == cold(system(0) + "C3?").token_ids
    assert ctx.stats().num_prefix_ram_refused == 1
    assert ctx.audit() == []


def test_a_failed_save_loses_only_the_entry(make: Make) -> None:
    ctx, backend = make()
    complete(ctx, system(0) + "A1?")

    def fail(where: str) -> None:
        if where == "state_seq_get":
            raise RuntimeError("injected")

    backend.fault = fail
    complete(ctx, system(1) + "B2?")  # the eviction goes on without a RAM copy
    backend.fault = None
    assert ctx.stats().num_prefix_ram_stores == 0 and ctx.stats().num_evictions == 1
    _, num = computed(ctx, system(0) + "C3?")
    assert num == len(system(0)) + 3


def test_clear_cache_empties_both_tiers(make: Make) -> None:
    ctx, _ = make(n_seq_max=2)
    for i in range(4):
        complete(ctx, system(i) + "?")
    stats = ctx.stats()
    assert stats.num_retained == 2 and stats.prefix_ram_entries == 2
    assert ctx.clear_cache() == 2
    stats = ctx.stats()
    assert (stats.num_retained, stats.prefix_ram_entries, stats.prefix_ram_bytes) == (0, 0, 0)
    assert stats.num_prefix_ram_stores == 2  # clearing stores nothing
    _, num = computed(ctx, system(0) + "!")
    assert num == len(system(0)) + 1


def test_the_audit_checks_the_tier_accounts(make: Make) -> None:
    ctx, _ = make()
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    tier = ctx._engine.scheduler.prefix.ram
    tier._lru._num_bytes += 1
    assert any("RAM tier accounts" in p for p in ctx.audit())
    tier._lru._num_bytes -= 1
    assert ctx.audit() == []


def test_without_prefix_sharing_nothing_is_stored(make: Make) -> None:
    ctx, _ = make(can_share_prefix=False)
    complete(ctx, system(0) + "A1?")
    complete(ctx, system(1) + "B2?")
    stats = ctx.stats()
    assert stats.prefix_ram_budget_bytes == 0 and stats.num_prefix_ram_stores == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_prefix_ram_bytes_is_a_typed_error(bad: object) -> None:
    with pytest.raises(llamax.InvalidParameterError, match="prefix_ram_bytes"):
        llamax.Context(backend=FakeBackend(), autostart=False, prefix_ram_bytes=bad)  # type: ignore[arg-type]


def test_the_default_budget_is_a_capped_quarter_of_available_memory(tmp_path: Any) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemAvailable: 4000000 kB\n")
    assert default_budget(str(meminfo)) == 4000000 * 1024 // 4
    meminfo.write_text("MemAvailable: 400000000 kB\n")
    assert default_budget(str(meminfo)) == 8 << 30
    assert default_budget(str(tmp_path / "missing")) >= 0  # falls back to sysconf
    ctx = llamax.Context(backend=FakeBackend(), autostart=False)
    assert 0 <= ctx.stats().prefix_ram_budget_bytes <= 8 << 30
    ctx.close()


# ---------------------------------------------------------------------- the tier alone
def tier(budget: int = 1000) -> PrefixRamTier:
    return PrefixRamTier(budget, min_tokens=2)


def test_tier_match_takes_the_longest_common_prefix_and_skips_the_last_token() -> None:
    t = tier()
    t.store([1, 2, 3, 4], b"a")
    t.store([1, 2, 3, 9, 9], b"b")
    t.store([1, 2], b"c")
    m = t.lookup([1, 2, 3, 4, 5])
    assert m is not None and (m.entry.data, m.num_common) == (b"a", 4)
    m = t.lookup([1, 2, 3, 4])  # the last prompt token is always computed
    assert m is not None and m.num_common == 3 and m.entry.data == b"a"  # shortest of equals
    assert t.lookup([1, 2, 3, 4, 5], longer_than=4) is None  # KV gives as much
    assert t.lookup([1, 2, 3, 4, 5], max_tokens=3) is not None  # only [1, 2] fits
    assert t.lookup([7, 2, 3]) is None and t.lookup([]) is None


def test_tier_keys_entries_by_adapter_set() -> None:
    t = tier()
    t.store([1, 2, 3], b"base")
    t.store([1, 2, 3], b"lora", adapters=(("a", 1.0),))
    assert t.num_entries == 2
    m = t.lookup([1, 2, 3, 4], adapters=(("a", 1.0),))
    assert m is not None and m.entry.data == b"lora"
    m = t.lookup([1, 2, 3, 4])
    assert m is not None and m.entry.data == b"base"
    assert t.lookup([1, 2, 3, 4], adapters=(("b", 1.0),)) is None


def test_tier_evicts_by_bytes_least_recently_used_first() -> None:
    t = tier(10)
    t.store([1, 1], b"x" * 4)
    t.store([2, 2], b"x" * 4)
    m = t.lookup([1, 1, 0])
    assert m is not None
    t.hold(m)  # a restore begins: the entry is out of the tier
    t.release(m, refused=False)  # no room: back in, now the most recent
    t.store([3, 3], b"x" * 4)  # drops [2, 2], the least recently used
    assert [e.tokens for e in t.entries()] == [(1, 1), (3, 3)]
    assert t.num_bytes == 8 and t.stats().num_dropped == 1 and t.audit() == []
    assert not t.store([4, 4], b"x" * 11)  # larger than the whole budget: not stored
    t.store([1, 1], b"yy")  # the same key replaces its entry
    assert t.num_bytes == 6 and t.num_entries == 2
    assert t.clear() == 2 and t.num_bytes == 0


def test_a_zero_budget_tier_stores_nothing() -> None:
    t = PrefixRamTier(0)
    assert not t.is_enabled and not t.store(list(range(100)), b"x")
    assert t.num_entries == 0


# ---------------------------------------------------------------------- server
def _call(app: Any, method: str, path: str, **kwargs: Any) -> Any:
    import asyncio

    import httpx

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


@pytest.mark.parametrize("route", ["/reset_prefix_cache", "/flush_cache"])
def test_the_server_clears_both_tiers_and_shows_them_in_metrics(route: str) -> None:
    from llamax.server import create_app

    ctx = llamax.Context(backend=FakeBackend(n_ctx=512, n_seq_max=1), prefix_ram_bytes=MB)
    try:
        app = create_app(ctx, api_key="secret")
        for i in range(3):
            ctx.add_request(system(i) + "?", GREEDY).result(60)
        ctx.add_request(system(0) + "!", GREEDY).result(60)  # a restore
        key = {"Authorization": "Bearer secret"}
        metrics = _call(app, "GET", "/metrics", headers=key).text
        assert "llamax_prefix_ram_entries 2.0" in metrics
        assert "llamax_prefix_ram_restores_total 1.0" in metrics
        assert "llamax_prefix_ram_hits_total 1.0" in metrics
        assert "llamax_prefix_ram_bytes " in metrics
        assert "llamax_prefix_ram_restore_seconds_total" in metrics
        assert _call(app, "POST", route).status_code == 401
        reply = _call(app, "POST", route, headers=key)
        assert reply.status_code == 200 and reply.json() == {"status": "ok", "freed_sequences": 1}
        stats = ctx.stats()
        assert (stats.num_retained, stats.prefix_ram_entries, stats.prefix_ram_bytes) == (0, 0, 0)
        assert "llamax_prefix_ram_entries 0.0" in _call(app, "GET", "/metrics", headers=key).text
        assert_idle(ctx)
    finally:
        ctx.close()


def test_an_entry_given_back_stays_within_the_budget() -> None:
    t = tier(10)
    t.store([1, 1], b"x" * 6)
    m = t.lookup([1, 1, 0])
    assert m is not None
    t.hold(m)
    t.store([2, 2], b"y" * 6)  # stored while the entry was out (an eviction to make room)
    t.release(m, refused=False)  # the restore did not happen: back in, the oldest other out
    assert [e.tokens for e in t.entries()] == [(1, 1)] and t.audit() == []


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("1048576", 1 << 20), ("512M", 512 << 20), ("2g", 2 << 30),
     ("1.5GiB", 3 << 29), ("64 KB", 64 << 10), ("1T", 1 << 40)],
)  # fmt: skip
def test_the_flag_takes_bytes_or_a_size_with_a_unit(text: str, size: int) -> None:
    from llamax.server.cli import build_parser

    ns = build_parser().parse_args(["m.gguf", "--prefix-ram-bytes", text])
    assert option_values(ns, llamax.ContextConfig)["prefix_ram_bytes"] == size
    assert llamax.ContextConfig("m.gguf", prefix_ram_bytes=size).prefix_ram_bytes == size


def test_a_bad_flag_is_refused_and_no_flag_is_the_default(capsys: Any) -> None:
    from llamax.server.cli import build_parser, main

    for bad in ["-1", "lots", "1X", "1.5.2G"]:
        assert main(["m.gguf", "--prefix-ram-bytes", bad, "--log-level", "critical"]) == 2
        assert "--prefix-ram-bytes: not a byte size" in capsys.readouterr().err
    assert "prefix_ram_bytes" not in option_values(
        build_parser().parse_args(["m.gguf"]), llamax.ContextConfig
    )
    with llamax.Context(backend=FakeBackend(), autostart=False) as ctx:  # None: the default
        assert 0 < ctx.stats().prefix_ram_budget_bytes <= MAX_DEFAULT_BYTES
    config = llamax.ContextConfig("<fake>", prefix_ram_bytes=MB)
    with llamax.Context(backend=FakeBackend(), config=config, autostart=False) as ctx:
        assert ctx.stats().prefix_ram_budget_bytes == MB
