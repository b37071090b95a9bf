"""Images in chat messages through the library's chat API, on the fake backend (issue 42):
OpenAI ``image_url`` parts with ``data:`` URLs and ``llamax.Image`` objects in a user
message's content, rendered where they sit by the model's own template; Anthropic's
``image`` blocks and the Responses API's ``input_image`` parts mapped onto them; what is
refused (with a typed error, before anything reaches the engine); and the counts a
conversation with images is fitted and counted by."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vision_files import pixels, png

import llamax
from llamax.anthropic import count_tokens, messages
from llamax.openai import create_response
from llamax.testing import FakeBackend

Make = Callable[..., tuple[llamax.Context, FakeBackend]]
TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
IMAGE_TOKENS = 8


@pytest.fixture
def make_chat(make_fake: Make) -> Callable[..., tuple[llamax.Context, FakeBackend]]:
    def make(**options: Any) -> tuple[llamax.Context, FakeBackend]:
        options.setdefault("image_tokens", IMAGE_TOKENS)
        options.setdefault("n_ctx", 1024)
        return make_fake(
            metadata={"tokenizer.chat_template": options.pop("template", TEMPLATE)},
            special_tokens=SPECIALS,
            autostart=True,
            **options,
        )

    return make


def png_bytes(seed: int) -> bytes:
    return png(pixels(seed, 4, 5))


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()


def image_part(seed: int, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(seed), **extra}}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def ask(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def shape(parts: list[Any]) -> list[Any]:
    """Rendered parts with each image as ``"image"`` (images compare by identity)."""
    return ["image" if isinstance(p, llamax.Image) else p for p in parts]


def decoded_images(backend: FakeBackend) -> int:
    return sum(len(i.token_ids) for s in backend.decode_log for i in s if i.embeddings is not None)


# ---------------------------------------------------------------------- rendering
def test_an_image_is_rendered_where_its_part_sits(make_chat: Callable[..., Any]) -> None:
    ctx, _ = make_chat()
    parts = ctx.chat_prompt_parts(ask(text("What is "), image_part(1), text(" this?")))
    at = next(i for i, p in enumerate(parts) if isinstance(p, llamax.Image))
    before = ctx.chat_prompt([{"role": "user", "content": "What is "}])
    cut = len(before) - 1 - before[::-1].index(SPECIALS["<|im_end|>"])  # the user turn's end
    assert parts[:at] == before[:cut]  # the text before it, as text alone renders it
    after = ctx.tokenize(" this?<|im_end|>\n<|im_start|>assistant\n", add_special=False)
    assert parts[at + 1 :] == after
    assert ctx.prompt_positions(parts) == len(parts) - 1 + IMAGE_TOKENS
    with pytest.raises(llamax.InvalidMessageError, match="chat_prompt_parts"):
        ctx.chat_prompt(ask(image_part(1)))


def test_an_image_object_is_the_same_as_its_data_url(make_chat: Callable[..., Any]) -> None:
    ctx, backend = make_chat()
    greedy = {"max_tokens": 3, "temperature": 0.0}
    by_url = ctx.chat_completion(ask(text("a "), image_part(3), text(" b")), **greedy)
    by_object = ctx.chat_completion(
        ask(text("a "), llamax.Image(png_bytes(3)), text(" b")), **greedy
    )
    assert by_url["usage"]["prompt_tokens"] == by_object["usage"]["prompt_tokens"]
    assert by_object["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
        by_object["usage"]["prompt_tokens"] - 1
    )  # the whole prompt was a prefix hit, the image included
    assert backend.fault_calls["encode_image"] == 1
    assert by_url["choices"][0]["message"] == by_object["choices"][0]["message"]


def test_images_in_a_chat_completion_count_and_reuse(make_chat: Callable[..., Any]) -> None:
    ctx, backend = make_chat()
    two = ask(text("Compare "), image_part(1), text(" with "), image_part(2), text("."))
    first = ctx.chat_completion(two, max_tokens=3)
    text_only = ctx.chat_completion(ask(text("Compare  with .")), max_tokens=3)
    num_text = text_only["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens"] == num_text + 2 * IMAGE_TOKENS
    assert decoded_images(backend) == 2 * IMAGE_TOKENS
    again = ctx.chat_completion(two, max_tokens=3)
    assert (
        again["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_text + 2 * IMAGE_TOKENS - 1
    )
    other = ctx.chat_completion(
        ask(text("Compare "), image_part(1), text(" with "), image_part(4), text(".")),
        max_tokens=3,
    )  # the same first image: a prefix through it, not past the second
    cached = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert IMAGE_TOKENS < cached < num_text + IMAGE_TOKENS
    streamed = list(ctx.chat_completion(two, max_tokens=3, stream=True))
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    assert ctx.audit() == []


def test_async_chat_completion_takes_images(make_chat: Callable[..., Any]) -> None:
    import asyncio

    ctx, _ = make_chat()
    out = asyncio.run(ctx.achat_completion(ask(image_part(1), text("?")), max_tokens=2))
    assert out["usage"]["prompt_tokens"] > IMAGE_TOKENS


def test_add_request_takes_the_rendered_parts(make_chat: Callable[..., Any]) -> None:
    ctx, _ = make_chat()
    parts = ctx.chat_prompt_parts(ask(text("x "), image_part(5), text(" y")))
    params = llamax.SamplingParams(max_tokens=2, temperature=0.0)
    out = ctx.add_request(parts, params).result()
    assert out.usage.prompt_tokens == ctx.prompt_positions(parts)
    with pytest.raises(llamax.InvalidRequestError, match="in \\[0, "):
        ctx.add_request([*parts[:-1], 10**6], params)
    with pytest.raises(llamax.InvalidRequestError, match="parts must be"):
        ctx.add_request([*parts, "text too"], params)


def test_every_rendering_path_places_the_image(make_chat: Callable[..., Any]) -> None:
    """Plain content, special-token parsing in content, and a template that rewrites
    content (rendered as a whole): the image lands in each; a template that loses the
    marker is a TemplateError, not a silently dropped image."""
    ctx, _ = make_chat()
    conversation = ask(text("see "), image_part(1), text(" now"))
    plain = ctx.chat_prompt_parts(conversation)
    special = ctx.chat_prompt_parts(conversation, parse_special_in_content=True)
    assert shape(plain) == shape(special) and shape(plain).count("image") == 1
    rewriting = "{% for m in messages %}[{{ m.content | replace('see', 'look at') }}]{% endfor %}"
    ctx2, _ = make_chat(template=rewriting)
    parts = ctx2.chat_prompt_parts(conversation)
    at = next(i for i, p in enumerate(parts) if isinstance(p, llamax.Image))
    assert (
        ctx2.detokenize(parts[:at]) == "[look at " and ctx2.detokenize(parts[at + 1 :]) == " now]"
    )  # type: ignore[arg-type]
    ctx3, backend3 = make_chat(
        template="{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    )
    with pytest.raises(llamax.TemplateError, match="left 1 of the 1 images out"):
        ctx3.chat_completion(conversation, max_tokens=2)
    assert not backend3.decode_log


def test_a_conversation_with_images_is_fitted_by_its_positions(
    make_chat: Callable[..., Any],
) -> None:
    """``truncate`` counts an image as its positions: a first turn whose image does not fit
    is dropped (counted as one token, it looked as if it fitted, and the request failed)."""
    ctx, _ = make_chat(image_tokens=120, n_ctx=256)
    conversation = [
        {"role": "user", "content": [text("old "), image_part(1)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "new question"},
    ]
    with pytest.raises(llamax.ContextLengthError) as too_long:
        ctx.chat_completion(conversation, max_tokens=16)
    assert too_long.value.num_prompt_tokens > 256 - 16
    out = ctx.chat_completion(conversation, max_tokens=16, truncate="oldest_messages")
    assert out["usage"]["prompt_tokens"] < 120  # the image's turn is gone


# ---------------------------------------------------------------------- refused
BAD_PARTS = [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote"),
    ({"type": "image_url", "image_url": {"url": "data:text/html;base64,aGVsbG8="}}, "not an image"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64 is damaged"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "must be base64"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, "an object"),
    (image_part(1, detail="ultra"), "detail must be"),
    (image_part(1, size=3), "unknown field 'size'"),
    ({"type": "input_audio", "input_audio": {}}, "'text' and 'image_url'"),
]


@pytest.mark.parametrize(("part", "match"), BAD_PARTS, ids=[m for _, m in BAD_PARTS])
def test_bad_image_parts_are_message_errors(
    make_chat: Callable[..., Any], part: dict[str, Any], match: str
) -> None:
    ctx, backend = make_chat()
    with pytest.raises(llamax.InvalidMessageError, match=match) as info:
        ctx.chat_completion(ask(text("x"), part), max_tokens=2)
    assert info.value.index == 0 and info.value.field == "content"
    assert not backend.decode_log and not ctx.has_work()


def test_bad_images_never_reach_the_engine(make_chat: Callable[..., Any]) -> None:
    ctx, backend = make_chat()
    not_an_image = "data:image/png;base64," + base64.b64encode(b"hello there").decode()
    truncated = png_bytes(1)[:-20]
    huge = png(pixels(1, 2, 2), width=100_000, height=100_000)
    for source, match in (
        ({"type": "image_url", "image_url": {"url": not_an_image}}, "not an image"),
        (llamax.Image(truncated), "truncated PNG"),
        (llamax.Image(huge), "the limit is"),
    ):
        with pytest.raises(llamax.ImageError, match=match):
            ctx.chat_completion(ask(text("x"), source), max_tokens=2)
    with pytest.raises(llamax.InvalidMessageError, match="only user messages"):
        ctx.chat_completion(
            [{"role": "system", "content": [image_part(1)]}, *ask(text("x"))], max_tokens=2
        )
    assert not backend.decode_log and not ctx.has_work()


def test_a_context_without_a_projector_refuses_images(make_chat: Callable[..., Any]) -> None:
    ctx, backend = make_chat(image_tokens=None)
    for call in (
        lambda: ctx.chat_completion(ask(image_part(1), text("?")), max_tokens=2),
        lambda: ctx.prompt_positions(ctx.chat_prompt_parts(ask(image_part(1), text("?")))),
        lambda: ctx.add_request([1, 2, llamax.Image(png_bytes(1)), 3]),
    ):
        with pytest.raises(llamax.ImageError, match="does not take images"):
            call()
    assert not ctx.sees_images and not backend.decode_log and not ctx.has_work()
    assert ctx.chat_completion(ask(text("plain")), max_tokens=2)["object"] == "chat.completion"


def test_a_chat_takes_images_and_keeps_them_between_turns(
    make_chat: Callable[..., Any],
) -> None:
    """A ``Chat`` runs on a session: an image of turn 1 is decoded once, and turns 2 and 3
    reuse it with the rest of the history (the old code refused images in a Chat)."""
    ctx, backend = make_chat()
    params = llamax.SamplingParams(max_tokens=3, temperature=0.0)
    with ctx.chat(params=params) as chat:
        out = chat.send([text("Hi"), text(" there")])
        assert chat.messages[0]["content"] == "Hi there" and out.usage.prompt_tokens > 0
        chat.send([text("What is "), image_part(1), text("?")])
        assert decoded_images(backend) == IMAGE_TOKENS
        held = chat.session.token_ids
        for question in ("And its colour?", "Thanks."):
            before = chat.messages
            reply = chat.send(question)
            assert chat.last_turn is not None and chat.last_turn.reused_tokens == len(held)
            assert decoded_images(backend) == IMAGE_TOKENS  # never decoded again
            held = chat.session.token_ids
        conversation = [*before, {"role": "user", "content": "Thanks."}]
        assert ctx.prompt_positions(ctx.chat_prompt_parts(conversation)) == (
            reply.usage.prompt_tokens
        )
    cold_ctx, _ = make_chat()
    cold = cold_ctx.chat_completion(conversation, max_tokens=3, temperature=0.0)
    assert cold["choices"][0]["message"]["content"] == reply.text
    with ctx.chat(messages=ask(image_part(1)), params=params) as started:
        again = started.send("Again?")
        assert again.usage.prompt_tokens > IMAGE_TOKENS and started.session.token_ids
    plain, _ = make_chat(image_tokens=None)
    with plain.chat() as chat:
        with pytest.raises(llamax.ImageError, match="does not take images"):
            chat.send([text("What is "), image_part(1)])
        assert chat.messages == []  # the refused turn left the history as it was


def test_a_chat_drops_an_old_image_turn_by_shifting_the_cache(
    make_chat: Callable[..., Any],
) -> None:
    """A turn that no longer fits drops the oldest turn, its image with it: the cache is
    shifted past it (whole messages, so never part of an image) and the rest reused."""
    ctx, backend = make_chat()
    params = llamax.SamplingParams(max_tokens=3, temperature=0.0)
    with ctx.chat(system="Be brief.", max_context=120, params=params) as chat:
        chat.send([text("What is "), image_part(2), text("?")])
        chat.send("Say more.")
        decoded = decoded_images(backend)
        chat.send("And more, please, as much as you can.")
        turn = chat.last_turn
        assert turn is not None and turn.dropped_messages == 2 and turn.shifted_tokens > 8
        assert turn.reused_tokens > 0
        assert decoded_images(backend) == decoded  # the image went, none was computed
        assert all(isinstance(m["content"], str) for m in chat.messages)  # the image's gone
        assert ctx.audit() == []


def test_tools_and_images_in_one_request(make_chat: Callable[..., Any]) -> None:
    ctx, _ = make_chat()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    out = ctx.chat_completion(ask(text("look "), image_part(1)), tools=[tool], max_tokens=4)
    assert out["usage"]["prompt_tokens"] > IMAGE_TOKENS


# ---------------------------------------------------------------------- other shapes
def test_anthropic_image_blocks(make_chat: Callable[..., Any]) -> None:
    ctx, backend = make_chat()
    source = {"type": "base64", "media_type": "image/png", "data": data_url(2).split(",")[1]}
    request = {
        "max_tokens": 3,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is "},
                    {"type": "image", "source": source},
                    {"type": "text", "text": " this?"},
                ],
            },
        ],
    }
    reply = messages(ctx, request)
    assert isinstance(reply, dict) and reply["type"] == "message"
    same = ctx.chat_completion(ask(text("What is "), image_part(2), text(" this?")), max_tokens=3)
    counted = count_tokens(ctx, {"messages": request["messages"]})["input_tokens"]
    assert counted == same["usage"]["prompt_tokens"]
    assert reply["usage"]["input_tokens"] == counted
    for bad, match in (
        ({"type": "url", "url": "https://example.com/a.png"}, "not fetched here"),
        ({**source, "media_type": "text/plain"}, "not an image type"),
        ({**source, "data": "!!"}, "damaged"),
        ({"type": "file", "file_id": "x"}, "must be 'base64' or 'url'"),
    ):
        block = {"type": "image", "source": bad}
        broken = {**request, "messages": [{"role": "user", "content": [block]}]}
        with pytest.raises(llamax.InvalidRequestError, match=match):
            messages(ctx, broken)
    assert decoded_images(backend) == IMAGE_TOKENS


def test_responses_input_image_parts(make_chat: Callable[..., Any]) -> None:
    ctx, _ = make_chat()
    store = llamax.openai.ResponseStore()
    content = [
        {"type": "input_text", "text": "What is "},
        {"type": "input_image", "image_url": data_url(4), "detail": "low"},
    ]
    turn = {"role": "user", "content": content}
    first = create_response(ctx, {"input": [turn], "max_output_tokens": 3}, store=store)
    assert isinstance(first, dict) and first["status"] in ("completed", "incomplete")
    then = {"input": "and now?", "previous_response_id": first["id"], "max_output_tokens": 3}
    follow = create_response(ctx, then, store=store)
    assert isinstance(follow, dict)
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] > IMAGE_TOKENS
    assert store.num_chars > len(png_bytes(4))  # the stored image counts against the bound
    for part, match in (
        ({"type": "input_image", "file_id": "file_1"}, "file_id is not supported"),
        ({"type": "input_image", "image_url": "https://x/a.png"}, "not fetched here"),
        ({"type": "input_image", "image_url": data_url(4), "detail": "max"}, "detail"),
    ):
        with pytest.raises(llamax.InvalidRequestError, match=match):
            create_response(ctx, {"input": [{"role": "user", "content": [part]}]})
