"""The image limit counts every image a prompt holds (issue 54, finding 10): a Responses
follow-up carries the images of the responses it follows, read again each turn, so those
count against ``--max-images-per-request`` with the request's own, before anything is
read or fetched. In-process ASGI on the fake backend with a projector."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vision_files import pixels, png

import llamax
from llamax.backend.vision import RgbImage
from llamax.server import ImagePolicy, create_app
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}


class CountsReads(FakeBackend):
    """Counts the images it reads."""

    num_reads = 0

    def read_image(self, data: bytes) -> RgbImage:
        self.num_reads += 1
        return super().read_image(data)


@pytest.fixture
def vision() -> Iterator[tuple[llamax.Context, CountsReads]]:
    backend = CountsReads(
        n_ctx=2048,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SPECIALS,
        image_tokens=8,
    )
    ctx = llamax.Context(backend=backend)
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


def call(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def turn(num_images: int, previous: str | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": "And this?"}]
    for seed in range(num_images):
        data = base64.b64encode(png(pixels(seed, 4, 5))).decode()
        content.append({"type": "input_image", "image_url": f"data:image/png;base64,{data}"})
    body: dict[str, Any] = {"input": [{"role": "user", "content": content}]}
    if previous is not None:
        body["previous_response_id"] = previous
    return body | {"max_output_tokens": 2}


def test_a_responses_chain_counts_its_stored_images(
    vision: tuple[llamax.Context, CountsReads],
) -> None:
    ctx, backend = vision
    app = create_app(ctx, images=ImagePolicy(max_images=4))
    first = call(app, "/v1/responses", turn(2))
    assert first.status_code == 200, first.text
    second = call(app, "/v1/responses", turn(2, first.json()["id"]))
    assert second.status_code == 200, second.text  # 4 images: the limit
    reads = backend.num_reads
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        refused = call(app, path, turn(1, second.json()["id"]))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "too_many_images"
        assert (
            "holds 5 images (4 in the responses it follows, 1 in this request)"
            in (error["message"])
        )
        assert error["param"] == "input"
    assert backend.num_reads == reads  # refused before any image was read
    text_only = call(app, "/v1/responses", turn(0, second.json()["id"]))
    assert text_only.status_code == 200, text_only.text  # still 4
    over = call(app, "/v1/responses", turn(0, text_only.json()["id"]) | {"input": "More?"})
    assert over.status_code == 200  # a string input holds no image
