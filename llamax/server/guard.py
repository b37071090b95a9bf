"""What a web page may make a local server do: the cross-site and DNS-rebinding guard.

CORS only decides whether a page may *read* an answer; it does not stop a browser from
*sending* a "simple" request (``text/plain``, a form, no ``Content-Type``) to any origin
without asking first, and llamax reads JSON whatever the content type. Nor does it stop DNS
rebinding: a page on ``evil.example`` whose name then resolves to ``127.0.0.1`` is
same-origin with itself and reads everything. :class:`SiteGuard` closes both, before any
route runs:

- **Host** (every request): the ``Host`` header must name this server: a localhost name
  (``localhost``, ``*.localhost``), any IP literal, this machine's host name, the address
  the ASGI server says it listens on (an in-process client's base URL), or a name in
  ``allowed_hosts`` (``*``: no check). Else 403 ``host_not_allowed``. IP literals are safe:
  a rebinding page's requests carry the attacker's *name*, never an address.
- **Cross-origin writes** (``POST``, ``PUT``, ``PATCH``, ``DELETE`` whose ``Origin`` is not
  the request's own host, or, without one, ``Sec-Fetch-Site: cross-site``/``same-site``),
  from an origin that ``cors_origins`` does not name:

  - on llama-server's CORS-open routes (:data:`~.cors.NATIVE_PATHS`, while native CORS
    is on), a simple content type is refused with 415: a page must send
    ``application/json``, which makes the browser ask first (the preflight that
    llama-server's clients, a web UI on another port, already pass);
  - on every other route (``/v1``, ``POST /slots/{id}``, ``/models/load`` ...), 403
    whatever the content type: CORS is off there, so no browser page may write.

  A request with no ``Origin`` (curl, the SDKs, llama.cpp's tests) is never cross-site:
  ``curl -d`` keeps working.

:func:`is_cross_origin` and :func:`shown_path` let routes keep absolute paths (``/props``'
``model_path``, adapters) from other origins' pages; the guard leaves the folders out of
every error body (JSON, status 400 or more) it passes to one (:func:`path_free`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .cors import NATIVE_PATHS
from .dialects import ANTHROPIC, LLAMA, OPENAI, Dialect
from .errors import APIError

__all__ = ["SiteGuard", "SitePolicy", "is_cross_origin", "path_free", "shown_path"]

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SIMPLE_TYPES = frozenset({"", "text/plain", "application/x-www-form-urlencoded",
                           "multipart/form-data"})  # fmt: skip
"""The content types a browser sends cross-origin without a preflight ("" for none)."""
_LLAMA_SHAPED = ("/completion", "/completions", "/chat/completions", "/infill",
                 "/apply-template", "/props", "/slots", "/models/")  # fmt: skip


@dataclass(frozen=True, slots=True)
class SitePolicy:
    """Which hosts and origins may use the server (what :class:`SiteGuard` enforces).

    Attributes:
        allowed_hosts: ``Host`` names allowed beside the defaults (lower case, no port);
            ``*.example.com`` allows every name under ``example.com``; ``*`` turns the
            Host check off.
        trusted_origins: Origins that may write cross-origin with any content type (the
            ``cors_origins`` of :func:`~.app.create_app`; ``*``: every origin).
        native_cors: Whether llama-server's routes answer every origin by CORS (then a
            cross-origin write there needs a non-simple content type, not a trusted
            origin).
    """

    allowed_hosts: frozenset[str] = frozenset()
    trusted_origins: frozenset[str] = frozenset()
    native_cors: bool = True

    def __post_init__(self) -> None:
        for host in self.allowed_hosts:
            name = host.removeprefix("*.")
            if _is_ip(host) or host == "*":
                continue
            if not name or host != host.strip().lower() or any(c in name for c in "/:@*[] "):
                raise ValueError(f"allowed_hosts: {host!r} is not a host name (lower case, "
                                 "no port; '*' or '*.example.com' allowed)")  # fmt: skip

    @classmethod
    def of(
        cls,
        allowed_hosts: Iterable[str] | None,
        cors_origins: Sequence[str] | None,
        native_cors: bool,
    ) -> SitePolicy:
        """The policy of :func:`~.app.create_app`'s options (names normalised)."""
        hosts = frozenset(_host_name(h) if h.startswith("[") else h.strip().lower().rstrip(".")
                          for h in allowed_hosts or ())  # fmt: skip
        origins = frozenset(o.strip().lower().rstrip("/") for o in cors_origins or ())
        return cls(hosts, origins, native_cors and not origins)

    def allows_host(self, name: str, server_name: str | None) -> bool:
        """Whether ``Host`` ``name`` (lower case, no port) names this server."""
        if "*" in self.allowed_hosts or name in self.allowed_hosts or name == server_name:
            return True
        if name == "localhost" or name.endswith(".localhost") or name in _machine_names():
            return True
        if any(h.startswith("*.") and name.endswith(h[1:]) for h in self.allowed_hosts):
            return True
        return _is_ip(name)

    def trusts(self, origin: str | None) -> bool:
        """Whether cross-origin ``origin`` (``None``: not said) may write like a local
        client."""
        return "*" in self.trusted_origins or (
            origin is not None and origin.lower().rstrip("/") in self.trusted_origins
        )


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _machine_names() -> frozenset[str]:
    """This machine's host name, and its first label (``box`` of ``box.lan``)."""
    name = socket.gethostname().lower().rstrip(".")
    return frozenset({name, name.split(".")[0]}) - {""}


def _host_name(host: str) -> str:
    """The name of a ``Host`` header: lower case, no port, no brackets, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":")[0]
    return host.rstrip(".")


def is_cross_origin(headers: Headers) -> bool:
    """Whether a browser sent this request from another origin's page: an ``Origin`` that
    is not the request's own ``Host``, or no ``Origin`` and ``Sec-Fetch-Site`` saying so.
    Clients that are not browsers send neither."""
    origin = headers.get("origin")
    if origin is None:
        return headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site")
    _, sep, authority = origin.partition("://")
    return not sep or authority.lower().rstrip("/") != headers.get("host", "").lower()


_FOLDERS = re.compile(r"""(?<![^\s"'(=,\[])(?:[A-Za-z]:)?[/\\](?:[^\s"'/\\]+[/\\])+""")
"""The folders of an absolute path (POSIX or Windows) in text: ``/srv/models/`` of
``/srv/models/a.gguf``. It starts the text or follows a space, quote, ``(``, ``=``, ``,``
or ``[``, so a URL's ``//host/path/`` is none."""


def path_free(text: str) -> str:
    """``text`` with the folders of every absolute path in it left out (file names stay)."""
    return _FOLDERS.sub("", text)


def shown_path(headers: Headers, path: str | os.PathLike[str]) -> str:
    """``path`` as a response shows it: the file name alone to another origin's page (it
    learns nothing of the server's folders), the whole path to every other client."""
    return os.path.basename(path) if is_cross_origin(headers) else os.fspath(path)


class SiteGuard:
    """ASGI middleware: refuse a request whose ``Host`` is not this server, and a write a
    page on another origin could send without CORS' say (see the module docstring)."""

    def __init__(self, app: ASGIApp, policy: SitePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = self.refusal(scope, headers)
        if error is None:
            cross = is_cross_origin(headers)
            await self.app(scope, receive, _errors_path_free(send) if cross else send)
            return
        path = scope.get("path", "")
        body = json.dumps(_dialect_of(path).error_body(error)).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope: Scope, headers: Headers) -> APIError | None:
        """Why the request (``scope``, with its ``headers``) is refused, or ``None`` if it
        may go on."""
        host = headers.get("host")
        server = scope.get("server")
        server_name = _host_name(str(server[0])) if server else None
        if host is not None and not self.policy.allows_host(_host_name(host), server_name):
            return APIError(
                403,
                f"Host {host!r} is not a name of this server, so the request is refused (a "
                "DNS-rebinding guard); allow it with --allowed-hosts (create_app's "
                "allowed_hosts)",
                code="host_not_allowed",
            )
        if scope.get("method") not in _WRITES or not is_cross_origin(headers):
            return None
        origin = headers.get("origin")
        if self.policy.trusts(origin):
            return None
        path = scope.get("path", "").rstrip("/") or "/"
        if not (self.policy.native_cors and path in NATIVE_PATHS):
            return APIError(
                403,
                f"a cross-origin {scope['method']} from {origin or 'another site'} is refused "
                "on this route; allow the origin with --cors-origin (create_app's "
                "cors_origins)",
                code="cross_origin_refused",
            )
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media in _SIMPLE_TYPES:
            return APIError(
                415,
                f"a cross-origin request must send Content-Type: application/json, not "
                f"{media or 'none'} (a page may send that without CORS' preflight)",
                code="unsupported_media_type",
            )
        return None


def _errors_path_free(send: Send) -> Send:
    """``send`` with :func:`path_free` applied to the strings of a JSON error body (status
    400 or more): what another origin's page reads of an error names no server folder."""
    held: list[Message] = []

    async def scrubbed(message: Message) -> None:
        if message["type"] == "http.response.start":
            types = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
            if message["status"] >= 400 and types and types[0].startswith(b"application/json"):
                held.append(message)
                return
        elif held and message["type"] == "http.response.body":
            held.append(message)
            if message.get("more_body", False):
                return
            start, *parts = held
            body = _path_free_json(b"".join(p.get("body", b"") for p in parts))
            start["headers"] = [(k, v) for k, v in start["headers"]
                                if k.lower() != b"content-length"]  # fmt: skip
            start["headers"].append((b"content-length", str(len(body)).encode()))
            held.clear()
            await send(start)
            message = {"type": "http.response.body", "body": body}
        await send(message)

    return scrubbed


def _path_free_json(body: bytes) -> bytes:
    """A JSON document with :func:`path_free` applied to each string in it."""

    def scrub(value: object) -> object:
        if isinstance(value, str):
            return path_free(value)
        if isinstance(value, list):
            return [scrub(v) for v in value]
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items()}
        return value

    try:
        return json.dumps(scrub(json.loads(body))).encode()
    except ValueError:  # not JSON after all: its text, scrubbed
        return path_free(body.decode("utf-8", "replace")).encode()


def _dialect_of(path: str) -> Dialect:
    """The error shape of the route at ``path``."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith(_LLAMA_SHAPED):
        return LLAMA
    return OPENAI
