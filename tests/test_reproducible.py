"""The reproducible mode's rules (``reproducible=True``, docs/reproducible.md), on the fake
backend, deterministically: the options it refuses or sets, prompt chunks at multiples of
the grid and each alone in its decode whatever the load, decode rows together only where
a start-up probe finds a row's logits alike beside other rows (else each alone), no move of
the layout, no thread adaptation, and a prefix reused only up to a grid boundary its slot
computed as prompt chunks (never a reply's cells), from the KV cache, a session or the
host-RAM tier. The real model's differential harness is tests/test_model_reproducible.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

GRID = 16
GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0.0)


def prompt(seed: int, length: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 200 for i in range(length)]


@pytest.fixture
def made() -> Iterator[list[llamax.Context]]:
    contexts: list[llamax.Context] = []
    yield contexts
    for ctx in contexts:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


class ChunksMove(FakeBackend):
    """A backend whose rows depend on how their prompt was chunked (as llama.cpp's CPU
    attention without flash attention does: a one-row product sums otherwise than a
    chunk's): a row's logits move with the length of its item. The start-up probe finds it,
    so the grid's rules hold; the plain fake is batch-invariant (a row's logits are its
    token's alone) and needs no grid."""

    def decode(self, items: Sequence[Any]) -> int:
        status = super().decode(items)
        if status == 0:
            for item in items:
                for row in item.rows:
                    self._logits[self._rows[row], 0] += 1e-4 * len(item.token_ids)
        return status


def fake(
    made: list[llamax.Context], kind: type[FakeBackend] = ChunksMove, **options: Any
) -> tuple[llamax.Context, FakeBackend]:
    backend_options: dict[str, Any] = {
        "n_ctx": 4 * 256,
        "n_seq_max": 4,
        "n_batch": GRID,
        "kv_layout": "streams",
    }
    backend_options.update(options.pop("backend", {}))
    backend = kind(**backend_options)
    ctx = llamax.Context(backend=backend, autostart=False, reproducible=True, **options)
    made.append(ctx)
    assert_idle(ctx)  # the start-up probe of decode rows left nothing behind
    backend.decode_log.clear()  # what the tests look at is the load's decodes
    return ctx, backend


def drain(ctx: llamax.Context, handles: Sequence[llamax.RequestHandle]) -> list[llamax.Completion]:
    while ctx.has_work():
        ctx.process()
    return [h.result(0) for h in handles]


# ------------------------------------------------------------------ options


def test_the_mode_is_off_by_default_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMAX_REPRODUCIBLE", raising=False)
    config = llamax.ContextConfig("m.gguf")
    assert not config.is_reproducible and config.reproducible_chunk is None
    assert config.kv_layout == "auto" and config.flash_attn is None
    assert config.engine_config().reproducible_chunk is None


def test_the_mode_pins_streams_fixed_threads_and_no_flash_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLAMAX_ADAPT_THREADS", "1")
    config = llamax.ContextConfig("m.gguf", reproducible=True)
    assert config.is_reproducible and config.kv_layout == "streams"
    assert config.flash_attn is False and not config.adapts_threads
    assert config.reproducible_chunk == 256  # n_batch 512, at most 256
    assert llamax.ContextConfig("m.gguf", reproducible=True, n_ubatch=64).reproducible_chunk == 64
    assert llamax.ContextConfig("m.gguf", reproducible=True, n_batch=32).reproducible_chunk == 32
    assert config.engine_config().reproducible_chunk == 256
    assert not config.engine_config().adapt_threads


def test_the_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMAX_REPRODUCIBLE", "1")
    assert llamax.ContextConfig("m.gguf").is_reproducible
    assert not llamax.ContextConfig("m.gguf", reproducible=False).is_reproducible
    monkeypatch.setenv("LLAMAX_REPRODUCIBLE", "maybe")
    with pytest.raises(llamax.InvalidParameterError, match="LLAMAX_REPRODUCIBLE"):
        llamax.ContextConfig("m.gguf")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"kv_layout": "unified"}, "kv_layout"),
        ({"adapt_threads": True}, "adapt_threads"),
        ({"flash_attn": True}, "flash_attn"),
        ({"speculative": llamax.PromptLookup()}, "speculative"),
        ({"n_threads": 2, "n_threads_batch": 4}, "n_threads_batch"),
        ({"n_ctx": 1024, "n_seq_max": 4, "n_ctx_seq": 512}, "n_ctx_seq"),
        ({"reproducible": "yes"}, "reproducible"),
    ],
)
def test_what_contradicts_it_is_refused_naming_the_field(
    options: dict[str, Any], field: str
) -> None:
    with pytest.raises(llamax.InvalidParameterError) as caught:
        llamax.ContextConfig("m.gguf", **{"reproducible": True, **options})
    assert caught.value.param == field


@pytest.mark.parametrize("layout", ["unified", "auto"])
def test_a_backend_that_is_or_may_become_unified_is_refused(layout: str) -> None:
    backend = FakeBackend(n_ctx=1024, n_seq_max=4, kv_layout=layout)
    with pytest.raises(llamax.InvalidParameterError) as caught:
        llamax.Context(backend=backend, reproducible=True)
    assert caught.value.param == "kv_layout"
    backend.close()


# ------------------------------------------------------------------ chunks


def check_decodes(backend: FakeBackend, grid: int = GRID) -> None:
    """Each prompt chunk alone in its decode, from a multiple of the grid to at most the
    next one; the one-token rows together."""
    assert backend.decode_log
    for items in backend.decode_log:
        chunks = [i for i in items if len(i.token_ids) > 1]
        if chunks:
            assert len(items) == 1, f"a chunk beside other rows: {items}"
            (chunk,) = chunks
            assert chunk.start_pos % grid == 0, chunk
            assert chunk.start_pos // grid == (chunk.start_pos + len(chunk.token_ids) - 1) // grid


def test_chunks_start_on_the_grid_and_go_alone_whatever_the_load(
    made: list[llamax.Context],
) -> None:
    ctx, backend = fake(made, max_step_ms=1.0)
    first = [ctx.add_request(prompt(0, 5), llamax.SamplingParams(max_tokens=40))]
    ctx.process()
    ctx.process()  # it decodes: the burst's chunks come beside its rows
    burst = [ctx.add_request(prompt(s, 20 + 9 * s), GREEDY) for s in range(1, 6)]
    done = drain(ctx, first + burst)
    assert all(len(d.token_ids) for d in done)
    check_decodes(backend)
    assert any(len(items) > 1 for items in backend.decode_log)  # rows still go together


def test_the_default_mode_mixes_chunks_and_rows(made: list[llamax.Context]) -> None:
    backend = FakeBackend(n_ctx=1024, n_seq_max=4, n_batch=GRID, kv_layout="streams")
    ctx = llamax.Context(backend=backend, autostart=False)
    made.append(ctx)
    first = [ctx.add_request(prompt(0, 5), llamax.SamplingParams(max_tokens=40))]
    ctx.process()
    ctx.process()
    drain(ctx, first + [ctx.add_request(prompt(s, 20 + 9 * s), GREEDY) for s in range(1, 6)])
    mixed = [items for items in backend.decode_log if len(items) > 1]
    assert any(any(len(i.token_ids) > 1 for i in items) for items in mixed)


def test_replies_equal_their_solo_runs_on_the_fake(made: list[llamax.Context]) -> None:
    ctx, _ = fake(made)
    prompts = [prompt(s, 10 + 11 * s) for s in range(6)]
    together = drain(ctx, [ctx.add_request(p, GREEDY) for p in prompts])
    for p, got in zip(prompts, together, strict=True):
        alone, _ = fake(made)
        assert drain(alone, [alone.add_request(p, GREEDY)])[0].token_ids == got.token_ids


# ------------------------------------------------------------------ prefix reuse


def test_a_prefix_is_reused_only_up_to_a_boundary_of_the_sources_prompt(
    made: list[llamax.Context],
) -> None:
    ctx, backend = fake(made)
    head = prompt(1, 45)
    a = drain(ctx, [ctx.add_request([*head, 9, 9, 9, 9, 9], GREEDY)])[0]  # 50: exact to 48
    b = drain(ctx, [ctx.add_request([*head, 7, 7], GREEDY)])[0]  # shares 45
    assert b.usage.cached_tokens == 32
    # a continuation holds a's reply: only a's prompt, to its last boundary, is reused
    follow = [*head, 9, 9, 9, 9, 9, *a.token_ids, 5, 5, 5]
    c = drain(ctx, [ctx.add_request(follow, GREEDY)])[0]
    assert c.usage.cached_tokens == 48
    check_decodes(backend)


def test_a_session_turn_keeps_only_its_prompts_boundary(made: list[llamax.Context]) -> None:
    ctx, backend = fake(made)
    session = ctx.session()
    first = prompt(2, 40)
    handle = session.add_request(first, GREEDY)
    reply = drain(ctx, [handle])[0]
    turn = [*first, *reply.token_ids, 3, 3, 3]
    second = drain(ctx, [session.add_request(turn, GREEDY)])[0]
    assert second.usage.cached_tokens == 32  # not the 46 the session holds
    alone, _ = fake(made)
    assert drain(alone, [alone.add_request(turn, GREEDY)])[0].token_ids == second.token_ids
    session.close()
    check_decodes(backend)


def test_the_ram_tier_keeps_and_gives_back_only_the_aligned_part(
    made: list[llamax.Context],
) -> None:
    ctx, backend = fake(made, prefix_ram_bytes=1 << 20, backend={"n_seq_max": 1, "n_ctx": 256})
    head = prompt(3, 40)
    drain(ctx, [ctx.add_request([*head, 1, 2], GREEDY)])  # 42: exact to 32
    drain(ctx, [ctx.add_request(prompt(4, 30), GREEDY)])  # evicts it to RAM
    assert ctx.stats().prefix_ram.num_entries >= 1
    hit = drain(ctx, [ctx.add_request([*head, 1, 2, 3, 4], GREEDY)])[0]
    assert ctx.stats().prefix_ram.num_restores == 1
    assert hit.usage.cached_tokens == 32
    check_decodes(backend)


def test_n_greater_than_one_forks_and_equals_its_solo_run(made: list[llamax.Context]) -> None:
    params = llamax.SamplingParams(max_tokens=5, temperature=0.9, seed=3, n=3)
    ctx, backend = fake(made)
    busy = ctx.add_request(prompt(5, 12), llamax.SamplingParams(max_tokens=30))
    ctx.process()
    got = drain(ctx, [busy, ctx.add_request(prompt(6, 37), params)])[1]
    alone, _ = fake(made)
    want = drain(alone, [alone.add_request(prompt(6, 37), params)])[0]
    assert [c.token_ids for c in got.choices] == [c.token_ids for c in want.choices]
    check_decodes(backend)


# ------------------------------------------------------------------ decode rows


class RowsMoveBesideOthers(ChunksMove):
    """A backend whose kernels compute a decode row differently beside other rows (as
    llama.cpp's CPU matmuls do for F16 and Q4_K weights here): token 0's logit moves."""

    def decode(self, items: Sequence[Any]) -> int:
        status = super().decode(items)
        if status == 0 and len(items) > 1:
            self._logits[:, 0] += 1e-3
        return status


LOGPROBS = llamax.SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)


def _bits(done: llamax.Completion) -> list[tuple[int, float]]:
    assert done.choices[0].logprobs is not None
    return [(lp.token_id, lp.logprob) for lp in done.choices[0].logprobs]


def _burst_and_solos(
    made: list[llamax.Context], kind: type[FakeBackend], **backend: Any
) -> tuple[FakeBackend, list[list[tuple[int, float]]], list[list[tuple[int, float]]]]:
    ctx, fake_backend = fake(made, kind, backend=backend)
    prompts = [prompt(s, 10 + 11 * s) for s in range(4)]
    together = [_bits(d) for d in drain(ctx, [ctx.add_request(p, LOGPROBS) for p in prompts])]
    solo = []
    for p in prompts:
        alone, _ = fake(made, kind, backend=backend)
        solo.append(_bits(drain(alone, [alone.add_request(p, LOGPROBS)])[0]))
    return fake_backend, together, solo


def test_rows_go_alone_where_a_row_moves_beside_others(made: list[llamax.Context]) -> None:
    backend, together, solo = _burst_and_solos(made, RowsMoveBesideOthers)
    assert together == solo
    assert all(len(items) == 1 for items in backend.decode_log)


def test_rows_together_beside_a_row_that_moves_differ(
    made: list[llamax.Context], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule broken (the probe's verdict ignored, rows together as before it): the same
    burst's logprobs differ from the solo runs'."""
    monkeypatch.setattr("llamax.engine.sched.scheduler.rows_batch_invariant", lambda backend: True)
    backend, together, solo = _burst_and_solos(made, RowsMoveBesideOthers)
    assert any(len(items) > 1 for items in backend.decode_log)
    assert together != solo


@pytest.mark.parametrize("memory", [{"recurrent": True}, {"sliding_window": 8}])
def test_a_recurrent_or_sliding_memory_decodes_rows_alone_without_a_probe(
    made: list[llamax.Context], memory: dict[str, Any]
) -> None:
    ctx, backend = fake(made, backend=memory)
    assert ctx._engine.scheduler.planner.rows_together is False
    drain(ctx, [ctx.add_request(prompt(s, 10 + 11 * s), GREEDY) for s in range(4)])
    assert all(len(items) == 1 for items in backend.decode_log)


class KeyedFake(FakeBackend):
    def calibration_key(self) -> str | None:
        return "keyed fake"


def test_a_verdict_is_probed_once_per_model_build_cpu_and_settings(
    made: list[llamax.Context],
) -> None:
    first = KeyedFake(n_ctx=4 * 256, n_seq_max=4, n_batch=GRID, kv_layout="streams")
    made.append(llamax.Context(backend=first, autostart=False, reproducible=True))
    second = KeyedFake(n_ctx=4 * 256, n_seq_max=4, n_batch=GRID, kv_layout="streams")
    made.append(llamax.Context(backend=second, autostart=False, reproducible=True))
    assert first.decode_log and not second.decode_log
    assert made[-1]._engine.scheduler.planner.rows_together is True


def test_the_default_mode_probes_nothing(made: list[llamax.Context]) -> None:
    backend = RowsMoveBesideOthers(n_ctx=1024, n_seq_max=4, n_batch=GRID, kv_layout="streams")
    made.append(llamax.Context(backend=backend, autostart=False))
    assert backend.decode_log == []


def test_rows_under_an_adapter_go_alone(made: list[llamax.Context], tmp_path: Any) -> None:
    """A LoRA adapter's products are F32 matmuls, which compute a row differently in a
    batch (measured on SmolLM2 with a random adapter, rows together: 2 replies differed
    from their solo runs, and the same test failed 2 of 2 reruns): under an adapter each
    decode row goes alone, without, they go together as the probe allows."""
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF fake adapter")
    backend = FakeBackend(n_ctx=4 * 256, n_seq_max=4, n_batch=GRID, kv_layout="streams")
    ctx = llamax.Context(
        backend=backend, autostart=False, reproducible=True, lora={"a": str(adapter)}
    )
    made.append(ctx)
    backend.decode_log.clear()
    tuned = llamax.SamplingParams(max_tokens=6, temperature=0.0, lora={"a": 1.0})
    drain(ctx, [ctx.add_request(prompt(s, 10 + 11 * s), tuned) for s in range(4)])
    assert backend.decode_log and all(len(items) == 1 for items in backend.decode_log)
    backend.decode_log.clear()
    drain(ctx, [ctx.add_request(prompt(s, 10 + 11 * s), GREEDY) for s in range(4)])
    assert any(len(items) > 1 for items in backend.decode_log)


class RefusesTogether(FakeBackend):
    """A backend that refuses any decode of several sequences while ``refusing`` is set."""

    refusing = True

    def decode(self, items: Sequence[Any]) -> int:
        if self.refusing and len(items) > 1:
            return 1
        return super().decode(items)


def test_a_probe_that_cannot_decode_sends_rows_apart_and_leaves_nothing(
    made: list[llamax.Context],
) -> None:
    ctx, backend = fake(made, RefusesTogether)  # asserts the context idle after the probe
    assert ctx._engine.scheduler.planner.rows_together is False
    assert isinstance(backend, RefusesTogether)
    backend.refusing = False
    drain(ctx, [ctx.add_request(prompt(s, 12), GREEDY) for s in range(3)])
    assert all(len(items) == 1 for items in backend.decode_log)


# ------------------------------------------------------------------ batch-invariant models

ROW_ATTENTION = {"kv_type_v": "q8_0"}
"""A quantized V: the mode turns flash attention on, which ggml computes row by row."""


def test_the_probe_finds_rows_that_move_with_their_chunk(made: list[llamax.Context]) -> None:
    ctx, _ = fake(made)  # ChunksMove
    assert ctx._engine.scheduler.planner.rows_together is True
    assert ctx._engine.scheduler.kv.invariant is False
    plain, _ = fake(made, FakeBackend, **ROW_ATTENTION)
    assert plain._engine.scheduler.kv.invariant is True
    small, _ = fake(made, FakeBackend, backend={"n_batch": 8}, **ROW_ATTENTION)
    assert small._engine.scheduler.kv.invariant is False  # too small to look: the grid
    f16, _ = fake(made, FakeBackend)  # attention without flash attention: not row by row
    assert f16._engine.scheduler.kv.invariant is False
    gpu, _ = fake(made, FakeBackend, backend={"cpu_attention": False}, **ROW_ATTENTION)
    assert gpu._engine.scheduler.kv.invariant is False  # a GPU's kernels: not probed here


def test_a_batch_invariant_model_batches_and_cuts_chunks_as_the_default_mode(
    made: list[llamax.Context],
) -> None:
    """Where the probe finds every row alike however it is chunked and batched, the
    grid's rules are not needed: chunks go beside rows and off the grid, as in the default
    mode, and every reply still equals its solo run."""
    ctx, backend = fake(made, FakeBackend, max_step_ms=1.0, **ROW_ATTENTION)
    first = [ctx.add_request(prompt(0, 5), llamax.SamplingParams(max_tokens=40))]
    ctx.process()
    ctx.process()
    prompts = [prompt(s, 20 + 9 * s) for s in range(1, 6)]
    done = drain(ctx, first + [ctx.add_request(p, LOGPROBS) for p in prompts])
    mixed = [items for items in backend.decode_log if len(items) > 1]
    assert any(any(len(i.token_ids) > 1 for i in items) for items in mixed)
    for p, got in zip(prompts, done[1:], strict=True):
        alone, _ = fake(made, FakeBackend, **ROW_ATTENTION)
        assert _bits(drain(alone, [alone.add_request(p, LOGPROBS)])[0]) == _bits(got)


def test_a_batch_invariant_model_reuses_every_cell(made: list[llamax.Context]) -> None:
    """A reply's cells and a prefix off the grid are reused whole: the model computes them
    as a cold prompt does (the probe's one-token-at-a-time rows against a chunk)."""
    ctx, _ = fake(made, FakeBackend, **ROW_ATTENTION)
    head = prompt(1, 45)
    a = drain(ctx, [ctx.add_request([*head, 9, 9, 9, 9, 9], GREEDY)])[0]
    b = drain(ctx, [ctx.add_request([*head, 7, 7], GREEDY)])[0]
    assert b.usage.cached_tokens == 45  # 32 on the grid
    follow = [*head, 9, 9, 9, 9, 9, *a.token_ids, 5, 5, 5]
    c = drain(ctx, [ctx.add_request(follow, GREEDY)])[0]
    assert c.usage.cached_tokens == 50 + len(a.token_ids) - 1  # the reply's cells too


def test_a_batch_invariant_model_keeps_the_grid_under_an_adapter(
    made: list[llamax.Context], tmp_path: Any
) -> None:
    """An adapter's F32 products depend on the batch even where the base model's do not:
    under one, chunks stay on the grid and alone, and reuse stops at a boundary."""
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF fake adapter")
    ctx, backend = fake(made, FakeBackend, lora={"a": str(adapter)}, **ROW_ATTENTION)
    assert ctx._engine.scheduler.kv.invariant is True
    tuned = llamax.SamplingParams(max_tokens=6, temperature=0.0, lora={"a": 1.0})
    busy = ctx.add_request(prompt(0, 5), llamax.SamplingParams(max_tokens=40, lora={"a": 1.0}))
    ctx.process()
    ctx.process()
    head = prompt(1, 45)
    drain(ctx, [busy, *(ctx.add_request(prompt(s, 20 + 9 * s), tuned) for s in range(2, 5))])
    drain(ctx, [ctx.add_request([*head, 9, 9, 9, 9, 9], tuned)])
    check_decodes(backend)
    b = drain(ctx, [ctx.add_request([*head, 7, 7], tuned)])[0]
    assert b.usage.cached_tokens == 32


def test_a_batch_invariant_model_keeps_whole_prefixes_in_the_ram_tier(
    made: list[llamax.Context],
) -> None:
    ctx, _ = fake(
        made,
        FakeBackend,
        prefix_ram_bytes=1 << 20,
        backend={"n_seq_max": 1, "n_ctx": 256},
        **ROW_ATTENTION,
    )
    head = prompt(3, 40)
    drain(ctx, [ctx.add_request([*head, 1, 2], GREEDY)])
    drain(ctx, [ctx.add_request(prompt(4, 30), GREEDY)])  # evicts it to RAM
    hit = drain(ctx, [ctx.add_request([*head, 1, 2, 3, 4], GREEDY)])[0]
    assert ctx.stats().prefix_ram.num_restores == 1
    assert hit.usage.cached_tokens >= 42  # the prompt whole (and the reply's cells)


def test_the_grid_rule_broken_on_a_model_whose_chunks_move_differs(
    made: list[llamax.Context], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's chunk verdict ignored (no grid on a model whose rows move with their
    chunk): the same burst's logprobs differ from the solo runs'."""
    monkeypatch.setattr("llamax.engine.sched.scheduler.chunks_batch_invariant", lambda _: True)
    ctx, _ = fake(made, max_step_ms=1.0, **ROW_ATTENTION)
    first = [ctx.add_request(prompt(0, 5), llamax.SamplingParams(max_tokens=40))]
    ctx.process()
    ctx.process()
    prompts = [prompt(s, 20 + 9 * s) for s in range(1, 6)]
    done = drain(ctx, first + [ctx.add_request(p, LOGPROBS) for p in prompts])
    solo = []
    for p in prompts:
        alone, _ = fake(made, **ROW_ATTENTION)
        solo.append(_bits(drain(alone, [alone.add_request(p, LOGPROBS)])[0]))
    assert [_bits(d) for d in done[1:]] != solo


def copying(seed: int) -> str:
    """A prompt the fake continues as it ran before (the fake's next letter follows the
    last one, a..z cycling): prompt lookup drafts the alphabet again, the fake confirms it."""
    return f"{seed}: " + "abcdefghijklmnopqrstuvwxyz" * 2


COPY = llamax.SamplingParams(max_tokens=20, temperature=0.0, logprobs=1)


def test_a_batch_invariant_model_verifies_drafts_and_stays_exact(
    made: list[llamax.Context],
) -> None:
    """On a batch-invariant model a verified draft's cells are the cells a cold run
    computes, so the mode drafts (``speculative=`` with a row-by-row attention is taken),
    and every reply equals its solo run without drafts."""
    ctx, _ = fake(made, FakeBackend, speculative=llamax.PromptLookup(), **ROW_ATTENTION)
    assert ctx._engine.scheduler.kv.invariant is True
    ctx._engine.scheduler.drafts.priced = False  # verify every proposal
    done = drain(ctx, [ctx.add_request(copying(s), COPY) for s in range(3)])
    assert sum(d.usage.drafted_tokens for d in done) > 0
    assert sum(d.usage.accepted_tokens for d in done) > 0
    for s, got in enumerate(done):
        alone, _ = fake(made, FakeBackend, **ROW_ATTENTION)
        assert _bits(drain(alone, [alone.add_request(copying(s), COPY)])[0]) == _bits(got)


def test_drafts_stay_off_where_the_grid_holds(
    made: list[llamax.Context], tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose rows move with their chunk keeps the grid, and nothing drafts (a
    warning says why); under an adapter nothing drafts on a batch-invariant model either."""
    with caplog.at_level("WARNING", logger="llamax.engine"):
        ctx, _ = fake(made, speculative=llamax.PromptLookup(), **ROW_ATTENTION)
    assert "not batch-invariant" in caplog.text
    ctx._engine.scheduler.drafts.priced = False
    done = drain(ctx, [ctx.add_request(copying(s), COPY) for s in range(2)])
    assert sum(d.usage.drafted_tokens for d in done) == 0
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF fake adapter")
    ctx, _ = fake(
        made,
        FakeBackend,
        speculative=llamax.PromptLookup(),
        lora={"a": str(adapter)},
        **ROW_ATTENTION,
    )
    ctx._engine.scheduler.drafts.priced = False
    tuned = llamax.SamplingParams(max_tokens=20, temperature=0.0, lora={"a": 1.0})
    under = drain(ctx, [ctx.add_request(copying(s), tuned) for s in range(2)])
    assert sum(d.usage.drafted_tokens for d in under) == 0
    plain = drain(ctx, [ctx.add_request(copying(5), COPY)])
    assert plain[0].usage.drafted_tokens > 0


def test_speculation_without_row_by_row_attention_is_refused() -> None:
    with pytest.raises(llamax.InvalidParameterError) as caught:
        llamax.ContextConfig("m.gguf", reproducible=True, speculative=llamax.PromptLookup())
    assert caught.value.param == "speculative"
    taken = llamax.ContextConfig(
        "m.gguf", reproducible=True, speculative=llamax.PromptLookup(), kv_type_v="q8_0"
    )
    assert taken.flash_attn is True and taken.speculative is not None
