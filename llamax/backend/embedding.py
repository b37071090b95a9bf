"""A llama.cpp context in embeddings mode: many texts per ``llama_decode``, pooled per sequence.

Native handles (:mod:`llamax.backend.native`: batch, context, model) are freed in that order
by :meth:`EmbeddingBackend.close`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ..errors import EngineError, ModelLoadError
from ..facts import ModelFacts
from .native import NativeBatch, NativeContext, NativeModel, bindings, context_params, utf8
from .openmp import release_threads

__all__ = ["POOLING_TYPES", "EmbeddingBackend", "EmbeddingConfig"]

POOLING_TYPES = {"model": -1, "none": 0, "mean": 1, "cls": 2, "last": 3}
"""llama.cpp's ``llama_pooling_type`` values by name (``model``: whatever the GGUF says)."""
_POOLING_NAMES = {value: name for name, value in POOLING_TYPES.items()}


def _is_not_pooling_notice(record: logging.LogRecord) -> bool:
    """llama.cpp warns whenever a pooling type is chosen for a model that names none."""
    return "model default pooling_type" not in record.getMessage()


logging.getLogger("llamax.llama_cpp").addFilter(_is_not_pooling_notice)


@dataclass(frozen=True, slots=True)
class EmbeddingConfig:
    """What an embeddings context is built with (validated by :class:`llamax.Embedder`)."""

    model_path: Path
    pooling: int
    """A value of :data:`POOLING_TYPES`; ``-1`` means the model's own."""
    n_ctx: int
    n_seq_max: int
    n_threads: int
    n_gpu_layers: int = -1


class EmbeddingBackend:
    """One model and one context with ``embeddings = true`` and a unified KV cache.

    ``n_batch`` and ``n_ubatch`` equal ``n_ctx``, so every text of a decode (at most
    ``n_ctx`` tokens in all) lies in one micro-batch, as pooling requires.
    """

    def __init__(self, config: EmbeddingConfig) -> None:
        C = bindings()
        with ExitStack() as stack:  # closes in reverse: batch, context, model
            model = NativeModel(C, config.model_path, n_gpu_layers=config.n_gpu_layers)
            stack.callback(model.close)
            cparams = context_params(
                C,
                n_ctx=config.n_ctx,
                n_batch=config.n_ctx,
                n_ubatch=config.n_ctx,
                n_seq_max=config.n_seq_max,
                n_threads=config.n_threads,
                n_threads_batch=config.n_threads,
                embeddings=True,
                pooling_type=config.pooling,
                kv_unified=True,  # any one text may use all n_ctx cells
            )
            context = NativeContext.create(model, cparams)
            if context is None:
                raise ModelLoadError(
                    f"llama.cpp could not create an embeddings context for "
                    f"{config.model_path} (n_ctx={config.n_ctx}); out of memory?"
                )
            stack.callback(context.close)
            self._n_batch = context.n_batch()
            batch = NativeBatch(C, self._n_batch)
            stack.callback(batch.close)
            self._stack = stack.pop_all()
        self._model, self._context, self._batch = model, context, batch
        n_ctx = min(context.n_ctx(), self._n_batch)  # one decode, and one text, at most
        self._n_embd = model.n_embd()
        bos, eos = model.bos_eos()
        self._facts = ModelFacts(
            model_name=model.meta("general.name") or config.model_path.stem,
            n_vocab=model.n_vocab(),
            n_embd=self._n_embd,
            n_ctx_train=model.n_ctx_train(),
            n_ctx=n_ctx,
            n_ctx_seq=n_ctx,
            n_seq_max=context.n_seq_max(),
            bos_token_id=bos,
            eos_token_id=eos,
        )
        self._pooling = context.pooling_type()
        self._closed = False

    @property
    def facts(self) -> ModelFacts:
        """The model's and the context's facts: ``n_ctx`` (and ``n_ctx_seq``) are the KV
        cells granted, the most tokens one decode (and one text) may hold; ``n_seq_max`` the
        most texts one decode may hold; ``n_embd`` the width of an embedding."""
        return self._facts

    @property
    def pooling(self) -> str:
        """The pooling in force. A model without pooling (``none``) is mean-pooled here."""
        if self._pooling == POOLING_TYPES["none"]:
            return "mean"
        return _POOLING_NAMES.get(self._pooling, str(self._pooling))

    def tokenize(self, text: str) -> list[int]:
        """Tokenize ``text`` as data: BOS added as the model wants, special tokens not parsed.

        Raises:
            InvalidRequestError: ``text`` holds a lone surrogate.
        """
        return self._model.tokenize(utf8(text), add_special=True, parse_special=False)

    def release_compute_threads(self) -> None:
        """Free the OpenMP workers this thread's compute keeps
        (:func:`~llamax.backend.openmp.release_threads`): ``Embedder.embed`` runs on its
        caller's thread, which may not compute again."""
        release_threads()

    def embed_batch(self, texts: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]:
        """Decode ``texts`` (token ids) in one ``llama_decode``, one sequence each, and pool.

        The caller keeps ``len(texts) <= n_seq_max`` and the total tokens ``<= n_ctx``. The
        KV memory is cleared before the decode. When llama.cpp pools nothing (a generative
        model asked for its own pooling), the token embeddings of each sequence are
        averaged here, as llama.cpp's mean pooling would.

        Returns:
            ``(len(texts), n_embd)`` float32, not normalised.

        Raises:
            EngineError: ``llama_decode`` failed.
        """
        context, batch = self._context, self._batch
        context.clear()
        n = 0
        for seq_id, tokens in enumerate(texts):
            for pos, token in enumerate(tokens):
                batch.tokens[n] = token
                batch.pos[n] = pos
                batch.seq_rows[n][0] = seq_id
                batch.logits[n] = True  # pooling reads every token's output
                n += 1
        batch.set_n_tokens(n)
        status = context.decode(batch)
        if status != 0:
            raise EngineError(f"llama_decode failed with status {status} on an embeddings batch")
        out = np.empty((len(texts), self._n_embd), dtype=np.float32)
        if self._pooling == POOLING_TYPES["none"]:
            rows = context.embeddings(n, self._n_embd)
            start = 0
            for i, tokens in enumerate(texts):
                out[i] = rows[start : start + len(tokens)].mean(axis=0)
                start += len(tokens)
            return out
        for seq_id in range(len(texts)):
            pooled = context.seq_embedding(seq_id, self._n_embd)
            if pooled is None:
                raise EngineError(f"llama.cpp returned no pooled embedding for sequence {seq_id}")
            out[seq_id] = pooled
        return out

    def close(self) -> None:
        """Free the batch, the context and the model, in that order. Idempotent."""
        if not self._closed:
            self._closed = True
            self._stack.close()
