"""Text embeddings from a GGUF model: :class:`Embedder`.

An embedder owns its own llama.cpp context in embeddings mode (separate from any
:class:`~llamax.Context`, whose context computes logits). Texts are packed many to a
``llama_decode``, one sequence each, up to ``n_seq_max`` texts and ``n_ctx`` tokens, and
read back pooled with ``llama_get_embeddings_seq``; the KV memory is cleared between
batches. It is thread-safe: calls are serialised by a lock, so a server may share one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import numpy as np
import numpy.typing as npt
from typing_extensions import Self

from .backend.embedding import POOLING_TYPES, EmbeddingBackend, EmbeddingConfig
from .errors import (
    ContextClosedError,
    ContextLengthError,
    EmptyPromptError,
    InvalidParameterError,
    InvalidRequestError,
)
from .facts import ModelFacts
from .models import default_model_path

__all__ = ["Embedder", "Pooling"]

Pooling = Literal["model", "mean", "cls", "last"]
"""``model`` uses the GGUF's pooling type (mean when the model defines none)."""
_POOLINGS = ("model", "mean", "cls", "last")


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


class Embedder:
    """Embeds texts with a GGUF model; one llama.cpp context in embeddings mode.

    Args:
        model_path: a GGUF file. ``None`` uses ``$LLAMAX_MODEL`` or the default model.
        pooling: how token outputs become one vector: ``"model"`` (the GGUF's pooling type;
            mean for generative models, which define none), ``"mean"``, ``"cls"`` (first
            token) or ``"last"`` (last token).
        n_ctx: KV cells; the most tokens one text (and one decode) may hold.
        n_seq_max: the most texts one decode may hold.
        n_threads: CPU threads (default: all available cores).
        n_gpu_layers: layers to offload to a GPU (``-1``: all that fit).
        normalize: the default of :meth:`embed`'s ``normalize``.

    Raises:
        InvalidParameterError: an option is out of range.
        ModelLoadError: the model is missing, corrupt or cannot be loaded.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        pooling: Pooling = "model",
        n_ctx: int = 2048,
        n_seq_max: int = 16,
        n_threads: int | None = None,
        n_gpu_layers: int = -1,
        normalize: bool = True,
    ) -> None:
        if pooling not in _POOLINGS:
            raise InvalidParameterError(
                f"pooling must be one of {_POOLINGS}, got {pooling!r}", param="pooling"
            )
        for name, value in (("n_ctx", n_ctx), ("n_seq_max", n_seq_max)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(
                    f"{name} must be an int >= 1, got {value!r}", param=name
                )
        if n_seq_max > min(n_ctx, 256):  # llama.cpp aborts the process, or refuses > 256
            raise InvalidParameterError(
                f"n_seq_max ({n_seq_max}) must be <= n_ctx ({n_ctx}) and <= 256: a decode "
                "holds one token of every sequence at least",
                param="n_seq_max",
            )
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise InvalidParameterError(
                f"n_threads must be an int >= 1, got {n_threads!r}", param="n_threads"
            )
        path = model_path or os.environ.get("LLAMAX_MODEL") or default_model_path()
        config = EmbeddingConfig(
            model_path=Path(path).expanduser(),
            pooling=POOLING_TYPES[pooling],
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_threads=n_threads or _default_threads(),
            n_gpu_layers=n_gpu_layers,
        )
        self._backend: EmbeddingBackend | None = EmbeddingBackend(config)
        self._facts = self._backend.facts
        self._pooling = self._backend.pooling
        self._model_path = config.model_path
        self._normalize = normalize
        self._lock = threading.Lock()

    @property
    def facts(self) -> ModelFacts:
        """The model's facts, computed at load: ``n_ctx``, ``n_seq_max``, ``n_embd`` and
        ``model_name`` are also properties of their own."""
        return self._facts

    @property
    def model_name(self) -> str:
        """The model's name from its metadata (else the file name)."""
        return self._facts.model_name

    @property
    def model_path(self) -> Path:
        """The loaded GGUF file."""
        return self._model_path

    @property
    def n_embd(self) -> int:
        """Width of an embedding."""
        return self._facts.n_embd

    @property
    def n_ctx(self) -> int:
        """The most tokens one text may have."""
        return self._facts.n_ctx

    @property
    def n_seq_max(self) -> int:
        """The most texts computed in one ``llama_decode``."""
        return self._facts.n_seq_max

    @property
    def pooling(self) -> str:
        """The pooling in force: ``"mean"``, ``"cls"``, ``"last"`` (or the model's own)."""
        return self._pooling

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._backend is None

    def num_tokens(self, text: str) -> int:
        """How many tokens ``text`` takes (BOS included when the model adds it).

        Raises:
            ContextClosedError: the embedder is closed.
        """
        with self._lock:
            return len(self._require_backend().tokenize(text))

    def embed(
        self, texts: Sequence[str], *, normalize: bool | None = None
    ) -> npt.NDArray[np.float32]:
        """Embed ``texts``; row ``i`` is the embedding of ``texts[i]``.

        Every text is tokenized and checked before anything is computed.

        Args:
            texts: the texts (a list, not a single string).
            normalize: scale each row to unit L2 norm (default: the constructor's choice),
                so a dot product is the cosine similarity.

        Returns:
            A ``(len(texts), n_embd)`` float32 array.

        Raises:
            InvalidRequestError: ``texts`` is not a sequence of strings.
            EmptyPromptError: a text has no tokens.
            ContextLengthError: a text has more than ``n_ctx`` tokens; split it (or raise
                ``n_ctx``).
            ContextClosedError: the embedder is closed.
            EngineError: llama.cpp failed to decode.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise InvalidRequestError(
                f"texts must be a list of strings, got {type(texts)!r}", param="texts"
            )
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"texts[{i}] must be a str, got {type(text).__name__}", param=f"texts[{i}]"
                )
        with self._lock:
            backend = self._require_backend()
            token_lists = [backend.tokenize(text) for text in texts]
            self._check_lengths(token_lists)
            out = np.empty((len(texts), self._facts.n_embd), dtype=np.float32)
            try:
                for start, stop in self._batches(token_lists):
                    out[start:stop] = backend.embed_batch(token_lists[start:stop])
            finally:  # the caller's thread keeps no compute workers to slow other contexts
                backend.release_compute_threads()
        if self._normalize if normalize is None else normalize:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out /= np.maximum(norms, np.finfo(np.float32).tiny)
        return out

    def _check_lengths(self, token_lists: Sequence[Sequence[int]]) -> None:
        for i, tokens in enumerate(token_lists):
            if not tokens:
                raise EmptyPromptError(f"texts[{i}] has no tokens")
            if len(tokens) > self._facts.n_ctx:
                raise ContextLengthError(
                    f"texts[{i}] has {len(tokens)} tokens, more than n_ctx={self._facts.n_ctx}; "
                    "split it into shorter texts or create the Embedder with a larger n_ctx",
                    num_prompt_tokens=len(tokens),
                    n_ctx=self._facts.n_ctx,
                )

    def _batches(self, token_lists: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """Consecutive ``(start, stop)`` ranges of at most n_seq_max texts and n_ctx tokens."""
        ranges: list[tuple[int, int]] = []
        start, num_tokens = 0, 0
        for i, tokens in enumerate(token_lists):
            if i > start and (
                num_tokens + len(tokens) > self._facts.n_ctx or i - start >= self._facts.n_seq_max
            ):
                ranges.append((start, i))
                start, num_tokens = i, 0
            num_tokens += len(tokens)
        if start < len(token_lists):
            ranges.append((start, len(token_lists)))
        return ranges

    def _require_backend(self) -> EmbeddingBackend:
        if self._backend is None:
            raise ContextClosedError("cannot embed: the Embedder has been closed")
        return self._backend

    def close(self) -> None:
        """Free the llama.cpp context and model. Idempotent."""
        with self._lock:
            if self._backend is not None:
                self._backend.close()
                self._backend = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_embd={self._facts.n_embd} pooling={self._pooling}"
        return f"<llamax.Embedder {state}>"
