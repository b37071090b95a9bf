"""The chat page in a real headless browser (Debian's chromium, driven by Playwright).

Needs ``/usr/bin/chromium`` (``scripts/install_browser.sh``, which ``scripts/test.sh`` runs).
No browser is downloaded: Playwright drives the system one through ``executable_path``.
``LLAMAX_UPDATE_SCREENSHOT=1`` saves the screenshot of docs/server.md (docs/img/chat-page.png).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

pytestmark = pytest.mark.model

CHROMIUM = os.environ.get("LLAMAX_CHROMIUM", "/usr/bin/chromium")
SCREENSHOT = Path(__file__).parent.parent / "docs" / "img" / "chat-page.png"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: run 'bash scripts/install_browser.sh' (as root; it "
            "apt-get installs Debian's chromium) or point LLAMAX_CHROMIUM at a Chromium binary"
        )
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser, real_ctx: llamax.Context) -> Iterator[Page]:
    with BackgroundServer(create_app(real_ctx)) as server:
        context = browser.new_context(viewport={"width": 1200, "height": 760})
        tab = context.new_page()
        tab.goto(server.url + "/")
        yield tab
        context.close()
    assert_idle(real_ctx, timeout=60)


def test_send_a_message_and_see_the_streamed_reply(page: Page, tmp_path: Path) -> None:
    expect(page.locator("#health")).to_contain_text("ok", timeout=10_000)
    page.fill("#system", "You are a cheerful assistant. Answer in one or two sentences.")
    page.fill("#max-tokens", "48")
    page.fill("#input", "Hi! What is the capital of France?")
    page.keyboard.press("Enter")
    reply = page.locator(".msg.assistant .bubble").last
    expect(page.locator("#send")).to_have_text("Stop", timeout=5_000)  # streaming has begun
    expect(reply).not_to_be_empty(timeout=30_000)
    expect(page.locator("#send")).to_have_text("Send", timeout=60_000)  # the stream ended
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("tokens")
    assert page.locator(".msg.user .bubble").last.inner_text().startswith("Hi!")
    update_docs = os.environ.get("LLAMAX_UPDATE_SCREENSHOT") == "1"
    page.screenshot(path=str(SCREENSHOT if update_docs else tmp_path / "chat-page.png"))


def test_stop_button_ends_a_reply(page: Page) -> None:
    page.fill("#max-tokens", "2000")
    page.fill("#input", "Write a very long story about a dragon.")
    page.click("#send")
    reply = page.locator(".msg.assistant .bubble").last
    expect(reply).not_to_be_empty(timeout=30_000)
    page.click("#send")  # now the Stop button
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("stopped", timeout=10_000)
