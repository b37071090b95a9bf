"""Images through the chat APIs on SmolLM2 with a random projector from
scripts/make_vision_model.py (issue 42), after llama.cpp's
``tools/server/tests/unit/test_vision_api.py``: the model lists say ``multimodal``; chat
completions with ``data:`` URLs through the real ``openai`` client, bad images refused;
several images in one message; two different images give different outputs and the same
image twice is a prefix hit (cached tokens in the usage); Anthropic's Messages through the
real ``anthropic`` client; and, below HTTP, ``chat_completion`` renders the image where
the template puts the message, the same prompt as the hand-written ChatML parts.

Outputs are compared only at the same batch composition (one request at a time).

The default selection keeps what the lists, ``/props`` and refused images say; the replies
and comparisons walk a user's path and are ``integration`` (issue 55)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import vision_files
from vision_files import jpeg, pixels, png

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

pytestmark = pytest.mark.model
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 6, "logprobs": True, "top_logprobs": 3}
QUESTION = "What is this:\n"


@pytest.fixture(scope="module")
def vision_ctx(model_path: Path) -> Iterator[llamax.Context]:
    """SmolLM2 with Janus-Pro's (causal) random projector."""
    mmproj = vision_files.script().cached_vision_model(projector="janus_pro")
    with llamax.Context(
        model_path, mmproj=str(mmproj), n_ctx=2048, n_seq_max=4, n_batch=256
    ) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def url(vision_ctx: llamax.Context) -> Iterator[str]:
    with BackgroundServer(create_app(vision_ctx)) as running:
        yield running.url


@pytest.fixture(autouse=True)
def idle_engine(vision_ctx: llamax.Context) -> Iterator[None]:
    vision_ctx.clear_cache()
    yield
    assert_idle(vision_ctx, timeout=60)
    assert vision_ctx.audit() == []


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


def png_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(pixels(seed, 48, 64))).decode()


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*images: str, question: str = QUESTION) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": question}]
    return [{"role": "user", "content": [*parts, *(image_url(u) for u in images)]}]


def first_logprobs(reply: Any) -> list[tuple[str, float]]:
    return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content[0].top_logprobs]


def test_models_and_props_say_multimodal(url: str) -> None:
    for path in ("/models", "/v1/models"):
        model = httpx.get(url + path).json()["models"][0]
        assert "completion" in model["capabilities"] and "multimodal" in model["capabilities"]
    assert httpx.get(url + "/props").json()["modalities"]["vision"] is True


JPEG_URL = "data:image/jpeg;base64," + base64.b64encode(jpeg(pixels(9, 40, 40))).decode()


@pytest.mark.parametrize(
    ("image", "success"),
    [
        pytest.param(png_url(0), True, marks=pytest.mark.integration),
        pytest.param(JPEG_URL, True, marks=pytest.mark.integration),
        ("malformed", False),
        ("https://example.com/404.png", False),  # remote: not fetched without the flag
        ("data:text/html;base64,aGVsbG8=", False),  # not an image type
        ("data:image/png;base64," + base64.b64encode(b"hello").decode(), False),  # not a PNG
    ],
)
def test_vision_chat_completion(client: openai.OpenAI, image: str, success: bool) -> None:
    if not success:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="smollm2", messages=ask(image), **GREEDY)  # type: ignore[arg-type]
        return
    reply = client.chat.completions.create(model="smollm2", messages=ask(image), **GREEDY)  # type: ignore[arg-type]
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 6


@pytest.mark.integration
def test_several_images_in_one_message(client: openai.OpenAI, vision_ctx: llamax.Context) -> None:
    one = client.chat.completions.create(model="smollm2", messages=ask(png_url(1)), **GREEDY)  # type: ignore[arg-type]
    two = client.chat.completions.create(
        model="smollm2",
        messages=ask(png_url(1), png_url(2)),  # type: ignore[arg-type]
        **GREEDY,
    )
    assert one.usage is not None and two.usage is not None
    per_image = vision_ctx.prompt_positions([llamax.Image(png(pixels(2, 48, 64)))])
    assert per_image >= 16  # Janus-Pro's 16 embeddings, and any marker tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + per_image
    counted = httpx.post(
        str(client.base_url) + "chat/completions/input_tokens",
        json={"messages": ask(png_url(1), png_url(2))},
    ).json()
    assert counted["input_tokens"] == two.usage.prompt_tokens


@pytest.mark.integration
def test_two_images_differ_and_the_same_one_is_a_prefix_hit(client: openai.OpenAI) -> None:
    cold = client.chat.completions.create(model="smollm2", messages=ask(png_url(3)), **GREEDY)  # type: ignore[arg-type]
    other = client.chat.completions.create(model="smollm2", messages=ask(png_url(4)), **GREEDY)  # type: ignore[arg-type]
    assert first_logprobs(cold) != first_logprobs(other)
    warm = client.chat.completions.create(model="smollm2", messages=ask(png_url(3)), **GREEDY)  # type: ignore[arg-type]
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert first_logprobs(warm) == first_logprobs(cold)


@pytest.mark.integration
def test_anthropic_messages_with_images(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    data = base64.b64encode(png(pixels(5, 48, 64))).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    content = [{"type": "text", "text": QUESTION}, image]
    messages = [{"role": "user", "content": content}]
    cold = client.messages.create(
        model="smollm2",
        max_tokens=6,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"temperature": 0.0},  # this client version has no temperature argument
    )
    warm = client.messages.create(
        model="smollm2",
        max_tokens=6,
        messages=messages,  # type: ignore[arg-type]
        extra_body={"temperature": 0.0},  # this client version has no temperature argument
    )
    assert warm.usage.cache_read_input_tokens and warm.usage.cache_read_input_tokens > 16
    assert [b.model_dump() for b in warm.content] == [b.model_dump() for b in cold.content]
    counted = client.messages.count_tokens(model="smollm2", messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == cold.usage.input_tokens
    broken = {**image, "source": {**image["source"], "data": base64.b64encode(b"x" * 40).decode()}}  # type: ignore[dict-item]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="smollm2",
            max_tokens=6,
            messages=[{"role": "user", "content": [broken]}],  # type: ignore[list-item]
        )


@pytest.mark.integration
def test_responses_with_an_input_image(client: openai.OpenAI) -> None:
    content = [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": png_url(6), "detail": "auto"},
    ]
    reply = client.responses.create(
        model="smollm2",
        input=[{"role": "user", "content": content}],  # type: ignore[list-item]
        max_output_tokens=6,
        temperature=0.0,
    )
    assert reply.usage is not None and reply.usage.input_tokens > 16


@pytest.fixture(params=["janus_pro", "gemma3"])
def each_projector(
    request: Any, vision_ctx: llamax.Context, model_path: Path
) -> Iterator[llamax.Context]:
    """The module's context (Janus-Pro), then one with Gemma 3's non-causal projector,
    which puts marker text around each image."""
    if request.param == "janus_pro":
        yield vision_ctx
        return
    mmproj = vision_files.script().cached_vision_model(projector="gemma3")
    with llamax.Context(
        model_path, mmproj=str(mmproj), n_ctx=1024, n_seq_max=2, n_batch=256
    ) as ctx:
        yield ctx
        assert_idle(ctx, timeout=60)


@pytest.mark.integration
def test_completion_multimodal_data_equals_the_same_parts_below_http(
    url: str, vision_ctx: llamax.Context
) -> None:
    """llama-server's ``/completion`` with ``multimodal_data`` at ``/props``'
    ``media_marker`` (what benchmarks/images.py sends llama-server) answers as
    ``add_request`` does with the image in the same place (issue 42)."""
    picture = png(pixels(5, 48, 64))
    head, tail = "<|im_start|>user\n", " What is this?<|im_end|>\n<|im_start|>assistant\n"
    marker = httpx.get(url + "/props").json()["media_marker"]
    prompt = {"prompt_string": head + marker + tail,
              "multimodal_data": [base64.b64encode(picture).decode()]}  # fmt: skip
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True}
    reply = httpx.post(url + "/completion", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    vision_ctx.clear_cache()
    params = llamax.SamplingParams(max_tokens=6, temperature=0.0)
    below = vision_ctx.add_request([head, llamax.Image(picture), tail], params).result()
    assert reply.json()["tokens"] == list(below.choices[0].token_ids)
    assert reply.json()["tokens_evaluated"] == below.usage.prompt_tokens


@pytest.mark.integration
def test_completion_with_id_slot_takes_images_and_keeps_them_in_the_slot(
    vision_ctx: llamax.Context, tmp_path: Path
) -> None:
    """``/completion`` with ``id_slot`` and ``multimodal_data`` runs on the slot's session:
    the answer is ``add_request``'s with the image in place, the same prompt again on the
    slot reuses the image's cells, and a bad image is a 400 that leaves the slot serving
    (the first version refused images with ``id_slot`` altogether)."""
    with BackgroundServer(create_app(vision_ctx, slot_save_path=tmp_path)) as running:
        _id_slot_with_images(running.url, vision_ctx)


def _id_slot_with_images(url: str, vision_ctx: llamax.Context) -> None:
    picture = png(pixels(6, 48, 64))
    head, tail = "<|im_start|>user\n", " What is this?<|im_end|>\n<|im_start|>assistant\n"
    marker = httpx.get(url + "/props").json()["media_marker"]

    def body(data: str) -> dict[str, Any]:
        prompt = {"prompt_string": head + marker + tail, "multimodal_data": [data]}
        return {"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": True,
                "id_slot": 1, "cache_prompt": True}  # fmt: skip

    good = base64.b64encode(picture).decode()
    first = httpx.post(url + "/completion", json=body(good), timeout=120)
    assert first.status_code == 200, first.text
    assert first.json()["id_slot"] == 1
    assert marker in first.json()["prompt"]
    again = httpx.post(url + "/completion", json=body(good), timeout=120).json()
    assert again["tokens"] == first.json()["tokens"]
    positions = first.json()["tokens_evaluated"]
    assert again["timings"]["cache_n"] >= positions - 1  # the image's cells came from the slot
    bad = httpx.post(url + "/completion", json=body(base64.b64encode(b"no image").decode()))
    assert bad.status_code == 400, bad.text
    after = httpx.post(url + "/completion", json=body(good), timeout=120).json()
    assert after["tokens"] == first.json()["tokens"]
    vision_ctx.clear_cache()
    params = llamax.SamplingParams(max_tokens=6, temperature=0.0)
    below = vision_ctx.add_request([head, llamax.Image(picture), tail], params).result()
    assert first.json()["tokens"] == list(below.choices[0].token_ids)
    assert positions == below.usage.prompt_tokens
    assert httpx.post(url + "/slots/1?action=erase").status_code == 200


@pytest.mark.integration
def test_chat_completion_renders_the_image_where_it_sits(each_projector: llamax.Context) -> None:
    """The chat path's prompt is the hand-written ChatML with the image in the user turn:
    the same positions, and the same reply and logprobs (one request at a time)."""
    vision_ctx = each_projector
    image = llamax.Image(png(pixels(7, 48, 64)))
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is "},
                image,
                {"type": "text", "text": " here?"},
            ],
        },
    ]
    greedy = {"max_tokens": 6, "temperature": 0.0, "logprobs": True, "top_logprobs": 3}
    chat = vision_ctx.chat_completion(messages, **greedy)
    vision_ctx.clear_cache()
    by_hand = [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is ",
        image,
        " here?<|im_end|>\n<|im_start|>assistant\n",
    ]
    params = llamax.SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    params = params.with_stop_token_ids(vision_ctx.end_of_turn_token_ids)
    out = vision_ctx.add_request(by_hand, params).result()
    assert chat["usage"]["prompt_tokens"] == out.usage.prompt_tokens
    assert chat["choices"][0]["message"]["content"] == out.text
    lp = out.choices[0].logprobs
    assert lp is not None
    content = chat["choices"][0]["logprobs"]["content"]  # type: ignore[index]
    assert [t["logprob"] for t in content] == [t.logprob for t in lp]


@pytest.mark.integration
def test_model_info_says_whether_images_are_read(
    vision_ctx: llamax.Context, model_path: Path
) -> None:
    assert vision_ctx.model_info().sees_images
    mmproj = vision_files.script().cached_vision_model(projector="janus_pro")
    assert llamax.model_info(model_path, mmproj=mmproj).sees_images
    assert not llamax.model_info(model_path).sees_images
    with pytest.raises(llamax.ProjectorError):
        llamax.model_info(model_path, mmproj=model_path)


def test_a_server_without_a_projector_says_so(shared_ctx: llamax.Context) -> None:
    with BackgroundServer(create_app(shared_ctx)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="smollm2", messages=ask(png_url(0)), max_tokens=2)  # type: ignore[arg-type]
        assert "does not take images" in str(refused.value)
        assert httpx.get(running.url + "/props").json()["modalities"]["vision"] is False
    assert_idle(shared_ctx)
