"""Sliding-window models (issue 40) in every KV layout, through the public API.

The random Gemma 3 model of ``scripts/make_memory_model.py`` has a 32-token window. llamax
keeps llama.cpp's full-size window cache (``swa_full``, the context default), so its memory
is cut and copied like a plain one (``can_share_prefix``; no checkpoints), in
``kv_layout="unified"``, ``"streams"`` and ``"auto"`` (which, for a model whose saved
states cannot move between layouts, stays unified: ``adapts_layout`` needs a plain cache).

Each test compares a cache hit with a cold computation of the same tokens *at the same
batch composition*, so logprobs must be equal to the bit: the cold context has the prefix
cache off and ``n_batch`` equal to the cached prefix, so it computes the prompt in the same
two decodes ([0, P), then the rest) as the cached run, which copied [0, P) from another
sequence (or stream) or kept it in a session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import memory_model_files
import numpy as np
import pytest

import llamax

pytest.importorskip("gguf")
pytestmark = [pytest.mark.model, pytest.mark.integration]  # checkpoints: the hybrid is default

P, TAIL = 150, 40  # cached prefix (several windows), tokens after it
PARAMS = llamax.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def window_model(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    return memory_model_files.shared(tmp_path_factory, "sliding_window", model_path)


@pytest.fixture(params=["unified", "streams", "auto"])
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _context(path: Path, layout: str, **options: object) -> llamax.Context:
    settings: dict[str, object] = {
        "n_ctx": 4096,
        "n_seq_max": 4,
        "n_batch": 256,
        "n_threads": 1,
        "kv_layout": layout,
    }
    settings.update(options)
    return llamax.Context(path, **settings)  # type: ignore[arg-type]


@pytest.fixture
def ctx(window_model: Path, layout: str) -> Iterator[llamax.Context]:
    with _context(window_model, layout) as made:
        yield made


@pytest.fixture
def cold(window_model: Path, layout: str) -> Iterator[llamax.Context]:
    """Nothing cached; a prompt is computed as [0, P) then the rest (``n_batch`` = P)."""
    with _context(window_model, layout, n_batch=P, prefix_cache=False) as made:
        yield made


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, n).tolist()


def _picks(done: llamax.Completion, index: int = 0) -> tuple[list[int], list[list[float]]]:
    """A choice's tokens and, for each, the top logprobs' values."""
    choice = done.choices[index]
    tops = [[t.logprob for t in lp.top_logprobs] for lp in choice.logprobs or ()]
    return list(choice.token_ids), tops


PREFIX, OTHER, TAIL_TOKENS = _tokens(1, P), _tokens(2, 30), _tokens(3, TAIL)


def test_the_layouts_are_what_the_docs_say(ctx: llamax.Context, layout: str) -> None:
    stats = ctx.stats()
    assert stats.kv_layout == ("unified" if layout == "auto" else layout)
    assert ctx._engine.backend.can_share_prefix and not ctx._engine.backend.can_checkpoint


def test_a_shared_prefix_is_copied_exactly(ctx: llamax.Context, cold: llamax.Context) -> None:
    """Another sequence's prefix (a retained slot, copied across streams or re-tagged in
    the unified cache) gives the cold run's logprobs to the bit."""
    ctx.add_request([*PREFIX, *OTHER], PARAMS).result(timeout=120)
    prompt = [*PREFIX, *TAIL_TOKENS]
    hit = ctx.add_request(prompt, PARAMS).result(timeout=120)
    assert hit.usage.cached_tokens == P
    assert _picks(hit) == _picks(cold.add_request(prompt, PARAMS).result(timeout=120))


def test_n_choices_share_the_prompt_exactly(ctx: llamax.Context, cold: llamax.Context) -> None:
    """``n = 3`` forks the leader after its prompt: every choice's first token has the cold
    run's logprobs to the bit (later tokens are decoded three rows at a time, another batch
    composition than the cold run's single row, so only their picks are compared)."""
    ctx.add_request([*PREFIX, *OTHER], PARAMS).result(timeout=120)
    prompt = [*PREFIX, *TAIL_TOKENS]
    params = llamax.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=5, n=3)
    hit = ctx.add_request(prompt, params).result(timeout=120)
    assert hit.usage.cached_tokens == P
    tokens, tops = _picks(cold.add_request(prompt, PARAMS).result(timeout=120))
    for index in range(3):
        got_tokens, got_tops = _picks(hit, index)
        assert got_tops[0] == tops[0]
        assert got_tokens == tokens


def test_a_session_rewound_past_its_window_continues_exactly(
    ctx: llamax.Context, cold: llamax.Context
) -> None:
    """A session that went on far past the window, rewound to P and continued, equals the
    cold run: the full-size window cache still holds the cells the window needs at P."""
    with ctx.session() as session:
        session.add_request([*PREFIX, *OTHER, *_tokens(4, 60)], PARAMS).result(timeout=120)
        session.rewind(len(session.token_ids) - P)
        assert list(session.token_ids) == PREFIX
        prompt = [*PREFIX, *TAIL_TOKENS]
        hit = session.add_request(prompt, PARAMS).result(timeout=120)
    assert hit.usage.cached_tokens == P
    assert _picks(hit) == _picks(cold.add_request(prompt, PARAMS).result(timeout=120))


def test_a_saved_session_holds_only_its_window_and_continues_exactly(
    ctx: llamax.Context, cold: llamax.Context, tmp_path: Path
) -> None:
    """Regression: llama.cpp saves a sliding-window sequence's window cache without the
    cells the window has passed (``llama_kv_cache::state_write`` skips masked cells), so a
    loaded session holds positions ``P - 32 .. P - 1`` there, not 0. The engine reused a
    slot only if it held position 0, so the loaded session was recomputed whole (0 cached
    tokens; the same for every prefix the RAM and disk tiers kept). It now asks for the
    window before the cut (``KVCache.is_intact``): the continuation reuses all P tokens and
    gives the cold run's logprobs to the bit."""
    with ctx.session() as session:
        session.add_request([*PREFIX, *OTHER], PARAMS).result(timeout=120)
        session.rewind(len(session.token_ids) - P)
        session.save(tmp_path / "window.llamax")
    prompt = [*PREFIX, *TAIL_TOKENS]
    with ctx.load_session(tmp_path / "window.llamax") as loaded:
        assert list(loaded.token_ids) == PREFIX
        hit = loaded.add_request(prompt, PARAMS).result(timeout=120)
    assert hit.usage.cached_tokens == P
    assert _picks(hit) == _picks(cold.add_request(prompt, PARAMS).result(timeout=120))


def _spilled(ctx: llamax.Context) -> list[int]:
    """Compute ``PREFIX + OTHER``, then another prompt that takes the one sequence id, so the
    first goes to the RAM tier; the tokens the first's slot held (prompt and reply but its
    last token, which was sampled and never computed)."""
    first = ctx.add_request([*PREFIX, *OTHER], PARAMS).result(timeout=120)
    ctx.add_request(_tokens(5, 50), PARAMS).result(timeout=120)
    assert ctx.stats().prefix_ram_entries >= 1
    return [*PREFIX, *OTHER, *first.token_ids[:-1]]


def test_a_cut_below_a_saved_window_is_recomputed(window_model: Path, layout: str) -> None:
    """Regression: a prefix back from the RAM tier holds only its window's cells (the last
    32 positions); cut below them, the window cache held nothing (``seq_pos_min`` -1, which
    passed the old ``<= 0`` check) and the prompt was answered from no window at all (other
    tokens than the cold run's from the first one). Now the restore is refused and the
    prompt computed whole, as the cold run."""
    prompt = [*PREFIX, *TAIL_TOKENS]
    with _context(window_model, layout, n_seq_max=1, prefix_ram_bytes=64 << 20) as ctx:
        _spilled(ctx)
        hit = ctx.add_request(prompt, PARAMS).result(timeout=120)
    with _context(window_model, layout, prefix_cache=False) as whole:
        assert _picks(hit) == _picks(whole.add_request(prompt, PARAMS).result(timeout=120))
    assert hit.usage.cached_tokens == 0


def test_a_next_turn_comes_back_from_the_ram_tier_exactly(window_model: Path, layout: str) -> None:
    """A next turn (the spilled prompt, its reply, more) is cut at the saved state's end,
    inside its window: all of it is reused, with the logprobs of the same turn served from
    the KV it was saved from (the same batch composition: the prompt in one decode, the
    reply a token a decode, the turn in one)."""
    with _context(window_model, layout, n_seq_max=1, prefix_ram_bytes=64 << 20) as ctx:
        held = _spilled(ctx)
        prompt = [*held, *TAIL_TOKENS]
        hit = ctx.add_request(prompt, PARAMS).result(timeout=120)
        assert ctx.stats().num_prefix_ram_restores == 1
    assert hit.usage.cached_tokens == len(held)
    with _context(window_model, layout, n_seq_max=1) as kept:
        kept.add_request([*PREFIX, *OTHER], PARAMS).result(timeout=120)
        again = kept.add_request(prompt, PARAMS).result(timeout=120)
    assert again.usage.cached_tokens == len(held)
    assert _picks(hit) == _picks(again)
