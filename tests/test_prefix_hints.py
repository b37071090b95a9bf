"""Issue 56: cache hints decide what the prefix cache keeps longest. A request with
``SamplingParams.keep_prefix`` (what Anthropic's ``cache_control`` and OpenAI's
``prompt_cache_key`` set) leaves a *hinted* slot: evicted from KV only when no unhinted
retained slot is left; the RAM and disk tiers below drop unhinted entries first, keep the
mark when one drops to the other, and the disk tier's files keep it across contexts. Least
recently used order within each class is unchanged. Fake backend, both KV layouts; the
dialects through ``llamax.anthropic.messages``, ``ctx.chat_completion`` and
``llamax.openai.create_response``."""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_chat import make as make_chat

import llamax
from llamax.anthropic import count_tokens, messages
from llamax.chat import ChatCall
from llamax.engine.kv.disk_files import MAGIC, encode
from llamax.engine.kv.prefix_disk import PrefixDiskTier
from llamax.engine.kv.prefix_ram import PrefixRamTier
from llamax.openai import create_response
from llamax.server import BackgroundServer, create_app
from llamax.testing import FakeBackend, assert_idle

HINTED = llamax.SamplingParams(max_tokens=6, temperature=0, keep_prefix=True)
PLAIN = llamax.SamplingParams(max_tokens=6, temperature=0)
LETTERS = "ABCDEFGHIJ"
RAM_ENTRY = 472
"""Bytes of one of these prompts' state on the fake (system(i) + "?" and its reply)."""


def system(i: int) -> str:
    """A ~90-token system prompt (one fake token per byte) sharing not even its first token
    with another's."""
    return f"{LETTERS[i]}) You are assistant number {i}. " + "Answer briefly and politely. " * 2


Make = Callable[..., llamax.Context]


@pytest.fixture(params=["unified", "streams"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """Contexts on the fake (``n_seq_max`` ids, 512 cells each), by default with no tier;
    each is checked idle (tiers included) and closed after the test."""
    layout = str(request.param)
    made: list[llamax.Context] = []

    def build(
        *,
        n_seq_max: int = 2,
        prefix_ram_bytes: int = 0,
        prefix_disk_bytes: int | None = None,
    ) -> llamax.Context:
        n_ctx = 512 * n_seq_max if layout == "streams" else 512
        backend = FakeBackend(n_ctx=n_ctx, n_seq_max=n_seq_max, kv_layout=layout)
        ctx = llamax.Context(
            backend=backend,
            autostart=False,
            prefix_ram_bytes=prefix_ram_bytes,
            prefix_disk_dir=None if prefix_disk_bytes is None else str(tmp_path),
            prefix_disk_bytes=prefix_disk_bytes,
        )
        made.append(ctx)
        return ctx

    yield build
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


def computed(ctx: llamax.Context, prompt: str, params: llamax.SamplingParams = PLAIN) -> int:
    """Run ``prompt`` to its end; return the prompt tokens computed for it."""
    before = ctx.stats().num_prefill_tokens
    handle = ctx.add_request(prompt, params)
    while ctx.has_work():
        ctx.process()
    handle.result(0)
    return ctx.stats().num_prefill_tokens - before


def retained(ctx: llamax.Context) -> list[str]:
    """The retained slots, least recently used first, as their system prompt's letter
    (lower case: hinted)."""
    slots = ctx._engine.scheduler.prefix.retained()
    return [chr(s.tokens[0] - 1).lower() if s.hinted else chr(s.tokens[0] - 1) for s in slots]


# ---------------------------------------------------------------------- KV
def test_a_hinted_slot_outlives_unhinted_ones_under_kv_pressure(make: Make) -> None:
    ctx = make(n_seq_max=2)
    computed(ctx, system(0) + "?", HINTED)
    computed(ctx, system(1) + "?")
    assert ctx.stats().num_retained_hinted == 1
    computed(ctx, system(2) + "?")  # needs an id: the unhinted system(1) goes, not system(0)
    assert retained(ctx) == ["a", "C"]
    assert computed(ctx, system(0) + "!") == 1  # only "!": its prefix was still in KV
    assert computed(ctx, system(1) + "!") == len(system(1)) + 1  # evicted: computed again
    assert ctx.stats().num_evictions == 3  # C made room for the copy of a, then a for B


def test_lru_order_within_each_class_is_unchanged(make: Make) -> None:
    ctx = make(n_seq_max=4)
    for i, params in enumerate((HINTED, PLAIN, HINTED, PLAIN)):
        computed(ctx, system(i) + "?", params)
    assert retained(ctx) == ["a", "B", "c", "D"]
    computed(ctx, system(4) + "?")  # the least recently used unhinted one goes
    assert retained(ctx) == ["a", "c", "D", "E"]
    computed(ctx, system(5) + "?", HINTED)
    computed(ctx, system(6) + "?", HINTED)
    assert retained(ctx) == ["a", "c", "f", "g"]  # D, then E: no unhinted one is left
    assert ctx.stats().num_retained_hinted == 4
    computed(ctx, system(7) + "?")  # only hinted ones: the least recently used goes
    assert retained(ctx) == ["c", "f", "g", "H"]
    assert computed(ctx, system(2) + "!") == 1  # H made room for a copy from c, now used
    assert retained(ctx) == ["f", "g", "c", "C"]


def test_the_mark_is_the_last_request_run_in_the_slot(make: Make) -> None:
    ctx = make(n_seq_max=1)
    computed(ctx, system(0) + "?", HINTED)
    assert retained(ctx) == ["a"] and ctx.stats().num_retained_hinted == 1
    computed(ctx, system(0) + "??")  # takes the only slot over: unhinted now
    assert retained(ctx) == ["A"] and ctx.stats().num_retained_hinted == 0
    computed(ctx, system(0) + "???", HINTED)  # a hinted request marks it again
    assert retained(ctx) == ["a"]


def test_copying_from_a_hinted_slot_leaves_its_mark(make: Make) -> None:
    ctx = make(n_seq_max=3)
    computed(ctx, system(0) + "?", HINTED)
    assert computed(ctx, system(0) + "!") == 1  # an unhinted copy in a slot of its own
    computed(ctx, system(1) + "?")
    assert retained(ctx) == ["a", "A", "B"]
    computed(ctx, system(2) + "?")  # the unhinted copy goes first, though more recent
    assert retained(ctx) == ["a", "B", "C"]


# ---------------------------------------------------------------------- the RAM tier
def test_the_ram_tier_drops_unhinted_entries_first(make: Make) -> None:
    ctx = make(n_seq_max=1, prefix_ram_bytes=2 * RAM_ENTRY + 50)  # two entries
    computed(ctx, system(0) + "?", HINTED)
    for i in (1, 2, 3):  # each evicts the one before to RAM
        computed(ctx, system(i) + "?")
    ram = ctx._engine.scheduler.prefix.ram
    assert [(e.tokens[0] - 1, e.hinted) for e in ram.entries()] == [(65, True), (67, False)]
    stats = ctx.stats()
    assert (stats.prefix_ram_entries, stats.prefix_ram_hinted_entries) == (2, 1)
    assert computed(ctx, system(0) + "!") == 1  # restored from RAM
    assert ctx.audit() == []


def test_the_ram_tier_alone_keeps_lru_order_in_each_class() -> None:
    # one owner (no fair_key): its hinted entries are protected up to half the budget, 6
    tier = PrefixRamTier(12, min_tokens=2)
    assert tier.store([1, 1], b"x" * 3, hinted=True)
    for i in (2, 3, 4):
        assert tier.store([i, i], b"x" * 3)
    assert tier.store([5, 5], b"x" * 3)  # drops [2, 2]: the oldest unhinted, not [1, 1]
    assert [e.tokens[0] for e in tier.entries()] == [1, 3, 4, 5]
    assert tier.store([6, 6], b"x" * 3, hinted=True)  # drops [3, 3]
    assert tier.store([7, 7], b"x" * 3)  # drops [4, 4]
    assert [e.tokens[0] for e in tier.entries()] == [1, 5, 6, 7]
    assert tier.share_bytes() == 6 and tier.stats().num_hinted == 2
    # 9 bytes would not fit: the unhinted give 6, the hinted within their share no more
    assert not tier.store([8, 8], b"x" * 9)
    assert not tier.store([9, 9], b"x" * 13, hinted=True)  # larger than the budget
    assert tier.store([10, 10], b"x" * 3, hinted=True)  # drops [5, 5], the oldest unhinted
    assert [e.tokens[0] for e in tier.entries()] == [1, 6, 7, 10]
    # hinted 9 bytes > the share of 6: the oldest hinted is dropped like an unhinted one
    assert tier.store([11, 11], b"x" * 3)
    assert [e.tokens[0] for e in tier.entries()] == [6, 7, 10, 11]
    assert tier.store([12, 12], b"x" * 3)  # within the share again: [7, 7] goes
    assert [e.tokens[0] for e in tier.entries()] == [6, 10, 11, 12]
    assert tier.stats().num_hinted == 2 and tier.audit() == []
    tier.store([6, 6], b"yy")  # the same key, stored unhinted, replaces the entry and mark
    assert tier.stats().num_hinted == 1 and tier.num_bytes == 11 and tier.audit() == []


def test_one_client_hinting_everything_holds_only_its_share() -> None:
    """Hints are a claim on a shared tier, so each owner (a request's ``fair_key``) is
    protected up to ``budget / (owners + 1)``: a client that hints every request cannot
    keep another client's hinted prefixes, or everyone's unhinted ones, out of the tier.
    The old code kept every hinted entry against every unhinted one, whoever sent it."""
    tier = PrefixRamTier(12, min_tokens=2)
    for i in range(1, 5):  # "a" alone fills the tier with hints
        assert tier.store([i, i], b"x" * 3, hinted=True, owner="a")
    assert tier.share_bytes() == 6 and tier.share_bytes("b") == 4
    assert tier.store([5, 5], b"x" * 3, hinted=True, owner="b")  # a's oldest goes
    assert tier.store([6, 6], b"x" * 3)  # unhinted: a's next oldest goes (a is over 4)
    assert tier.store([7, 7], b"x" * 3)  # and the next: a is within its share after
    assert [e.tokens[0] for e in tier.entries()] == [4, 5, 6, 7]
    assert tier.store([8, 8], b"x" * 3)  # a's [4, 4] and b's [5, 5] are kept: [6, 6] goes
    assert [(e.tokens[0], e.owner) for e in tier.entries() if e.hinted] == [(4, "a"), (5, "b")]
    # a's new hints take a's own old room, never b's
    assert tier.store([9, 9], b"x" * 3, hinted=True, owner="a")  # [7, 7] goes (unhinted)
    assert tier.store([10, 10], b"x" * 6, hinted=True, owner="a")  # [8, 8], then a's [4, 4]
    assert [(e.tokens[0], e.owner) for e in tier.entries() if e.hinted] == [
        (5, "b"),
        (9, "a"),
        (10, "a"),
    ]
    assert tier.audit() == []


# ---------------------------------------------------------------------- the disk tier
def test_what_the_ram_tier_drops_goes_to_disk_with_its_mark(make: Make, tmp_path: Path) -> None:
    # RAM holds two entries (its hints protected up to one: half the budget), disk two
    # files (~900 bytes each); one sequence id: each request evicts the one before
    ctx = make(n_seq_max=1, prefix_ram_bytes=2 * RAM_ENTRY + 50, prefix_disk_bytes=2000)
    computed(ctx, system(0) + "?", HINTED)
    computed(ctx, system(1) + "?", HINTED)  # a to RAM
    computed(ctx, system(2) + "?")  # b to RAM: two hinted, one more than the share
    computed(ctx, system(3) + "?")  # C to RAM: a, the older hinted one, to disk, still hinted
    computed(ctx, system(4) + "?")  # D to RAM: b is within the share, so C goes to disk
    prefix = ctx._engine.scheduler.prefix
    assert prefix.disk is not None
    assert [(e.tokens[0] - 1, e.hinted) for e in prefix.ram.entries()] == [
        (66, True),
        (68, False),
    ]
    assert [(e.tokens[0] - 1, e.hinted) for e in prefix.disk.entries()] == [
        (65, True),
        (67, False),
    ]
    stats = ctx.stats()
    assert (stats.prefix_disk_entries, stats.prefix_disk_hinted_entries) == (2, 1)
    assert (stats.prefix_ram_entries, stats.prefix_ram_hinted_entries) == (2, 1)
    assert computed(ctx, system(0) + "!") == 1  # restored from disk
    assert ctx.audit() == []


def tokens(i: int) -> list[int]:
    """40 two-digit tokens starting at ``10 + i`` (every entry's file the same size)."""
    return list(range(10 + i, 50 + i))


def test_the_disk_tier_keeps_the_mark_across_contexts(tmp_path: Path) -> None:
    data = b"x" * 60
    size = len(encode(tokens(0), data)) + len(data)
    # four files, two of them hinted (a longer header): within the hints' share, half
    budget = 4 * size + 80
    tier = PrefixDiskTier(str(tmp_path), budget, min_tokens=2)
    try:
        assert tier.store(tokens(1), data, hinted=True)
        for i in (2, 3, 4):
            assert tier.store(tokens(i), data)
        assert [e.tokens[0] for e in tier.entries()] == [11, 12, 13, 14]
    finally:
        tier.close()
    tier = PrefixDiskTier(str(tmp_path), budget, min_tokens=2)  # the next context
    try:
        marks = [(e.tokens[0], e.hinted) for e in tier.entries()]
        assert marks == [(11, True), (12, False), (13, False), (14, False)]
        assert tier.store(tokens(5), data)  # deletes 12's file, not the older 11's
        assert [e.tokens[0] for e in tier.entries()] == [11, 13, 14, 15]
        assert tier.stats().num_hinted == 1
        assert not tier.store(tokens(6), b"x" * budget, hinted=True)  # larger than the budget
        assert tier.store(tokens(3), data, hinted=True)  # the other mark: written again
        marks = [(e.tokens[0], e.hinted) for e in tier.entries()]
        assert marks == [(11, True), (14, False), (15, False), (13, True)]
        assert not tier.store(tokens(6), b"x" * (3 * size))  # it would push a hinted file out
        assert tier.store(tokens(7), data)  # fits in 14's room: 14 goes
        assert [e.tokens[0] for e in tier.entries()] == [11, 15, 13, 17]
        assert len(list(Path(tier.directory).glob("*.kv"))) == 4 and tier.audit() == []
    finally:
        tier.close()


@pytest.mark.parametrize("extra", [{}, {"hinted": True}])
def test_a_file_says_its_mark_and_a_false_one_is_a_lie(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    tier = PrefixDiskTier(str(tmp_path), 1 << 20, min_tokens=2)
    folder = Path(tier.directory)
    tier.close()
    data = b"x" * 16
    for name, fields in (
        ("a.kv", {"tokens": [1, 2, 3], **extra}),
        ("b.kv", {"tokens": [4, 5, 6], "hinted": False}),  # never written: a lie
    ):
        header = json.dumps({**fields, "size": len(data), "crc32": zlib.crc32(data)}).encode()
        (folder / name).write_bytes(struct.pack("<8sII", MAGIC, 1, len(header)) + header + data)
    tier = PrefixDiskTier(str(tmp_path), 1 << 20, min_tokens=2)
    try:
        assert [(e.tokens, e.hinted) for e in tier.entries()] == [((1, 2, 3), "hinted" in extra)]
        assert not (folder / "b.kv").exists()
    finally:
        tier.close()


# ---------------------------------------------------------------------- the dialects
@pytest.fixture
def chat_ctx(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[llamax.Context, list[bool]]]:
    """A chat model on the fake, and the ``keep_prefix`` of every request submitted."""
    with make_chat("Hello there!", autostart=True, n_ctx=4096) as ctx:
        hints: list[bool] = []
        submit = ctx.submit_chat  # the one entry every dialect submits through

        def recording(call: ChatCall, **kwargs: Any) -> Any:
            hints.append(call.params.keep_prefix)
            return submit(call, **kwargs)

        monkeypatch.setattr(ctx, "submit_chat", recording)
        yield ctx, hints
        assert_idle(ctx)


EPHEMERAL = {"type": "ephemeral"}
HI = [{"role": "user", "content": "Hi!"}]
TOOL = {"name": "Read", "description": "Reads a file.", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "hinted"),
    [
        ({}, False),
        ({"cache_control": EPHEMERAL}, True),  # automatic caching
        ({"cache_control": None}, False),
        ({"system": [{"type": "text", "text": "Be brief.", "cache_control": EPHEMERAL}]}, True),
        ({"system": [{"type": "text", "text": "Be brief."}]}, False),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Hi!", "cache_control": EPHEMERAL}],
                    }
                ]
            },
            True,
        ),
        ({"tools": [{**TOOL, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}, True),
        ({"tools": [TOOL]}, False),
    ],
)
def test_anthropic_cache_control_sets_keep_prefix(
    chat_ctx: tuple[llamax.Context, list[bool]], body: dict[str, Any], hinted: bool
) -> None:
    ctx, hints = chat_ctx
    request = {"messages": HI, "max_tokens": 8, **body}
    reply = messages(ctx, request)
    assert isinstance(reply, dict) and reply["type"] == "message"
    assert hints == [hinted]
    assert count_tokens(ctx, request)["input_tokens"] > 0  # the same fields are taken


def test_anthropic_cache_control_in_a_tool_result_and_a_bad_one(
    chat_ctx: tuple[llamax.Context, list[bool]],
) -> None:
    ctx, hints = chat_ctx
    turns = [
        {"role": "user", "content": "Read it."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "x = 1", "cache_control": EPHEMERAL}],
                }
            ],
        },
    ]
    messages(ctx, {"messages": turns, "tools": [TOOL], "max_tokens": 8})
    assert hints == [True]
    for bad in ({"type": "persistent"}, "yes"):
        system = [{"type": "text", "text": "Be brief.", "cache_control": bad}]
        with pytest.raises(llamax.InvalidParameterError, match=r"system\[0\]\.cache_control"):
            messages(ctx, {"messages": HI, "system": system, "max_tokens": 8})
    assert hints == [True]  # nothing was submitted


@pytest.mark.parametrize(
    ("options", "hinted"),
    [
        ({}, False),
        ({"prompt_cache_key": "session-42"}, True),
        ({"prompt_cache_retention": "24h"}, True),
        ({"prompt_cache_retention": "in_memory"}, True),
        ({"prompt_cache_key": None}, False),
    ],
)
def test_openai_prompt_cache_key_sets_keep_prefix(
    chat_ctx: tuple[llamax.Context, list[bool]], options: dict[str, Any], hinted: bool
) -> None:
    ctx, hints = chat_ctx
    ctx.chat_completion(HI, max_tokens=8, **options)
    create_response(ctx, {"input": "Hi!", "max_output_tokens": 8, **options})
    assert hints == [hinted, hinted]


def test_keep_prefix_is_a_chat_option_too(chat_ctx: tuple[llamax.Context, list[bool]]) -> None:
    ctx, hints = chat_ctx
    ctx.chat_completion(HI, max_tokens=8, keep_prefix=True)
    assert hints == [True]
    ctx.chat_completion(HI, max_tokens=8, prompt_cache_key="s")  # typed (ChatOptions) too
    with pytest.raises(llamax.InvalidParameterError, match="keep_prefix must be a boolean"):
        ctx.chat_completion(HI, max_tokens=8, keep_prefix="yes")


@pytest.mark.parametrize(
    "options",
    [{"prompt_cache_key": "k" * 257}, {"prompt_cache_key": 7}, {"prompt_cache_retention": "1w"}],
)
def test_a_bad_prompt_cache_hint_is_refused(
    chat_ctx: tuple[llamax.Context, list[bool]], options: dict[str, Any]
) -> None:
    ctx, hints = chat_ctx
    with pytest.raises(llamax.InvalidParameterError, match="prompt_cache"):
        ctx.chat_completion(HI, max_tokens=8, **options)
    with pytest.raises(llamax.InvalidParameterError, match="prompt_cache"):
        create_response(ctx, {"input": "Hi!", "max_output_tokens": 8, **options})
    assert hints == []


def test_keep_prefix_is_a_typed_option() -> None:
    assert not llamax.SamplingParams().keep_prefix
    with pytest.raises(llamax.InvalidParameterError, match="keep_prefix must be a bool"):
        llamax.SamplingParams(keep_prefix=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 8, "prompt_cache_key": "s1"}),
        ("/v1/responses", {"input": "Hi!", "max_output_tokens": 8, "prompt_cache_key": "s1"}),
        ("/v1/messages", {"messages": HI, "max_tokens": 8, "cache_control": EPHEMERAL}),
    ],
)
def test_over_http_the_hint_leaves_a_hinted_slot(path: str, body: dict[str, Any]) -> None:
    with make_chat("Hello there!", autostart=True, n_ctx=4096) as ctx:
        with BackgroundServer(create_app(ctx)) as server:
            plain = {
                k: v for k, v in body.items() if k not in ("prompt_cache_key", "cache_control")
            }
            assert httpx.post(server.url + path, json=plain, timeout=30).status_code == 200
            assert httpx.post(server.url + path, json=body, timeout=30).status_code == 200
            end = time.monotonic() + 10
            while ctx.stats().num_retained != 2 and time.monotonic() < end:
                time.sleep(0.01)  # the last step's stats are published after the reply
            assert (ctx.stats().num_retained, ctx.stats().num_retained_hinted) == (2, 1)
        assert_idle(ctx)


def test_each_clients_hints_hold_a_share_of_the_ram_tier(make: Make) -> None:
    """Through the engine: a request's ``fair_key`` (the server's client key) owns the hint
    its evicted slot carries into the RAM tier. Client a hints four prompts, b one: a's
    oldest hints go first, then, with b hinting too, a keeps one share (a third of the
    budget) and b its own, and unhinted prefixes still pass through the rest. The old
    code let a's hints keep b's unhinted traffic out of the tier altogether."""
    ctx = make(n_seq_max=1, prefix_ram_bytes=3 * RAM_ENTRY + 50)

    def run(i: int, key: str | None, params: llamax.SamplingParams) -> None:
        handle = ctx.add_request(system(i) + "?", params, fair_key=key)
        while ctx.has_work():
            ctx.process()
        handle.result(0)

    for i in range(4):
        run(i, "a", HINTED)
    run(4, "b", HINTED)
    for i in (5, 6, 7):
        run(i, "b", PLAIN)  # each evicts the one before into RAM
    prefix = ctx._engine.scheduler.prefix
    held = [(e.tokens[0] - 1, e.hinted, e.owner) for e in prefix.ram.entries()]
    assert held == [(ord("D"), True, "a"), (ord("E"), True, "b"), (ord("G"), False, "b")]
    assert ctx.stats().prefix_ram_hinted_entries == 2 and ctx.audit() == []


def test_requests_without_a_key_share_one_owner_that_rotates_its_own_hints() -> None:
    """None (no ``fair_key``) is an owner like any other: beyond its share its hints go as
    unhinted ones do, and within it a new hint of its own takes its own older hint's
    room (the first version of the shares treated None's hints as unhinted in that last
    step, and refused the store)."""
    tier = PrefixRamTier(12, min_tokens=2)
    assert tier.store([1, 1], b"x" * 3, hinted=True, owner="a")
    assert tier.store([2, 2], b"x" * 3, hinted=True, owner="b")
    assert tier.store([3, 3], b"x" * 3, hinted=True)
    assert tier.store([4, 4], b"x" * 3, hinted=True)  # the tier is full: 3 bytes a share
    assert tier.share_bytes() == 3 and tier.share_bytes(None, "c") == 2
    assert tier.store([5, 5], b"x" * 3)  # unhinted: None's oldest hint, beyond its share
    assert tier.store([6, 6], b"x" * 3, hinted=True)  # [5, 5], unhinted, goes
    assert [(e.tokens[0], e.owner) for e in tier.entries()] == [
        (1, "a"),
        (2, "b"),
        (4, None),
        (6, None),
    ]
    assert tier.store([7, 7], b"x" * 3)  # None is beyond its share again: [4, 4] goes
    assert tier.store([8, 8], b"x" * 3, hinted=True)  # [7, 7] goes; None holds 6 again
    assert tier.store([9, 9], b"x" * 3)  # [6, 6] goes: every owner within its share now
    assert not tier.store([10, 10], b"x" * 6)  # unhinted, it would need a hint's room
    assert tier.store([11, 11], b"x" * 6, hinted=True)  # [9, 9], then None's own [8, 8]
    assert [(e.tokens[0], e.owner) for e in tier.entries()] == [(1, "a"), (2, "b"), (11, None)]
    assert tier.audit() == []
