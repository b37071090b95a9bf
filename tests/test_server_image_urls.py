"""Image URLs with ``--allow-image-urls`` (issue 54, findings 2 and 3), on the fake backend
against local HTTP servers: loopback in every spelling, and a redirect to a refused host,
never reach a server; every failure says the same thing whether a host is internal or
down; proxy environment variables are ignored and a configured proxy is tunnelled to the
checked address; a server that drips a byte at a time is cut off at the deadline; more
slow fetches than the fetch slots never keep a plain chat request from being served; and
the Responses store lists the URL, not the fetched bytes.

Every local server is on loopback, which the fetcher refuses, so the tests that need an
answer allow ``127.0.0.1/32`` (``url_allow_networks``); the default refuses it."""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import select
import socket
import socketserver
import ssl
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from vision_files import pixels, png

import llamax
from llamax.server import ImagePolicy, create_app
from llamax.server.image_addresses import is_address_allowed
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
)
CHAT = "/v1/chat/completions"
WHERE = "messages[0].content[1].image_url.url"
LOOPBACK = ("127.0.0.1/32",)
GENERIC = (
    "could not fetch it (the address is not allowed, the host did not answer, or its "
    "answer was not an image)"
)
WAIT = 30.0
"""The generous bound on anything the tests wait for (it is never a timing claim)."""


# ---------------------------------------------------------------------- local servers
class _Site(http.server.ThreadingHTTPServer):
    """A local HTTP server that counts what it got: ``/cat.png`` an image, ``/text``
    text/plain, ``/redirect?to=URL`` a 302, ``/loop`` a 302 to itself, ``/drip.png``
    headers then a byte every 0.2 s (until ``stop``), ``/hold.png`` an image once
    ``release`` is set, else 404."""

    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        super().__init__((host, 0), _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.got: list[str] = []
        self.hosts: list[str | None] = []
        self.stop, self.release, self.left = threading.Event(), threading.Event(), threading.Event()
        self.url = f"http://{host}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.release.set()
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Site

    def do_GET(self) -> None:
        site, path = self.server, urlsplit(self.path)
        site.got.append(self.path)
        site.hosts.append(self.headers.get("Host"))
        if path.path in ("/redirect", "/loop"):
            self.send_response(302)
            to = "/loop" if path.path == "/loop" else parse_qs(path.query)["to"][0]
            self.send_header("Location", to)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path.path in ("/cat.png", "/text", "/hold.png"):
            if path.path == "/hold.png":
                site.release.wait(4 * WAIT)
            kind, body = ("text/plain", b"secret") if path.path == "/text" else ("image/png", CAT)
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path.path == "/drip.png":
            self._drip(site)
        else:
            self.send_error(404)

    def _drip(self, site: _Site) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        try:
            while not site.stop.wait(0.2):
                self.wfile.write(b"\0")
                self.wfile.flush()
        except OSError:
            site.left.set()  # the fetch hung up

    def log_message(self, *args: Any) -> None:
        pass


class _TunnelProxy(socketserver.ThreadingTCPServer):
    """A ``CONNECT``-only proxy that records each request line and pipes the tunnel."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _TunnelHandler)
        self.got: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _TunnelHandler(socketserver.StreamRequestHandler):
    server: _TunnelProxy

    def handle(self) -> None:
        line = self.rfile.readline().decode("latin-1").strip()
        self.server.got.append(line)
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        method, target, _ = line.split(" ", 2)
        if method != "CONNECT":
            self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return
        host, _, port = target.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=WAIT) as upstream:
            self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            self.wfile.flush()
            _pipe(self.connection, upstream)


def _pipe(a: socket.socket, b: socket.socket) -> None:
    while True:
        ready, _, _ = select.select([a, b], [], [], WAIT)
        if not ready:
            return
        for sock in ready:
            data = sock.recv(65536)
            if not data:
                return
            (b if sock is a else a).sendall(data)


CAT = png(pixels(7, 4, 5))


@pytest.fixture
def site() -> Iterator[_Site]:
    server = _Site()
    yield server
    server.close()


@pytest.fixture
def vision() -> Iterator[llamax.Context]:
    backend = FakeBackend(
        n_ctx=1024,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens={"<|im_start|>": 300, "<|im_end|>": 301},
        image_tokens=8,
    )
    ctx = llamax.Context(backend=backend)
    yield ctx
    assert_idle(ctx)
    ctx.close()


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def chat_body(*urls: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


def failure(app: Any, url: str) -> str:
    """The 400 message of a chat request with ``url``, with the URL itself taken out."""
    reply = call(app, "POST", CHAT, json=chat_body(url))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "image_url_failed" and error["param"] == WHERE
    return str(error["message"]).replace(url, "URL")


def policy(**fields: Any) -> ImagePolicy:
    return ImagePolicy(allow_urls=True, **fields)


# ---------------------------------------------------------------------- the addresses
@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True), ("1.1.1.1", True), ("2606:4700:4700::1111", True),
        ("127.0.0.1", False), ("127.255.0.9", False), ("10.1.2.3", False),
        ("172.16.0.1", False), ("172.31.255.255", False), ("192.168.1.1", False),
        ("100.64.0.1", False), ("100.127.255.254", False), ("169.254.169.254", False),
        ("0.0.0.0", False), ("0.1.2.3", False), ("224.0.0.1", False), ("239.1.1.1", False),
        ("240.0.0.1", False), ("255.255.255.255", False), ("198.18.0.1", False),
        ("192.0.0.8", False), ("192.0.2.1", False),
        ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False),
        ("fd12:3456::1", False), ("fec0::1", False), ("ff02::1", False),
        ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("::ffff:8.8.8.8", True),
        ("::127.0.0.1", False), ("64:ff9b::7f00:1", False), ("64:ff9b::a9fe:a9fe", False),
        ("2002:7f00:1::1", False), ("2002:a00:1::1", False), ("2001:db8::1", False),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),
    ],
)  # fmt: skip
def test_only_public_addresses_are_allowed(address: str, allowed: bool) -> None:
    assert is_address_allowed(ipaddress.ip_address(address)) is allowed


def test_listed_networks_are_allowed() -> None:
    networks = [ipaddress.ip_network("10.20.0.0/16"), ipaddress.ip_network("127.0.0.1/32")]
    assert is_address_allowed(ipaddress.ip_address("10.20.3.4"), networks)
    assert is_address_allowed(ipaddress.ip_address("::ffff:127.0.0.1"), networks)
    assert not is_address_allowed(ipaddress.ip_address("10.21.0.1"), networks)
    assert not is_address_allowed(ipaddress.ip_address("127.0.0.2"), networks)
    with pytest.raises(ValueError):
        ImagePolicy(url_allow_networks=("10.0.0.0/33",))
    for proxy in (
        "socks5://h:1080",
        "http://proxy",
        "http://h:port",
        "http://:3128",
        "http://[::1",
    ):
        with pytest.raises(ValueError, match="url_proxy"):
            ImagePolicy(url_proxy=proxy)
    assert ImagePolicy(url_allow_networks=["10.0.0.0/8"]).url_allow_networks == ("10.0.0.0/8",)


# ---------------------------------------------------------------------- finding 2
def test_loopback_in_any_spelling_is_refused_without_a_connection(
    vision: llamax.Context, site: _Site
) -> None:
    app = create_app(vision, images=policy())
    port = site.server_address[1]
    hosts = ["127.0.0.1", "127.1", "0x7f000001", "2130706433", "017700000001", "localhost",
             "[::ffff:127.0.0.1]", "[::1]", "0.0.0.0", "127.0.0.1.", "LOCALHOST"]  # fmt: skip
    for host in hosts:
        for path in ("/cat.png", f"/redirect?to={site.url}/cat.png"):
            message = failure(app, f"http://{host}:{port}{path}")
            assert message == f"{WHERE}: the image at URL: {GENERIC}", host
    assert site.got == []  # no spelling reached the server


def test_a_redirect_to_a_refused_host_is_refused(vision: llamax.Context, site: _Site) -> None:
    inside = _Site("127.0.0.2")  # loopback too, but not in the allowed network
    try:
        app = create_app(vision, images=policy(url_allow_networks=LOOPBACK))
        assert call(app, "POST", CHAT, json=chat_body(site.url + "/redirect?to=/cat.png"))\
            .status_code == 200  # fmt: skip
        inside_port = inside.server_address[1]
        for to in (inside.url + "/cat.png", f"http://2130706434:{inside_port}/cat.png",
                   "file:///etc/hostname", "/loop"):  # fmt: skip
            url = f"{site.url}/redirect?to={to}"
            assert failure(app, url) == f"{WHERE}: the image at URL: {GENERIC}", to
        assert inside.got == []
        assert site.got.count("/loop") == 5  # at most 5 redirects: 1 + 5 hops
    finally:
        inside.close()


def test_every_failure_says_the_same_whatever_is_listening(
    vision: llamax.Context, site: _Site
) -> None:
    app = create_app(vision, images=policy(url_allow_networks=LOOPBACK))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    try:
        messages = {
            failure(app, url)
            for url in (
                f"http://127.0.0.1:{closed.getsockname()[1]}/cat.png",  # nothing there
                site.url + "/missing.png",  # 404
                site.url + "/text",  # text/plain
                f"http://127.0.0.2:{site.server_address[1]}/cat.png",  # a refused address
                "http://no-such-host.invalid/cat.png",  # no such name
            )
        }
    finally:
        closed.close()
    assert messages == {f"{WHERE}: the image at URL: {GENERIC}"}


def test_proxy_variables_are_ignored(
    vision: llamax.Context, site: _Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoy = _Site()
    try:
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
            monkeypatch.setenv(name, decoy.url)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        app = create_app(vision, images=policy(url_allow_networks=LOOPBACK))
        reply = call(app, "POST", CHAT, json=chat_body(site.url + "/cat.png"))
        assert reply.status_code == 200, reply.text
        assert decoy.got == [] and site.got == ["/cat.png"]
    finally:
        decoy.close()


def test_a_configured_proxy_tunnels_to_the_checked_address(
    vision: llamax.Context, site: _Site
) -> None:
    proxy = _TunnelProxy()
    try:
        app = create_app(vision, images=policy(url_allow_networks=LOOPBACK, url_proxy=proxy.url))
        port = site.server_address[1]
        reply = call(app, "POST", CHAT, json=chat_body(f"http://localhost:{port}/cat.png"))
        assert reply.status_code == 200, reply.text
        assert proxy.got == [f"CONNECT 127.0.0.1:{port} HTTP/1.1"] and site.got == ["/cat.png"]
        assert failure(app, f"http://127.0.0.2:{port}/cat.png").endswith(GENERIC)
        assert len(proxy.got) == 1  # refused before the proxy was asked
    finally:
        proxy.close()


def _tls_for_localhost(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """A CA's certificate file, and a server context with a certificate it signed for
    ``localhost`` (a DNS name only: no IP address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def cert(name: str, key: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        now = datetime.now(timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = x509.SubjectAlternativeName([x509.DNSName("localhost")])
            builder = builder.add_extension(names, critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("test CA", ca_key, "test CA", ca_key, True)
    leaf = cert("localhost", key, "test CA", ca_key, False)
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca_cert.public_bytes(pem))
    (folder / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (folder / "key.pem").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "leaf.pem", folder / "key.pem")
    return folder / "ca.pem", server


def test_https_verifies_the_certificate_for_the_urls_host(
    vision: llamax.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca_file, server_tls = _tls_for_localhost(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))  # the fetcher's default context trusts it
    secure = _Site(tls=server_tls)
    try:
        app = create_app(vision, images=policy(url_allow_networks=LOOPBACK))
        port = secure.server_address[1]
        url = f"https://localhost:{port}/cat.png"  # connects to 127.0.0.1, checks "localhost"
        reply = call(app, "POST", CHAT, json=chat_body(url))
        assert reply.status_code == 200, reply.text
        assert secure.got == ["/cat.png"] and secure.hosts == [f"localhost:{port}"]
        assert failure(app, f"https://127.0.0.1:{port}/cat.png").endswith(GENERIC)  # not its name
    finally:
        secure.close()


def test_responses_store_keeps_the_url_not_the_bytes(vision: llamax.Context, site: _Site) -> None:
    app = create_app(vision, images=policy(url_allow_networks=LOOPBACK))
    url = site.url + "/cat.png"
    content = [{"type": "input_text", "text": "What is this?"},
               {"type": "input_image", "image_url": url}]  # fmt: skip
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 2}
    first = call(app, "POST", "/v1/responses", json=body)
    assert first.status_code == 200, first.text
    items = call(app, "GET", f"/v1/responses/{first.json()['id']}/input_items")
    assert items.status_code == 200 and "base64" not in items.text
    parts = [part for item in items.json()["data"] for part in item.get("content", [])]
    assert {"type": "input_image", "image_url": url} in parts
    follow = {"input": "And now?", "previous_response_id": first.json()["id"],
              "max_output_tokens": 2}  # fmt: skip
    second = call(app, "POST", "/v1/responses", json=follow)
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
    assert site.got == ["/cat.png"]  # the follow-up used the stored image, no second fetch


def test_verbose_shows_the_media_marker_not_the_bytes(site: _Site) -> None:
    backend = FakeBackend(
        n_ctx=1024,
        metadata={"tokenizer.chat_template": PLAIN_TEMPLATE},  # prints a content list whole
        special_tokens={"<|im_start|>": 300, "<|im_end|>": 301},
        image_tokens=8,
    )
    ctx = llamax.Context(backend=backend)
    try:
        app = create_app(ctx, images=policy(url_allow_networks=LOOPBACK))
        body = chat_body(site.url + "/cat.png") | {"verbose": True}
        reply = call(app, "POST", "/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert "base64" not in reply.text  # llama-server's __verbose.prompt: the marker
        assert "<__media__>" in reply.json()["__verbose"]["prompt"]
        assert_idle(ctx)
    finally:
        ctx.close()


# ---------------------------------------------------------------------- finding 3
def test_a_dripping_server_is_cut_off_at_the_deadline(vision: llamax.Context, site: _Site) -> None:
    app = create_app(vision, images=policy(url_allow_networks=LOOPBACK, url_seconds=1.0))
    done, replies = threading.Event(), []

    def fetch() -> None:
        replies.append(call(app, "POST", CHAT, json=chat_body(site.url + "/drip.png")))
        done.set()

    thread = threading.Thread(target=fetch)
    thread.start()
    try:
        assert done.wait(WAIT), "a byte every 0.2 s kept a 1 s fetch going"
        assert site.left.wait(WAIT), "the fetch did not hang up"
    finally:
        site.stop.set()
        thread.join(WAIT)
    error = replies[0].json()["error"]
    assert replies[0].status_code == 400 and "took longer than 1 s" in error["message"]


def test_a_hanging_name_lookup_ends_at_the_deadline(
    vision: llamax.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang, lookups = threading.Event(), []

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        lookups.append(host)
        hang.wait(WAIT)  # a resolver that does not answer
        raise socket.gaierror("no answer")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    app = create_app(vision, images=policy(url_seconds=1.0))
    try:
        error = call(app, "POST", CHAT, json=chat_body("http://slow.example/cat.png")).json()
    finally:
        hang.set()
    assert "took longer than 1 s" in error["error"]["message"] and lookups == ["slow.example"]


def test_slow_urls_past_the_fetch_slots_never_hold_up_a_plain_chat(
    vision: llamax.Context, site: _Site
) -> None:
    slow_policy = policy(url_allow_networks=LOOPBACK, url_seconds=3 * WAIT)
    app = create_app(vision, images=slow_policy)
    num_slow = 44  # more than Starlette's 40 worker threads

    async def go() -> tuple[int | None, list[httpx.Response]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=2 * WAIT) as client:  # fmt: skip
            slow = [asyncio.create_task(client.post(CHAT, json=chat_body(site.url + "/hold.png")))
                    for _ in range(num_slow)]  # fmt: skip
            try:
                for _ in range(int(WAIT / 0.05)):  # until the fetches that got a slot hang
                    if len(site.got) >= 4:
                        break
                    await asyncio.sleep(0.05)
                plain = await asyncio.wait_for(client.post(CHAT, json=chat_body()), WAIT)
                status = plain.status_code
            except TimeoutError:
                status = None  # the slow fetches took every worker thread
            finally:
                site.release.set()
            return status, list(await asyncio.gather(*slow))

    status, replies = asyncio.run(go())
    assert status == 200, "a plain chat waited behind slow image URLs"
    busy = [r for r in replies if r.status_code == 503]
    assert len(busy) >= num_slow - 4 and all(r.status_code in (200, 503) for r in replies)
    error = busy[0].json()["error"]
    assert error["code"] == "image_fetch_busy" and busy[0].headers["retry-after"] == "1"
    assert len(site.got) == num_slow - len(busy)
