"""What checkpoints (issue 40) rest on, shown on random models of each memory kind.

``scripts/make_memory_model.py`` writes a hybrid (LFM2), a recurrent (Mamba2) and a
sliding-window (Gemma 3, 32-token window) model; SmolLM2 is the plain one. On each, in both
KV layouts, through :class:`~llamax.backend.llama_cpp.LlamaCppBackend`:

- a partial state (``state_seq_get(partial=True)``: the recurrent state, the window's
  cells) taken after ``P`` tokens, set back into the sequence after it went on to ``N``,
  then the cells past ``P`` removed, continues exactly as the sequence did at ``P``: the
  logits equal a cold run's with the same batch composition, to the bit;
- the same into another sequence that got the source's cells by ``seq_cp``;
- and why it is needed: without it a recurrent or hybrid memory refuses the cut (a
  sliding window's full-size cache, llama.cpp's default, keeps every cell and cuts
  exactly).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import memory_model_files
import numpy as np
import pytest

import llamax
from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig

pytest.importorskip("gguf")
pytestmark = pytest.mark.model

KINDS = ("hybrid", "recurrent", "sliding_window")
P, N, TAIL = 96, 160, 24  # checkpoint position, where the sequence went on to, tokens after P


@pytest.fixture(scope="module")
def memory_models(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> dict[str, Path]:
    return {kind: memory_model_files.shared(tmp_path_factory, kind, model_path) for kind in KINDS}


@pytest.fixture(params=["unified", "streams"])
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _backend(path: Path, layout: str) -> LlamaCppBackend:
    return LlamaCppBackend(
        ContextConfig(
            model_path=str(path),
            n_ctx=1024,
            n_seq_max=4,
            n_batch=256,
            n_threads=1,
            kv_layout=layout,
        )
    )


# the hybrid (a recurrent state and attention) in the default run, the others in the
# integration run
DEFAULT_KINDS = [
    "hybrid",
    pytest.param("recurrent", marks=pytest.mark.integration),
    pytest.param("sliding_window", marks=pytest.mark.integration),
]


@pytest.fixture(params=DEFAULT_KINDS)
def backend(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    model_path: Path,
    layout: str,
) -> Iterator[LlamaCppBackend]:
    made = _backend(memory_model_files.shared(tmp_path_factory, request.param, model_path), layout)
    yield made
    made.close()


@pytest.mark.integration
def test_the_written_models_are_the_memory_kinds_they_claim(
    memory_models: dict[str, Path], model_path: Path
) -> None:
    infos = {kind: llamax.model_info(path) for kind, path in memory_models.items()}
    facts = {
        k: (i.architecture, i.is_hybrid, i.is_recurrent, i.sliding_window) for k, i in infos.items()
    }
    assert facts == {
        "hybrid": ("lfm2", True, False, 0),
        "recurrent": ("mamba2", False, True, 0),
        "sliding_window": ("gemma3", False, False, 32),
    }
    assert all(path.stat().st_size < 10_000_000 for path in memory_models.values())
    # `llamax info` measures memory (issue 57): a recurrent state does not grow a token at
    # a time; attention (the hybrid's attention layers, the sliding window's) does
    assert infos["recurrent"].kv_bytes_per_cell == 0 < infos["recurrent"].state_bytes_per_seq
    assert infos["hybrid"].kv_bytes_per_cell > 0 < infos["hybrid"].state_bytes_per_seq
    assert infos["sliding_window"].kv_bytes_per_cell > 0
    again = memory_model_files.script().write_memory_model(
        memory_models["hybrid"].with_name("again.gguf"), kind="hybrid", tokenizer_from=model_path
    )
    assert again.read_bytes() == memory_models["hybrid"].read_bytes()  # seeded
    with pytest.raises(ValueError, match="kind must be one of"):
        memory_model_files.script().write_memory_model(again, kind="rwkv")


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, n).tolist()


def _run(backend: LlamaCppBackend, seq_id: int, tokens: list[int], start: int) -> np.ndarray:
    """Decode ``tokens`` into ``seq_id`` from ``start`` as one item; the last row's logits."""
    assert backend.decode([BatchItem(seq_id, tokens, start, (len(tokens) - 1,))]) == 0
    return np.array(backend.logits(len(tokens) - 1), copy=True)


PROMPT, TAIL_TOKENS = _tokens(1, N), _tokens(2, TAIL)


def _cold(backend: LlamaCppBackend, seq_id: int) -> np.ndarray:
    """``PROMPT[:P]`` then ``TAIL_TOKENS``, computed from nothing, in the same two items."""
    _run(backend, seq_id, PROMPT[:P], 0)
    logits = _run(backend, seq_id, TAIL_TOKENS, P)
    assert backend.seq_rm(seq_id, -1, -1)
    return logits


def test_a_partial_state_takes_a_sequence_back_to_its_checkpoint(backend: LlamaCppBackend) -> None:
    cold = _cold(backend, 0)
    _run(backend, 1, PROMPT[:P], 0)
    checkpoint = backend.state_seq_get(1, partial=True)
    _run(backend, 1, PROMPT[P:], P)
    assert backend.seq_pos_max(1) == N - 1
    assert backend.state_seq_set(1, checkpoint, partial=True)
    assert backend.seq_rm(1, P, -1)
    assert backend.seq_pos_max(1) == P - 1
    np.testing.assert_array_equal(_run(backend, 1, TAIL_TOKENS, P), cold)
    assert backend.seq_rm(1, -1, -1)


def test_a_partial_state_completes_a_copied_prefix(backend: LlamaCppBackend) -> None:
    cold = _cold(backend, 0)
    _run(backend, 1, PROMPT[:P], 0)
    checkpoint = backend.state_seq_get(1, partial=True)
    _run(backend, 1, PROMPT[P:], P)
    backend.seq_cp(1, 2, -1, -1)  # the whole sequence: a partial copy aborts between streams
    backend.run_queued_copies()
    assert backend.state_seq_set(2, checkpoint, partial=True)
    assert backend.seq_rm(2, P, -1)
    np.testing.assert_array_equal(_run(backend, 2, TAIL_TOKENS, P), cold)
    for seq_id in (1, 2):
        assert backend.seq_rm(seq_id, -1, -1)


@pytest.mark.parametrize("kind", DEFAULT_KINDS)
def test_running_queued_copies_with_every_sequence_in_use_leaves_each_as_it_was(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, kind: str
) -> None:
    """llama.cpp runs a cross-stream copy only at a decode, so ``run_queued_copies`` decodes
    one token into the shortest sequence and removes it. A recurrent state cannot remove
    it: the old code left it in (the hybrid soak's next decode failed, "the last position
    stored ... is X = 4", and a recurrent state would have answered from a token the
    sequence never had). Now the state is set back: the sequence goes on exactly. (Copies
    are queued only between streams; in one unified buffer other sequences' cells change
    the sums, so the comparison is made in streams.)"""
    backend = _backend(memory_model_files.shared(tmp_path_factory, kind, model_path), "streams")
    try:
        _check_queued_copies(backend)
    finally:
        backend.close()


def _check_queued_copies(backend: LlamaCppBackend) -> None:
    cold = _cold(backend, 0)
    _run(backend, 0, PROMPT[:P], 0)
    _run(backend, 1, PROMPT[:P], 0)
    _run(backend, 2, PROMPT[:P] + PROMPT[P:N], 0)  # every sequence in use: none empty
    _run(backend, 3, PROMPT[:N], 0)
    assert backend.seq_rm(3, -1, -1)
    backend.seq_cp(2, 3, -1, -1)  # queued between streams
    backend.run_queued_copies()
    for seq_id, num in ((0, P), (1, P), (2, N), (3, N)):
        assert backend.seq_pos_max(seq_id) == num - 1, seq_id
    np.testing.assert_array_equal(_run(backend, 1, TAIL_TOKENS, P), cold)
    for seq_id in range(4):
        assert backend.seq_rm(seq_id, -1, -1)


@pytest.mark.parametrize(
    "kind", ["hybrid", pytest.param("recurrent", marks=pytest.mark.integration)]
)
def test_without_the_checkpoint_a_recurrent_or_hybrid_memory_refuses_the_cut(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, layout: str, kind: str
) -> None:
    backend = _backend(memory_model_files.shared(tmp_path_factory, kind, model_path), layout)
    try:
        _run(backend, 1, PROMPT, 0)
        assert not backend.seq_rm(1, P, -1)  # refused, and nothing changed:
        assert backend.seq_pos_max(1) == N - 1
        assert backend.seq_rm(1, -1, -1)
    finally:
        backend.close()


@pytest.mark.integration
def test_a_full_size_window_cache_cuts_exactly_without_a_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, model_path: Path, layout: str
) -> None:
    """llamax keeps llama.cpp's default full-size sliding-window cache (``swa_full``), so a
    cut needs no checkpoint there; a window-sized cache would need one."""
    window = memory_model_files.shared(tmp_path_factory, "sliding_window", model_path)
    backend = _backend(window, layout)
    try:
        cold = _cold(backend, 0)
        _run(backend, 1, PROMPT, 0)
        assert backend.seq_rm(1, P, -1)
        np.testing.assert_array_equal(_run(backend, 1, TAIL_TOKENS, P), cold)
        assert backend.seq_rm(1, -1, -1)
    finally:
        backend.close()
