"""What a completion route is, for :func:`~llamax.server.serve.serve` and the response that
runs it: a :class:`CompletionRoute` (one object per route, built once per app) and the
:class:`Lease` a request holds on its model."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

import llamax

from .dialects import Dialect

__all__ = ["CompletionRoute", "JSONObjectRoute", "Lease"]

B = TypeVar("B")


class CompletionRoute(Protocol[B]):
    """How one completion route's dialect reads a request and starts its reply. ``B`` is
    what :meth:`parse` makes of a body."""

    @property
    def endpoint(self) -> str:
        """The ``endpoint`` label of the route's metrics (``chat``, ``messages`` ...)."""

    @property
    def dialect(self) -> Dialect:
        """The API's stream framing, error shape and usage (:mod:`.dialects`)."""

    @property
    def fields(self) -> frozenset[str]:
        """The request's field names, so an error's ``param`` names one of them."""

    @property
    def prompt_field(self) -> str:
        """The field holding the prompt (``messages``, ``prompt``, ``input``)."""

    @property
    def check_key(self) -> bool:
        """Whether :func:`serve` checks the API key (to answer a 401 in the route's own
        shape; else a router dependency does)."""

    @property
    def ping_seconds(self) -> float | None:
        """A stream quiet this long gets a ``ping`` event (Anthropic's); ``None``: never."""

    def parse(self, raw: bytes) -> B:
        """The body, checked (runs in a worker thread: it may fetch images)."""

    def model(self, body: B) -> object:
        """The ``model`` the body names (``None``: the default)."""

    def stream(self, body: B) -> bool:
        """Whether the reply is streamed."""

    def include_usage(self, body: B) -> bool:
        """Whether a stream shows the client its usage chunk (it is always counted)."""

    def start(self, body: B, ctx: llamax.Context, request: Request) -> Awaitable[Any]:
        """Submit the request on ``ctx``: the reply dict, or an async iterator of its
        events."""


class Lease(Protocol):
    """A request's hold on the context it runs on
    (:class:`~llamax.server.state.ContextLease`)."""

    async def context(self) -> llamax.Context:
        """The context, once its model has loaded."""

    def release(self) -> None:
        """Give the model and the admission slot back (idempotent)."""


class JSONObjectRoute:
    """What the routes whose parsed body is the JSON object itself (Anthropic's Messages,
    the Responses API) read of it the same way: its ``model``, whether it streams (a
    non-boolean ``stream`` is refused when the body is mapped), and no usage chunk to
    show (those streams carry their usage in their own events)."""

    def model(self, body: Mapping[str, Any]) -> object:
        """The ``model`` the body names."""
        return body.get("model")

    def stream(self, body: Mapping[str, Any]) -> bool:
        """Whether the reply streams."""
        return body.get("stream") is True

    def include_usage(self, body: Mapping[str, Any]) -> bool:
        """No OpenAI usage chunk: the dialect's own events carry the usage."""
        return False
