"""Prefix reuse, in-flight sharing, n > 1, LRU retention and sessions on the real model.

Outputs are compared token for token with a *cold* run: the same prompt run alone on a
context built with ``prefix_cache=False`` whose KV cache is verified empty first, so
nothing is reused. Requests whose outputs are compared run one at a time; batching long
prompts together can flip near-tie tokens in llama.cpp even without any cache (different
attention reductions), which is llama.cpp numerics, not the cache. Even alone, a hit
computes only the question, and for some prompts a one-chunk prefill and a chunked one
disagree; test_cache_hit_equals_a_cold_prefill_split_at_the_prefix pins the exact property.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from near_tie import assert_greedy_agrees

import llamax
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
Prompt = str | Sequence[int]
Cold = Callable[[Prompt], llamax.Completion]

TIMEOUT = 240.0
# Eight tokens: a reused cell that differs from a computed one shows in the first logits,
# and every later token depends on those cells alike.
GREEDY = llamax.SamplingParams(temperature=0.0, max_tokens=8)
VALID_FINISH = {llamax.FinishReason.STOP, llamax.FinishReason.LENGTH}

SYS_TEXT = (
    "You are Juniper, the support assistant of Brightwater Outdoor Supply, a small family "
    "business in Oregon that sells camping gear, hiking boots, tents, sleeping bags and "
    "kayaks. Answer in two or three friendly sentences. Our store opens at nine in the "
    "morning and closes at six in the evening from Monday to Saturday; on Sunday we open at "
    "ten and close at four. Orders above fifty dollars ship for free inside the United "
    "States and usually arrive within five business days. Customers may return unused items "
    "within thirty days for a full refund, and worn boots within ninety days for store "
    "credit. Kayak rentals cost forty dollars a day, including a paddle and a life jacket, "
    "and must be booked at least two days ahead. Every tent comes with a lifetime warranty "
    "on its poles and a two year warranty on its fabric. We offer a free workshop on "
    "map reading and trail safety on the first Saturday of every month at eleven. Members "
    "of our loyalty club earn one point for every dollar spent, and one hundred points give "
    "a ten dollar discount. Never invent products, prices or policies that are not listed "
    "here; when you do not know, ask the customer to call the store at 555 0199 or to write "
    "to help at brightwater dot example. Do not discuss competitors, politics or medical "
    "questions. Keep a calm and cheerful tone, and always thank the customer for choosing "
    "Brightwater."
)
SYS = "<|im_start|>system\n" + SYS_TEXT + "<|im_end|>\n<|im_start|>user\n"  # ~290 tokens

# Sixteen questions, each starting with a different word (so they share only SYS).
QUESTIONS = (
    "What time do you open on Sunday?",
    "How much does a kayak rental cost?",
    "Can I return boots that I wore on a hike?",
    "Do you ship to Canada?",
    "Is the tent warranty valid for torn fabric?",
    "When is the next map reading workshop?",
    "Who should I contact about a missing order?",
    "Why was my loyalty discount not applied?",
    "Which sleeping bag is best for winter?",
    "Should I book a kayak a week ahead?",
    "Tell me about your loyalty club.",
    "Explain the return policy for unused items.",
    "List the items a kayak rental includes.",
    "Where is your store located?",
    "Are you open on Saturday evening?",
    "Give me a tip for my first overnight hike.",
)


def user(question: str) -> str:
    """A user question closing the user turn and opening the assistant turn (ChatML)."""
    return question + "<|im_end|>\n<|im_start|>assistant\n"


def next_turn(ctx: llamax.Context, question: str) -> list[int]:
    """Tokens that close the assistant's reply and ask the next question."""
    return ctx.tokenize("<|im_end|>\n<|im_start|>user\n" + user(question), add_special=False)


def run(ctx: llamax.Context) -> None:
    """Drive a context built with ``autostart=False`` until it is idle."""
    while ctx.has_work():
        ctx.process()


# ---------------------------------------------------------------------- cold reference
@pytest.fixture(scope="module")
def cold_ctx(model_path: Path) -> Iterator[llamax.Context]:
    """A context without the prefix cache: every request computes its whole prompt."""
    ctx = llamax.Context(model_path, n_ctx=2048, n_seq_max=1, prefix_cache=False)
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def cold(cold_ctx: llamax.Context) -> Cold:
    """Run a prompt alone, greedily, with nothing cached (memoized per prompt)."""
    memo: dict[tuple[int, ...], llamax.Completion] = {}

    def complete(prompt: Prompt) -> llamax.Completion:
        tokens = tuple(cold_ctx.tokenize(prompt) if isinstance(prompt, str) else prompt)
        if tokens not in memo:
            stats = cold_ctx.stats()
            assert stats.kv_cells_used == 0 and stats.num_retained == 0, "cold KV not empty"
            done = cold_ctx.add_request(list(tokens), GREEDY).result(TIMEOUT)
            assert done.usage.cached_tokens == 0
            assert_idle(cold_ctx)  # nothing kept: the next cold run starts from empty KV too
            memo[tokens] = done
        return memo[tokens]

    return complete


# ---------------------------------------------------------------------- prefix hits
def split_cold(make_real: MakeReal, prompt: Sequence[int], at: int) -> llamax.Completion:
    """``prompt`` run with nothing cached, prefilled in chunks of ``at`` tokens: the batch
    shapes of a hit that reuses ``at`` tokens and computes the rest (shorter than ``at``).

    llama.cpp's numerics depend on the batch shape, and on some CPUs (this AVX2 machine)
    a one-chunk prefill and a split one part even where the two picks are 0.14 nats
    apart, beyond the 0.1-nat near-tie rule; so a hit is compared with a cold run of the
    same shapes, token for token.
    """
    assert len(prompt) - at <= at
    split = make_real(n_ctx=1024, n_seq_max=1, prefix_cache=False, n_batch=at)
    done = split.add_request(list(prompt), GREEDY).result(TIMEOUT)
    assert done.usage.cached_tokens == 0
    split.close()
    return done


@pytest.mark.integration
def test_cache_hit_output_equals_cold_output(
    real_ctx: llamax.Context, cold: Cold, cold_ctx: llamax.Context, make_real: MakeReal
) -> None:
    ctx = real_ctx
    n_sys = len(ctx.tokenize(SYS))
    prompt_b = ctx.tokenize(SYS + user(QUESTIONS[1]))
    a = ctx.add_request(SYS + user(QUESTIONS[0]), GREEDY).result(TIMEOUT)
    assert a.usage.cached_tokens == 0
    before = ctx.stats()
    b = ctx.add_request(SYS + user(QUESTIONS[1]), GREEDY).result(TIMEOUT)
    after = ctx.stats()
    assert n_sys - 3 <= b.usage.cached_tokens < len(prompt_b)
    assert after.num_cached_tokens - before.num_cached_tokens == b.usage.cached_tokens
    assert after.num_prefill_tokens - before.num_prefill_tokens == (
        len(prompt_b) - b.usage.cached_tokens
    )
    assert b.usage.prompt_tokens == len(prompt_b)
    assert_greedy_agrees(cold_ctx, prompt_b, cold(prompt_b).token_ids, b.token_ids, nats=0.2)
    reference = split_cold(make_real, prompt_b, b.usage.cached_tokens)
    assert (b.token_ids, b.text) == (reference.token_ids, reference.text)

    # The very same prompt again: everything but its last token (needed for logits) is reused.
    before = ctx.stats()
    again = ctx.add_request(prompt_b, GREEDY).result(TIMEOUT)
    assert again.usage.cached_tokens == len(prompt_b) - 1
    assert ctx.stats().num_prefill_tokens - before.num_prefill_tokens == 1
    reference = split_cold(make_real, prompt_b, len(prompt_b) - 1)
    assert again.token_ids == reference.token_ids


@pytest.mark.parametrize(
    "question", [QUESTIONS[2], pytest.param(QUESTIONS[7], marks=pytest.mark.integration)]
)
def test_cache_hit_equals_a_cold_prefill_split_at_the_prefix(
    real_ctx: llamax.Context, make_real: MakeReal, question: str
) -> None:
    """The exact property behind "a hit equals a cold run", on near-tie prompts.

    For these questions a cold prefill of the whole prompt in one chunk and one split into
    chunks disagree with each other (llama.cpp numerics depend on the batch shape), so a
    hit, which computes only the question, is compared with a cold run (no cache) whose
    chunks are exactly SYS then the question: it must match token for token.
    """
    ctx = real_ctx
    n_sys = len(ctx.tokenize(SYS))
    split = make_real(n_ctx=1024, n_seq_max=1, prefix_cache=False, n_batch=n_sys)
    ctx.add_request(SYS + user(QUESTIONS[0]), GREEDY).result(TIMEOUT)
    prompt = ctx.tokenize(SYS + user(question))
    hit = ctx.add_request(prompt, GREEDY).result(TIMEOUT)
    assert hit.usage.cached_tokens == n_sys
    reference = split.add_request(prompt, GREEDY).result(TIMEOUT)
    assert reference.usage.cached_tokens == 0
    assert hit.token_ids == reference.token_ids, question


# ---------------------------------------------------------------------- sessions
@pytest.mark.integration
def test_session_divergent_edit_equals_cold(real_ctx: llamax.Context, cold: Cold) -> None:
    ctx = real_ctx
    n_sys = len(ctx.tokenize(SYS))
    first_prompt = ctx.tokenize(SYS + user(QUESTIONS[2]))
    edited_prompt = ctx.tokenize(SYS + user(QUESTIONS[3]))
    with ctx.session() as session:
        first = session.add_request(first_prompt, GREEDY).result(TIMEOUT)
        assert session.token_ids[: len(first_prompt)] == tuple(first_prompt)
        assert len(session.token_ids) > len(first_prompt)  # the reply stays cached
        assert first.token_ids == cold(first_prompt).token_ids

        before = ctx.stats()
        edited = session.add_request(edited_prompt, GREEDY).result(TIMEOUT)
        assert n_sys - 3 <= edited.usage.cached_tokens < len(edited_prompt)
        assert ctx.stats().num_prefill_tokens - before.num_prefill_tokens == (
            len(edited_prompt) - edited.usage.cached_tokens
        )
        assert session.token_ids[: len(edited_prompt)] == tuple(edited_prompt)
        assert edited.token_ids == cold(edited_prompt).token_ids


@pytest.mark.integration
def test_session_next_turn_and_fork_equal_cold(
    real_ctx: llamax.Context, cold: Cold, cold_ctx: llamax.Context
) -> None:
    ctx = real_ctx
    prompt = ctx.tokenize(SYS + user(QUESTIONS[4]))
    with ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result(TIMEOUT)
        held = session.token_ids
        transcript = prompt + list(reply.token_ids)
        assert transcript[: len(held)] == list(held)
        cells = ctx.stats().kv_cells_used
        with session.fork() as fork:
            assert fork.token_ids == held
            assert ctx.stats().kv_cells_used == cells  # the fork shares cells, copies none

            branch_prompt = transcript + next_turn(ctx, QUESTIONS[5])
            before = ctx.stats()
            branch = fork.add_request(branch_prompt, GREEDY).result(TIMEOUT)
            assert branch.usage.cached_tokens == len(held)
            assert ctx.stats().num_prefill_tokens - before.num_prefill_tokens == (
                len(branch_prompt) - len(held)
            )

            # The original session is untouched by the fork's writes: it continues on its own.
            assert session.token_ids == held
            main_prompt = transcript + next_turn(ctx, QUESTIONS[6])
            main = session.add_request(main_prompt, GREEDY).result(TIMEOUT)
            assert main.usage.cached_tokens == len(held)
            assert fork.token_ids[: len(branch_prompt)] == tuple(branch_prompt)

            assert_greedy_agrees(
                cold_ctx, branch_prompt, cold(branch_prompt).token_ids, branch.token_ids
            )
            assert_greedy_agrees(cold_ctx, main_prompt, cold(main_prompt).token_ids, main.token_ids)


@pytest.mark.integration
def test_session_save_load_round_trip(
    real_ctx: llamax.Context, make_real: MakeReal, tmp_path: Path
) -> None:
    path = tmp_path / "chat.llamax"
    prompt = real_ctx.tokenize(SYS + user(QUESTIONS[7]))
    with real_ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result(TIMEOUT)
        held = session.token_ids
        session.save(path)
        follow_up = prompt + list(reply.token_ids) + next_turn(real_ctx, QUESTIONS[8])
        expected = session.add_request(follow_up, GREEDY).result(TIMEOUT)
        assert expected.usage.cached_tokens == len(held)

    # Load into the same context (its cells were freed on close) ...
    with llamax.Session.load(real_ctx, path) as loaded:
        assert loaded.token_ids == held
        before = real_ctx.stats()
        again = loaded.add_request(follow_up, GREEDY).result(TIMEOUT)
        assert again.usage.cached_tokens == len(held)
        assert real_ctx.stats().num_prefill_tokens - before.num_prefill_tokens == (
            len(follow_up) - len(held)
        )
        assert again.token_ids == expected.token_ids

    # ... and into a brand-new context, where the KV can only come from the file.
    other = make_real(n_ctx=1024, n_seq_max=2)
    with llamax.Session.load(other, path) as loaded:
        assert loaded.token_ids == held
        assert other.stats().kv_cells_used == len(held)
        again = loaded.add_request(follow_up, GREEDY).result(TIMEOUT)
        assert again.usage.cached_tokens == len(held)
        assert other.stats().num_prefill_tokens == len(follow_up) - len(held)
        assert again.token_ids == expected.token_ids


def _rewrite(path: Path, header: dict[str, object], state: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<8sI", b"LLAMAXS1", len(raw)) + raw + state)


def test_session_load_rejects_damaged_and_foreign_files(
    real_ctx: llamax.Context, tmp_path: Path
) -> None:
    path = tmp_path / "chat.llamax"
    prompt = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    with real_ctx.session() as session:
        session.add_request(prompt, llamax.SamplingParams(temperature=0, max_tokens=4)).result(
            TIMEOUT
        )
        held = session.token_ids
        session.save(path)
    data = path.read_bytes()
    # File layout (llamax/session.py): 8-byte magic, uint32 header length, JSON header, state.
    magic, size = struct.unpack_from("<8sI", data)
    assert magic == b"LLAMAXS1"
    header = json.loads(data[12 : 12 + size])
    state = data[12 + size :]
    assert header["tokens"] == list(held) and state

    def refused(name: str, content: bytes, match: str) -> None:
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(llamax.SessionLoadError, match=match):
            llamax.Session.load(real_ctx, bad)

    refused("junk.llamax", b"not a session at all", "not a llamax session")
    refused("empty.llamax", b"", "not a llamax session")
    refused("cut-header.llamax", data[: 12 + size // 2], "not a llamax session")
    refused("magic.llamax", b"XXXXXXXX" + data[8:], "not a llamax session")
    refused("cut-state.llamax", data[: 12 + size + len(state) // 2], "damaged")
    refused("no-state.llamax", data[: 12 + size], "damaged")

    foreign = tmp_path / "foreign.llamax"
    identity = dict(header["model"])
    identity["name"] = "Other-Model-7B"
    identity["n_params"] = int(identity["n_params"]) + 1
    _rewrite(foreign, {**header, "model": identity}, state)
    with pytest.raises(llamax.SessionLoadError, match="model") as info:
        llamax.Session.load(real_ctx, foreign)
    assert "Other-Model-7B" in str(info.value)

    # Failed loads leak nothing (the teardown checks every sequence id); a good load works.
    with llamax.Session.load(real_ctx, path) as loaded:
        assert loaded.token_ids == held


# ---------------------------------------------------------------------- burst
@pytest.mark.integration
def test_burst_with_shared_prefix_computes_it_once(make_real: MakeReal) -> None:
    """Eight requests sharing SYS, submitted at once: SYS is computed once, in flight.

    Eight distinct questions force the same sharing as sixteen did; the solo cold runs
    the old version printed (and asserted nothing on) are gone: a hit's output is checked
    against cold runs in the tests above, one request at a time.
    """
    questions = QUESTIONS[:8]
    ctx = make_real(n_ctx=4096, n_seq_max=len(questions))  # streams of 512 cells, as before
    n_sys = len(ctx.tokenize(SYS))
    prompts = [ctx.tokenize(SYS + user(q)) for q in questions]
    for p in prompts:
        assert p[:n_sys] == ctx.tokenize(SYS)
    question_tokens = sum(len(p) - n_sys for p in prompts)
    before = ctx.stats()
    params = llamax.SamplingParams(temperature=0.0, max_tokens=4)
    handles = [ctx.add_request(p, params) for p in prompts]
    results = [h.result(TIMEOUT) for h in handles]
    after = ctx.stats()

    prefill = after.num_prefill_tokens - before.num_prefill_tokens
    cached = after.num_cached_tokens - before.num_cached_tokens
    num_followers = len(questions) - 1
    assert prefill <= n_sys + question_tokens + 16, (prefill, n_sys, question_tokens)
    assert cached >= num_followers * n_sys - 16, (cached, n_sys)
    assert after.num_preemptions == before.num_preemptions
    assert sum(r.usage.cached_tokens for r in results) == cached
    assert sum(r.usage.cached_tokens >= n_sys - 3 for r in results) >= num_followers
    for p, r in zip(prompts, results, strict=True):
        assert r.text.strip(), r
        assert r.finish_reason in VALID_FINISH
        assert r.usage.prompt_tokens == len(p)


# ---------------------------------------------------------------------- n > 1
def test_n_choices_share_one_prefill(real_ctx: llamax.Context) -> None:
    ctx = real_ctx
    prompt = (
        "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
    )
    tokens = ctx.tokenize(prompt)
    params = llamax.SamplingParams(temperature=0.9, seed=1234, max_tokens=24, n=8)
    before = ctx.stats()
    handle = ctx.add_request(prompt, params)
    events = list(handle)
    done = handle.result(TIMEOUT)
    after = ctx.stats()

    assert [c.index for c in done.choices] == list(range(8))
    assert len({c.token_ids for c in done.choices}) == 8
    assert after.num_prefill_tokens - before.num_prefill_tokens == len(tokens)
    assert done.usage.prompt_tokens == len(tokens)
    assert done.usage.completion_tokens == sum(len(c.token_ids) for c in done.choices)
    assert {e.index for e in events} == set(range(8))
    for choice in done.choices:
        mine = [e for e in events if e.index == choice.index]
        assert "".join(e.text for e in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason
        assert all(e.finish_reason is None for e in mine[:-1])
        assert choice.finish_reason in VALID_FINISH
        assert choice.text.strip()


# ---------------------------------------------------------------------- eviction
PREFIXES = (  # distinct first tokens: no two share a prefix
    "Alpine lakes form when glaciers carve deep basins into the rock and later melt, leaving "
    "cold, clear water behind. Many of them are fed by snow for most of the year, and their "
    "colour depends on the fine rock flour that the ice grinds and the water carries. ",
    "Bread rises because yeast eats the sugars in the flour and releases carbon dioxide, "
    "which the gluten network traps in countless small bubbles. A long, cool fermentation "
    "gives the loaf more flavour, while a hot oven sets the crust before it dries out. ",
    "Comets are loose balls of ice and dust that spend most of their lives far from the sun. "
    "When one of them comes closer, the ice turns into gas and drags dust along, forming a "
    "glowing head and a long tail that always points away from the sun. ",
)


@pytest.mark.integration
def test_retained_prefixes_are_evicted_lru(make_real: MakeReal, cold: Cold) -> None:
    # the KV tier alone: with the host-RAM tier an evicted prefix comes back from RAM
    # (tests/test_model_prefix_ram.py)
    ctx = make_real(n_ctx=2048, n_seq_max=2, prefix_ram_bytes=0)

    def ask(prefix: str, question: str) -> tuple[llamax.Completion, list[int]]:
        prompt = ctx.tokenize(prefix + "Question: " + question + "\nAnswer:")
        return ctx.add_request(prompt, GREEDY).result(TIMEOUT), prompt

    n_prefix = [len(ctx.tokenize(p)) for p in PREFIXES]
    for prefix in PREFIXES:  # the third evicts the first (least recently used)
        done, _ = ask(prefix, "What is this text about?")
        assert done.usage.cached_tokens == 0
    assert ctx.stats().num_retained == 2

    # Prefix 0 was evicted: computed again (this evicts prefix 1, now the oldest).
    miss, prompt = ask(PREFIXES[0], "Why does it matter?")
    assert miss.usage.cached_tokens == 0
    assert miss.token_ids == cold(prompt).token_ids
    # Prefix 2 survived both evictions.
    hit, prompt = ask(PREFIXES[2], "Why does it matter?")
    assert n_prefix[2] - 2 <= hit.usage.cached_tokens < len(prompt)
    assert hit.token_ids == cold(prompt).token_ids
    # Prefix 1 was evicted.
    late, prompt = ask(PREFIXES[1], "Why does it matter?")
    assert late.usage.cached_tokens == 0
    assert late.token_ids == cold(prompt).token_ids
    stats = ctx.stats()
    assert stats.num_retained == 2 and stats.num_free_seq_ids == 0


# ---------------------------------------------------------------------- session rules
def test_session_is_busy_while_a_request_runs(make_real: MakeReal, tmp_path: Path) -> None:
    ctx = make_real(n_ctx=1024, n_seq_max=2, autostart=False)
    prompt = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"
    with ctx.session() as session:
        first = session.add_request(prompt, GREEDY)
        with pytest.raises(llamax.SessionBusyError):
            session.add_request(prompt + "Sure", GREEDY)
        with pytest.raises(llamax.SessionBusyError):
            session.fork()
        with pytest.raises(llamax.SessionBusyError):
            session.rewind(1)
        with pytest.raises(llamax.SessionBusyError):
            session.save(tmp_path / "busy.llamax")
        ctx.process()  # mid-request: still busy
        assert not first.done()
        with pytest.raises(llamax.SessionBusyError):
            session.add_request(prompt, GREEDY)
        run(ctx)
        assert first.result(0).finish_reason in VALID_FINISH
        second = session.add_request(prompt, GREEDY)  # idle again: accepted
        run(ctx)
        assert second.result(0).token_ids == first.result(0).token_ids


@pytest.mark.integration
def test_session_rewind_drops_tokens(real_ctx: llamax.Context, make_real: MakeReal) -> None:
    ctx = real_ctx
    prompt = ctx.tokenize(SYS + user(QUESTIONS[9]))
    with ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result(TIMEOUT)
        held = session.token_ids
        num_reply = len(held) - len(prompt)
        assert num_reply >= 6, reply
        session.rewind(5)
        assert session.token_ids == held[:-5]
        session.rewind(0)
        assert session.token_ids == held[:-5]
        session.rewind(num_reply - 5)  # back to the bare prompt
        assert session.token_ids == tuple(prompt)
        with pytest.raises(ValueError, match="num_tokens"):
            session.rewind(-1)

        before = ctx.stats()
        again = session.add_request(prompt, GREEDY).result(TIMEOUT)
        assert again.usage.cached_tokens == len(prompt) - 1
        assert ctx.stats().num_prefill_tokens - before.num_prefill_tokens == 1
        assert again.token_ids == split_cold(make_real, prompt, len(prompt) - 1).token_ids
        if again.token_ids == reply.token_ids:
            assert session.token_ids == held
        held = session.token_ids  # the same, or a reply that parted from the first (shapes)
        assert held[: len(prompt)] == tuple(prompt)

        with pytest.raises(llamax.InvalidParameterError, match=f"holds {len(held)}"):
            session.rewind(10**6)  # past the start: refused, naming the session's length
        assert session.token_ids == held
        session.rewind(len(held))
        assert session.token_ids == ()
        assert ctx.stats().kv_cells_used == 0


@pytest.mark.integration
def test_session_is_not_evicted_by_other_requests(make_real: MakeReal, cold: Cold) -> None:
    ctx = make_real(n_ctx=1024, n_seq_max=2)
    prompt = ctx.tokenize(SYS + user(QUESTIONS[10]))
    with ctx.session() as session:
        reply = session.add_request(prompt, GREEDY).result(TIMEOUT)
        held = session.token_ids
        # Four requests compete for the one other sequence id (and evict each other).
        others = [ctx.add_request(p + "Question: Who cares?\nAnswer:", GREEDY) for p in PREFIXES]
        others.append(ctx.add_request(SYS + user(QUESTIONS[11]), GREEDY))
        for handle in others:
            assert handle.result(TIMEOUT).finish_reason in VALID_FINISH
        assert session.token_ids == held
        assert ctx.stats().num_retained == 1

        follow_up = prompt + list(reply.token_ids) + next_turn(ctx, QUESTIONS[12])
        before = ctx.stats()
        nxt = session.add_request(follow_up, GREEDY).result(TIMEOUT)
        assert nxt.usage.cached_tokens == len(held)
        assert ctx.stats().num_prefill_tokens - before.num_prefill_tokens == (
            len(follow_up) - len(held)
        )
        assert nxt.token_ids == cold(follow_up).token_ids
