"""The chat page in a real headless browser (Debian's chromium, driven by Playwright).

Needs ``/usr/bin/chromium`` (``scripts/install_browser.sh``, which ``scripts/test.sh`` runs).
No browser is downloaded: Playwright drives the system one through ``executable_path``.
``LLAMAX_UPDATE_SCREENSHOT=1`` saves the screenshot of docs/server.md (docs/img/chat-page.png).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vision_files
from playwright.sync_api import Browser, Page, Request, expect, sync_playwright
from vision_files import pixels, png

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

pytestmark = [pytest.mark.model, pytest.mark.browser]

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


# ---------------------------------------------------------------------- images
DROP_FILE = """([selector, type, b64, name]) => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const data = new DataTransfer();
    data.items.add(new File([bytes], name, { type: "image/png" }));
    const target = document.querySelector(selector);
    const event = type === "paste"
        ? new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true })
        : new DragEvent(type, { dataTransfer: data, bubbles: true, cancelable: true });
    target.dispatchEvent(event);
}"""


@pytest.fixture(scope="module")
def vision_ctx(model_path: Path) -> Iterator[llamax.Context]:
    """SmolLM2 with Janus-Pro's (causal) random projector."""
    mmproj = vision_files.script().cached_vision_model(projector="janus_pro")
    with llamax.Context(model_path, mmproj=mmproj, n_ctx=2048, n_seq_max=4) as ctx:
        yield ctx


@pytest.fixture
def vision_page(browser: Browser, vision_ctx: llamax.Context) -> Iterator[Page]:
    with BackgroundServer(create_app(vision_ctx)) as server:
        context = browser.new_context(viewport={"width": 1200, "height": 760})
        tab = context.new_page()
        tab.goto(server.url + "/")
        yield tab
        context.close()
    assert_idle(vision_ctx, timeout=60)


def _chat_bodies(page: Page) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []

    def record(request: Request) -> None:
        if request.url.endswith("/v1/chat/completions") and request.post_data:
            bodies.append(json.loads(request.post_data))

    page.on("request", record)
    return bodies


def test_attach_an_image_and_ask_about_it(vision_page: Page, tmp_path: Path) -> None:
    page = vision_page
    bodies = _chat_bodies(page)
    expect(page.locator("#attach")).to_be_visible(timeout=10_000)  # /props says vision
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(pixels(7, 48, 64)))
    page.set_input_files("#file", str(picture))
    expect(page.locator("#attachments .thumb")).to_have_count(1)
    page.fill("#max-tokens", "8")
    page.fill("#input", "What is in this picture?")
    page.keyboard.press("Enter")
    expect(page.locator(".msg.user .bubble img")).to_have_count(1)
    expect(page.locator("#attachments .thumb")).to_have_count(0)  # sent, so cleared
    expect(page.locator("#send")).to_have_text("Send", timeout=60_000)
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("tokens")
    content = bodies[-1]["messages"][-1]["content"]
    assert [part["type"] for part in content] == ["image_url", "text"]
    assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert content[1]["text"] == "What is in this picture?"
    # the next turn sends the image again; the server serves it from the prefix cache
    page.fill("#input", "And its colours?")
    page.keyboard.press("Enter")
    expect(page.locator("#send")).to_have_text("Send", timeout=60_000)
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("from cache")
    assert bodies[-1]["messages"][0]["content"] == content


def test_drop_and_paste_images_then_remove_one(vision_page: Page) -> None:
    page = vision_page
    expect(page.locator("#attach")).to_be_visible(timeout=10_000)
    b64 = base64.b64encode(png(pixels(8, 32, 32))).decode()
    page.evaluate(DROP_FILE, ["#composer", "drop", b64, "dropped.png"])
    page.evaluate(DROP_FILE, ["#input", "paste", b64, "pasted.png"])
    expect(page.locator("#attachments .thumb")).to_have_count(2)
    page.locator("#attachments .thumb button").first.click()
    expect(page.locator("#attachments .thumb")).to_have_count(1)
    page.click("#new-chat")
    expect(page.locator("#attachments .thumb")).to_have_count(0)


def test_a_model_without_a_projector_takes_no_images(page: Page) -> None:
    expect(page.locator("#health")).to_contain_text("ok", timeout=10_000)
    expect(page.locator("#attach")).to_be_hidden()
    b64 = base64.b64encode(png(pixels(9, 32, 32))).decode()
    page.evaluate(DROP_FILE, ["#composer", "drop", b64, "dropped.png"])
    expect(page.locator("#hint")).to_contain_text("does not take images")
    expect(page.locator("#attachments .thumb")).to_have_count(0)


@pytest.fixture
def phone_page(browser: Browser) -> Iterator[Page]:
    """The page on a 390 x 664 phone screen, served behind a proxy at ``/llm/`` (the
    fake backend: the layout, not the model, is under test)."""
    from test_server_fake import fake_context
    from test_server_subpath import behind_proxy

    ctx = fake_context()
    with BackgroundServer(behind_proxy(create_app(ctx))) as server:
        context = browser.new_context(viewport={"width": 390, "height": 664})
        tab = context.new_page()
        tab.goto(server.url + "/llm/")
        yield tab
        context.close()
    assert_idle(ctx)
    ctx.close()


def test_behind_a_prefix_on_a_phone(phone_page: Page, tmp_path: Path) -> None:
    """Relative URLs: /health, /props and the chat reach the server through /llm/; a short
    bubble stays on one line; the message box stays on a 390 px screen."""
    page = phone_page
    expect(page.locator("#health")).to_contain_text("ok", timeout=10_000)
    composer = page.locator("#composer").bounding_box()
    assert composer is not None and composer["y"] + composer["height"] <= 664
    page.fill("#max-tokens", "4")
    page.fill("#input", "Hi!")
    page.keyboard.press("Enter")
    expect(page.locator(".msg.assistant .meta").last).to_contain_text("tokens", timeout=10_000)
    bubble = page.locator(".msg.user .bubble").last
    line = float(bubble.evaluate("b => parseFloat(getComputedStyle(b).lineHeight)"))
    box = bubble.bounding_box()
    assert box is not None and box["height"] < 2 * line + 24, box  # one line plus padding
    composer = page.locator("#composer").bounding_box()
    assert composer is not None and composer["y"] + composer["height"] <= 664
    page.screenshot(path=str(tmp_path / "phone.png"))
