"""``llamax.Context``: the one object an application holds."""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import Self, Unpack

from .backend.base import Backend
from .engine import Engine, EngineState
from .errors import ContextClosedError, InvalidParameterError, InvalidRequestError, SessionError
from .handle import RequestHandle
from .kvcache import Slot
from .models import default_model_path
from .params import ContextConfig, SamplingParams
from .prompts import check_token_ids, prompt_tokens, request_grammar
from .results import Completion, TokenEvent
from .sampling import BatchLogitsProcessor
from .sequence import Request
from .session import Session

if TYPE_CHECKING:
    from .chat.history import Chat
    from .chat.template import ChatTemplate

__all__ = ["Context", "ContextOptions", "ContextStats"]


class ContextOptions(TypedDict, total=False):
    """Keyword options of :class:`Context`; see :class:`ContextConfig` for their meaning."""

    n_ctx: int
    n_seq_max: int
    n_batch: int
    n_ubatch: int | None
    n_threads: int
    n_threads_batch: int | None
    n_gpu_layers: int
    use_mmap: bool
    use_extra_bufts: bool | None
    flash_attn: bool | None
    prefix_cache: bool
    chat_template: str | None
    verbose: bool


@dataclass(frozen=True, slots=True)
class ContextStats:
    """A snapshot of the engine's counters (see :meth:`Context.stats`)."""

    state: str
    num_waiting: int
    """Sequences queued."""
    num_running: int
    """Sequences being computed."""
    num_retained: int
    """Finished sequences kept in KV for their prefix (evicted LRU)."""
    kv_cells_used: int
    """Distinct KV cells in use (shared prefixes count once)."""
    kv_cells_total: int
    """KV cells in the context."""
    num_free_seq_ids: int
    """Sequence ids held by nothing."""
    num_steps: int
    """Decodes run."""
    num_prefill_tokens: int
    """Prompt tokens computed (prefix-cache hits are not computed)."""
    num_decode_tokens: int
    """Generated tokens computed."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache instead of computed."""
    num_preemptions: int
    """Sequences preempted under KV pressure (recomputed later)."""


class Context:
    """A loaded model, its llama.cpp context and a continuous-batching run loop.

    ``Context()`` loads the default model (SmolLM2-135M-Instruct) when it is installed.
    Any thread may call :meth:`add_request`. With ``autostart=True`` (default) a background
    thread runs the loop and sleeps when idle; with ``autostart=False`` the caller drives
    it with :meth:`process`. ``close()`` (or leaving a ``with`` block) cancels pending
    requests, which complete with ``finish_reason == "cancelled"``, joins the loop and frees
    the native handles; ``close(drain=True)`` lets them finish first.

    Args:
        model_path: a GGUF file. ``None`` uses ``$LLAMAX_MODEL`` or the default model.
        autostart: start the background loop.
        config: a complete :class:`ContextConfig` (instead of keyword options).
        backend: an already built backend (e.g. :class:`llamax.testing.FakeBackend`).
        batch_logits_processor: ``fn(rows, logits)`` called once per step with a zero-copy
            ``(rows, n_vocab)`` view of every row about to be sampled, for vectorised work.
        **options: fields of :class:`ContextConfig` (``n_ctx``, ``n_seq_max``, ...).

    Raises:
        ModelLoadError: the model is missing, corrupt or cannot be loaded.
        InvalidParameterError: an option is out of range.
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
            config = ContextConfig(model_path=os.fspath(path), **options)
        if backend is None:
            from .backend.llama_cpp import LlamaCppBackend

            backend = LlamaCppBackend(config)
        prefix_cache = config.prefix_cache
        self._config: ContextConfig = config
        self._backend = backend
        self._engine = Engine(
            backend,
            autostart=autostart,
            prefix_cache=prefix_cache,
            batch_processor=batch_logits_processor,
        )
        self._arrivals = itertools.count()
        self._arrival_lock = threading.Lock()
        self._chat_template: ChatTemplate | None = None
        self._end_of_turn: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ facts
    @property
    def config(self) -> ContextConfig:
        """What was asked for."""
        return self._config

    @property
    def n_ctx(self) -> int:
        """KV cells granted: the most tokens one sequence may hold, shared by all."""
        return self._backend.n_ctx

    @property
    def n_seq_max(self) -> int:
        """How many sequences may hold KV cells at once."""
        return self._backend.n_seq_max

    @property
    def model_name(self) -> str:
        """The model's name from its metadata."""
        return self._backend.model_name

    @property
    def closed(self) -> bool:
        """Whether the context no longer accepts requests."""
        return self._engine.state is not EngineState.RUNNING

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokenize ``text`` as a prompt would be."""
        return self._backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Join the pieces of ``token_ids`` into text (special tokens render as nothing)."""
        return b"".join(self._backend.token_to_piece(t) for t in token_ids).decode(
            "utf-8", "replace"
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Submit a prompt (text or token ids) from any thread; returns at once.

        Requests are served first come, first served; a lower ``priority`` value is served
        earlier.

        Raises:
            ContextClosedError: the context is closed.
            EmptyPromptError: the prompt has no tokens.
            ContextLengthError: the prompt leaves no room for a reply in ``n_ctx``.
            InvalidRequestError: the prompt or params have the wrong type or bad token ids.
        """
        return self._submit(prompt, params, priority=priority, request_id=request_id)

    def session(self) -> Session:
        """Open a :class:`Session`: a KV sequence that stays resident between requests.

        Raises:
            SessionError: every sequence id is held by running sequences or other sessions.
        """

        def open_slot() -> Slot:
            slot = self._engine.scheduler.cache.allocate(pinned=True)
            if slot is None:
                raise SessionError(
                    f"no free sequence id for a session (n_seq_max={self.n_seq_max}); "
                    "close a session or raise n_seq_max"
                )
            return slot

        return Session(self, self._engine.call(open_slot))

    def _submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        *,
        priority: int = 0,
        request_id: str | None = None,
        session: Session | None = None,
    ) -> RequestHandle:
        if self.closed:
            raise ContextClosedError("cannot add a request: the context has been closed")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}"
            )
        if session is not None and params.n != 1:
            raise InvalidParameterError(f"n must be 1 for a session request, got {params.n}")
        tokens = prompt_tokens(self._backend, prompt, self.n_ctx)
        check_token_ids(self._backend, params)
        grammar = request_grammar(self._backend, params)
        with self._arrival_lock:
            arrival = next(self._arrivals)
        handle = RequestHandle(request_id or f"req-{uuid.uuid4().hex[:16]}")
        request = Request(
            handle.request_id,
            tokens,
            params,
            handle,
            token_to_piece=self._backend.token_to_piece,
            seed=params.seed if params.seed is not None else secrets.randbits(32),
            priority=priority,
            arrival=arrival,
            num_choices=params.n,
            session=session,
            grammar=grammar,
        )
        handle._bind(lambda: self._engine.cancel(request))
        self._engine.submit(request)
        return handle

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
            ContextClosedError: the context is closed.
            EngineError: llama.cpp failed; all pending requests failed and the context closed.
        """
        return self._engine.process()

    def stats(self) -> ContextStats:
        """Counters of the engine (approximate while the loop runs)."""
        s = self._engine.scheduler
        return ContextStats(
            state=self._engine.state.value,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            kv_cells_used=s.num_cells_in_use,
            kv_cells_total=self.n_ctx,
            num_retained=s.cache.num_retained,
            num_free_seq_ids=s.num_free_seq_ids,
            num_steps=self._engine.num_steps,
            num_prefill_tokens=s.num_prefill_tokens,
            num_decode_tokens=s.num_decode_tokens,
            num_cached_tokens=s.num_cached_tokens,
            num_preemptions=s.num_preemptions,
        )

    def clear_cache(self) -> int:
        """Drop every retained prefix from the KV cache; return how many sequences were freed.

        Running requests and open sessions keep their cells.
        """

        def evict_all() -> int:
            cache = self._engine.scheduler.cache
            count = 0
            while cache.evict_one():
                count += 1
            return count

        return self._engine.call(evict_all)

    # ------------------------------------------------------------------ chat
    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (or the ``chat_template=`` override), sandboxed.

        Raises:
            TemplateError: the model has no template and none was given.
        """
        if self._chat_template is None:
            from .chat.binding import load_template

            override = self._config.chat_template
            self._chat_template = load_template(self._backend, override, self.model_name)
        return self._chat_template

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """Special tokens the template ends a turn with (``<|im_end|>`` ...): chat stops there."""
        if self._end_of_turn is None:
            from .chat.binding import end_of_turn_ids

            self._end_of_turn = end_of_turn_ids(self._backend, self.chat_template)
        return self._end_of_turn

    @property
    def can_shift(self) -> bool:
        """Whether the KV memory supports position shifts (history shift in chats)."""
        return self._backend.can_shift

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Validate ``messages``, render them with the chat template and tokenize the text.

        Raises:
            InvalidMessageError: a message has an unknown role or unsupported content.
            TemplateError: the template failed, broke the sandbox or its budget.
        """
        from .chat.binding import render_tokens

        return render_tokens(
            self._backend,
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
        )

    def chat_completion(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Any:
        """An OpenAI-shaped ``chat.completion`` (or, with ``stream=True``, an iterator of
        ``chat.completion.chunk`` dicts). See :mod:`llamax.chat.api` for the options."""
        from .chat.api import chat_completion

        return chat_completion(self, messages, **options)

    def completion(self, prompt: str | Sequence[int], **options: Any) -> Any:
        """An OpenAI-shaped ``text_completion`` (or a stream of them with ``stream=True``)."""
        from .chat.api import completion

        return completion(self, prompt, **options)

    async def achat_completion(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Any:
        """Async twin of :meth:`chat_completion` (needs the background loop)."""
        from .chat.api import achat_completion

        return await achat_completion(self, messages, **options)

    async def acompletion(self, prompt: str | Sequence[int], **options: Any) -> Any:
        """Async twin of :meth:`completion` (needs the background loop)."""
        from .chat.api import acompletion

        return await acompletion(self, prompt, **options)

    def chat(
        self,
        *,
        system: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        max_context: int | None = None,
        params: SamplingParams | None = None,
    ) -> Chat:
        """Open a :class:`~llamax.Chat`: a conversation whose KV cache stays resident and
        whose oldest turns are dropped by shifting the cache when it outgrows
        ``max_context`` (default ``n_ctx``)."""
        from .chat.history import Chat

        return Chat(self, system=system, messages=messages, max_context=max_context, params=params)

    def _with_end_of_turn(self, params: SamplingParams) -> SamplingParams:
        extra = tuple(t for t in self.end_of_turn_token_ids if t not in params.stop_token_ids)
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))

    def _wait(self, handle: RequestHandle) -> Completion:
        """The completion, driving the loop here when the context is manual."""
        while not handle.done() and not self._engine.is_background:
            self.process()
        return handle.result()

    def _events(self, handle: RequestHandle) -> Iterator[TokenEvent]:
        """The handle's events, driving the loop here when the context is manual."""
        return handle.stream(drive=None if self._engine.is_background else self.process)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the loop and free native handles (batch, context, model). Idempotent.

        Pending requests are cancelled (``finish_reason == "cancelled"``) unless ``drain``
        is true, in which case they finish first.
        """
        self._engine.close(drain=drain, timeout=timeout)

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
