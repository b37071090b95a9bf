"""``llamax.Context``: the one object an application holds. A facade that delegates."""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from typing_extensions import Self, Unpack

from .adapters import AdapterNames
from .backend.base import Backend, ImageHost
from .backend.fingerprint import weights_fingerprint
from .batch import agenerate as batch_agenerate
from .batch import generate as batch_generate
from .chat import (
    ChatCall,
    ChatHandle,
    Prepared,
    TextCall,
    prepare_chat,
    prepare_text,
    submit_in_worker,
)
from .chat.options import ChatOptions, CompletionOptions, check_flag
from .config import ContextConfig, ContextOptions
from .conversation import Chat
from .dialects.openai_shapes import ChatCompletion, ChatCompletionChunk, TextCompletion
from .engine.kv.kvops import Audit, ClearCache, KVOp, OpenSession
from .engine.loop import Engine, EngineState
from .engine.sched.sampling import BatchLogitsProcessor
from .engine.timing.calibration import Calibration
from .errors import (
    ContextClosedError,
    InvalidParameterError,
    InvalidRequestError,
    ModelLoadError,
)
from .facts import ModelFacts
from .handle import RequestHandle
from .images import Image, ImagePrompts
from .models import default_model_path
from .openai.requests import OpenAIRequest, arespond, include_usage, respond
from .params import SamplingParams
from .prompts import Prompt, build_request, prompt_token_ids
from .reasoning import ReasoningFormat
from .results import Completion
from .session import Session, SessionPort, restore_session
from .stats import ContextStats
from .templates.binding import BoundTemplate
from .tokens import FimTokens

if TYPE_CHECKING:  # the layers above, for annotations only: the methods import them lazily
    import numpy as np
    import numpy.typing as npt

    from .embeddings import Embedder
    from .info import ModelInfo
    from .memory_plan import MemoryPlan
    from .templates.template import ChatTemplate

__all__ = ["Context"]

T = TypeVar("T")
BatchParams = SamplingParams | Sequence[SamplingParams] | None


class Context:
    """A loaded model, its llama.cpp context and a continuous-batching run loop.

    ``Context()`` loads the default model (SmolLM2-135M-Instruct) when it is installed.
    Any thread may call :meth:`add_request`. With ``autostart=True`` (default) a background
    thread runs the loop and sleeps when idle; with ``autostart=False`` the caller drives
    it with :meth:`process` (or by waiting on a handle, which steps the loop itself).
    ``close()`` (or leaving a ``with`` block) cancels pending requests, which complete with
    ``finish_reason == "cancelled"``, releases every session, joins the loop and frees the
    native handles; ``close(drain=True)`` lets them finish first. After ``close()`` every
    method that would do work raises :class:`ContextClosedError` (even when racing it from
    another thread); facts known at load (``n_ctx``, ``model_name``, ``config`` ...),
    ``closed``, ``stats()`` and ``has_work()`` keep answering.

    Args:
        model_path: a GGUF file (a leading ``~`` is the home folder). ``None`` uses
            ``$LLAMAX_MODEL`` or the default model.
        autostart: start the background loop.
        config: a complete :class:`ContextConfig` (instead of keyword options).
        backend: an already built backend (e.g. :class:`llamax.testing.FakeBackend`).
        batch_logits_processor: ``fn(rows, logits)`` called once per step with a zero-copy
            ``(rows, n_vocab)`` view of every row about to be sampled, for vectorised work.
        **options: fields of :class:`ContextConfig` (``n_ctx``, ``n_seq_max``, ...).

    Raises:
        ModelLoadError: the model is missing, corrupt or cannot be loaded.
        InvalidParameterError: an option is out of range.
        TypeError: an unknown option (the message suggests the closest one).
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        autostart: bool = True,
        config: ContextConfig | None = None,
        backend: Backend | None = None,
        batch_logits_processor: BatchLogitsProcessor | None = None,
        **options: Unpack[ContextOptions],
    ) -> None:
        if config is None:
            if backend is None:
                path = model_path or os.environ.get("LLAMAX_MODEL") or default_model_path()
            else:
                path = model_path or f"<{type(backend).__name__}>"
            config = ContextConfig.from_options(os.path.expanduser(os.fspath(path)), options)
        owned = backend is None
        if backend is None:
            from .backend.llama_cpp import LlamaCppBackend

            backend = LlamaCppBackend(config)
        self._config: ContextConfig = config
        self._backend = backend
        try:
            self._engine = Engine(
                backend,
                config.engine_config(owns_backend=owned),
                autostart=autostart,
                batch_processor=batch_logits_processor,
            )
        except BaseException:
            if owned:  # the model and context it loaded are freed
                backend.close()
            raise
        self._adapters = AdapterNames()
        try:
            for name, path in (config.lora or {}).items():
                self.load_adapter(name, path)
        except BaseException:
            self._engine.close()  # frees the backend too
            raise
        self._arrivals = itertools.count()
        self._arrival_lock = threading.Lock()
        self._embedder_lock = threading.Lock()
        self._facts = backend.facts  # known at load: they answer after close
        host = backend if isinstance(backend, ImageHost) and self._facts.sees_images else None
        self._images = ImagePrompts(host)
        self._projector_identity = host.projector_identity if host is not None else None
        self._chat = BoundTemplate(backend, config.chat_template, self._images)
        self._embedder: Embedder | None = None
        self._embedder_finalizer: weakref.finalize[Any, Any] | None = None
        # A context nobody references any more is closed (a notebook re-running
        # ``ctx = Context(...)`` would otherwise keep every earlier model, KV cache and loop
        # thread). Handles of pending requests and open sessions reference their context,
        # so it lives while they do.
        self._finalizer = weakref.finalize(self, _close_unreferenced, self._engine, repr(self))

    # ------------------------------------------------------------------ facts
    @property
    def config(self) -> ContextConfig:
        """What was asked for."""
        return self._config

    @property
    def facts(self) -> ModelFacts:
        """The model's and the context's facts, computed once at load (:class:`ModelFacts`):
        ``n_ctx``, ``n_ctx_seq``, ``n_seq_max``, ``n_vocab``, ``model_name``, ``fim_tokens``,
        ``sees_images`` (each also a property of the context), ``n_embd``, ``n_ctx_train``,
        ``bos_token_id``, ``eos_token_id``."""
        return self._facts

    @property
    def n_ctx(self) -> int:
        """KV cells granted (``n_ctx`` padded to a multiple of 256). ``stats().kv_cells_total``
        is what the current layout holds: with ``kv_layout="auto"`` in streams it may be up
        to twice as many, as llama.cpp rounds each stream up to 256 cells."""
        return self._facts.n_ctx

    @property
    def calibration(self) -> Calibration | None:
        """This machine's step costs, timed at load or read from the cache, which the
        time-budgeted steps and the pricing of speculative drafts started from; None when
        the context was not calibrated (``calibrate=False``, a ``backend=`` passed in, or a
        backend that cannot be). See docs/throughput.md."""
        return self._engine.calibration

    @property
    def n_seq_max(self) -> int:
        """How many sequences may hold KV cells at once."""
        return self._facts.n_seq_max

    @property
    def n_ctx_seq(self) -> int:
        """The most tokens one sequence (prompt plus reply) may hold."""
        return self._facts.n_ctx_seq

    @property
    def kv_layout(self) -> str:
        """The KV layout now: ``"unified"`` (one shared buffer) or ``"streams"`` (one per
        sequence); ``kv_layout="auto"`` moves between them (docs/kv-cache.md)."""
        return "unified" if self._backend.is_unified else "streams"

    @property
    def n_vocab(self) -> int:
        """The vocabulary size: token ids are in ``[0, n_vocab)``."""
        return self._facts.n_vocab

    @property
    def model_name(self) -> str:
        """The model's name from its metadata."""
        return self._facts.model_name

    @property
    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens (``fim_tokens.can_infill``: whether it has
        the prefix, suffix and middle tokens that code infill needs)."""
        return self._facts.fim_tokens

    @property
    def sees_images(self) -> bool:
        """Whether prompts may hold images (:class:`~llamax.Image`): a projector
        (``mmproj``) that encodes them is loaded."""
        return self._facts.sees_images

    def model_info(self) -> ModelInfo:
        """The model's :class:`~llamax.ModelInfo`, read from its file
        (:func:`llamax.model_info`), with ``sees_images`` saying whether this context reads
        images (a projector is loaded).

        Raises:
            ModelLoadError: the model file cannot be read (a context built on a
                ``backend=`` has no file).
            ContextClosedError: the context is closed.
        """
        import dataclasses

        from .info import model_info

        self._check_open("read the model's info")
        info = model_info(self._config.model_path)
        return dataclasses.replace(info, sees_images=self._facts.sees_images)

    @property
    def closed(self) -> bool:
        """Whether the context no longer accepts requests."""
        return self._engine.state is not EngineState.RUNNING

    @property
    def is_manual(self) -> bool:
        """Whether the caller drives the loop (``autostart=False``)."""
        return not self._engine.is_background

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokenize ``text`` as a prompt would be.

        Raises:
            InvalidRequestError: ``text`` is not a str.
            ContextClosedError: the context is closed.
        """
        self._check_open("tokenize")
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"text must be a str, got {type(text).__name__}", param="text"
            )
        return self._backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Join the pieces of ``token_ids`` into text (special tokens render as nothing).

        Raises:
            InvalidRequestError: an id is not an int in ``[0, n_vocab)``.
            ContextClosedError: the context is closed.
        """
        self._check_open("detokenize")
        ids = prompt_token_ids(self._backend, token_ids)
        return b"".join(self._backend.token_to_piece(t) for t in ids).decode("utf-8", "replace")

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        fair_key: str | None = None,
    ) -> RequestHandle:
        """Submit a prompt (text or token ids) from any thread; returns at once.

        Requests are served first come, first served; a lower ``priority`` value is served
        earlier. While others wait, one request holds at most its share of the sequences
        (``n_seq_max`` over the requests with work), so a large ``n`` cannot starve others.
        Requests submitted with the same ``fair_key`` (a caller's several prompts, or one
        client's requests) hold one share together and are served first come, first
        served among themselves, so a batch of many requests cannot starve another
        key's request either (docs/server.md#fair-turns).

        Raises:
            ContextClosedError: the context is closed.
            EmptyPromptError: the prompt has no tokens.
            ContextLengthError: the prompt leaves no room for a reply in ``n_ctx``.
            InvalidRequestError: the prompt, params, priority or fair_key have the wrong
                type, a token id is out of range, or ``request_id`` belongs to an
                unfinished request.
        """
        return self._submit(
            prompt, params, priority=priority, request_id=request_id, fair_key=fair_key
        )

    @staticmethod
    def plan(
        model_path: str | os.PathLike[str] | None = None,
        *,
        memory_bytes: int | None = None,
        search: bool = True,
        **options: Unpack[ContextOptions],
    ) -> MemoryPlan:
        """Plan the memory of ``Context(model_path, **options)`` without creating it: the
        weights, the KV cache at its types and layout, the compute buffers, the RAM tier's
        budget, whether it all fits ``memory_bytes`` (default: the memory available now)
        and the largest ``n_ctx`` and ``n_seq_max`` that do (docs/memory.md).

        Every option is checked as the constructor checks it; those that decide memory
        (``n_ctx``, ``n_seq_max``, ``kv_type``, ``kv_type_k``, ``kv_type_v``, ``n_ctx_seq``,
        ``kv_layout``, ``n_batch``, ``n_ubatch``, ``flash_attn``, ``prefix_cache``,
        ``prefix_ram_bytes``, ``prefix_ram_share``) go to :func:`llamax.plan_memory`.

        Raises:
            InvalidParameterError: an option is out of range.
            TypeError: an unknown option.
            ModelLoadError: the file is missing, not GGUF, or llama.cpp refuses it.
        """
        from .memory_plan import PLANNED_OPTIONS, plan_memory

        path = model_path or os.environ.get("LLAMAX_MODEL") or default_model_path()
        config = ContextConfig.from_options(os.path.expanduser(os.fspath(path)), options)
        # the config's values: a mode's choices (reproducible: streams, flash attention) too
        planned = {name: getattr(config, name) for name in PLANNED_OPTIONS}
        return plan_memory(config.model_path, memory_bytes=memory_bytes, search=search, **planned)

    def session(self, *, yields: bool = False) -> Session:
        """Open a :class:`Session`: a KV sequence that stays resident between requests.

        Args:
            yields: Give the sequence back while the session is idle, whenever another
                request lacks a sequence id or KV cells it holds (least recently used
                session first): its cache becomes an ordinary retained prefix, and its
                next request reuses that if it survived, else computes again. Without
                it (the default) the session is pinned until closed.

        Raises:
            SessionError: every sequence id is held by running sequences or other sessions.
            ContextClosedError: the context is closed.
        """
        return Session(self._session_port(), self._engine.run(OpenSession(yields)))

    def load_session(self, path: str | os.PathLike[str], *, yields: bool = False) -> Session:
        """Restore a session saved by :meth:`Session.save <llamax.Session.save>` (the same as
        ``llamax.Session.load(ctx, path)``).

        A file is input: its header must name this model (weights included) and this
        context's KV cache types (``kv_type``: cells saved in ``f16`` cannot be read as
        ``q8_0``; the error names the types to load it with), its tokens
        must be ids of this vocabulary that fit one sequence (``n_ctx_seq``), the LoRA
        adapters it was saved under must be loaded here under the same names, from the same
        files, and its KV state must be whole and hold exactly those tokens' positions.
        Nothing reaches the KV cache otherwise. The session's cells keep that adapter set:
        only requests under the same set reuse them (see docs/lora.md).
        ``yields`` as in :meth:`session`.

        Raises:
            SessionLoadError: the file is damaged, truncated, lies about its contents, or
                was saved with a different model, with other KV cache types, or under
                adapters not loaded here.
            ContextClosedError: the context is closed.
            OSError: the file cannot be read.
        """
        if self.closed:
            raise ContextClosedError("cannot load a session: the context has been closed")
        return restore_session(
            self._session_port(),
            path,
            n_vocab=self.n_vocab,
            n_ctx_seq=self.n_ctx_seq,
            yields=yields,
        )

    def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        session_id: int | None = None,
        fair_key: str | None = None,
    ) -> RequestHandle:
        self._check_open("add a request")
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise InvalidRequestError(
                f"request_id must be a non-empty str, got {request_id!r}", param="request_id"
            )
        handle = RequestHandle(request_id or f"req-{uuid.uuid4().hex[:16]}")
        with self._arrival_lock:
            arrival = next(self._arrivals)
        request = build_request(
            self._backend,
            prompt,
            params,
            handle,
            n_ctx=self.n_ctx_seq,
            priority=priority,
            arrival=arrival,
            session_id=session_id,
            adapters=self._adapters.resolve(
                params.lora if isinstance(params, SamplingParams) else None
            ),
            images=self._images,
            fair_key=fair_key,
        )
        engine = self._engine
        handle._bind(
            lambda: engine.cancel(request),
            check_wait=engine.check_wait,
            drive=None if engine.is_background else engine.drive,
            owner=self,
        )
        engine.submit(request)
        return handle

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters loaded, name -> path, in load order (a request's
        ``SamplingParams.lora`` may also name one by its index here)."""
        return self._adapters.paths

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the LoRA adapter GGUF at ``path`` under ``name``. It changes nothing until a
        request asks for it (``SamplingParams(lora={name: scale})``); requests under
        different adapter sets run in separate steps (see docs/lora.md). An adapter stays
        loaded until the context closes (llama.cpp frees it with the model).

        Raises:
            InvalidParameterError: ``name`` is empty, taken, or not a str.
            ModelLoadError: the file is missing or not a LoRA adapter for this model.
            ContextClosedError: the context is closed.
        """
        from .backend.base import LoraHost

        self._check_open("load a LoRA adapter")
        if not isinstance(name, str) or not name:
            raise InvalidParameterError(
                f"an adapter name must be a non-empty str, got {name!r}", param="name"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidParameterError(
                f"an adapter path must be a path, got {path!r}", param="path"
            )
        if not isinstance(self._backend, LoraHost):
            raise InvalidParameterError(
                f"this backend ({type(self._backend).__name__}) cannot load LoRA adapters"
            )
        backend = self._backend

        def load() -> str:
            backend.load_adapter(name, os.fspath(path))
            try:  # saved sessions record it (Session.save)
                return weights_fingerprint(path)
            except OSError as exc:
                raise ModelLoadError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from exc

        self._adapters.add(name, os.fspath(path), load)

    # ------------------------------------------------------------------ the loop
    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return self._engine.has_work()

    def process(self) -> bool:
        """Run one step (schedule, one ``llama_decode``, sample, emit) in this thread.

        Only for contexts created with ``autostart=False``. Returns whether anything was
        computed.

        Raises:
            LoopOwnershipError: the background loop runs, or another thread is in process().
            DeadlockError: called from a callback or logits processor of a step.
            ContextClosedError: the context is closed.
            EngineError: llama.cpp failed; all pending requests failed and the context closed.
        """
        return self._engine.process()

    def stats(self) -> ContextStats:
        """A consistent snapshot of the engine's counters; safe from any thread, any time."""
        return self._engine.stats()

    def clear_cache(self) -> int:
        """Drop every retained prefix from the KV cache, every prefix kept in host RAM
        (``prefix_ram_bytes``) and every file of the disk tier (``prefix_disk_dir``);
        return how many KV sequences were freed.

        Running requests and open sessions keep their cells.

        Raises:
            CacheClearError: some files of the disk tier could not be deleted (a read-only
                filesystem): the KV cache and the RAM tier were cleared, the files stay.
            ContextClosedError: the context is closed (it still runs while closing).
        """
        return self._engine.run(ClearCache())

    def audit(self) -> list[str]:
        """Check the engine's KV bookkeeping against llama.cpp's memory, between steps.

        Returns one sentence per inconsistency (a sequence id whose KV extent differs from
        what the engine recorded, a leaked sampler ...); empty when everything agrees. For
        tests and debugging: :func:`llamax.testing.assert_idle` runs it after every test.

        Raises:
            ContextClosedError: the context is closed (it still runs while closing).
        """
        return self._engine.run(Audit())

    # ------------------------------------------------------------------ chat
    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (or the ``chat_template=`` override), sandboxed.

        Raises:
            TemplateError: the model has no template and none was given.
            ContextClosedError: the context is closed.
        """
        self._check_open("read the chat template")
        return self._chat.chat_template

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """Special tokens the template ends a turn with (``<|im_end|>`` ...): chat stops there.

        Raises:
            ContextClosedError: the context is closed.
        """
        self._check_open("read the chat template")
        return self._chat.end_of_turn_token_ids

    @property
    def can_shift(self) -> bool:
        """Whether the KV memory supports position shifts (history shift in chats).

        Raises:
            ContextClosedError: the context is closed.
        """
        self._check_open("ask the KV memory")
        return self._backend.can_shift

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> list[int]:
        """Validate ``messages``, render them with the chat template and tokenize the text.

        ``template_vars`` (``tools=...``) are passed to the template. Messages with images
        are rendered by :meth:`chat_prompt_parts`.

        Raises:
            InvalidMessageError: a message has an unknown role or unsupported content, or
                holds an image.
            TemplateError: the template failed, broke the sandbox or its budget.
            ContextClosedError: the context is closed.
        """
        self._check_open("render a chat prompt")
        return self._chat.chat_prompt(
            messages, add_generation_prompt=add_generation_prompt, **template_vars
        )

    def chat_prompt_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> list[int | Image]:
        """:meth:`chat_prompt` for messages that may hold images (OpenAI ``image_url``
        parts with ``data:`` URLs, or :class:`~llamax.Image` s, in user messages): token
        ids with a :class:`~llamax.Image` where the template put each one, as
        :meth:`add_request` takes them (docs/images.md).

        Raises:
            InvalidMessageError: a message has an unknown role or unsupported content.
            TemplateError: the template failed, broke the sandbox or its budget.
            ContextClosedError: the context is closed.
        """
        self._check_open("render a chat prompt")
        return self._chat.chat_prompt_parts(
            messages, add_generation_prompt=add_generation_prompt, **template_vars
        )

    def prompt_positions(self, prompt: Sequence[int | Image]) -> int:
        """The positions ``prompt`` (token ids and images, as :meth:`chat_prompt_parts`
        renders) takes in a sequence: one per token, and for each image its embeddings and
        the marker tokens the projector puts around it. Images are read, not encoded.

        Raises:
            ImageError: the prompt holds an image and this context has no projector, or an
                image cannot be read.
            ContextClosedError: the context is closed.
        """
        self._check_open("count a prompt")
        return self._chat.prompt_positions(prompt)

    def prompt_token_ids(self, prompt: Sequence[int | Image]) -> list[int]:
        """The ids ``prompt`` (token ids and images, as :meth:`chat_prompt_parts` renders)
        is in a sequence, one per position: each image as the marker tokens the projector
        puts around it and its placeholder ids (negative, derived from its pixels). What a
        session's :attr:`~llamax.Session.token_ids` hold, so a caller can tell how much of a
        prompt a session holds. Images are read, not encoded.

        Raises:
            ImageError: the prompt holds an image and this context has no projector, or an
                image cannot be read.
            ContextClosedError: the context is closed.
        """
        self._check_open("count a prompt")
        if not any(isinstance(part, Image) for part in prompt):
            return list(prompt)  # type: ignore[arg-type]
        return self._images.token_ids(prompt)

    def chat(
        self,
        *,
        system: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        max_context: int | None = None,
        params: SamplingParams | None = None,
        reasoning_format: ReasoningFormat = "auto",
        enable_thinking: bool | None = None,
    ) -> Chat[Session]:
        """Open a :class:`~llamax.Chat`: a conversation whose KV cache stays resident and
        whose oldest turns are dropped by shifting the cache when it outgrows
        ``max_context`` (default ``n_ctx``). A reply's thinking is kept in the history's
        ``reasoning_content`` unless ``reasoning_format="none"``; ``enable_thinking`` goes
        to templates that take it.

        Raises:
            ContextClosedError: the context is closed.
            InvalidParameterError: an argument is out of range.
        """
        self._check_open("open a chat")
        return Chat(
            self,
            system=system,
            messages=messages,
            max_context=max_context,
            params=params,
            reasoning_format=reasoning_format,
            enable_thinking=enable_thinking,
        )

    # ------------------------------------------------------------------ typed calls
    # The one entry for chat and text requests: a checked call (:mod:`llamax.chat`) is
    # prepared below the facade on the template binding this context holds and submitted
    # here. The OpenAI-shaped methods after these are conveniences over them.
    def submit_chat(self, call: ChatCall, *, fair_key: str | None = None) -> ChatHandle:
        """Render, fit and submit a chat call; returns its :class:`~llamax.chat.ChatHandle`
        at once (the reply as typed parts, or whole). ``fair_key``: the fairness key the
        request's sequences share with other requests of that key (:meth:`add_request`;
        the server passes the client's address); a keyword of the call, never an option,
        so a request body cannot set it.

        Raises:
            ContextClosedError: the context is closed.
            InvalidParameterError, InvalidMessageError, TemplateError: bad values or
                messages (nothing was enqueued).
            ContextLengthError: the conversation does not fit.
        """
        self._check_open("add a request")
        return self._submitted(prepare_chat(self._chat, call), fair_key)

    def submit_text(self, call: TextCall, *, fair_key: str | None = None) -> ChatHandle:
        """Submit a text completion call (its prompt as given, no template); as
        :meth:`submit_chat`.

        Raises:
            ContextClosedError: the context is closed.
            InvalidParameterError, ContextLengthError: bad values or a prompt that does
                not fit.
        """
        self._check_open("add a request")
        return self._submitted(prepare_text(call), fair_key)

    async def asubmit_chat(self, call: ChatCall, *, fair_key: str | None = None) -> ChatHandle:
        """Async twin of :meth:`submit_chat`: rendering, truncation and tokenizing run in a
        worker thread, so the event loop stays free; a caller cancelled meanwhile cancels
        the request as soon as it exists."""
        return await submit_in_worker(lambda: self.submit_chat(call, fair_key=fair_key), _handle)

    async def asubmit_text(self, call: TextCall, *, fair_key: str | None = None) -> ChatHandle:
        """Async twin of :meth:`submit_text` (tokenizing runs in a worker thread)."""
        return await submit_in_worker(lambda: self.submit_text(call, fair_key=fair_key), _handle)

    def _submitted(self, prepared: Prepared, fair_key: str | None) -> ChatHandle:
        handle = self._submit(
            prepared.prompt, prepared.params, request_id=prepared.request_id, fair_key=fair_key
        )
        return ChatHandle.of(handle, prepared, self._chat)

    # ------------------------------------------------------------------ OpenAI shapes
    # Conveniences over :meth:`submit_chat` / :meth:`submit_text`: OpenAI-named options
    # become a call (``ChatCall.of``), the handle is read as OpenAI's shapes.
    @overload
    def chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        fair_key: str | None = None,
        **options: Unpack[ChatOptions],
    ) -> ChatCompletion: ...
    @overload
    def chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[True],
        fair_key: str | None = None,
        **options: Unpack[ChatOptions],
    ) -> Iterator[ChatCompletionChunk]: ...
    def chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        fair_key: str | None = None,
        **options: Unpack[ChatOptions],
    ) -> ChatCompletion | Iterator[ChatCompletionChunk]:
        """An OpenAI-shaped ``chat.completion``, or with ``stream=True`` an iterator of
        ``chat.completion.chunk`` dicts (closing it early cancels the request).
        ``fair_key`` is a keyword of the call, not an option: the fairness key the
        request's sequences share with others of that key (:meth:`add_request`; the server
        passes the client's address).

        Raises:
            TypeError: an unknown option (the message names the closest valid one).
            InvalidParameterError, InvalidMessageError, ContextLengthError, TemplateError:
                bad values, messages, or a conversation that does not fit.
        """
        stream = check_flag(stream, "stream")
        usage = include_usage(options.pop("stream_options", None))
        handle = self.submit_chat(
            ChatCall.of(messages, **options, _where="chat_completion"), fair_key=fair_key
        )
        return respond(OpenAIRequest(handle), stream, usage)  # type: ignore[return-value]

    @overload
    def completion(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[False] = False,
        fair_key: str | None = None,
        **options: Unpack[CompletionOptions],
    ) -> TextCompletion: ...
    @overload
    def completion(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[True],
        fair_key: str | None = None,
        **options: Unpack[CompletionOptions],
    ) -> Iterator[TextCompletion]: ...
    def completion(
        self,
        prompt: str | Sequence[int],
        *,
        stream: bool = False,
        fair_key: str | None = None,
        **options: Unpack[CompletionOptions],
    ) -> TextCompletion | Iterator[TextCompletion]:
        """An OpenAI-shaped ``text_completion``, or a stream of them with ``stream=True``;
        ``fair_key`` as in :meth:`chat_completion`.

        Raises:
            TypeError: an unknown option.
            InvalidParameterError, ContextLengthError: bad values or a prompt that does not fit.
        """
        stream = check_flag(stream, "stream")
        usage = include_usage(options.pop("stream_options", None))
        handle = self.submit_text(
            TextCall.of(prompt, **options, _where="completion"), fair_key=fair_key
        )
        return respond(OpenAIRequest(handle), stream, usage)  # type: ignore[return-value]

    @overload
    async def achat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[False] = False,
        fair_key: str | None = None,
        **options: Unpack[ChatOptions],
    ) -> ChatCompletion: ...
    @overload
    async def achat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: Literal[True],
        fair_key: str | None = None,
        **options: Unpack[ChatOptions],
    ) -> AsyncIterator[ChatCompletionChunk]: ...
    async def achat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        stream: bool = False,
        fair_key: str | None = None,
        **options: Unpack[ChatOptions],
    ) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
        """Async twin of :meth:`chat_completion` (needs the background loop); rendering,
        truncation and tokenizing run in a worker thread, so the event loop stays free."""
        stream = check_flag(stream, "stream")
        usage = include_usage(options.pop("stream_options", None))
        handle = await submit_in_worker(  # the call too: a schema compiles to a grammar
            lambda: self.submit_chat(
                ChatCall.of(messages, **options, _where="achat_completion"), fair_key=fair_key
            ),
            _handle,
        )
        return await arespond(OpenAIRequest(handle), stream, usage)  # type: ignore[return-value]

    @overload
    async def acompletion(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[False] = False,
        fair_key: str | None = None,
        **options: Unpack[CompletionOptions],
    ) -> TextCompletion: ...
    @overload
    async def acompletion(
        self,
        prompt: str | Sequence[int],
        *,
        stream: Literal[True],
        fair_key: str | None = None,
        **options: Unpack[CompletionOptions],
    ) -> AsyncIterator[TextCompletion]: ...
    async def acompletion(
        self,
        prompt: str | Sequence[int],
        *,
        stream: bool = False,
        fair_key: str | None = None,
        **options: Unpack[CompletionOptions],
    ) -> TextCompletion | AsyncIterator[TextCompletion]:
        """Async twin of :meth:`completion` (needs the background loop)."""
        stream = check_flag(stream, "stream")
        usage = include_usage(options.pop("stream_options", None))
        handle = await submit_in_worker(
            lambda: self.submit_text(
                TextCall.of(prompt, **options, _where="acompletion"), fair_key=fair_key
            ),
            _handle,
        )
        return await arespond(OpenAIRequest(handle), stream, usage)  # type: ignore[return-value]

    # ------------------------------------------------------------------ notebooks, pipelines
    # ``generate`` hands this context down to :mod:`llamax.batch` (below the facade: it
    # works on a ``BatchHost``); ``embed`` to an :class:`~llamax.Embedder` the context owns
    # and frees.
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: BatchParams = None,
        *,
        progress: bool | None = None,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: BatchParams = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool,
    ) -> list[Completion | BaseException]: ...
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: BatchParams = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | BaseException]:
        """Run every prompt at once (the engine batches them); completions in input order.

        See :func:`llamax.batch.generate` for the arguments, the progress bar and errors.

        Raises:
            ContextClosedError: the context is closed.
        """
        self._check_open("generate")
        return batch_generate(
            self, prompts, params, progress=progress, return_exceptions=return_exceptions
        )

    @overload
    async def agenerate(
        self,
        prompts: Sequence[Prompt],
        params: BatchParams = None,
        *,
        progress: bool | None = None,
        return_exceptions: Literal[False] = False,
    ) -> list[Completion]: ...
    @overload
    async def agenerate(
        self,
        prompts: Sequence[Prompt],
        params: BatchParams = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool,
    ) -> list[Completion | BaseException]: ...
    async def agenerate(
        self,
        prompts: Sequence[Prompt],
        params: BatchParams = None,
        *,
        progress: bool | None = None,
        return_exceptions: bool = False,
    ) -> list[Completion] | list[Completion | BaseException]:
        """Async twin of :meth:`generate` (needs the background loop).

        Raises:
            ContextClosedError: the context is closed.
        """
        self._check_open("generate")
        return await batch_agenerate(
            self, prompts, params, progress=progress, return_exceptions=return_exceptions
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
            if self.closed:
                raise ContextClosedError("cannot embed: the context has been closed")
            if self._embedder is None:
                from .embeddings import Embedder

                config = self._config
                self._embedder = Embedder(
                    config.model_path,
                    n_threads=config.resolved_n_threads,
                    n_gpu_layers=config.n_gpu_layers,
                )
                self._embedder_finalizer = weakref.finalize(self, self._embedder.close)
            return self._embedder

    def _close_embedder(self) -> None:
        with self._embedder_lock:
            embedder, self._embedder = self._embedder, None
            finalizer, self._embedder_finalizer = self._embedder_finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if embedder is not None:
            embedder.close()

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the loop, release every session and free native handles (batch, context,
        model). Idempotent.

        Pending requests are cancelled (``finish_reason == "cancelled"``) unless ``drain``
        is true, in which case they finish first; while they drain, ``Session.close()``
        still frees its room. Native memory is freed only after every other thread's call
        into it has returned; calls that come later raise :class:`ContextClosedError`.

        From a done-callback, or inside a logits processor, ``close()`` marks the context
        closing and returns; the loop (or the manual step's ``process()``) tears it down
        when the step is over. Otherwise it waits for the loop thread to leave the step or
        callback it is in: a callback that never returns keeps it waiting, unless
        ``timeout`` is given (then ``TimeoutError``; the context stays closed to new work
        and is freed by the loop thread when the callback returns).

        Raises:
            InvalidParameterError: ``timeout`` is not None or a number >= 0.
            TimeoutError: the loop (or a drain) did not finish within ``timeout``.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
        ):
            raise InvalidParameterError(
                f"timeout must be None or a number >= 0, got {timeout!r}", param="timeout"
            )
        self._engine.close(drain=drain, timeout=timeout)
        self._finalizer.detach()
        self._close_embedder()

    def _check_open(self, action: str) -> None:
        if self.closed:
            raise ContextClosedError(f"cannot {action}: the context has been closed")

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
        state = self._engine.state.value
        return f"<llamax.Context model={self.model_name!r} n_ctx={self.n_ctx} {state}>"

    def _session_port(self) -> SessionPort:
        """The port through which this context's sessions reach its engine
        (:meth:`Context.session`, :meth:`Session.load <llamax.Session.load>`)."""
        return _SessionPort(self)


_exiting = threading.Event()
atexit.register(_exiting.set)  # runs before weakref.finalize's own exit hook (registered first)


def _close_unreferenced(engine: Engine, name: str) -> None:
    """Close the engine of a :class:`Context` that was collected without ``close()``.

    At interpreter exit this is the normal end of a script that never closed its context;
    otherwise it is a leak that went unnoticed, so a :class:`ResourceWarning` says so (shown
    with ``python -X dev`` or ``-W default``, and by pytest).
    """
    if engine.state in (EngineState.CLOSED, EngineState.FAILED):
        return
    if not _exiting.is_set():
        warnings.warn(
            f"{name} was never closed; it is closed now that nothing references it "
            "(call ctx.close(), or use `with llamax.Context(...) as ctx:`)",
            ResourceWarning,
            stacklevel=2,
        )
    engine.close()


def _handle(chat: ChatHandle) -> RequestHandle:
    return chat.handle


class _SessionPort:
    """The :class:`~llamax.session.SessionPort` a context hands its sessions: its engine's
    KV operations and state, its request path and its model's identity, nothing more.

    Built per session (no reference cycle with the context); reads ``ctx._engine`` at each
    call, so a test that wraps ``Engine.run`` on a live context sees the sessions' calls.
    """

    __slots__ = ("_ctx",)

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    @property
    def ended(self) -> bool:
        return self._ctx._engine.state in (EngineState.CLOSED, EngineState.FAILED)

    @property
    def model_identity(self) -> dict[str, object]:
        return self._ctx._backend.model_identity

    @property
    def projector_identity(self) -> dict[str, object] | None:
        return self._ctx._projector_identity

    @property
    def adapter_weights(self) -> dict[str, str]:
        return self._ctx._adapters.weights

    def run(self, op: KVOp[T]) -> T:
        return self._ctx._engine.run(op)

    def submit(
        self, prompt: Prompt, params: SamplingParams | None, *, session_id: int
    ) -> RequestHandle:
        return self._ctx._submit(prompt, params, session_id=session_id)
