"""The two Ray Serve deployments: llamax replicas and the ingress that routes to them.

```
HTTP ─▶ Serve proxy ─▶ LlamaxIngress ──handle (PrefixAffinityRouter)──▶ LlamaxReplica x N
                       reads the body,                                  one llamax.Context +
                       computes the routing key                         llamax.server.create_app
```

The ingress must read the body to know the prompt, which Serve's HTTP proxy never does
before picking a replica; so the custom router sits on the ingress → replica handle.
"""

import json
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import llamax
from llamax.server import ServerConfig, create_app

from .asgi import ForwardedRequest, ResponseStart, run_asgi
from .keys import routing_key

__all__ = ["LlamaxIngress", "LlamaxReplica", "replica_summary"]

_METHODS = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]
_DROPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


def replica_summary(stats: llamax.ContextStats) -> dict[str, Any]:
    """A replica's routing stats: queue, KV and prefix-cache numbers from ``ctx.stats()``.

    Args:
        stats: The replica context's stats.

    Returns:
        Every ``ContextStats`` value under its flat name (:meth:`~llamax.ContextStats.flat`),
        plus ``cached_token_fraction`` (prompt tokens served
        from the prefix cache / all prompt tokens) and ``kv_used_fraction``.
    """
    summary = stats.flat()
    tokens = stats.sequences
    prompt = tokens.num_cached_tokens + tokens.num_prefill_tokens
    summary["cached_token_fraction"] = tokens.num_cached_tokens / prompt if prompt else 0.0
    summary["kv_used_fraction"] = (
        stats.kv.cells_used / stats.kv.cells_total if stats.kv.cells_total else 0.0
    )
    return summary


class LlamaxReplica:
    """One Serve replica: a ``llamax.Context`` served by ``llamax.server.create_app``.

    Args:
        model_path: The GGUF to load (``None``: ``$LLAMAX_MODEL`` or the default model,
            resolved on the replica's node).
        context_options: Keyword options of ``llamax.Context``.
        server_config: The server's settings.
    """

    def __init__(
        self,
        model_path: str | None,
        context_options: Mapping[str, Any],
        server_config: ServerConfig,
    ) -> None:
        self.ctx = llamax.Context(model_path, **context_options)
        self.app = create_app(self.ctx, server_config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(
        self, request: ForwardedRequest
    ) -> AsyncIterator[ResponseStart | bytes | dict[str, Any]]:
        """Serve one forwarded request; yield its start, its body chunks, then our stats.

        Args:
            request: The request from the ingress.

        Yields:
            A :class:`ResponseStart`, the body chunks, then :func:`replica_summary`.
        """
        async for item in run_asgi(self.app, request):
            if isinstance(item, bytes):
                yield item
            else:
                yield ResponseStart(item[0], item[1], self.replica_id, os.getpid())
        yield replica_summary(self.ctx.stats())

    def record_routing_stats(self) -> dict[str, Any]:
        """What Serve hands the router about this replica (polled periodically)."""
        return replica_summary(self.ctx.stats())

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.close()


def _respond(
    start: ResponseStart,
    first: Any,
    stream: DeploymentResponseGenerator[Any],
    replica_stats: dict[str, dict[str, Any]],
) -> StreamingResponse:
    """Stream a replica's answer to the client; record the stats it sends last.

    Every helper of the ingress is defined above it: ``@serve.ingress`` captures the
    class while the module is still executing, so later names would not resolve.
    """
    headers = [(k, v) for k, v in start.headers if k.lower() not in _DROPPED_HEADERS]
    headers += [(b"x-llamax-replica", start.replica.encode()),
                (b"x-llamax-replica-pid", str(start.pid).encode())]  # fmt: skip
    is_sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                 for k, v in headers)  # fmt: skip

    async def body() -> AsyncIterator[bytes]:
        item = first
        try:
            while True:
                if isinstance(item, bytes):
                    yield item
                elif isinstance(item, dict):
                    replica_stats[start.replica] = item
                item = await stream.__anext__()
        except StopAsyncIteration:
            return
        except RayError as exc:
            if is_sse:
                yield _sse_error(start.replica, exc)
        finally:
            _cancel(stream)

    response = StreamingResponse(body(), status_code=start.status)
    response.raw_headers = headers
    return response


def _cancel(stream: DeploymentResponseGenerator[Any]) -> None:
    stream.cancel()  # type: ignore[no-untyped-call]


def _sse_error(replica: str, exc: BaseException) -> bytes:
    message = (
        f"llamax replica {replica} failed mid-stream ({type(exc).__name__}); "
        "the output above is incomplete, retry the request"
    )
    error = {"message": message, "type": "server_error", "code": "replica_failed", "param": None}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


ingress_app = FastAPI(title="llamax on Ray Serve", docs_url=None, redoc_url=None)


@serve.ingress(ingress_app)
class LlamaxIngress:
    """The HTTP entry point: computes each request's routing key and forwards it.

    A request is retried on another replica (up to ``max_attempts`` in all) when its
    replica fails before sending any of the body; once bytes have reached the client, a
    failure ends the stream with an OpenAI-shaped error event (SSE) instead.

    Args:
        replicas: A handle to the replica deployment (its router picks the replica).
        max_attempts: Replicas tried per request before answering 503.
    """

    def __init__(self, replicas: DeploymentHandle[Any], max_attempts: int = 2) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.replicas = replicas
        self.max_attempts = max_attempts
        self.replica_stats: dict[str, dict[str, Any]] = {}

    @ingress_app.get("/llamax/replicas")
    async def replicas_view(self) -> dict[str, Any]:
        """Per-replica stats, as each replica reported them with its latest answer."""
        rows = [{"replica": rid, **stats} for rid, stats in sorted(self.replica_stats.items())]
        return {"object": "list", "data": rows}

    @ingress_app.api_route("/{path:path}", methods=_METHODS)
    async def proxy(self, request: Request) -> Response:
        """Forward any other route to a replica, streaming its answer back."""
        body = await request.body()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=tuple(request.headers.raw),
            body=body,
            routing_key=routing_key(request.url.path, body, headers),
        )
        failures: list[str] = []
        for _ in range(self.max_attempts):
            stream = cast(
                DeploymentResponseGenerator[Any],
                self.replicas.forward.options(stream=True).remote(forwarded),
            )
            try:
                start = await stream.__anext__()
                first = await stream.__anext__()
            except (RayError, StopAsyncIteration) as exc:
                _cancel(stream)
                failures.append(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")
                continue
            assert isinstance(start, ResponseStart)
            return _respond(start, first, stream, self.replica_stats)
        return JSONResponse(
            {"error": {"message": "no llamax replica could serve the request: "
                       + "; ".join(failures), "type": "server_error",
                       "code": "replica_unavailable", "param": None}},
            status_code=503, headers={"Retry-After": "1"},
        )  # fmt: skip
