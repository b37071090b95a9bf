"""The loaded llama.cpp model: the side of the backend that any thread may reach.

Native lifetime: every method here (tokenizing, pieces, metadata, grammar checks, loading
an adapter ...) enters a guard (:class:`NativeGuard`) that counts its users and raises
:class:`~llamax.errors.ContextClosedError` once the backend is closing; closing waits
until the last user is out, and only then frees. The engine's own calls
(decode, sample, the KV operations) need no guard: the engine closes the backend under its
step lock, after the last step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ..config import ContextConfig
from ..errors import ContextClosedError, ModelLoadError
from ..tokens import FimTokens
from .fingerprint import weights_fingerprint
from .lora_file import check_lora_file
from .native import NativeModel, utf8

__all__ = ["LlamaCppModel", "NativeGuard"]

_FIM_ROLES = {"prefix": "pre", "suffix": "suf", "middle": "mid", "pad": "pad", "repo": "rep",
              "separator": "sep"}  # fmt: skip
"""``FimTokens`` field -> the ``llama_vocab_fim_*`` function's suffix."""


class NativeGuard:
    """Counts the threads inside a native call made from outside the engine (tokenizing,
    pieces, metadata ...); :meth:`close` marks it closed and waits until the last one is
    out, so the owner frees its handles only after."""

    def __init__(self) -> None:
        self._gate = threading.Condition()  # guards _users and _closed
        self._users = 0
        self._closed = False

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Count the caller as a user of the native handles for the ``with`` block.

        Raises:
            ContextClosedError: the owner is closed or closing.
        """
        with self._gate:
            if self._closed:
                raise ContextClosedError("the context is closed: its model has been freed")
            self._users += 1
        try:
            yield
        finally:
            with self._gate:
                self._users -= 1
                if not self._users:
                    self._gate.notify_all()

    def close(self) -> bool:
        """Refuse new users and wait for those inside; False when it was closed already."""
        with self._gate:
            if self._closed:
                return False
            self._closed = True
            while self._users:
                self._gate.wait()
        return True


class LlamaCppModel:
    """A llama.cpp model and what any thread may ask of it (the ``LoadedModel`` and
    ``LoraHost`` roles of :mod:`~llamax.backend.base`, but ``facts``: it reads the model's,
    and :class:`~llamax.backend.llama_cpp.LlamaCppBackend` adds the context's to make
    :class:`~llamax.ModelFacts`).
    :class:`~llamax.backend.llama_cpp.LlamaCppBackend` is one with a context: it inherits
    these methods rather than holding a model, since they are its own protocol methods and
    holding one would repeat each as a forwarding method."""

    def __init__(self, C: Any, config: ContextConfig, stack: ExitStack) -> None:
        """Load ``config``'s model; ``stack`` frees it.

        Raises:
            ModelLoadError: llama.cpp could not load the file, or it cannot be read.
        """
        path = Path(config.model_path)
        self._C = C
        self._guard = NativeGuard()
        self._pieces: dict[int, bytes] = {}
        model = NativeModel(
            C,
            path,
            n_gpu_layers=config.n_gpu_layers,
            use_mmap=config.use_mmap,
            use_extra_bufts=config.use_extra_bufts,
        )
        stack.callback(model.close)
        try:
            self._weights = weights_fingerprint(path)
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path} to fingerprint it: {exc}") from exc
        self._model = model
        self._model_path = path
        self._n_vocab = model.n_vocab()
        self._bos_eos = model.bos_eos()
        self._eog = frozenset(t for t in range(self._n_vocab) if model.is_eog(t))
        fim = {name: model.fim(role) for name, role in _FIM_ROLES.items()}
        self._fim = FimTokens(**{name: t if t >= 0 else None for name, t in fim.items()})
        self._model_name = self.metadata("general.name") or path.stem
        self._adapters: dict[str, Any] = {}  # name -> llama_adapter_lora*, freed with the model

    @property
    def model_path(self) -> Path:
        """The loaded file."""
        return self._model_path

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Every end-of-generation token of the vocabulary."""
        return self._eog

    def token_text(self, token: int) -> str:
        """The token's text with special tokens rendered."""
        with self._guard.entered():
            return self._model.piece(token, special=True, size=256).decode("utf-8", "replace")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None."""
        with self._guard.entered():
            return self._model.meta(key)

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokenize ``text``; read-only on the vocabulary, so safe from any thread.

        Raises:
            InvalidRequestError: ``text`` holds a lone surrogate (not encodable as UTF-8).
            ContextClosedError: the backend is closed.
        """
        data = utf8(text)
        with self._guard.entered():
            return self._model.tokenize(data, add_special=add_special, parse_special=parse_special)

    def token_to_piece(self, token: int) -> bytes:
        """The bytes of ``token`` (special tokens render as empty), cached per id.

        Raises:
            ContextClosedError: the backend is closed (and the piece was not cached).
        """
        piece = self._pieces.get(token)
        if piece is None:
            with self._guard.entered():
                piece = self._pieces[token] = self._model.piece(token, special=False)
        return piece

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation."""
        return token in self._eog

    def load_adapter(self, name: str, path: str) -> None:
        """``llama_adapter_lora_init``: load a LoRA GGUF for this model under ``name``
        (:class:`~llamax.backend.base.LoraHost`). llama.cpp frees it with the model.

        The file is checked first (:func:`~llamax.backend.lora_file.check_lora_file`):
        llama.cpp loads tensor types it cannot multiply and NaN weights, and crashes or
        answers nothing later.

        Raises:
            ModelLoadError: the file is missing, fails those checks (the message names the
                tensor or key), or llama.cpp refused it (not a LoRA, another architecture,
                shapes that do not fit the model); its log says why.
        """
        if not Path(path).is_file():
            raise ModelLoadError(f"LoRA adapter {name!r}: no file at {path}")
        try:
            check_lora_file(path)  # what llama.cpp lets through and then crashes on
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"LoRA adapter {name!r}: could not load {path}: {exc}") from None
        with self._guard.entered():
            adapter = self._C.llama_adapter_lora_init(self._model.ptr, os.fsencode(path))
        if not adapter:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: llama.cpp could not load {path} for this model "
                "(not a LoRA GGUF, another architecture, or tensors of the wrong shape; "
                "verbose=True shows llama.cpp's reason)"
            )
        self._adapters[name] = adapter

    def check_grammar(self, grammar: str) -> str | None:
        """Build and free a grammar sampler: llama.cpp returns NULL for invalid GBNF.

        Raises:
            ContextClosedError: the backend is closed.
        """
        with self._guard.entered():
            sampler = self._model.grammar_sampler(grammar)
            if not sampler:
                return "llama.cpp could not parse it (its parser prints the reason to stderr)"
            self._C.llama_sampler_free(sampler)
        return None

    @property
    def can_share_prefix(self) -> bool:
        """False for recurrent and hybrid memories, which cannot drop or copy partial ranges."""
        with self._guard.entered():
            return not (self._model.is_recurrent() or self._model.is_hybrid())

    @property
    def sliding_window(self) -> int:
        """``llama_model_n_swa`` (0: no sliding-window layers)."""
        return self._model.n_swa()

    @property
    def can_checkpoint(self) -> bool:
        """True for recurrent and hybrid memories: llama.cpp reads and writes their partial
        state (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``)."""
        return not self.can_share_prefix
