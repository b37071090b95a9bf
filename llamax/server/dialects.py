"""The API dialects the server speaks: each one's wire format
(:mod:`llamax.dialects.wire`: framing, error shapes, what an event says) plus what the
server does with it: the HTTP error response and the meters (token timing, usage). One
:class:`Dialect` per API; a route names its dialect, and
:class:`~llamax.server.responses.CompletionResponse` asks it, so a new API is a new wire
format and its routes, not a branch in the response code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from llamax.dialects import wire
from llamax.dialects.wire import Wire, sse

from .errors import APIError
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


@dataclass(slots=True)
class StreamMeter:
    """What one stream records as it is sent: token timing, the final usage, and the
    number of events sent (the Responses API numbers them)."""

    metrics: ServerMetrics
    clock: TokenClock
    include_usage: bool = False
    """Whether the client asked to see OpenAI's usage chunk (it is always counted)."""
    num_events: int = field(default=0)


@dataclass(frozen=True, slots=True)
class Dialect:
    """One API as the server speaks it: its :class:`~llamax.dialects.wire.Wire`, metered."""

    wire: Wire

    @property
    def name(self) -> str:
        """The API's name (``openai``, ``anthropic``, ``responses``, ``llama``)."""
        return self.wire.name

    @property
    def done(self) -> bytes:
        """What ends a stream that succeeded."""
        return self.wire.done

    def error_body(self, error: APIError) -> object:
        """``error`` as this API's JSON body."""
        return self.wire.error_body(error)

    def error_response(self, error: APIError) -> JSONResponse:
        """``error`` as this API's HTTP response."""
        return JSONResponse(self.error_body(error), status_code=error.status, headers=error.headers)

    def error_event(self, error: APIError, meter: StreamMeter) -> bytes:
        """The last event of a stream that failed after it began."""
        return self.wire.error_event(error, meter.num_events)

    def result_usage(self, result: Any) -> dict[str, Any] | None:
        """The usage counts of a whole (not streamed) response body."""
        return self.wire.result_usage(result)

    def frame(self, event: dict[str, Any], meter: StreamMeter) -> bytes | None:
        """One streamed event as bytes (None: not sent), timed and counted."""
        read = self.wire.read(event)
        if read.number is not None:
            meter.num_events = read.number + 1
        if read.usage is not None:
            meter.metrics.record_usage(read.usage)
        if read.optional and not meter.include_usage:
            return None
        for index in read.ticks:
            meter.clock.tick(index)
        return self.wire.encode(event)


OPENAI = Dialect(wire.OPENAI)
ANTHROPIC = Dialect(wire.ANTHROPIC)
RESPONSES = Dialect(wire.RESPONSES)
LLAMA = Dialect(wire.LLAMA)
OPENAI_LLAMA = Dialect(wire.OPENAI_LLAMA)
