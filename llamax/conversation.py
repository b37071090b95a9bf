"""Chat conversations with message-level history shift, on the public API.

A :class:`Chat` keeps the messages of a conversation and a resident KV sequence (a
:class:`~llamax.Session`). Each turn computes only the new user message and the reply.
When a turn would not fit, the oldest whole turns are dropped (the system messages and the
newest turns stay) and the cache is *shifted*: ``llama_memory_seq_rm`` removes the dropped
span and ``llama_memory_seq_add`` moves the kept cells back, so nothing is recomputed.

A shift is only a head start: the session then keeps the longest common prefix between the
shifted cells and the tokenized shortened conversation and recomputes from the first
difference, so a template that renders differently once old messages are gone still gives
correct output. Where the memory cannot shift (``llama_memory_can_shift`` is false), the
dropped turns and everything after them are recomputed.

A user message may hold images (OpenAI ``image_url`` parts, :class:`~llamax.Image` s:
docs/images.md). The session keeps them like any prefix: the same pixels give the same
placeholder ids, so the next turn reuses an earlier image's cells; a dropped turn takes its
images with it (a shift moves whole messages, never part of an image).

A reply that thinks (``<think>...</think>``, see :mod:`llamax.reasoning`) goes into the
history as its answer in ``content`` and its thinking in ``reasoning_content``, the shape
thinking templates expect: they decide what of it the next turn's prompt shows (Qwen3's
drops the thinking of finished turns), and the session recomputes from the first token
that differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Protocol

from typing_extensions import Self, TypeVar

from .errors import InvalidParameterError
from .facts import ModelFacts
from .handle import RequestHandle
from .images import Image
from .params import SamplingParams
from .prompts import Prompt
from .reasoning import ReasoningFormat, check_reasoning_format, opens_thinking, split_reasoning
from .results import Completion, TokenEvent
from .templates.messages import has_images, validate_messages
from .templates.truncation import drop_oldest_turns, leading_system_count
from .tokens import common_prefix_len

__all__ = ["Chat", "ChatHost", "ChatSession", "TurnStats"]

Message = dict[str, Any]
Content = str | Sequence[Mapping[str, Any] | Image]
"""A user message's content: text, or OpenAI content parts (``{"type": "text", ...}``,
``{"type": "image_url", ...}``) and :class:`~llamax.Image` s."""


class ChatSession(Protocol):
    """What a :class:`Chat` needs of its resident sequence (a :class:`llamax.Session`)."""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The ids the sequence holds, one per position."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Continue the sequence with ``prompt``; returns the reply's handle."""

    def shift(self, start: int, end: int) -> bool:
        """Drop positions ``[start, end)`` and move the rest back (False: cannot)."""

    def close(self) -> None:
        """Free the sequence."""


S_co = TypeVar("S_co", bound=ChatSession, covariant=True)
S = TypeVar("S", bound=ChatSession, covariant=True, default=ChatSession)


class ChatHost(Protocol[S_co]):
    """What a :class:`Chat` needs of its context (a :class:`llamax.Context`, which hands
    itself down from ``ctx.chat()``): a session to hold the conversation, the template,
    and the sizes a turn must fit. A chat names no context, so the facade builds one
    without climbing into a layer above it."""

    @property
    def facts(self) -> ModelFacts:
        """The model's facts (``n_ctx_seq``: the most tokens one sequence may hold)."""

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """The tokens the template ends a turn with."""

    @property
    def can_shift(self) -> bool:
        """Whether the memory can move cells (the history shift)."""

    def session(self) -> S_co:
        """Open the resident sequence the chat holds."""

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Join the pieces of ``token_ids`` into text."""

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """The prompt token ids of ``messages`` (text only)."""

    def chat_prompt_parts(
        self, messages: Sequence[Mapping[str, Any]], **options: Any
    ) -> list[int | Image]:
        """The prompt of ``messages``, with an :class:`~llamax.Image` where each sits."""

    def prompt_token_ids(self, prompt: Sequence[int | Image]) -> list[int]:
        """One id a position (an image's placeholder ids)."""


@dataclass(frozen=True, slots=True)
class _Turn:
    handle: RequestHandle
    kept: list[Message]
    prompt_tokens: int
    dropped: int
    shifted: int
    thinking_opened: bool


@dataclass(frozen=True, slots=True)
class TurnStats:
    """What one turn cost."""

    prompt_tokens: int
    """Tokens of the rendered conversation sent to the model."""
    reused_tokens: int
    """Prompt tokens already in the session's cache (after any shift)."""
    computed_tokens: int
    """Prompt tokens prefilled this turn."""
    dropped_messages: int
    """Old messages dropped to make the turn fit."""
    shifted_tokens: int
    """Cells removed by the history shift (0 when nothing was dropped or shifting failed)."""


class Chat(Generic[S]):
    """A multi-turn conversation on a resident KV sequence. Create with ``ctx.chat()``
    (a ``Chat[Session]``: :attr:`session` is the context's :class:`~llamax.Session`).

    Args:
        ctx: the context (any :class:`ChatHost`).
        system: an optional system message.
        messages: earlier messages to start from.
        max_context: token budget of the conversation (prompt plus reply); default n_ctx.
        params: default sampling parameters for :meth:`send` and :meth:`stream`.
        reasoning_format: ``"auto"`` (default) or ``"deepseek"``: a reply's thinking is
            kept apart from its answer in the history (``reasoning_content``); ``"none"``:
            the reply's whole text is the history's ``content``.
        enable_thinking: passed to templates that take it (Qwen3's thinking switch);
            ``None``: the template's default.

    Raises:
        InvalidParameterError: ``max_context`` is below 16, or ``reasoning_format`` or
            ``enable_thinking`` is not one.
    """

    def __init__(
        self,
        ctx: ChatHost[S],
        *,
        system: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        max_context: int | None = None,
        params: SamplingParams | None = None,
        reasoning_format: ReasoningFormat = "auto",
        enable_thinking: bool | None = None,
    ) -> None:
        self._reasoning_format = check_reasoning_format(reasoning_format)
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise InvalidParameterError(
                f"enable_thinking must be a bool, got {enable_thinking!r}", param="enable_thinking"
            )
        self._template_vars: dict[str, Any] = {}
        if enable_thinking is not None:
            self._template_vars["enable_thinking"] = enable_thinking
        start = ([{"role": "system", "content": system}] if system is not None else []) + list(
            messages
        )
        self._messages: list[Message] = validate_messages(start) if start else []
        self._ctx = ctx
        self._max_context = min(max_context or ctx.facts.n_ctx_seq, ctx.facts.n_ctx_seq)
        if self._max_context < 16:
            raise InvalidParameterError(
                f"max_context must be >= 16, got {self._max_context}", param="max_context"
            )
        self._params = params or SamplingParams(max_tokens=256)
        self._session: S = ctx.session()
        self.last_turn: TurnStats | None = None
        """Costs of the latest turn."""

    @property
    def messages(self) -> list[Message]:
        """The conversation as it stands (dropped turns are gone)."""
        return [dict(m) for m in self._messages]

    @property
    def session(self) -> S:
        """The underlying resident KV sequence."""
        return self._session

    # ------------------------------------------------------------------ turns
    def send(self, content: Content, params: SamplingParams | None = None) -> Completion:
        """Add a user message (text, or OpenAI content parts: text, ``image_url`` with a
        ``data:`` URL, :class:`~llamax.Image`) and return the assistant's reply (blocking).

        Raises:
            InvalidMessageError: the content is malformed.
            ImageError: it holds an image, and the context has no projector, or the image
                cannot be read.
        """
        turn = self._start_turn(content, params)
        completion = turn.handle.result()
        self._end_turn(turn, completion)
        return completion

    def stream(
        self, content: Content, params: SamplingParams | None = None
    ) -> Iterator[TokenEvent]:
        """Add a user message and stream the reply; the history updates when it ends
        (``content`` as in :meth:`send`).

        Closing the stream early (``break`` then dropping it, or ``close()``) cancels the
        reply; the history keeps the part already produced.
        """
        turn = self._start_turn(content, params)
        try:
            yield from turn.handle
        finally:
            turn.handle.cancel()  # a no-op once the reply has ended
            self._end_turn(turn, turn.handle.result())

    def _start_turn(self, content: Content, params: SamplingParams | None) -> _Turn:
        params = params or self._params
        if params.n != 1:
            raise InvalidParameterError(f"n must be 1 in a chat, got {params.n}", param="n")
        params = params.with_stop_token_ids(self._ctx.end_of_turn_token_ids)
        turn = validate_messages([{"role": "user", "content": content}])
        wanted = [*self._messages, *turn]
        reserve = params.max_tokens or 1
        kept = drop_oldest_turns(
            wanted,
            lambda m: len(self._ids(self._render(m))),
            self._max_context - reserve,
            reserve=reserve,
            limit_name="n_ctx" if self._max_context == self._ctx.facts.n_ctx_seq else "max_context",
        )
        dropped = len(wanted) - len(kept)
        shifted = self._shift(kept, dropped) if dropped else 0
        prompt = self._render(kept)
        ids = self._ids(prompt)
        opened = opens_thinking(self._ctx.detokenize([t for t in ids[-8:] if t >= 0]))
        handle = self._session.add_request(prompt, params)
        return _Turn(handle, kept, len(ids), dropped, shifted, opened)

    def _render(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int | Image]:
        """The prompt of ``messages``: token ids, with an :class:`~llamax.Image` where each
        image sits."""
        if has_images(messages):
            return self._ctx.chat_prompt_parts(messages, **options, **self._template_vars)
        return list(self._ctx.chat_prompt(messages, **options, **self._template_vars))

    def _ids(self, prompt: Sequence[int | Image]) -> list[int]:
        """One id a position, as the session holds them (an image's placeholder ids)."""
        return self._ctx.prompt_token_ids(prompt)

    def _end_turn(self, turn: _Turn, completion: Completion) -> None:
        reply: Message = {"role": "assistant", "content": completion.text}
        if self._reasoning_format != "none":
            reasoning, content = split_reasoning(
                completion.text,
                inside=turn.thinking_opened,
                cut=completion.finish_reason != "stop",
            )
            if reasoning is not None:
                reply = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        self._messages = [*turn.kept, reply]
        reused = completion.usage.cached_tokens
        computed = turn.prompt_tokens - reused
        self.last_turn = TurnStats(turn.prompt_tokens, reused, computed, turn.dropped, turn.shifted)

    def _shift(self, kept: list[Message], num_dropped: int) -> int:
        """Move the cache past the dropped messages; return how many cells were removed.

        The dropped span is found by rendering both conversations through their first kept
        message after the system head: the old rendering must equal the cached tokens there,
        and removing ``[start, start + removed)`` from it must give the new rendering exactly.
        Any template glue the two share (a default system prompt the template adds on its
        own, a repeated message header) stays in the cache. When the boundaries do not line
        up, nothing is shifted and the session's common prefix decides what to recompute.
        """
        old = self._messages
        head = leading_system_count(old)
        if not self._ctx.can_shift or head + num_dropped >= len(old):
            return 0  # nothing of the old history survives: plain truncation does the job
        old_tokens = self._ids(
            self._render(old[: head + num_dropped + 1], add_generation_prompt=False)
        )
        new_tokens = self._ids(self._render(kept[: head + 1], add_generation_prompt=False))
        removed = len(old_tokens) - len(new_tokens)
        session = self._session
        if removed <= 0 or tuple(old_tokens) != session.token_ids[: len(old_tokens)]:
            return 0
        start = common_prefix_len(old_tokens, new_tokens)
        if old_tokens[start + removed :] != new_tokens[start:]:
            return 0
        return removed if session.shift(start, start + removed) else 0

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free the conversation's KV sequence."""
        self._session.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
