"""Each API's wire format, pure: how its stream's events are framed (server-sent events),
what ends a stream, how an error is shaped (a whole body, or the last event of a stream
that failed after it began), and what each sent event says for the meters (which choices'
text it carries, the final usage). The server's dialects (``llamax.server.dialects``) add
only the metering and the HTTP response.

- :data:`OPENAI`: ``data:`` chunks ending with ``data: [DONE]``; errors as
  ``{"error": {"message", "type", "param", "code"}}``, in a stream one such ``data:``.
- :data:`ANTHROPIC`: ``event: NAME`` / ``data:`` pairs, no ``[DONE]``; errors as
  ``{"type": "error", "error": {"type", "message"}}``, in a stream an ``error`` event.
- :data:`RESPONSES`: OpenAI's Responses events (``event: response.created`` ...), no
  ``[DONE]``; errors in OpenAI's shape, in a stream an ``error`` event with the next
  ``sequence_number``.
- :data:`LLAMA`: llama-server's native API (``/completion``): ``data:`` events with no
  ``[DONE]``; errors as ``{"error": {"code", "message", "type"}}`` (in a stream one such
  ``data:``).
- :data:`OPENAI_LLAMA`: OpenAI's chat and text completions as llama-server serves them on
  its un-prefixed routes (``/chat/completions``): OpenAI's stream, llama-server's errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ANTHROPIC",
    "LLAMA",
    "OPENAI",
    "OPENAI_LLAMA",
    "RESPONSES",
    "ErrorInfo",
    "Read",
    "Wire",
    "anthropic_error",
    "llama_error",
    "openai_error",
    "sse",
]


class ErrorInfo(Protocol):
    """What an error answer says (the server's ``APIError``)."""

    @property
    def status(self) -> int:
        """The HTTP status."""

    @property
    def message(self) -> str:
        """What went wrong, for a human."""

    @property
    def param(self) -> str | None:
        """The request field at fault, if one is."""

    @property
    def code(self) -> str | None:
        """A machine-readable code (``context_length_exceeded`` ...)."""

    @property
    def details(self) -> Mapping[str, object]:
        """Extra fields llama-server's error shape carries (``n_prompt_tokens``, ``n_ctx``)."""


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    403: "permission_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_LLAMA_TYPES = {**_OPENAI_TYPES, 403: "permission_error", 501: "not_supported_error"}


def openai_error(error: ErrorInfo) -> dict[str, dict[str, str | None]]:
    """``error`` in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``
    (what the ``openai`` client turns into its typed exceptions)."""
    status = error.status
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "error")
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.code}}  # fmt: skip


def anthropic_error(error: ErrorInfo) -> dict[str, object]:
    """``error`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``
    (what the ``anthropic`` client turns into its typed exceptions)."""
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def llama_error(error: ErrorInfo) -> dict[str, object]:
    """``error`` in llama-server's shape: ``{"error": {"code", "message", "type"}}``, with
    ``type: exceed_context_size_error`` (and ``n_prompt_tokens``, ``n_ctx``) for a prompt
    past the context."""
    if error.code == "context_length_exceeded":
        kind = "exceed_context_size_error"
    else:
        status = error.status
        kind = _LLAMA_TYPES.get(status, "server_error" if status >= 500 else "error")
    return {"error": {"code": error.status, "message": error.message, "type": kind,
                      **error.details}}  # fmt: skip


def sse(payload: object, event: str | None = None) -> bytes:
    """One server-sent event: ``data: JSON`` (after ``event: NAME`` when named)."""
    data = b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


@dataclass(frozen=True, slots=True)
class Read:
    """What one stream event says, for the meters."""

    ticks: tuple[int, ...] = ()
    """The choices whose text it carries (a token's time, per choice)."""
    usage: dict[str, Any] | None = None
    """The request's final usage, in OpenAI's counts (``prompt_tokens``,
    ``completion_tokens``, ``prompt_tokens_details.cached_tokens``)."""
    optional: bool = False
    """Sent only when the client asked for it (OpenAI's usage chunk)."""
    number: int | None = None
    """The event's ``sequence_number`` (the Responses API numbers its events)."""


_NOTHING = Read()


class Wire:
    """OpenAI's chat and text completions (the base every other wire format adjusts)."""

    name = "openai"
    done = b"data: [DONE]\n\n"
    """What ends a stream that succeeded."""

    def error_body(self, error: ErrorInfo) -> object:
        """``error`` as this API's JSON body."""
        return openai_error(error)

    def error_event(self, error: ErrorInfo, num_events: int) -> bytes:
        """The last event of a stream that failed after ``num_events`` numbered events."""
        return sse(self.error_body(error))

    def usage(self, usage: Any) -> dict[str, Any] | None:
        """This API's ``usage`` object as OpenAI's counts (what the meters record)."""
        return usage or None

    def result_usage(self, result: Any) -> dict[str, Any] | None:
        """The usage counts of a whole (not streamed) response body."""
        return self.usage(result.get("usage"))

    def read(self, event: dict[str, Any]) -> Read:
        """What a stream event says (:class:`Read`)."""
        if not event["choices"]:  # the usage chunk
            return Read(usage=self.usage(event.get("usage")), optional=True)
        ticks = tuple(
            choice["index"]
            for choice in event["choices"]
            if choice.get("text") or (choice.get("delta") or {}).get("content")
        )
        return Read(ticks) if ticks else _NOTHING

    def encode(self, event: dict[str, Any]) -> bytes:
        """A stream event as bytes on the wire."""
        return sse(event)


class _Anthropic(Wire):
    """Anthropic's Messages API."""

    name = "anthropic"
    done = b""

    def error_body(self, error: ErrorInfo) -> object:
        return anthropic_error(error)

    def error_event(self, error: ErrorInfo, num_events: int) -> bytes:
        return sse(anthropic_error(error), "error")

    def usage(self, usage: Any) -> dict[str, Any] | None:
        if not usage:
            return None
        cached = usage.get("cache_read_input_tokens", 0)
        return {  # Anthropic's input_tokens leave out the cached ones
            "prompt_tokens": usage.get("input_tokens", 0) + cached,
            "completion_tokens": usage.get("output_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def read(self, event: dict[str, Any]) -> Read:
        if event["type"] == "content_block_delta":
            return Read((0,))
        if event["type"] == "message_delta":  # the final usage, cache hits included
            return Read(usage=self.usage(event.get("usage")))
        return _NOTHING

    def encode(self, event: dict[str, Any]) -> bytes:
        return sse(event, event["type"])


_RESPONSE_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)


class _Responses(Wire):
    """OpenAI's Responses API."""

    name = "responses"
    done = b""

    def error_event(self, error: ErrorInfo, num_events: int) -> bytes:
        body = openai_error(error)["error"]
        event = {"type": "error", "code": body["code"], "message": body["message"],
                 "param": body["param"], "sequence_number": num_events}  # fmt: skip
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

    def read(self, event: dict[str, Any]) -> Read:
        number = event.get("sequence_number")
        if event["type"] in _RESPONSE_DELTAS:
            return Read((0,), number=number)
        if event["type"] in ("response.completed", "response.incomplete"):
            return Read(usage=self.usage(event["response"].get("usage")), number=number)
        return Read(number=number)

    def encode(self, event: dict[str, Any]) -> bytes:
        return sse(event, event["type"])


class _OpenAILlama(Wire):
    """OpenAI's completions on llama-server's un-prefixed routes: its error shape, and its
    chat stream's first chunk, ``{"role": "assistant", "content": null}``."""

    def error_body(self, error: ErrorInfo) -> object:
        return llama_error(error)

    def error_event(self, error: ErrorInfo, num_events: int) -> bytes:
        return sse(llama_error(error))

    def encode(self, event: dict[str, Any]) -> bytes:
        for choice in event["choices"]:
            delta = choice.get("delta")
            if delta is not None and "role" in delta and "content" not in delta:
                delta["content"] = None
        return sse(event)


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

    def read(self, event: dict[str, Any]) -> Read:
        ticks = (event.get("index", 0),) if event.get("content") else ()
        usage = self.result_usage(event) if event.get("stop") else None
        return Read(ticks, usage) if ticks or usage else _NOTHING

    def encode(self, event: dict[str, Any]) -> bytes:
        return sse(event)


OPENAI = Wire()
ANTHROPIC: Wire = _Anthropic()
RESPONSES: Wire = _Responses()
LLAMA: Wire = _Llama()
OPENAI_LLAMA: Wire = _OpenAILlama()
