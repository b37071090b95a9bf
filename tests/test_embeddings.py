"""llamax.embeddings.Embedder on the real model (SmolLM2), against llama-cpp-python too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

import llamax
from llamax.embeddings import Embedder, Pooling

pytestmark = pytest.mark.model

TEXTS = [
    "The cat sat on the mat.",
    "A cat was sitting on the rug.",
    "Quarterly revenue grew by ten percent.",
    "How do I bake sourdough bread?",
    "Émile a mangé une pomme 🍎.",
]


@pytest.fixture(scope="module")
def embedder(model_path: Path) -> Iterator[Embedder]:
    with Embedder(model_path, pooling="mean", n_ctx=512, n_seq_max=4, n_threads=1) as made:
        yield made


def cosine(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_shape_dtype_and_normalisation(embedder: Embedder) -> None:
    vectors = embedder.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), embedder.n_embd) == (5, 576)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    raw = embedder.embed(TEXTS, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), vectors, atol=1e-6)
    assert embedder.embed([]).shape == (0, 576)
    assert embedder.model_name and embedder.model_path.suffix == ".gguf"


def test_deterministic(embedder: Embedder) -> None:
    np.testing.assert_array_equal(embedder.embed(TEXTS), embedder.embed(TEXTS))


def test_paraphrases_are_closer_than_unrelated_sentences(embedder: Embedder) -> None:
    cat, cat2, revenue, bread, _ = embedder.embed(TEXTS)
    assert cat @ cat2 > cat @ revenue + 0.05
    assert cat @ cat2 > cat @ bread + 0.05


def test_many_texts_are_packed_per_decode_and_match_one_by_one(embedder: Embedder) -> None:
    """Six texts on n_seq_max=4: a full decode of four, then the remainder of two."""
    texts = [f"Sentence number {i} is about {TEXTS[i % 5]}" for i in range(6)]
    backend = embedder._backend
    assert backend is not None
    sizes: list[int] = []
    original = backend.embed_batch

    def counting(token_lists: list[list[int]]) -> npt.NDArray[np.float32]:
        sizes.append(len(token_lists))
        return original(token_lists)

    backend.embed_batch = counting  # type: ignore[method-assign]
    try:
        together = embedder.embed(texts)
        alone = np.concatenate([embedder.embed([t]) for t in texts])
    finally:
        del backend.embed_batch
    assert sizes == [4, 2] + [1] * 6  # n_seq_max=4 texts per llama_decode, then one by one
    for a, b in zip(together, alone, strict=True):
        assert cosine(a, b) > 0.999


def test_thread_safe(embedder: Embedder) -> None:
    expected = embedder.embed(TEXTS)
    results: list[npt.NDArray[np.float32]] = []
    threads = [
        threading.Thread(target=lambda: results.append(embedder.embed(TEXTS))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for got in results:
        np.testing.assert_array_equal(got, expected)


def test_typed_errors(embedder: Embedder, model_path: Path) -> None:
    with pytest.raises(llamax.ContextLengthError, match="split it") as info:
        embedder.embed(["ok", "word " * 600])
    assert info.value.n_ctx == 512 and info.value.num_prompt_tokens > 512
    with pytest.raises(llamax.InvalidRequestError, match="list of strings"):
        embedder.embed("just one string")  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidRequestError, match=r"texts\[1\]"):
        embedder.embed(["a", 3])  # type: ignore[list-item]
    if embedder.num_tokens("") == 0:
        with pytest.raises(llamax.EmptyPromptError):
            embedder.embed(["a", ""])
    with pytest.raises(llamax.InvalidParameterError, match="pooling"):
        Embedder(model_path, pooling="max")  # type: ignore[arg-type]
    with pytest.raises(llamax.InvalidParameterError, match="n_seq_max"):
        Embedder(model_path, n_seq_max=0)
    with pytest.raises(llamax.ModelLoadError):
        Embedder(model_path.with_suffix(".missing"))
    closed = Embedder(model_path, n_ctx=64, n_seq_max=1, n_threads=1)
    closed.close()
    closed.close()
    with pytest.raises(llamax.ContextClosedError):
        closed.embed(["a"])


@pytest.mark.integration
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_matches_llama_cpp_python(model_path: Path, pooling: Pooling) -> None:
    """Integration: llama-cpp-python loads a second native model for the reference."""
    llama_cpp = pytest.importorskip("llama_cpp")
    pooling_type = {
        "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
        "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    }[pooling]
    reference = llama_cpp.Llama(
        str(model_path), embedding=True, pooling_type=pooling_type, n_threads=1, verbose=False
    )
    try:
        expected = np.asarray([reference.embed(text) for text in TEXTS], dtype=np.float32)
    finally:
        reference.close()
    with Embedder(model_path, pooling=pooling, n_ctx=512, n_seq_max=8, n_threads=1) as ours:
        assert ours.pooling == pooling
        got = ours.embed(TEXTS, normalize=False)
    for a, b in zip(got, expected, strict=True):
        assert cosine(a, b) >= 0.99


def test_model_pooling_of_a_generative_model_is_mean(model_path: Path, embedder: Embedder) -> None:
    with Embedder(model_path, n_ctx=512, n_seq_max=4, n_threads=1) as default:
        assert default.pooling == "mean"
        np.testing.assert_allclose(default.embed(TEXTS), embedder.embed(TEXTS), atol=1e-4)
