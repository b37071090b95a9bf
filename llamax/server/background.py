"""Run an app with uvicorn on a background thread (tests, examples, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any, Literal

import uvicorn

from .shutdown import GracefulServer

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Serve an ASGI app on ``host:port`` from a daemon thread.

    >>> with BackgroundServer(create_app(ctx)) as server:      # doctest: +SKIP
    ...     openai.OpenAI(base_url=server.url + "/v1", api_key="-")

    Args:
        app: The ASGI application.
        host: Interface to bind.
        port: TCP port; 0 picks a free one (see :attr:`port`).
        shutdown_timeout: Seconds requests in flight may take to finish on :meth:`stop`.
        http: uvicorn's HTTP implementation, as ``llamax serve --http``: ``h11`` sends
            header names as the app spells them, ``httptools`` in lower case.
    """

    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: int = 5,
        http: Literal["h11", "httptools"] = "h11",
    ) -> None:  # fmt: skip
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=shutdown_timeout,
            http=http,
        )  # fmt: skip
        self._server = GracefulServer(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True,
            name=f"llamax-server-{self.port}",
        )  # fmt: skip

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; return once the server accepts connections.

        Raises:
            TimeoutError: it did not start within ``timeout`` seconds.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TimeoutError(f"the server on {self.url} did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 30.0, *, force: bool = False) -> None:
        """Stop accepting, let requests in flight finish within the shutdown timeout, cut
        the rest (a stream gets its API's error event, then its end), and join.

        Args:
            timeout: Seconds to wait for the server thread.
            force: Cut the requests in flight at once, as a second Ctrl-C does.
        """
        self._server.should_exit = True
        self._server.force_exit = self._server.force_exit or force
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
