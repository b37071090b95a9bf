"""The reproducible mode (``reproducible=True``, docs/reproducible.md), differentially: a
random concurrent load (bursts, shared prefixes, the host-RAM tier, sessions, ``n > 1``,
seeded sampling, stops, cancels) runs on one context, and every reply is compared bit for
bit (token ids, logprobs and their alternatives) with the same request run alone on a
context holding nothing, with the same options. Zero differences.

Then each rule of the mode is broken on purpose (prompt chunks where the batch has room,
a chunk decoded beside other sequences' rows, a prefix reused from a reply's cells, flash
attention, another thread count) and the same comparison finds a difference: the harness
sees what the rules prevent. The default mode's drift under the same load is reported,
not asserted (it depends on the load's timing). ``pytest -m soak`` runs a longer load with
a fresh context for every reference."""

from __future__ import annotations

import random
import runpy
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

import llamax
from llamax.engine.kv.kvcache import KVCache
from llamax.engine.plan import StepPlan, split_plan
from llamax.engine.sched.step_planner import StepPlanner
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

TIMEOUT = 300.0
OPTIONS: dict[str, Any] = {
    "n_ctx": 2048,
    "n_seq_max": 4,
    "n_ctx_seq": 512,
    "n_batch": 64,
    "n_threads": 2,
    "calibrate": False,
    "prefix_ram_bytes": 64 << 20,
}
"""Chunks of 64 (the grid), 4 streams of 512 cells, the host-RAM tier on."""
HEAD = (
    "<|im_start|>system\nYou are the archivist of a small museum of clocks. You answer "
    "visitors' questions about pendulums, escapements, chronometers, water clocks and "
    "sundials in two plain sentences, naming a maker and a year where you can, and you "
    "never invent a source. Visitors are often children, so you keep every word simple "
    "and you explain each technical term the first time you use it.<|im_end|>\n"
)
QUESTIONS = (
    "Who built the first pendulum clock?",
    "What is an escapement?",
    "How old are sundials?",
    "Why did sailors need chronometers?",
    "How does a water clock keep time?",
    "What is a tourbillon?",
    "Why do clocks have twelve hours?",
    "What did Harrison build?",
)

Reply = tuple[tuple[int, ...], tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...]]


def user(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def replies(done: llamax.Completion) -> tuple[Reply, ...]:
    """Every choice's token ids and logprobs (with their alternatives), bit for bit."""
    out = []
    for choice in done.choices:
        assert choice.logprobs is not None
        lps = tuple(
            (lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top_logprobs))
            for lp in choice.logprobs
        )
        out.append((choice.token_ids, lps))
    return tuple(out)


@dataclass
class Job:
    """One request of the load: its prompt (token ids) and parameters, and its reply."""

    prompt: list[int]
    params: llamax.SamplingParams
    kind: str
    got: tuple[Reply, ...] | None = None
    cancelled: bool = False


@dataclass
class Load:
    """What a load ran, and how its replies compare with their solo runs."""

    jobs: list[Job] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)

    @property
    def compared(self) -> list[Job]:
        return [job for job in self.jobs if job.got is not None]


def params(rng: random.Random, **extra: Any) -> llamax.SamplingParams:
    base: dict[str, Any] = {"max_tokens": rng.randint(6, 14), "logprobs": 2, "temperature": 0.0}
    base.update(extra)
    return llamax.SamplingParams(**base)


def run_load(ctx: llamax.Context, seed: int, num_bursts: int) -> Load:
    """A random concurrent load on ``ctx`` (background loop): bursts of requests from
    threads, sharing the head (not on a chunk boundary) or not, some sampled with a seed
    and ``n=2``, some with a stop string, one cancelled per burst, a chat continued in a
    session and a continuation that reuses a reply's cells."""
    rng = random.Random(seed)
    load = Load()
    lock = threading.Lock()
    head = ctx.tokenize(HEAD)

    def submit(job: Job, cancel: bool = False) -> None:
        handle = ctx.add_request(job.prompt, job.params)
        if cancel:
            next(iter(handle))
            job.cancelled = handle.cancel()
        done = handle.result(TIMEOUT)
        if not job.cancelled:
            job.got = replies(done)

    session = ctx.session()
    history: list[int] = [*head]
    for burst in range(num_bursts):
        jobs: list[tuple[Job, bool]] = []
        for i in range(rng.randint(3, 5)):
            question = rng.choice(QUESTIONS)
            shared = rng.random() < 0.7
            prompt = [*head, *ctx.tokenize(user(question), add_special=False)]
            if not shared:
                prompt = ctx.tokenize(f"Note {burst}.{i}: " + user(question))
            kind = rng.choice(("greedy", "greedy", "sampled", "stop"))
            if kind == "sampled":
                p = params(rng, temperature=0.8, seed=rng.randint(0, 999), n=2)
            elif kind == "stop":
                p = params(rng, stop=["."], max_tokens=16)
            else:
                p = params(rng)
            jobs.append((Job(prompt, p, kind), False))
        cancel = Job(
            [*head, *ctx.tokenize(user("Tell me everything."), add_special=False)],
            llamax.SamplingParams(max_tokens=200, ignore_eos=True, logprobs=2, temperature=0.0),
            "cancel",
        )
        jobs.append((cancel, True))
        threads = [threading.Thread(target=submit, args=pair) for pair in jobs]
        for thread in threads:
            thread.start()
        # a chat going on in a session, beside the burst: its whole conversation each turn
        turn = Job([*history, *ctx.tokenize(user(QUESTIONS[burst]), add_special=False)],
                   params(rng), "session")  # fmt: skip
        done = session.add_request(turn.prompt, turn.params).result(TIMEOUT)
        turn.got = replies(done)
        history = [*turn.prompt, *done.token_ids]
        for thread in threads:
            thread.join(TIMEOUT)
        with lock:
            load.jobs.extend(job for job, _ in jobs)
            load.jobs.append(turn)
        # a continuation of a finished reply (its cells are in the prefix cache)
        first = next((j for j in load.jobs if j.kind == "greedy" and j.got), None)
        if first is not None and first.got is not None:
            follow = Job(
                [*first.prompt, *first.got[0][0], *ctx.tokenize(user("Why?"), add_special=False)],
                params(rng),
                "continuation",
            )
            follow.got = replies(ctx.add_request(follow.prompt, follow.params).result(TIMEOUT))
            load.jobs.append(follow)
    session.close()
    return load


def compare(load: Load, solo: Callable[[Job], tuple[Reply, ...]]) -> Load:
    """Each reply against its solo run (``solo``); the differences as sentences."""
    for job in load.compared:
        want = solo(job)
        if job.got != want:
            load.differences.append(f"{job.kind} ({len(job.prompt)} tokens): {diff(job.got, want)}")
    return load


def diff(got: tuple[Reply, ...] | None, want: tuple[Reply, ...]) -> str:
    assert got is not None
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        if ids != want_ids:
            return f"tokens differ: {ids} vs {want_ids}"
        for i, (a, b) in enumerate(zip(lps, want_lps, strict=True)):
            if a != b:
                return f"logprob {i} differs by {abs(a[1] - b[1]):.3g}"
    return "?"


def solo_on(ctx: llamax.Context) -> Callable[[Job], tuple[Reply, ...]]:
    """Each job alone on ``ctx``, emptied first (a context holding nothing)."""

    def solo(job: Job) -> tuple[Reply, ...]:
        ctx.clear_cache()
        return replies(ctx.add_request(job.prompt, job.params).result(TIMEOUT))

    return solo


def solo_fresh(model_path: Path, options: dict[str, Any]) -> Callable[[Job], tuple[Reply, ...]]:
    """Each job alone on a fresh context."""

    def solo(job: Job) -> tuple[Reply, ...]:
        with llamax.Context(model_path, **options) as ctx:
            return replies(ctx.add_request(job.prompt, job.params).result(TIMEOUT))

    return solo


@pytest.fixture
def reproducible(model_path: Path) -> Iterator[Callable[..., llamax.Context]]:
    made: list[llamax.Context] = []

    def make(**options: Any) -> llamax.Context:
        ctx = llamax.Context(model_path, **{**OPTIONS, "reproducible": True, **options})
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()


def test_every_reply_of_a_random_concurrent_load_equals_its_solo_run(
    reproducible: Callable[..., llamax.Context],
) -> None:
    ctx = reproducible()
    assert ctx.kv_layout == "streams" and ctx.config.is_reproducible
    load = run_load(ctx, seed=60, num_bursts=2)
    stats = ctx.stats()
    assert ctx.audit() == []
    kinds = {job.kind for job in load.compared}
    assert {"greedy", "session", "continuation"} <= kinds
    assert stats.num_cached_tokens > 0  # prefixes were reused
    compare(load, solo_on(reproducible()))
    assert load.differences == [], load.differences
    assert stats.num_relayouts == 0 and stats.kv_layout == "streams"


@pytest.mark.parametrize("kv", [{}, {"kv_type_v": "q8_0"}], ids=["grid", "batch-invariant"])
def test_every_reply_equals_its_solo_run_with_the_disk_tier(
    reproducible: Callable[..., llamax.Context], tmp_path: Path, kv: dict[str, Any]
) -> None:
    """The same load with evicted prefixes kept on disk instead of in RAM: a prefix read
    back from a file holds the bits a cold run computes (cut to the grid, or whole where
    the model is batch-invariant)."""
    disk = {"prefix_ram_bytes": 0, "prefix_disk_dir": str(tmp_path / "tier"),
            "prefix_disk_bytes": 1 << 30, **kv}  # fmt: skip
    ctx = reproducible(**disk)
    assert ctx._engine.scheduler.kv.invariant is bool(kv)
    load = run_load(ctx, seed=63, num_bursts=2)
    p = llamax.SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    head = ctx.tokenize(HEAD)
    for turn in range(2):  # fill every stream: the shared head goes to disk, then back
        fillers = [ctx.tokenize(f"Filler {turn}.{i}: " + user(QUESTIONS[i])) for i in range(4)]
        for handle in [ctx.add_request(f, p) for f in fillers]:
            handle.result(TIMEOUT)
        back = Job([*head, *ctx.tokenize(user(QUESTIONS[turn]), add_special=False)], p, "disk")
        back.got = replies(ctx.add_request(back.prompt, p).result(TIMEOUT))
        load.jobs.append(back)
    stats = ctx.stats()
    assert ctx.audit() == []
    assert stats.prefix_disk.num_restores >= 1, stats.prefix_disk
    compare(load, solo_on(reproducible(**kv)))
    assert load.differences == [], load.differences


@pytest.mark.soak
@pytest.mark.parametrize("kv", [{}, {"kv_type_v": "q8_0"}], ids=["grid", "batch-invariant"])
def test_soak_every_reply_equals_its_run_on_a_fresh_context(
    reproducible: Callable[..., llamax.Context], model_path: Path, kv: dict[str, Any]
) -> None:
    ctx = reproducible(n_ctx=4096, n_seq_max=8, **kv)
    load = run_load(ctx, seed=61, num_bursts=8)
    options = {**OPTIONS, "reproducible": True, "n_ctx": 4096, "n_seq_max": 8, **kv}
    compare(load, solo_fresh(model_path, options))
    assert len(load.compared) > 30
    assert load.differences == [], load.differences


# ---------------------------------------------------------------- each rule, broken
#
# Measured on SmolLM2 (benchmarks/results/issue60/rules*.json): without flash attention a
# chunk decoded beside other sequences' rows, and a prefix reused from a reply's cells,
# change bits past 256 cells; chunks cut elsewhere and another thread count do not (with
# flash attention they do: those two rules guard against such kernels, and are shown
# broken with it on).


def manual_pair(
    reproducible: Callable[..., llamax.Context], prompts: Sequence[Sequence[int]], **options: Any
) -> tuple[list[tuple[Reply, ...]], list[tuple[Reply, ...]]]:
    """Run ``prompts`` (greedy, 12 tokens) together in one manual context, submitted at once,
    and each alone on another: the replies of both."""
    p = llamax.SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    ctx = reproducible(autostart=False, **options)
    handles = [ctx.add_request(list(prompt), p) for prompt in prompts]
    while ctx.has_work():
        ctx.process()
    together = [replies(h.result(0)) for h in handles]
    alone = reproducible(autostart=False, **options)
    solo = []
    for prompt in prompts:
        alone.clear_cache()
        handle = alone.add_request(list(prompt), p)
        while alone.has_work():
            alone.process()
        solo.append(replies(handle.result(0)))
    return together, solo


@pytest.fixture
def prompts(model_path: Path) -> list[list[int]]:
    """Four prompts of 300 to 340 tokens that share no prefix (past 256 cells, where flash
    attention's sums depend on the batch): submitted at once they are prefilled together
    (a chunk of one beside the last chunk or the decode rows of another)."""
    with llamax.Context(model_path, n_ctx=512, n_seq_max=1, calibrate=False) as ctx:
        return [
            ctx.tokenize(f"Visitor {i} asks: " + HEAD * 4 + user(QUESTIONS[i]))[: 300 + 13 * i]
            for i in range(4)
        ]


@pytest.fixture
def flash_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproducible contexts with flash attention on (the mode turns it off)."""
    check = llamax.ContextConfig._check_reproducible

    def with_flash_attention(self: llamax.ContextConfig) -> None:
        check(self)
        object.__setattr__(self, "flash_attn", True)

    monkeypatch.setattr(llamax.ContextConfig, "_check_reproducible", with_flash_attention)


def test_the_rules_hold_a_burst_exact(
    reproducible: Callable[..., llamax.Context], prompts: list[list[int]]
) -> None:
    together, solo = manual_pair(reproducible, prompts)
    assert together == solo


@pytest.mark.usefixtures("flash_attention")
def test_broken_chunks_off_the_grid_differ(
    reproducible: Callable[..., llamax.Context],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt alone, chunked where a busier batch would have had room (33 tokens) rather
    than on the grid (64): other bits, with flash attention."""
    _, solo = manual_pair(reproducible, prompts[3:])

    def anywhere(
        self: StepPlanner, seq: Any, grid: int, budget: int, fixed: Any
    ) -> tuple[int, Any]:
        return min(seq.num_pending, budget, 33), fixed

    monkeypatch.setattr(StepPlanner, "_chunk_on_grid", anywhere)
    _, elsewhere = manual_pair(reproducible, prompts[3:])
    assert elsewhere != solo


def beside_three_rows(
    reproducible: Callable[..., llamax.Context], prompt: Sequence[int], *, invariant: bool = False
) -> tuple[tuple[Reply, ...], tuple[Reply, ...]]:
    """``prompt`` (greedy, 12 tokens) submitted while three other sequences decode, on a
    manual context (``n_batch=67``: room for a 64-token chunk beside the three rows), and
    alone on another: both replies. ``invariant``: the context must have dropped the grid."""
    p = llamax.SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    busy = llamax.SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    ctx = reproducible(autostart=False, n_batch=67, n_ubatch=64)
    assert ctx._engine.scheduler.kv.invariant is invariant
    for i in range(3):
        ctx.add_request(f"Tale {i}:", busy)
    while ctx.stats().sequences.num_decode_tokens < 3:  # the three decode
        ctx.process()
    handle = ctx.add_request(list(prompt), p)
    while not handle.done():
        ctx.process()
    together = replies(handle.result(0))
    while ctx.has_work():
        ctx.process()
    alone = reproducible(autostart=False, n_batch=67, n_ubatch=64)
    solo = alone.add_request(list(prompt), p)
    while alone.has_work():
        alone.process()
    return together, replies(solo.result(0))


def test_broken_a_chunk_beside_other_rows_differs(
    reproducible: Callable[..., llamax.Context],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt's chunks each in one decode with three other sequences' decode rows
    (llama.cpp cuts a chunk into other micro-batches there): other bits than alone, even
    without flash attention."""

    def mixed(plan: StepPlan) -> list[StepPlan]:
        rows = [i for i, e in enumerate(plan.entries) if len(e.item.token_ids) == 1]
        chunks = [i for i, e in enumerate(plan.entries) if len(e.item.token_ids) > 1]
        groups = [[*rows, *chunks[:1]], *([i] for i in chunks[1:])]
        return split_plan(plan, [g for g in groups if g])

    monkeypatch.setattr(StepPlanner, "_split_reproducible", staticmethod(mixed))
    together, solo = beside_three_rows(reproducible, prompts[3])
    assert together != solo


def test_broken_a_prefix_reused_from_a_reply_differs(
    reproducible: Callable[..., llamax.Context],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A next turn holds the last reply: reused from its cells (computed one by one as it
    was decoded) it differs from a cold prefill of the same tokens, even without flash
    attention."""
    usable = KVCache.usable

    def anything(self: KVCache, slot: Any, num: int) -> int:
        grid, self.grid = self.grid, None
        try:
            return usable(self, slot, num)
        finally:
            self.grid = grid

    p = llamax.SamplingParams(max_tokens=128, temperature=0.0, logprobs=2, ignore_eos=True)
    ctx = reproducible()
    first = ctx.add_request(prompts[3], p).result(TIMEOUT)
    follow = [*prompts[3], *first.token_ids, *prompts[1][:20]]
    want = replies(reproducible().add_request(follow, p).result(TIMEOUT))
    assert replies(ctx.add_request(follow, p).result(TIMEOUT)) == want  # the rule holds
    monkeypatch.setattr(KVCache, "usable", anything)
    ctx.add_request(prompts[3], p).result(TIMEOUT)  # the first turn's cells again
    got = ctx.add_request(follow, p).result(TIMEOUT)
    assert got.usage.cached_tokens > len(prompts[3])
    assert replies(got) != want


@pytest.mark.usefixtures("flash_attention")
def test_broken_another_thread_count_differs(
    reproducible: Callable[..., llamax.Context], prompts: list[list[int]]
) -> None:
    """What an adapting thread count would do: the same prompt on 1 thread and on 2."""
    together, solo = manual_pair(reproducible, prompts[:1], n_threads=1)
    _, two = manual_pair(reproducible, prompts[:1])
    assert together == solo
    assert solo != two


def test_broken_flash_attention_differs(
    reproducible: Callable[..., llamax.Context],
    model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With flash attention over an F16 K and V a decode row's sums change beside other
    sequences' rows (past 512 cells here), every other rule kept; without it, or with flash
    attention over K and V types that ggml computes row by row, they do not."""
    with llamax.Context(model_path, n_ctx=512, n_seq_max=1, calibrate=False) as probe:
        mine = probe.tokenize("List: " + " ".join(f"item{i}" for i in range(150)) + "\nSum:")
        other = probe.tokenize("Story: " + " ".join(f"w{i}" for i in range(200)))
    assert 490 < len(mine) < 505 and len(other) > 600
    big = {"n_ctx": 4096, "n_ctx_seq": 1024, "n_batch": 256}
    p = llamax.SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    busy = llamax.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    def run(**kv: Any) -> tuple[tuple[Reply, ...], tuple[Reply, ...]]:
        ctx = reproducible(**big, **kv)
        others = [ctx.add_request(o, busy) for o in (other, other[:-3])]
        for handle in others:
            next(iter(handle))  # both decode: the reply's rows go beside theirs
        together = replies(ctx.add_request(mine, p).result(TIMEOUT))
        for handle in others:
            handle.cancel()
        alone = reproducible(**big, **kv)
        return together, replies(alone.add_request(mine, p).result(TIMEOUT))

    together, solo = run()
    assert together == solo
    # flash attention over a quantized V (the mode turns it on) or a BF16 V (asked for)
    # takes ggml's row-by-row kernel: exact, past 512 cells and beside other rows too
    for kv in ({"kv_type_v": "q8_0"}, {"kv_type_v": "bf16", "flash_attn": True}):
        together, solo = run(**kv)
        assert together == solo, kv
    check = llamax.ContextConfig._check_reproducible

    def with_flash_attention(self: llamax.ContextConfig) -> None:
        check(self)
        object.__setattr__(self, "flash_attn", True)

    monkeypatch.setattr(llamax.ContextConfig, "_check_reproducible", with_flash_attention)
    together, solo = run()
    assert together != solo


@pytest.mark.parametrize(
    "kv", [{"kv_type_v": "q8_0"}, {"kv_type": "q4_0"}], ids=["v-q8_0", "kv-q4_0"]
)
def test_every_reply_with_a_quantized_v_equals_its_solo_run(
    reproducible: Callable[..., llamax.Context], kv: dict[str, Any]
) -> None:
    """A quantized V needs flash attention, which the mode turns on for it: over these
    types ggml computes each row by itself, so the load's replies stay exact."""
    ctx = reproducible(**kv)
    assert ctx.config.flash_attn is True and ctx.config.kv_types[1] == kv.get(
        "kv_type_v", kv.get("kv_type")
    )
    # the probe finds SmolLM2 Q4_1 batch-invariant here: no chunk grid, every cell reused
    assert ctx._engine.scheduler.kv.invariant is True
    load = run_load(ctx, seed=61, num_bursts=2)
    assert ctx.audit() == []
    compare(load, solo_on(reproducible(**kv)))
    assert load.differences == [], load.differences


COPY_TEXT = (
    "Gear 12 meshes with pinion 7; pinion 7 drives wheel 40; wheel 40 turns the escape "
    "wheel 15; the escape wheel 15 releases the pallet 3 twice a second."
)


def test_drafts_verified_on_a_batch_invariant_model_change_no_bit(
    reproducible: Callable[..., llamax.Context],
) -> None:
    """Speculation in the mode (a q8_0 V: batch-invariant here): copy-heavy requests, greedy
    and seeded-sampled, from threads, every draft verified (unpriced); each reply bit for
    bit as it comes alone on a context without speculation."""
    kv = {"kv_type_v": "q8_0"}
    ctx = reproducible(speculative=llamax.PromptLookup(), **kv)
    assert ctx._engine.scheduler.kv.invariant is True
    ctx._engine.scheduler.drafts.priced = False  # every proposal verified
    prompts = [
        user(f"Copy this sentence exactly, twice: {COPY_TEXT} ({i})") + COPY_TEXT[: 20 + 9 * i]
        for i in range(4)
    ]
    params = [
        llamax.SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
        llamax.SamplingParams(max_tokens=40, temperature=0.7, seed=5, logprobs=2, ignore_eos=True),
    ]
    handles: dict[int, llamax.RequestHandle] = {}

    def submit(i: int) -> None:
        handles[i] = ctx.add_request(prompts[i], params[i % 2])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    done = {i: h.result(TIMEOUT) for i, h in handles.items()}
    assert sum(d.usage.accepted_tokens for d in done.values()) > 0
    assert ctx.audit() == []
    alone = reproducible(**kv)
    for i, got in done.items():
        alone.clear_cache()
        solo = alone.add_request(prompts[i], params[i % 2]).result(TIMEOUT)
        assert solo.usage.drafted_tokens == 0
        assert replies(solo) == replies(got), i


def test_without_flash_attention_the_probe_keeps_the_grid(
    reproducible: Callable[..., llamax.Context],
) -> None:
    """Without flash attention a one-row attention product sums otherwise than a chunk's
    (a reply's cells differ from a prompt's): the start-up probe sees it, so the grid's
    rules hold. The verdict is cached per model, build, CPU and options."""
    from llamax.engine.sched import row_probe

    ctx = reproducible(autostart=False)
    assert ctx.config.flash_attn is False
    backend = ctx._engine.scheduler.backend
    assert ctx._engine.scheduler.kv.invariant is False
    row_probe._CHUNK_VERDICTS.clear()  # probe again, not the cached verdict
    assert row_probe._chunk_probe(backend) is False
    assert row_probe.chunks_batch_invariant(backend) is False
    assert_idle(ctx)


def test_broken_the_grid_dropped_without_flash_attention_differs(
    reproducible: Callable[..., llamax.Context],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's verdict overruled (no grid, chunks batched and reused as in the default
    mode, on attention without flash attention): a burst's replies differ from their solo
    runs."""
    monkeypatch.setattr("llamax.engine.sched.scheduler.chunks_batch_invariant", lambda _: True)
    engine_config = llamax.ContextConfig.engine_config

    def row_attention(self: llamax.ContextConfig, **kw: Any) -> Any:
        return replace(engine_config(self, **kw), reproducible_row_attention=True)

    monkeypatch.setattr(llamax.ContextConfig, "engine_config", row_attention)
    together, solo = beside_three_rows(reproducible, prompts[3], invariant=True)
    assert together != solo


def test_the_default_mode_reports_its_drift(
    model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same load in the default mode (auto layout, flash attention as llama.cpp
    decides, chunks where the time budget says): how many replies drift is printed, not
    asserted (the load's timing decides it)."""
    options = {**OPTIONS, "n_ctx_seq": None, "reproducible": False}
    with llamax.Context(model_path, **options) as ctx:
        load = run_load(ctx, seed=60, num_bursts=1)
    with llamax.Context(model_path, **options) as alone:
        compare(load, solo_on(alone))
    with capsys.disabled():
        print(f"\ndefault mode: {len(load.differences)} of {len(load.compared)} replies differ")


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "reproducible.py"
    runpy.run_path(str(example), run_name="__main__")
    assert "bit for bit the same: True" in capsys.readouterr().out
