"""llama-server's extensions of the OpenAI chat and Responses routes: ``timings_per_token``
(a chat stream's usage chunk carries llama-server's ``timings``; on ``/responses`` each
``response.output_text.delta`` and ``response.completed``) and ``verbose`` (a whole chat
reply carries ``__verbose``, with the rendered prompt). They are added around a submitted
chat call's reply and what :func:`~llamax.openai.acreate_response` returns; the engine
sees the request as any other (``return_progress`` is the chat layer's own).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

import llamax
from llamax.chat import ChatCall
from llamax.dialects.llama_native import MEDIA_MARKER, Timings

__all__ = ["timed_response_events", "with_llama_extras", "with_media_markers"]


async def with_llama_extras(
    ctx: llamax.Context,
    call: ChatCall,
    tools: Any,
    reply: Awaitable[Any],
    *,
    stream: bool,
    timings: bool,
    verbose: bool,
) -> Any:
    """``reply`` (a chat completion, or its chunks when ``stream``) with llama-server's
    ``timings`` and ``__verbose`` (the prompt rendered with ``tools``, the body's) where
    they were asked for."""
    started = time.perf_counter()
    result = await reply
    if stream:
        return _timed(result, started) if timings else result
    if verbose:
        prompt = await run_in_threadpool(_rendered, ctx, call, tools)
        content = [c["message"].get("content") for c in result["choices"]]
        result["__verbose"] = {"prompt": prompt, "content": content[0] if content else None}
    return result


def _rendered(ctx: llamax.Context, call: ChatCall, tools: Any) -> str:
    """The prompt as the chat template renders it (what ``/apply-template`` answers): an
    image as the media marker, never its bytes (a fetched URL's bytes are not for the
    client to read back)."""
    thinking = call.enable_thinking
    extra = {} if thinking is None else {"enable_thinking": thinking}
    return ctx.chat_template.render(with_media_markers(call.messages),
                                    add_generation_prompt=True, tools=tools, **extra)  # fmt: skip


def with_media_markers(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """(Checked) ``messages`` with each list of content parts as one string, an image as
    llama-server's media marker, as its ``/apply-template`` shows them."""
    marked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") if p.get("type") == "text" else MEDIA_MARKER
                     for p in content]  # fmt: skip
            message = {**message, "content": "".join(texts)}
        marked.append(message)
    return marked


async def _timed(chunks: AsyncIterator[dict[str, Any]], started: float) -> AsyncIterator[Any]:
    """The chunks, the usage chunk with ``timings`` (first token: the first chunk that
    carries text)."""
    clock = Timings(started)
    async for chunk in chunks:
        usage = chunk.get("usage")
        if clock.first_token is None and any(
            (c.get("delta") or {}).get("content") for c in chunk["choices"]
        ):
            clock.first_token = time.perf_counter()
        if usage and not chunk["choices"]:
            clock.num_prompt = usage["prompt_tokens"]
            clock.num_cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            clock.num_predicted = usage["completion_tokens"]
            chunk = chunk | {"timings": clock.to_json(time.perf_counter())}
        yield chunk


async def timed_response_events(
    events: AsyncIterator[dict[str, Any]], started: float
) -> AsyncIterator[dict[str, Any]]:
    """A Responses stream with llama-server's ``timings`` on each
    ``response.output_text.delta`` (the clock so far: ``predicted_n`` counts the deltas,
    the prompt's counts are not known yet) and on ``response.completed`` (its usage's
    counts). Closing it closes ``events``, which cancels the request."""
    clock = Timings(started)
    try:
        async for event in events:
            kind = event.get("type")
            if kind == "response.output_text.delta":
                if clock.first_token is None:
                    clock.first_token = time.perf_counter()
                clock.num_predicted += 1
                event = event | {"timings": clock.to_json(time.perf_counter())}
            elif kind in ("response.completed", "response.incomplete"):
                usage = event["response"].get("usage") or {}
                clock.num_prompt = usage.get("input_tokens", 0)
                clock.num_cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
                clock.num_predicted = usage.get("output_tokens", 0)
                event = event | {"timings": clock.to_json(time.perf_counter())}
            yield event
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()
