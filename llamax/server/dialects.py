"""The API dialects the server speaks: how each frames a stream, shapes an error and counts
its usage. One :class:`Dialect` per API; a route names its dialect, and
:class:`~llamax.server.responses.CompletionResponse` asks it, so a new API is a new
dialect (and its routes), not a branch in the response code.

- :data:`OPENAI`: ``data:`` chunks ending with ``data: [DONE]``; errors as
  ``{"error": {...}}``, a stream that fails after it began ends with one such ``data:``.
- :data:`ANTHROPIC`: ``event: NAME`` / ``data:`` pairs, no ``[DONE]``; errors as
  ``{"type": "error", "error": {"type", "message"}}``, in a stream an ``error`` event.
- :data:`RESPONSES`: OpenAI's Responses events (``event: response.created`` ...), no
  ``[DONE]``; errors in OpenAI's shape, in a stream an ``error`` event with the next
  ``sequence_number``.
- :data:`LLAMA`: llama-server's native API (``/completion``): ``data:`` events with no
  ``[DONE]``; errors as ``{"error": {"code", "message", "type"}}`` (a stream that fails
  ends with one such ``data:``).
- :data:`OPENAI_LLAMA`: OpenAI's chat and text completions as llama-server serves them on
  its un-prefixed routes (``/chat/completions``): OpenAI's stream, llama-server's errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from .errors import APIError, anthropic_body, llama_body
from .metrics import ServerMetrics, TokenClock

__all__ = [
    "ANTHROPIC",
    "LLAMA",
    "OPENAI",
    "OPENAI_LLAMA",
    "RESPONSES",
    "Dialect",
    "StreamMeter",
    "sse",
]


def sse(payload: object, event: str | None = None) -> bytes:
    """One server-sent event: ``data: JSON`` (after ``event: NAME`` when named)."""
    data = b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


@dataclass(slots=True)
class StreamMeter:
    """What one stream records as it is sent: token timing, the final usage, and the
    number of events sent (the Responses API numbers them)."""

    metrics: ServerMetrics
    clock: TokenClock
    include_usage: bool = False
    """Whether the client asked to see OpenAI's usage chunk (it is always counted)."""
    num_events: int = field(default=0)


class Dialect:
    """OpenAI's chat and text completions (the base every other dialect adjusts)."""

    name = "openai"
    done = b"data: [DONE]\n\n"
    """What ends a stream that succeeded."""

    def error_body(self, error: APIError) -> object:
        """``error`` as this API's JSON body."""
        return error.body()

    def error_response(self, error: APIError) -> JSONResponse:
        """``error`` as this API's HTTP response."""
        return JSONResponse(self.error_body(error), status_code=error.status, headers=error.headers)

    def error_event(self, error: APIError, meter: StreamMeter) -> bytes:
        """The last event of a stream that failed after it began."""
        return sse(error.body())

    def result_usage(self, result: Any) -> dict[str, Any] | None:
        """The usage counts of a whole (not streamed) response body."""
        return self.usage(result.get("usage"))

    def usage(self, usage: Any) -> dict[str, Any] | None:
        """This API's ``usage`` object as the counts the metrics record (OpenAI's shape:
        ``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``)."""
        return usage or None

    def frame(self, chunk: dict[str, Any], meter: StreamMeter) -> bytes | None:
        """One streamed chunk as SSE bytes (None: not sent), timed and counted."""
        if not chunk["choices"]:  # the usage chunk
            meter.metrics.record_usage(self.usage(chunk.get("usage")))
            if not meter.include_usage:
                return None
        for choice in chunk["choices"]:
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                meter.clock.tick(choice["index"])
        return sse(chunk)


class _Anthropic(Dialect):
    """Anthropic's Messages API."""

    name = "anthropic"
    done = b""

    def error_body(self, error: APIError) -> object:
        return anthropic_body(error)

    def error_event(self, error: APIError, meter: StreamMeter) -> bytes:
        return sse(anthropic_body(error), "error")

    def usage(self, usage: Any) -> dict[str, Any] | None:
        if not usage:
            return None
        cached = usage.get("cache_read_input_tokens", 0)
        return {  # Anthropic's input_tokens leave out the cached ones
            "prompt_tokens": usage.get("input_tokens", 0) + cached,
            "completion_tokens": usage.get("output_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def frame(self, chunk: dict[str, Any], meter: StreamMeter) -> bytes | None:
        if chunk["type"] == "content_block_delta":
            meter.clock.tick(0)
        elif chunk["type"] == "message_delta":  # the final usage, cache hits included
            meter.metrics.record_usage(self.usage(chunk.get("usage")))
        return sse(chunk, chunk["type"])


_RESPONSE_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)


class _Responses(Dialect):
    """OpenAI's Responses API."""

    name = "responses"
    done = b""

    def error_event(self, error: APIError, meter: StreamMeter) -> bytes:
        body = error.body()["error"]
        event = {"type": "error", "code": body["code"], "message": body["message"],
                 "param": body["param"], "sequence_number": meter.num_events}  # fmt: skip
        return sse(event, "error")

    def usage(self, usage: Any) -> dict[str, Any] | None:
        if not usage:
            return None
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return {  # the Responses API's input_tokens count the cached ones
            "prompt_tokens": usage.get("input_tokens", 0),
            "completion_tokens": usage.get("output_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def frame(self, chunk: dict[str, Any], meter: StreamMeter) -> bytes | None:
        meter.num_events = chunk.get("sequence_number", meter.num_events) + 1
        if chunk["type"] in _RESPONSE_DELTAS:
            meter.clock.tick(0)
        elif chunk["type"] in ("response.completed", "response.incomplete"):
            meter.metrics.record_usage(self.usage(chunk["response"].get("usage")))
        return sse(chunk, chunk["type"])


OPENAI = Dialect()
ANTHROPIC: Dialect = _Anthropic()
RESPONSES: Dialect = _Responses()


class _OpenAILlama(Dialect):
    """OpenAI's completions on llama-server's un-prefixed routes: its error shape, and its
    chat stream's first chunk, ``{"role": "assistant", "content": null}``."""

    name = "openai"

    def error_body(self, error: APIError) -> object:
        return llama_body(error)

    def error_event(self, error: APIError, meter: StreamMeter) -> bytes:
        return sse(llama_body(error))

    def frame(self, chunk: dict[str, Any], meter: StreamMeter) -> bytes | None:
        for choice in chunk["choices"]:
            delta = choice.get("delta")
            if delta is not None and "role" in delta and "content" not in delta:
                delta["content"] = None
        return super().frame(chunk, meter)


class _Llama(_OpenAILlama):
    """llama-server's native ``/completion``: one ``data:`` event per step of each
    sequence, the last (``stop: true``) with its counts; no ``[DONE]``."""

    name = "llama"
    done = b""

    def result_usage(self, result: Any) -> dict[str, Any] | None:
        results = result if isinstance(result, list) else [result]
        return self.usage({
            "prompt_tokens": sum(r.get("tokens_evaluated", 0) for r in results),
            "completion_tokens": sum(r.get("tokens_predicted", 0) for r in results),
            "prompt_tokens_details": {"cached_tokens": sum(
                (r.get("timings") or {}).get("cache_n", 0) for r in results)},
        })  # fmt: skip

    def frame(self, chunk: dict[str, Any], meter: StreamMeter) -> bytes | None:
        if chunk.get("content"):
            meter.clock.tick(chunk.get("index", 0))
        if chunk.get("stop"):
            meter.metrics.record_usage(self.result_usage(chunk))
        return sse(chunk)


LLAMA: Dialect = _Llama()
OPENAI_LLAMA: Dialect = _OpenAILlama()
