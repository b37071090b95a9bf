"""One path for every completion route: admit -> lease -> submit -> encode -> frame.

A route that runs a completion is a :class:`~.route.CompletionRoute`: an object built once
per app
that says how its dialect parses a body (in a worker thread), which model the body names,
whether it streams, and how the call is submitted on the leased context and read back in
the dialect's shapes. :func:`serve` is the whole walk for any of them: the key (for routes
that answer in their own error shape), the body read within its bound, an admission slot,
the parse in a worker, the lease on the model it names, and the ASGI response that waits
for the model, runs the request while watching for the client to leave, and frames what
comes back (:class:`~llamax.server.responses.CompletionResponse`). Nothing is built per
request but the parsed body, the lease and the job.

Each routes module holds a route table, ``{path: route}``, and registers every row the
same way (:func:`add_completion_routes`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from .errors import APIError
from .responses import CompletionJob, CompletionResponse
from .route import CompletionRoute
from .state import ServerState, admit_leased

__all__ = ["add_completion_routes", "serve"]


async def serve(state: ServerState, route: CompletionRoute[Any], request: Request) -> Response:
    """A completion request, whole: the key (when the route checks it), the body read,
    an admission slot taken and the body parsed in a worker, the model it names leased,
    then the response that waits for the model and runs :meth:`CompletionRoute.start`
    while watching for the client to leave. The admission slot is held from the moment
    the body has arrived until the response ends, so ``max_queue`` bounds the parsing, the
    wait for a model's load and the rendering as well as the inference. An error before
    the response starts is in the route's dialect's shape."""
    try:
        body, lease = await admit_leased(
            state, request, route.endpoint, route.parse, route.model, check_key=route.check_key
        )
    except APIError as error:
        return route.dialect.error_response(error)
    return CompletionResponse(CompletionJob(route, body, lease, request, state.metrics))


def add_completion_routes(
    router: APIRouter, state: ServerState, table: Mapping[str, CompletionRoute[Any]]
) -> None:
    """Register each row of a route table, ``{path: route}``, as ``POST path`` served by
    :func:`serve`."""
    for path, route in table.items():
        router.add_api_route(path, _endpoint(state, route), methods=["POST"])


def _endpoint(
    state: ServerState, route: CompletionRoute[Any]
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await serve(state, route, request)

    endpoint.__name__ = f"{route.endpoint}_route"
    endpoint.route = route  # type: ignore[attr-defined]  # what serves it, for introspection
    return endpoint
