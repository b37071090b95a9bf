"""The newcomer's walk (issue 57): ``scripts/newcomer.sh`` builds llamax's wheel, installs
it in a fresh venv with only its runtime dependencies (the llama-cpp-python wheel bootstrap
built, nothing rebuilt), runs the README's Quickstart as written and an example with that
venv's Python; the ``server`` extra then adds the server and nothing from the dev extras,
and that venv's ``llamax serve``, behind a reverse proxy at ``/llm/``, answers a message
sent on its chat page in headless Chromium."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from starlette.types import ASGIApp, Receive, Scope, Send

import llamax
from llamax.server import BackgroundServer

REPO = Path(__file__).resolve().parent.parent
DEV_ONLY = {"fastapi", "uvicorn", "pytest", "mypy", "ruff", "ray", "playwright", "openai"}
CHROMIUM = os.environ.get("LLAMAX_CHROMIUM", "/usr/bin/chromium")
PREFIX = "/llm"
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length"}

pytestmark = pytest.mark.integration


@dataclass(frozen=True, slots=True)
class Walk:
    """A finished ``scripts/newcomer.sh`` run."""

    venv: Path
    dist: Path
    model: Path
    stdout: str

    @property
    def python(self) -> Path:
        """The fresh venv's interpreter."""
        return self.venv / "bin" / "python"


def _installed(python: Path) -> set[str]:
    listing = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; "
         "print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {name.lower().replace("_", "-") for name in listing.split()}


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> Walk:
    """Run ``scripts/newcomer.sh`` once (about a minute with bootstrap's wheel)."""
    model = Path(os.environ.get("LLAMAX_MODEL") or llamax.default_model_path())
    if not model.is_file():
        pytest.skip("the default model is not installed")
    tmp = tmp_path_factory.mktemp("newcomer")
    env = os.environ | {
        "LLAMAX_MODEL": str(model),
        "PYTHON": sys.executable,
        "LLAMAX_REQUIRE_BUILT_WHEEL": "1",  # reuse bootstrap's llama-cpp-python wheel
        "LLAMAX_DIST": str(tmp / "dist"),
    }
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "newcomer.sh"), str(tmp / "venv")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if run.returncode == 3:
        pytest.skip("no llama-cpp-python wheel built by scripts/bootstrap.sh to reuse")
    assert run.returncode == 0, run.stderr[-3000:]
    return Walk(tmp / "venv", tmp / "dist", model, run.stdout)


def test_a_fresh_venv_runs_the_quickstart_as_written_and_an_example(walk: Walk) -> None:
    """The Quickstart's four parts each printed (a reply, a streamed reply, the handle's
    finish reason and token count, the awaited calls), then basic_completion.py's."""
    lines = walk.stdout.splitlines()
    assert re.search(r"^(stop|length) \d+$", walk.stdout, re.M), walk.stdout  # handle.result
    assert sum(1 for line in lines if line.strip()) >= 5, walk.stdout
    assert re.search(r"^finish_reason=(stop|length)  usage=", walk.stdout, re.M), walk.stdout
    assert f"llamax {walk.venv}" in walk.stdout  # the installed copy, not the clone
    installed = _installed(walk.python)
    assert {"llamax", "llama-cpp-python", "numpy", "jinja2"} <= installed
    assert not installed & DEV_ONLY, installed & DEV_ONLY

    missing = subprocess.run([str(walk.python), "-c", "import llamax.server"],
                             capture_output=True, text=True, cwd=walk.dist)  # fmt: skip
    assert missing.returncode != 0 and "pip install '.[server]'" in missing.stderr


def _install_server_extra(walk: Walk) -> None:
    (wheel,) = walk.dist.glob("llamax-*.whl")
    subprocess.run([str(walk.python), "-m", "pip", "install", "-q", f"{wheel}[server]"],
                   check=True, capture_output=True)  # fmt: skip


def test_the_server_extra_adds_only_the_server(walk: Walk) -> None:
    _install_server_extra(walk)
    assert {"fastapi", "uvicorn", "prometheus-client"} <= _installed(walk.python)
    assert not _installed(walk.python) & (DEV_ONLY - {"fastapi", "uvicorn"})
    serve = subprocess.run([str(walk.venv / "bin" / "llamax"), "serve", "--help"],
                           capture_output=True, text=True, cwd=walk.dist)  # fmt: skip
    assert serve.returncode == 0 and "--shutdown-timeout" in serve.stdout, serve.stderr


def reverse_proxy(upstream: str, prefix: str = PREFIX) -> ASGIApp:
    """A streaming reverse proxy, as docs/server.md's nginx snippet (``location /llm/ {
    proxy_pass upstream/; proxy_buffering off; proxy_set_header Host $http_host; }``):
    paths under ``prefix`` go upstream without it, with the browser's ``Host``."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(120.0))

    async def proxy(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(prefix + "/"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"proxy: not found"})
            return
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        query = scope.get("query_string", b"").decode()
        url = path[len(prefix) :] + (f"?{query}" if query else "")
        upstream_request = client.build_request(scope["method"], url, headers=headers,
                                                content=body)  # fmt: skip
        reply = await client.send(upstream_request, stream=True)
        try:
            kept = [(k, v) for k, v in reply.headers.raw if k.lower() not in HOP_BY_HOP]
            await send({"type": "http.response.start", "status": reply.status_code,
                        "headers": kept})  # fmt: skip
            async for chunk in reply.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await reply.aclose()

    return proxy


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def served(walk: Walk) -> Iterator[str]:
    """The fresh venv's ``llamax serve`` (the default model, small), stopped by Ctrl-C."""
    _install_server_extra(walk)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    command = [str(walk.venv / "bin" / "llamax"), "serve", str(walk.model),
               "--port", str(port), "--n-ctx", "2048"]  # fmt: skip
    server = subprocess.Popen(command, cwd=walk.dist, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while server.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert server.poll() is None, server.communicate()[0][-3000:]
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            output = server.communicate()[0]
            pytest.fail(f"llamax serve did not stop on Ctrl-C:\n{output[-3000:]}")
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.browser
def test_the_chat_page_behind_a_prefix_answers_in_chromium(served: str) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run 'bash scripts/install_browser.sh' (as root) "
                    "or point LLAMAX_CHROMIUM at a Chromium binary")  # fmt: skip
    from test_server_browser import FLAGS

    with BackgroundServer(reverse_proxy(served)) as proxy, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 760})
            page.goto(proxy.url + PREFIX + "/")
            expect(page.locator("#health")).to_contain_text("ok", timeout=30_000)
            page.fill("#max-tokens", "16")
            page.fill("#input", "Hi! What is the capital of France?")
            page.keyboard.press("Enter")
            expect(page.locator(".msg.assistant .bubble").last).not_to_be_empty(timeout=60_000)
            expect(page.locator("#send")).to_have_text("Send", timeout=60_000)
            expect(page.locator(".msg.assistant .meta").last).to_contain_text("tokens")
            expect(page.locator(".msg.error")).to_have_count(0)
        finally:
            browser.close()
