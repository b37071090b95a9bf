"""The notebook and pipeline methods of :class:`llamax.Context`: batch generation and
embeddings. A mixin, so that the facade stays small; each method delegates."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, overload

import numpy as np
import numpy.typing as npt

from .errors import ContextClosedError
from .params import SamplingParams
from .prompts import Prompt
from .results import Completion

if TYPE_CHECKING:
    from .context import Context
    from .embeddings import Embedder

__all__ = ["PipelineMethods"]

Params = SamplingParams | Sequence[SamplingParams] | None


class PipelineMethods:
    """``generate``, ``agenerate`` and ``embed`` (see :mod:`llamax.batch`,
    :mod:`llamax.embeddings`)."""

    _embedder: Embedder | None = None
    _embedder_lock: threading.Lock

    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: Params = None,
        *,
        progress: bool | None = None,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: Params = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool,
    ) -> list[Completion | BaseException]: ...
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: Params = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | BaseException]:
        """Run every prompt at once (the engine batches them); completions in input order.

        See :func:`llamax.batch.generate` for the arguments, the progress bar and errors.

        Raises:
            ContextClosedError: the context is closed.
        """
        from .batch import generate

        _ctx(self)._check_open("generate")
        return generate(
            _ctx(self), prompts, params, progress=progress, return_exceptions=return_exceptions
        )

    @overload
    async def agenerate(
        self,
        prompts: Sequence[Prompt],
        params: Params = None,
        *,
        progress: bool | None = None,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...
    @overload
    async def agenerate(
        self,
        prompts: Sequence[Prompt],
        params: Params = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool,
    ) -> list[Completion | BaseException]: ...
    async def agenerate(
        self,
        prompts: Sequence[Prompt],
        params: Params = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | BaseException]:
        """Async twin of :meth:`generate` (needs the background loop).

        Raises:
            ContextClosedError: the context is closed.
        """
        from .batch import agenerate

        _ctx(self)._check_open("generate")
        return await agenerate(
            _ctx(self), prompts, params, progress=progress, return_exceptions=return_exceptions
        )

    def embed(self, texts: Sequence[str], *, normalize: bool = True) -> npt.NDArray[np.float32]:
        """Embed ``texts``: a ``(len(texts), n_embd)`` float32 array, L2-normalised by default.

        The first call loads an :class:`~llamax.embeddings.Embedder` on the same model (its
        own llama.cpp context in embeddings mode, freed by ``close()``).

        Raises:
            ContextLengthError: a text is longer than the embedder's context.
            ModelLoadError: the model cannot be loaded for embeddings.
            ContextClosedError: the context is closed (no second copy of the model is
                loaded after ``close()``).
        """
        return self._get_embedder().embed(texts, normalize=normalize)

    def _get_embedder(self) -> Embedder:
        with self._embedder_lock:  # close() frees the embedder under this lock, after closing
            if _ctx(self).closed:
                raise ContextClosedError("cannot embed: the context has been closed")
            if self._embedder is None:
                from .embeddings import Embedder

                config = _ctx(self).config
                self._embedder = Embedder(
                    config.model_path, n_threads=config.n_threads, n_gpu_layers=config.n_gpu_layers
                )
            return self._embedder

    def _close_embedder(self) -> None:
        with self._embedder_lock:
            embedder, self._embedder = self._embedder, None
        if embedder is not None:
            embedder.close()


def _ctx(methods: PipelineMethods) -> Context:
    return methods  # type: ignore[return-value]
