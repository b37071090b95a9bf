"""Fetching remote image URLs (``--allow-image-urls``) without lending the server's network
to its clients.

Design note. A URL a client sends makes the server open a connection, so each fetch:

- **resolves the host once** and checks every address it gets
  (:mod:`llamax.server.image_addresses`: public unicast only, unless in a network the
  operator lists with ``--image-url-allow-network``). Numeric spellings (``127.1``,
  ``0x7f000001``, ``2130706433``) are what the resolver makes of them, so they are
  checked as the address they are;
- **connects to the checked address** (no second lookup for DNS rebinding to win), sending
  the URL's own ``Host`` and, for ``https``, verifying the certificate for its host name;
- follows at most :data:`MAX_REDIRECTS` redirects by hand, to ``http(s)`` only, each hop
  checked the same way;
- uses no proxy unless the operator sets one (``--image-url-proxy``; environment
  variables are ignored); through a proxy, a ``CONNECT`` tunnel to the checked address;
- holds one of :attr:`~llamax.server.images.ImagePolicy.max_url_fetches` slots for all of
  a request's URLs, under one wall-clock deadline that bounds the name lookup, the
  connect and every ``recv`` (the socket's timeout is what is left of it), and a byte
  cap. With every slot taken a request is refused at once (503), never queued, so slow
  URLs hold at most that many of the server's worker threads, each until its deadline;
- fails with one message for a refused address, a host that cannot be reached, an HTTP
  error and a response that is not an image, so the answers say nothing about what is
  listening inside the network (only "too large" and "too slow", which need an allowed
  host to answer, are told apart).
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urljoin, urlsplit

import llamax

from .errors import APIError
from .image_addresses import is_address_allowed, parse_networks

__all__ = ["MAX_REDIRECTS", "FetchPolicy", "ImageFetcher", "check_proxy"]

MAX_REDIRECTS = 5
"""Most redirects one image URL may take."""

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_FAILED = (
    "could not fetch it (the address is not allowed, the host did not answer, or its "
    "answer was not an image)"
)
"""The one reason given for every failure that could tell an internal host from a
missing one."""


def check_proxy(url: str) -> None:
    """Check that ``url`` names an HTTP proxy: ``http://host:port``.

    Raises:
        ValueError: it does not.
    """
    try:
        parts = urlsplit(url)
        is_proxy = parts.scheme == "http" and bool(parts.hostname) and parts.port is not None
    except ValueError:
        is_proxy = False
    if not is_proxy or "@" in url:
        raise ValueError(f"url_proxy must be an http://host:port URL, got {url!r}")


class FetchPolicy(Protocol):
    """The settings a fetch follows (:class:`~llamax.server.images.ImagePolicy` has them)."""

    @property
    def max_url_bytes(self) -> int:
        """Largest body a fetched URL may have."""

    @property
    def url_seconds(self) -> float:
        """Longest the fetches of one request may take."""

    @property
    def max_url_fetches(self) -> int:
        """Most requests fetching at once."""

    @property
    def url_allow_networks(self) -> tuple[str, ...]:
        """Networks fetched from although not public."""

    @property
    def url_proxy(self) -> str | None:
        """The ``http://host:port`` proxy fetches go through, if any."""


class _Failed(Exception):
    """Why one fetch failed, in words fit for the client (:data:`_FAILED` or a limit)."""


@dataclass(frozen=True, slots=True)
class _Target:
    """One hop's URL, split."""

    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def of(cls, url: str) -> _Target:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise _Failed(_FAILED) from None
        if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
            raise _Failed(_FAILED)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, port or default, path)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most what is left of the deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        _set_timeout(self._sock, self._deadline)
        return self._sock.recv_into(buffer)


class _DeadlineSocket:
    """The socket http.client sees: its sends and reads bounded by the deadline; closing it
    is left to the fetch (it outlives the connection object's own ``close``)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        _set_timeout(self._sock, self._deadline)
        self._sock.sendall(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def close(self) -> None:
        pass


def _set_timeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _lookup(host: str, port: int, deadline: float) -> list[tuple[Any, ...]]:
    """``getaddrinfo``, waited for until the deadline at most. The system resolver takes
    no timeout of ours, so it runs in a daemon thread; one that hangs past the deadline is
    left to end by the resolver's own timeout.

    Raises:
        TimeoutError: no answer by the deadline.
        _Failed: the name does not resolve.
    """
    answer: list[list[tuple[Any, ...]] | None] = []
    done = threading.Event()

    def run() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError):
            answer.append(None)
        finally:
            done.set()

    threading.Thread(target=run, name="llamax-image-url-lookup", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0)):
        raise TimeoutError
    if answer[0] is None:
        raise _Failed(_FAILED)
    return answer[0]


class _Connection(http.client.HTTPConnection):
    """http.client's request and response parsing over a socket already connected."""

    def __init__(self, target: _Target, sock: _DeadlineSocket) -> None:
        super().__init__(target.host, target.port)
        self._given = sock

    def connect(self) -> None:
        self.sock = self._given


class ImageFetcher:
    """Fetches image URLs under an :class:`~llamax.server.images.ImagePolicy`, at most
    ``max_url_fetches`` requests' worth at once (one per app: it holds the slots).

    Args:
        policy: The server's image settings.
    """

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy
        self._allowed = parse_networks(policy.url_allow_networks)
        self._proxy = _Target.of(policy.url_proxy) if policy.url_proxy else None
        self._slots = threading.BoundedSemaphore(policy.max_url_fetches)
        self._tls: ssl.SSLContext | None = None

    def fetch_all(self, urls: Sequence[tuple[str, str]]) -> list[tuple[bytes, str]]:
        """Fetch each ``(url, where)`` (``where``: the request field holding it): their
        bytes and media types, in order. All of them share one slot and one deadline
        (``url_seconds``). Blocking: call it in a worker thread.

        Raises:
            APIError: 503 (with ``Retry-After``) when every slot is taken; 400 naming the
                field when a fetch fails, is too large or too slow, or is not an image.
        """
        if not urls:
            return []
        if not self._slots.acquire(blocking=False):
            raise APIError(
                503,
                f"the server is fetching {self.policy.max_url_fetches} requests' image URLs "
                "already (--image-url-fetches); retry later",
                code="image_fetch_busy",
                headers={"Retry-After": "1"},
            )
        try:
            deadline = time.monotonic() + self.policy.url_seconds
            return [self._fetch_one(url, where, deadline) for url, where in urls]
        finally:
            self._slots.release()

    def _fetch_one(self, url: str, where: str, deadline: float) -> tuple[bytes, str]:
        try:
            return self._follow(url, deadline)
        except _Failed as exc:
            problem = str(exc)
        except TimeoutError:
            problem = f"it took longer than {self.policy.url_seconds:g} s to fetch"
        except (OSError, ssl.SSLError, http.client.HTTPException, ValueError, UnicodeError):
            problem = _FAILED
        raise APIError(400, f"{where}: the image at {url}: {problem}", param=where,
                       code="image_url_failed")  # fmt: skip

    def _follow(self, url: str, deadline: float) -> tuple[bytes, str]:
        """The image at ``url``, redirects followed (each hop checked)."""
        for _ in range(MAX_REDIRECTS + 1):
            target = _Target.of(url)
            location = self._get(target, deadline)
            if isinstance(location, tuple):
                return location
            url = urljoin(url, location)
        raise _Failed(_FAILED)

    def _get(self, target: _Target, deadline: float) -> tuple[bytes, str] | str:
        """One hop: the image, or where a redirect points."""
        family, address = self._resolve(target, deadline)
        sock = self._connect(target, family, address, deadline)
        try:
            connection = _Connection(target, _DeadlineSocket(sock, deadline))
            connection.request("GET", target.path, headers={
                "Host": target.host_header,
                "User-Agent": f"llamax/{llamax.__version__}",
                "Accept": "image/*",
                "Accept-Encoding": "identity",
                "Connection": "close",
            })  # fmt: skip
            response = connection.getresponse()
            location = response.getheader("Location")
            if response.status in _REDIRECTS and location:
                return location
            if response.status != 200:
                raise _Failed(_FAILED)
            return self._read_image(response)
        finally:
            sock.close()

    def _read_image(self, response: http.client.HTTPResponse) -> tuple[bytes, str]:
        media_type = response.headers.get_content_type()
        if not media_type.startswith("image/"):
            raise _Failed(_FAILED)
        limit = self.policy.max_url_bytes
        too_large = _Failed(f"it is larger than {limit} bytes")
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        data = bytearray()
        while chunk := response.read(65536):
            data += chunk
            if len(data) > limit:
                raise too_large
        return bytes(data), media_type

    def _resolve(
        self, target: _Target, deadline: float
    ) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
        """The first address of ``target``'s host that may be fetched from (every one the
        resolver gives is checked; one lookup per hop, and the connection goes to it)."""
        for family, _, _, _, sockaddr in _lookup(target.host, target.port, deadline):
            address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
            if is_address_allowed(address, self._allowed):
                return family, sockaddr
        raise _Failed(_FAILED)

    def _connect(
        self, target: _Target, family: socket.AddressFamily, address: tuple[Any, ...],
        deadline: float,
    ) -> socket.socket:  # fmt: skip
        """A socket to the checked address (through the proxy's tunnel if one is set),
        TLS-wrapped for ``https`` with the URL's host name checked."""
        if self._proxy is None:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                _set_timeout(sock, deadline)
                sock.connect(address)
            except BaseException:
                sock.close()
                raise
        else:
            sock = self._tunnel(self._proxy, address, deadline)
        if target.scheme != "https":
            return sock
        try:
            _set_timeout(sock, deadline)
            if self._tls is None:  # loading the CA certificates takes a while: once
                self._tls = ssl.create_default_context()
            return self._tls.wrap_socket(sock, server_hostname=target.host)
        except BaseException:
            sock.close()
            raise

    def _tunnel(self, proxy: _Target, address: tuple[Any, ...], deadline: float) -> socket.socket:
        """A ``CONNECT`` tunnel through ``proxy`` to the checked ``address``."""
        host = f"[{address[0]}]" if ":" in str(address[0]) else str(address[0])
        sock = socket.create_connection(
            (proxy.host, proxy.port), timeout=max(deadline - time.monotonic(), 0.001)
        )
        try:
            sock.sendall(f"CONNECT {host}:{address[1]} HTTP/1.1\r\nHost: {host}:{address[1]}"
                         "\r\n\r\n".encode("ascii"))  # fmt: skip
            head = bytearray()
            reader = _DeadlineReader(sock, deadline)
            while not head.endswith(b"\r\n\r\n"):  # byte by byte: nothing past the head
                byte = bytearray(1)
                if not reader.readinto(byte) or len(head) > 16 << 10:
                    raise _Failed(_FAILED)
                head += byte
            if head.split(b" ", 2)[1:2] != [b"200"]:
                raise _Failed(_FAILED)
            return sock
        except BaseException:
            sock.close()
            raise
