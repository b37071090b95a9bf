"""OpenAI-shaped requests on top of the public API: ``Context.add_request`` and handles.

A :class:`OpenAIRequest` turns a handle's :class:`~llamax.Completion` into a
``chat.completion`` / ``text_completion`` dict, and its events into chunks.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from ..chat_stream import (
    ChatPart,
    ChatStream,
    ContentDelta,
    Finished,
    ReasoningDelta,
    Started,
    ToolCallDelta,
)
from ..errors import ContextLengthError, InvalidParameterError
from ..handle import RequestHandle
from ..params import SamplingParams
from ..reasoning import (
    ReasoningFormat,
    check_reasoning_format,
    opens_thinking,
    split_reasoning,
)
from ..results import Choice, Completion, FinishReason, TokenEvent, TokenLogprob, TopLogprob, Usage
from ..templates.messages import validate_messages
from ..templates.truncation import drop_oldest_turns
from ..tools import (
    ToolPlan,
    parse_tool_calls,
    tool_call_grammar,
    tool_prompt_tokens,
)
from ..tools.parse import ToolCallDelta as OpenAIToolCallDelta
from .options import Truncate
from .shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatDelta,
    CompletionUsage,
    OpenAIFinishReason,
    TextCompletion,
)

if TYPE_CHECKING:
    from .. import Context

__all__ = [
    "AsyncChunkStream",
    "ChunkStream",
    "EventBuilder",
    "OpenAIRequest",
    "prepare_chat",
    "prepare_text",
    "prepare_tool_chat",
]


def _chat_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    return {
        "content": [_chat_token(lp, lp.top_logprobs) for lp in choice.logprobs],
        "refusal": None,
    }


def _chat_token(lp: TokenLogprob | TopLogprob, top: Sequence[TopLogprob]) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.bytes)}
    entry["top_logprobs"] = [
        {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in top
    ]
    return entry


def _text_logprobs(choice: Choice) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    offsets, at = [], 0
    for lp in choice.logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in choice.logprobs],
        "token_logprobs": [lp.logprob for lp in choice.logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in choice.logprobs],
        "text_offset": offsets,
    }


def _finish_reason(reason: FinishReason | None) -> OpenAIFinishReason | None:
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


def _usage(usage: Usage) -> CompletionUsage:
    shape: CompletionUsage = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.drafted_tokens:  # OpenAI's names for predicted-output tokens
        shape["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.drafted_tokens - usage.accepted_tokens,
        }
    return shape


T = TypeVar("T")


class ChunkStream(Iterator[T]):
    """An iterator of response chunks; ``close()`` cancels the request at any point."""

    def __init__(self, chunks: Generator[T, None, None], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        """Stop the stream and cancel the request (a no-op once it has ended)."""
        self._handle.cancel()
        self._chunks.close()


class AsyncChunkStream(AsyncIterator[T]):
    """An async iterator of response chunks; ``aclose()`` cancels the request at any point."""

    def __init__(self, chunks: AsyncGenerator[T, None], handle: RequestHandle) -> None:
        self._chunks, self._handle = chunks, handle

    async def __anext__(self) -> T:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        """Stop the stream and cancel the request (a no-op once it has ended)."""
        self._handle.cancel()
        await self._chunks.aclose()


class EventBuilder(Protocol):
    """Encodes a chat request's typed stream (:mod:`llamax.chat_stream`) as another API's
    stream events (Anthropic's, Responses'): see :meth:`OpenAIRequest.events`."""

    def start(self) -> list[dict[str, Any]]:
        """The events before the first part."""

    def parts(self, parts: Sequence[ChatPart]) -> list[dict[str, Any]]:
        """The events of one token event's parts."""

    def end(self, completion: Completion) -> list[dict[str, Any]]:
        """The last events, once the request has finished."""


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A submitted OpenAI-style request: the handle plus what the response needs."""

    ctx: Context
    handle: RequestHandle
    kind: Literal["chat", "text"]
    model: str
    created: int
    tools: ToolPlan = field(default_factory=ToolPlan)
    """Tool calling asked for (``mode="none"``: replies are plain text)."""
    reasoning_format: ReasoningFormat = "none"
    """How the reply's thinking is reported (:mod:`llamax.reasoning`; chat only)."""
    thinking_opened: bool = False
    """Whether the rendered prompt left a ``<think>`` open (the reply starts thinking)."""
    num_prompt_tokens: int = 0
    """Tokens of the rendered prompt (chat; 0 for a text prompt given as a string)."""

    def named(self, model: object) -> OpenAIRequest:
        """This request answering as ``model`` when that is a non-empty str (a request's
        own ``model`` field is echoed, as OpenAI and llama-server do); else unchanged."""
        if isinstance(model, str) and model:
            return dataclasses.replace(self, model=model)
        return self

    @property
    def splits_reasoning(self) -> bool:
        """Whether the reply's thinking goes to ``reasoning_content``."""
        return self.kind == "chat" and self.reasoning_format != "none"

    def chat_stream(self) -> ChatStream:
        """A fresh typed stream of this chat request's parts (one per iteration)."""
        return ChatStream(self.tools, self.splits_reasoning, self.thinking_opened)

    @property
    def response_id(self) -> str:
        """``chatcmpl-...`` or ``cmpl-...``, derived from the request id."""
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return f"{prefix}-{self.handle.request_id.removeprefix('req-')}"

    # ------------------------------------------------------------------ whole results
    def response(self, completion: Completion) -> ChatCompletion | TextCompletion:
        """The full response object for a finished request."""
        if self.kind == "chat":
            return {
                "id": self.response_id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": c.index,
                        "message": message,
                        "finish_reason": finish,
                        "logprobs": _chat_logprobs(c),
                    }
                    for c in completion.choices
                    for message, finish in (self._message(c),)
                ],
                "usage": _usage(completion.usage),
            }
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": _finish_reason(c.finish_reason),
                    "logprobs": _text_logprobs(c),
                }
                for c in completion.choices
            ],
            "usage": _usage(completion.usage),
        }

    def _message(self, choice: Choice) -> tuple[ChatCompletionMessage, OpenAIFinishReason]:
        """A choice as an assistant message, its tool calls parsed out when tools are on.

        The parser sees the raw finish reason, so a call cut off by a cancel is dropped
        rather than returned as content with its markup."""
        finish = _finish_reason(choice.finish_reason) or "stop"
        text, reasoning = choice.text, None
        if self.splits_reasoning:
            cut = choice.finish_reason != "stop"
            reasoning, text = split_reasoning(text, inside=self.thinking_opened, cut=cut)
        if not self.tools.is_active:
            message: ChatCompletionMessage = {"role": "assistant", "content": text}
        else:
            parsed = parse_tool_calls(text, self.tools, str(choice.finish_reason))
            message = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = list(parsed.tool_calls)
            if parsed.finish_reason == "tool_calls":
                finish = "tool_calls"
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message, finish

    def result(self) -> ChatCompletion | TextCompletion:
        """Wait (a manual context steps in this thread) and return the full response."""
        return self.response(self.handle.result())

    async def aresult(self) -> ChatCompletion | TextCompletion:
        """Await the full response (needs the background loop)."""
        return self.response(await self.handle)

    # ------------------------------------------------------------------ streams
    def chunks(self, include_usage: bool) -> ChunkStream[ChatCompletionChunk | TextCompletion]:
        """Stream chunk objects; the last one carries usage when ``include_usage``.

        Closing the stream early (``close()``) cancels the request, even before its
        first chunk."""
        return ChunkStream(self._chunks(include_usage), self.handle)

    def achunks(
        self, include_usage: bool
    ) -> AsyncChunkStream[ChatCompletionChunk | TextCompletion]:
        """Async twin of :meth:`chunks`; ``aclose()`` cancels the request."""
        return AsyncChunkStream(self._achunks(include_usage), self.handle)

    def events(self, builder: EventBuilder) -> Iterator[dict[str, Any]]:
        """A chat request's stream as ``builder``'s events; closing it cancels the request."""
        stream = self.chat_stream()
        try:
            yield from builder.start()
            for event in self.handle:
                yield from builder.parts(stream.parts(event))
            yield from builder.end(self.handle.result())
        finally:
            self.handle.cancel()

    async def aevents(self, builder: EventBuilder) -> AsyncIterator[dict[str, Any]]:
        """Async twin of :meth:`events`; ``aclose()`` cancels the request."""
        stream = self.chat_stream()
        try:
            for encoded in builder.start():
                yield encoded
            async for event in self.handle:
                for encoded in builder.parts(stream.parts(event)):
                    yield encoded
            for encoded in builder.end(await self.handle):
                yield encoded
        finally:
            self.handle.cancel()

    def _chunks(
        self, include_usage: bool
    ) -> Generator[ChatCompletionChunk | TextCompletion, None, None]:
        stream = self.chat_stream()
        try:
            for event in self.handle:
                yield from self._event_chunks(event, stream)
            if include_usage:
                yield self._usage_chunk(self.handle.result())
        finally:
            self.handle.cancel()

    async def _achunks(
        self, include_usage: bool
    ) -> AsyncGenerator[ChatCompletionChunk | TextCompletion, None]:
        stream = self.chat_stream()
        try:
            async for event in self.handle:
                for chunk in self._event_chunks(event, stream):
                    yield chunk
            if include_usage:
                yield self._usage_chunk(await self.handle)
        finally:
            self.handle.cancel()

    def _event_chunks(
        self, event: TokenEvent, stream: ChatStream
    ) -> Iterator[ChatCompletionChunk | TextCompletion]:
        if self.kind == "chat":
            yield from self._encode(stream.parts(event))
            return
        finish = _finish_reason(event.finish_reason)
        if event.text or event.logprobs or finish:
            chunk = self._text_chunk(event.index, event.text, finish)
            if event.logprobs:
                choice = Choice(
                    event.index, event.text, event.token_ids, FinishReason.STOP, event.logprobs
                )
                chunk["choices"][0]["logprobs"] = _text_logprobs(choice)
            yield chunk

    def _encode(self, parts: Sequence[ChatPart]) -> Iterator[ChatCompletionChunk]:
        """One event's parts as ``chat.completion.chunk`` objects: with tools on, a chunk
        per part; else one delta (role, thinking, content and logprobs together), then the
        finish."""
        if self.tools.is_active:
            for part in parts:
                if isinstance(part, Finished):
                    yield self._finish_chunk(part)
                else:
                    yield self._delta_chunk(part.index, _delta(part))
            return
        delta: ChatDelta = {}
        logprobs: dict[str, Any] | None = None
        for part in parts:
            if isinstance(part, ContentDelta) and part.logprobs:
                logprobs = {"content": [_chat_token(lp, lp.top_logprobs) for lp in part.logprobs]}
            if not isinstance(part, Finished):
                delta.update(_delta(part))
        if delta or logprobs:  # held-back text still reports its tokens' logprobs
            index = parts[0].index
            yield self._chat_chunk(
                [{"index": index, "delta": delta, "finish_reason": None, "logprobs": logprobs}]
            )
        for part in parts:
            if isinstance(part, Finished):
                yield self._finish_chunk(part)

    def _finish_chunk(self, part: Finished) -> ChatCompletionChunk:
        return self._chat_chunk(
            [{"index": part.index, "delta": {}, "finish_reason": part.reason, "logprobs": None}]
        )

    def _delta_chunk(self, index: int, delta: ChatDelta) -> ChatCompletionChunk:
        return self._chat_chunk(
            [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]
        )

    def _chat_chunk(self, choices: list[ChatCompletionChunkChoice]) -> ChatCompletionChunk:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _text_chunk(
        self, index: int, text: str, finish: OpenAIFinishReason | None
    ) -> TextCompletion:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": None}],
        }

    def _usage_chunk(self, completion: Completion) -> ChatCompletionChunk | TextCompletion:
        chunk: Any = self._chat_chunk([]) if self.kind == "chat" else self._text_chunk(0, "", None)
        if self.kind == "text":
            chunk["choices"] = []
        chunk["usage"] = _usage(completion.usage)
        return chunk  # type: ignore[no-any-return]


def _delta(part: Started | ReasoningDelta | ContentDelta | ToolCallDelta) -> ChatDelta:
    """A part as what an OpenAI chunk's ``delta`` adds."""
    if isinstance(part, Started):
        return {"role": "assistant", "content": ""}
    if isinstance(part, ReasoningDelta):
        return {"reasoning_content": part.text}
    if isinstance(part, ContentDelta):
        return {"content": part.text} if part.text else {}
    return {"tool_calls": [_call_delta(part)]}


def _call_delta(part: ToolCallDelta) -> OpenAIToolCallDelta:
    """A tool call part as an entry of OpenAI's ``delta.tool_calls``."""
    if part.call_id is None:
        return {"index": part.position, "function": {"arguments": part.arguments}}
    return {
        "index": part.position,
        "id": part.call_id,
        "type": "function",
        "function": {"name": part.name or "", "arguments": part.arguments},
    }


def _template_vars(enable_thinking: bool | None) -> dict[str, Any]:
    if enable_thinking is None:
        return {}
    if not isinstance(enable_thinking, bool):
        raise InvalidParameterError(f"enable_thinking must be a bool, got {enable_thinking!r}")
    return {"enable_thinking": enable_thinking}


def _thinking_opened(ctx: Context, tokens: Sequence[int]) -> bool:
    return opens_thinking(ctx.detokenize(list(tokens[-8:])))


def prepare_chat(
    ctx: Context,
    messages: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    *,
    truncate: Truncate = "none",
    parse_special_in_content: bool = False,
    reasoning_format: ReasoningFormat = "auto",
    enable_thinking: bool | None = None,
) -> OpenAIRequest:
    """Validate, render, fit and submit a chat request.

    With ``truncate="oldest_messages"`` the cut is found by a binary search over turn
    boundaries (a few renders, whatever the length); each rendering is tokenized once.
    ``reasoning_format`` says how the reply's thinking is reported (:mod:`llamax.reasoning`);
    ``enable_thinking`` (None: the template's default) goes to templates that take it.
    """
    if truncate not in ("none", "oldest_messages"):
        raise InvalidParameterError(
            f"truncate must be 'none' or 'oldest_messages', got {truncate!r}"
        )
    if not isinstance(parse_special_in_content, bool):
        raise InvalidParameterError(
            f"parse_special_in_content must be a bool, got {parse_special_in_content!r}"
        )
    reasoning_format = check_reasoning_format(reasoning_format)
    template_vars = _template_vars(enable_thinking)
    msgs = validate_messages(messages)
    params = params.with_stop_token_ids(ctx.end_of_turn_token_ids)
    reserve = params.max_tokens or 1
    budget = ctx.n_ctx_seq - reserve
    rendered: dict[int, list[int]] = {}  # by the number of messages kept

    def render(kept: list[dict[str, Any]]) -> list[int]:
        if len(kept) not in rendered:
            rendered[len(kept)] = ctx.chat_prompt(
                kept, parse_special_in_content=parse_special_in_content, **template_vars
            )
        return rendered[len(kept)]

    tokens = render(msgs)
    if len(tokens) > budget:
        if truncate == "none":
            raise ContextLengthError(
                f"the conversation needs {len(tokens)} prompt tokens + {reserve} for the reply, "
                f"more than a sequence may hold ({_limit(ctx)}); "
                "pass truncate='oldest_messages' to drop old turns",
                num_prompt_tokens=len(tokens),
                n_ctx=ctx.n_ctx_seq,
            )
        tokens = render(drop_oldest_turns(msgs, lambda m: len(render(m)), budget))
    request = _submit(ctx, tokens, params, "chat")
    opened = reasoning_format != "none" and _thinking_opened(ctx, tokens)
    return dataclasses.replace(request, reasoning_format=reasoning_format, thinking_opened=opened)


def _limit(ctx: Context) -> str:
    """``n_ctx=4096``, or ``n_ctx_seq=512`` when a sequence may hold less than ``n_ctx``."""
    if ctx.n_ctx_seq == ctx.n_ctx:
        return f"n_ctx={ctx.n_ctx}"
    return f"n_ctx_seq={ctx.n_ctx_seq}"


def prepare_tool_chat(
    ctx: Context,
    messages: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    plan: ToolPlan,
    *,
    reasoning_format: ReasoningFormat = "auto",
    enable_thinking: bool | None = None,
) -> OpenAIRequest:
    """Render a conversation with tools (or with earlier tool calls and results), constrain
    the reply with the tool-call grammar, and submit it. ``reasoning_format`` and
    ``enable_thinking``: as :func:`prepare_chat`'s; the calls parse after the thinking.

    Raises:
        InvalidParameterError: tools together with ``grammar`` or ``response_format``.
        ContextLengthError: the conversation does not fit.
    """
    reasoning_format = check_reasoning_format(reasoning_format)
    template_vars = _template_vars(enable_thinking)
    grammar = tool_call_grammar(plan)
    if grammar is not None and (params.grammar is not None or params.json_schema is not None):
        raise InvalidParameterError(
            "tools cannot be combined with grammar or response_format: the tool-call grammar "
            "already constrains the reply"
        )
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    params = params.with_stop_token_ids(ctx.end_of_turn_token_ids)
    tokens = tool_prompt_tokens(ctx, messages, plan, **template_vars)
    reserve = params.max_tokens or 1
    if len(tokens) + reserve > ctx.n_ctx_seq:
        raise ContextLengthError(
            f"the conversation with its tools needs {len(tokens)} prompt tokens + {reserve} "
            f"for the reply, more than a sequence may hold ({_limit(ctx)})",
            num_prompt_tokens=len(tokens),
            n_ctx=ctx.n_ctx_seq,
        )
    request = _submit(ctx, tokens, params, "chat")
    opened = reasoning_format != "none" and _thinking_opened(ctx, tokens)
    return dataclasses.replace(
        request, tools=plan, reasoning_format=reasoning_format, thinking_opened=opened
    )


def prepare_text(
    ctx: Context, prompt: str | Sequence[int], params: SamplingParams
) -> OpenAIRequest:
    """Submit a text completion request."""
    return _submit(ctx, prompt, params, "text")


def _submit(
    ctx: Context, prompt: str | Sequence[int], params: SamplingParams, kind: Literal["chat", "text"]
) -> OpenAIRequest:
    handle = ctx.add_request(prompt, params, request_id=f"req-{uuid.uuid4().hex[:24]}")
    num = 0 if isinstance(prompt, str) else len(prompt)
    return OpenAIRequest(ctx, handle, kind, ctx.model_name, int(time.time()), num_prompt_tokens=num)
