"""Images over HTTP on the fake backend (issue 42): OpenAI chat ``image_url`` parts,
Anthropic ``image`` blocks and Responses ``input_image`` parts; bad images, too many, and
a server without a projector answer 400 in each API's own error shape, and nothing reaches
the engine; remote image URLs are a 400 naming the field unless the server fetches them
(``ImagePolicy(allow_urls=True)``: tested against a local HTTP server, with its size and
time limits and content types); images are read off the event loop (the loop keeps
answering while a slow one is read); the model lists and ``/props`` say vision."""

from __future__ import annotations

import asyncio
import base64
import gc
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from vision_files import pixels, png

import llamax
from llamax.backend.vision import RgbImage
from llamax.server import ImagePolicy, create_app
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
IMAGE_TOKENS = 8
CHAT = "/v1/chat/completions"


class SlowReads(FakeBackend):
    """Takes ``read_seconds`` to read each image (a large JPEG on a slow core)."""

    read_seconds = 0.0

    def read_image(self, data: bytes) -> RgbImage:
        time.sleep(self.read_seconds)
        return super().read_image(data)


def fake(image_tokens: int | None = IMAGE_TOKENS) -> tuple[llamax.Context, SlowReads]:
    backend = SlowReads(
        n_ctx=1024,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SPECIALS,
        image_tokens=image_tokens,
    )
    return llamax.Context(backend=backend), backend


@pytest.fixture
def vision() -> Iterator[tuple[llamax.Context, SlowReads]]:
    ctx, backend = fake()
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


@pytest.fixture
def blind() -> Iterator[tuple[llamax.Context, SlowReads]]:
    ctx, backend = fake(None)
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def png_bytes(seed: int) -> bytes:
    return png(pixels(seed, 4, 5))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + b64(png_bytes(seed))


def openai_body(*urls: str, **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


def anthropic_body(*sources: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is this?"}]
    content += [{"type": "image", "source": source} for source in sources]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


def responses_body(*urls: str, **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": "What is this?"}]
    content += [{"type": "input_image", "image_url": url} for url in urls]
    return {"input": [{"role": "user", "content": content}], "max_output_tokens": 3, **extra}


def base64_source(data: bytes) -> dict[str, Any]:
    return {"type": "base64", "media_type": "image/png", "data": b64(data)}


def decoded(backend: FakeBackend) -> int:
    return len(backend.decode_log)


# ---------------------------------------------------------------------- each API
def test_openai_chat_takes_data_url_images(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, _ = vision
    app = create_app(ctx)
    text_only = call(app, "POST", CHAT, json=openai_body()).json()["usage"]["prompt_tokens"]
    two = call(app, "POST", CHAT, json=openai_body(data_url(1), data_url(2)))
    assert two.status_code == 200, two.text
    assert two.json()["usage"]["prompt_tokens"] == text_only + 2 * IMAGE_TOKENS
    again = call(app, "POST", CHAT, json=openai_body(data_url(1), data_url(2)))
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= text_only + 2 * IMAGE_TOKENS - 1  # the same images: a prefix hit
    detail = openai_body()
    detail["messages"][0]["content"].append(
        {"type": "image_url", "image_url": {"url": data_url(3), "detail": "high"}}
    )
    assert call(app, "POST", CHAT, json=detail).status_code == 200
    streamed = call(app, "POST", CHAT, json=openai_body(data_url(1), stream=True))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    counted = call(app, "POST", CHAT + "/input_tokens", json=openai_body(data_url(1)))
    assert counted.json()["input_tokens"] == text_only + IMAGE_TOKENS


def test_anthropic_messages_take_base64_images(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, _ = vision
    app = create_app(ctx)
    body = anthropic_body(base64_source(png_bytes(1)))
    reply = call(app, "POST", "/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    counted = call(app, "POST", "/v1/messages/count_tokens",
                   json={"messages": body["messages"]}).json()["input_tokens"]  # fmt: skip
    assert reply.json()["usage"]["input_tokens"] == counted
    text_only = call(app, "POST", "/v1/messages/count_tokens",
                     json={"messages": anthropic_body()["messages"]}).json()  # fmt: skip
    assert counted == text_only["input_tokens"] + IMAGE_TOKENS


def test_responses_take_input_images(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, _ = vision
    app = create_app(ctx)
    reply = call(app, "POST", "/v1/responses", json=responses_body(data_url(1)))
    assert reply.status_code == 200, reply.text
    follow = {"input": "And now?", "previous_response_id": reply.json()["id"],
              "max_output_tokens": 3}  # fmt: skip
    again = call(app, "POST", "/v1/responses", json=follow).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > IMAGE_TOKENS
    items = call(app, "GET", f"/v1/responses/{reply.json()['id']}/input_items").json()
    assert items["data"][0]["content"][1]["type"] == "input_image"
    counted = call(app, "POST", "/v1/responses/input_tokens", json=responses_body(data_url(1)))
    assert counted.json()["input_tokens"] == reply.json()["usage"]["input_tokens"]


# ---------------------------------------------------------------------- 400s
def openai_error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["code"], str)
    return str(error["message"])


def llama_error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    return str(error["message"])


def anthropic_error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


NOT_AN_IMAGE = b"hello, not an image"
TRUNCATED = png_bytes(1)[:-20]
HUGE = png(pixels(1, 2, 2), width=100_000, height=100_000)
BAD_IMAGES = [(NOT_AN_IMAGE, "not an image"), (TRUNCATED, "truncated PNG"), (HUGE, "limit is")]


@pytest.mark.parametrize(("data", "match"), BAD_IMAGES, ids=["text", "truncated", "huge"])
def test_bad_images_are_400_in_each_apis_shape(
    vision: tuple[llamax.Context, SlowReads], data: bytes, match: str
) -> None:
    ctx, backend = vision
    app = create_app(ctx)
    url = "data:image/png;base64," + b64(data)
    assert match in openai_error(call(app, "POST", CHAT, json=openai_body(url)))
    assert match in llama_error(call(app, "POST", "/chat/completions", json=openai_body(url)))
    body = anthropic_body(base64_source(data))
    assert match in anthropic_error(call(app, "POST", "/v1/messages", json=body))
    assert match in openai_error(call(app, "POST", "/v1/responses", json=responses_body(url)))
    assert decoded(backend) == 0


def test_malformed_image_parts_are_400(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, backend = vision
    app = create_app(ctx)
    for url, match in (
        ("data:text/html;base64,aGVsbG8=", "not an image"),
        ("data:image/png;base64,@@@@", "base64 is damaged"),
        ("", "data: URL"),
    ):
        error = call(app, "POST", CHAT, json=openai_body(url)).json()["error"]
        assert match in error["message"] and error["param"] == "messages"
        assert match in openai_error(call(app, "POST", "/v1/responses", json=responses_body(url)))
    bad_source = {"type": "base64", "media_type": "image/png", "data": "@@"}
    assert "damaged" in anthropic_error(
        call(app, "POST", "/v1/messages", json=anthropic_body(bad_source))
    )
    assert decoded(backend) == 0


def test_too_many_images_are_400(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, backend = vision
    app = create_app(ctx, images=ImagePolicy(max_images=2))
    three = [data_url(1)] * 3
    message = openai_error(call(app, "POST", CHAT, json=openai_body(*three)))
    assert "3 images; at most 2" in message
    sources = [base64_source(png_bytes(1))] * 3
    assert "at most 2" in anthropic_error(
        call(app, "POST", "/v1/messages", json=anthropic_body(*sources))
    )
    assert "at most 2" in openai_error(
        call(app, "POST", "/v1/responses", json=responses_body(*three))
    )
    assert call(app, "POST", CHAT, json=openai_body(*three[:2])).status_code == 200
    assert decoded(backend) > 0  # the two-image request ran


def test_a_server_without_a_projector_refuses_images(
    blind: tuple[llamax.Context, SlowReads],
) -> None:
    ctx, backend = blind
    app = create_app(ctx)
    said = "does not take images"
    assert said in openai_error(call(app, "POST", CHAT, json=openai_body(data_url(1))))
    # llama-server's words (its Anthropic tests read them; it answers 500, llamax 400)
    assert "image input is not supported" in anthropic_error(
        call(app, "POST", "/v1/messages", json=anthropic_body(base64_source(png_bytes(1))))
    )
    assert said in llama_error(
        call(app, "POST", "/chat/completions", json=openai_body(data_url(1)))
    )
    body = anthropic_body(base64_source(png_bytes(1)))
    assert said in anthropic_error(call(app, "POST", "/v1/messages", json=body))
    assert said in anthropic_error(
        call(app, "POST", "/v1/messages/count_tokens", json={"messages": body["messages"]})
    )
    assert said in openai_error(
        call(app, "POST", "/v1/responses", json=responses_body(data_url(1)))
    )
    assert decoded(backend) == 0
    assert call(app, "POST", CHAT, json=openai_body()).status_code == 200
    assert call(app, "GET", "/props").json()["modalities"]["vision"] is False
    listed = call(app, "GET", "/v1/models").json()
    assert listed["data"][0]["capabilities"] == ["completion"]


def test_model_lists_and_props_say_vision(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, _ = vision
    app = create_app(ctx)
    shown = call(app, "POST", "/apply-template", json=openai_body(data_url(1)))
    assert "What is this?<__media__>" in shown.json()["prompt"]  # llama-server's marker
    assert call(app, "GET", "/props").json()["modalities"] == {"vision": True, "audio": False}
    for path in ("/v1/models", "/models"):
        listed = call(app, "GET", path).json()
        assert "multimodal" in listed["data"][0]["capabilities"]
        assert listed["models"][0]["capabilities"] == ["completion", "multimodal"]


def test_completion_takes_multimodal_data_at_the_media_marker(
    vision: tuple[llamax.Context, SlowReads],
) -> None:
    """llama-server's ``/completion`` prompt object (issue 42): each ``multimodal_data``
    item (base64) goes where ``/props``' ``media_marker`` sits in ``prompt_string``."""
    ctx, backend = vision
    app = create_app(ctx, images=ImagePolicy(max_images=2))
    marker = call(app, "GET", "/props").json()["media_marker"]
    assert marker == "<__media__>"

    def prompt(*images: bytes, text: str | None = None) -> dict[str, Any]:
        string = text if text is not None else "look: " + " and ".join([marker] * len(images))
        return {"prompt_string": string + " now", "multimodal_data": [b64(i) for i in images]}

    greedy = {"prompt": prompt(png_bytes(1)), "n_predict": 2, "temperature": 0}
    one = call(app, "POST", "/completion", json=greedy)
    assert one.status_code == 200, one.text
    body = one.json()
    assert body["tokens_evaluated"] == len("look:  now") + IMAGE_TOKENS
    assert body["prompt"] == "look: <__media__> now"
    again = call(app, "POST", "/completion", json=greedy)
    assert again.json()["timings"]["cache_n"] >= len("look: ") + IMAGE_TOKENS  # a prefix hit
    assert again.json()["content"] == body["content"]
    both = [prompt(png_bytes(1)), prompt(png_bytes(2))]  # two prompts, an image each
    assert len(call(app, "POST", "/completion", json={"prompt": both, "n_predict": 1}).json()) == 2
    steps = decoded(backend)
    for bad, said in (
        (prompt(png_bytes(1), text="no marker"), "0 media markers"),
        ({**prompt(png_bytes(1)), "multimodal_data": ["!!"]}, "damaged"),
        ({**prompt(png_bytes(1)), "multimodal_data": [3]}, "base64 strings"),
        (prompt(b"hello"), "not an image"),
        ([prompt(png_bytes(1), png_bytes(2)), prompt(png_bytes(3))], "3 images; at most 2"),
    ):
        refused = call(app, "POST", "/completion", json={"prompt": bad, "n_predict": 1})
        assert refused.status_code == 400 and said in llama_error(refused), refused.text
    assert decoded(backend) == steps  # nothing reached the engine
    counted = call(
        app, "POST", "/completion", json={"prompt": prompt(png_bytes(1)), "n_predict": 0}
    )
    assert counted.json()["tokens_evaluated"] == body["tokens_evaluated"]


# ---------------------------------------------------------------------- remote URLs
class _Images(http.server.BaseHTTPRequestHandler):
    """``/cat.png`` an image, ``/page`` HTML, ``/big.png`` 64 KiB, ``/slow.png`` an image
    after 3 s, anything else 404; it counts the requests it got."""

    got: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.got.append(self.path)
        kind, body = {
            "/cat.png": ("image/png", png_bytes(7)),
            "/page": ("text/html", b"<html>cat</html>"),
            "/big.png": ("image/png", b"\x89PNG" + bytes(64 << 10)),
            "/slow.png": ("image/png", png_bytes(8)),
        }.get(self.path, ("", b""))
        if not kind:
            self.send_error(404)
            return
        if self.path == "/slow.png":
            time.sleep(3)
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_site() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Images.got.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_urls_are_refused_naming_the_field(
    vision: tuple[llamax.Context, SlowReads], image_site: str
) -> None:
    ctx, backend = vision
    app = create_app(ctx)
    url = image_site + "/cat.png"
    error = call(app, "POST", CHAT, json=openai_body(data_url(1), url)).json()["error"]
    assert error["param"] == "messages[0].content[2].image_url.url"
    assert error["code"] == "image_url_not_allowed" and "--allow-image-urls" in error["message"]
    source = {"type": "url", "url": url}
    message = anthropic_error(call(app, "POST", "/v1/messages", json=anthropic_body(source)))
    assert message.startswith("messages[0].content[1].source:")
    error = call(app, "POST", "/v1/responses", json=responses_body(url)).json()["error"]
    assert error["param"] == "input[0].content[1].image_url"
    assert _Images.got == [] and decoded(backend) == 0


def test_allowed_urls_are_fetched_within_limits(
    vision: tuple[llamax.Context, SlowReads], image_site: str
) -> None:
    ctx, backend = vision
    policy = ImagePolicy(allow_urls=True, max_url_bytes=32 << 10, url_seconds=1.0,
                         url_allow_networks=("127.0.0.1/32",))  # fmt: skip
    app = create_app(ctx, images=policy)
    cat = image_site + "/cat.png"
    by_url = call(app, "POST", CHAT, json=openai_body(cat, temperature=0))
    assert by_url.status_code == 200, by_url.text
    by_data = call(app, "POST", CHAT, json=openai_body(
        "data:image/png;base64," + b64(png_bytes(7)), temperature=0)).json()  # fmt: skip
    assert by_data["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        by_data["usage"]["prompt_tokens"] - 1
    )  # the fetched image is the same image
    reply = call(app, "POST", "/v1/messages", json=anthropic_body({"type": "url", "url": cat}))
    assert reply.status_code == 200, reply.text
    assert call(app, "POST", "/v1/responses", json=responses_body(cat)).status_code == 200
    for path, match in (  # issue 54: not an image and 404 say the same, as a refused host
        ("/page", "could not fetch it (the address is not allowed"),
        ("/big.png", "larger than 32768 bytes"),
        ("/slow.png", "took longer than 1 s"),
        ("/missing.png", "could not fetch it (the address is not allowed"),
    ):
        error = call(app, "POST", CHAT, json=openai_body(image_site + path)).json()["error"]
        assert match in error["message"] and error["code"] == "image_url_failed"
        assert error["param"] == "messages[0].content[1].image_url.url"
    refused = call(app, "POST", CHAT, json=openai_body("ftp://127.0.0.1/cat.png"))
    assert "data: URL" in openai_error(refused)  # only http(s) is fetched
    assert decoded(backend) > 0


# ---------------------------------------------------------------------- the event loop
def _loop_answers_while(app: Any, body: dict[str, Any]) -> tuple[int, float, int]:
    """Send ``body`` to the chat route while a heartbeat runs on the loop and pings
    ``/health``: the chat request's status, the longest the loop went without running the
    heartbeat (seconds), and how many pings were answered meanwhile. The garbage collector
    is collected first and off meanwhile: in one fresh-clone run the loop paused 0.6 s
    (here 0.02-0.03 s alone, 0.04-0.05 s beside three spinners on its core), most likely a
    full collection of a test worker's heap, which is not what this measures."""

    async def go() -> tuple[int, float, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            chat = asyncio.create_task(client.post(CHAT, json=body))
            longest, pings, last = 0.0, 0, time.perf_counter()
            while not chat.done():
                await asyncio.sleep(0.02)
                assert (await client.get("/health")).status_code == 200
                now = time.perf_counter()
                longest, pings, last = max(longest, now - last), pings + 1, now
            return (await chat).status_code, longest, pings

    gc.collect()
    gc.disable()
    try:
        return asyncio.run(go())
    finally:
        gc.enable()


def test_images_are_read_off_the_event_loop(vision: tuple[llamax.Context, SlowReads]) -> None:
    ctx, backend = vision
    backend.read_seconds = 1.0
    status, longest, pings = _loop_answers_while(create_app(ctx), openai_body(data_url(1)))
    assert status == 200 and longest < 0.5 and pings > 5


def test_urls_are_fetched_off_the_event_loop(
    vision: tuple[llamax.Context, SlowReads], image_site: str
) -> None:
    ctx, _ = vision
    policy = ImagePolicy(allow_urls=True, url_seconds=5.0, url_allow_networks=("127.0.0.1",))
    app = create_app(ctx, images=policy)
    status, longest, pings = _loop_answers_while(app, openai_body(image_site + "/slow.png"))
    assert status == 200 and longest < 0.5 and pings > 20


def test_the_cli_flags_make_the_policy() -> None:
    from llamax.server.cli import build_parser, server_config

    def images(*args: str) -> ImagePolicy:
        return server_config(build_parser().parse_args(args)).images

    ns = images()
    assert (ns.max_images, ns.allow_urls) == (16, False)
    flags = "--allow-image-urls --max-images-per-request 2 --image-url-max-bytes 1000"
    ns = images(*flags.split(), "--image-url-timeout", "2.5")
    assert (ns.max_images, ns.allow_urls) == (2, True)
    assert (ns.max_url_bytes, ns.url_seconds) == (1000, 2.5)
    assert (ns.max_url_fetches, ns.url_allow_networks, ns.url_proxy) == (4, (), None)
    more = "--image-url-fetches 2 --image-url-allow-network 10.0.0.0/8 --image-url-proxy"
    ns = images(*more.split(), "http://proxy:3128", "--image-url-allow-network", "fd00::/8")
    assert (ns.max_url_fetches, ns.url_proxy) == (2, "http://proxy:3128")
    assert ns.url_allow_networks == ("10.0.0.0/8", "fd00::/8")
    with pytest.raises(ValueError):
        ImagePolicy(max_images=-1)
