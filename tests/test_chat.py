"""chat_completion / completion shapes, end-of-turn stops and chat history shift, no model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import llamax
from llamax.templates.template import TemplateError
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
IM_START, IM_END = 300, 301
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}


def replies(reply: str) -> Any:
    """A fake model that answers every assistant turn with ``reply`` then <|im_end|>."""
    script = [b + 1 for b in reply.encode()] + [IM_END]

    def next_token(history: Sequence[int]) -> int:
        if IM_START not in history:
            return ord("x") + 1
        since = len(history) - 1 - max(i for i, t in enumerate(history) if t == IM_START)
        generated = since - len(b"assistant\n")
        return script[min(max(generated, 0), len(script) - 1)]

    return next_token


def make(reply: str = "Hello there!", *, autostart: bool = False, **options: Any) -> llamax.Context:
    backend = FakeBackend(
        n_ctx=options.pop("n_ctx", 1024),
        n_seq_max=options.pop("n_seq_max", 4),
        next_token=replies(reply),
        metadata={"tokenizer.chat_template": options.pop("template", TEMPLATE)},
        special_tokens=SPECIALS,
        **options,
    )
    return llamax.Context(backend=backend, autostart=autostart)


@pytest.fixture
def ctx() -> Any:
    context = make()
    yield context
    assert_idle(context)
    context.close()


USER = [{"role": "user", "content": "Hi!"}]


def test_chat_completion_is_openai_shaped(ctx: llamax.Context) -> None:
    response = ctx.chat_completion(USER, max_tokens=32, temperature=0)
    parsed = ChatCompletion.model_validate(response)
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.content == "Hello there!"
    assert parsed.choices[0].finish_reason == "stop"  # at <|im_end|>, which is no EOG here
    assert response["usage"]["completion_tokens"] == len("Hello there!")
    assert parsed.model == "fake" and parsed.id.startswith("chatcmpl-")


def test_chat_stream_chunks_are_openai_shaped(ctx: llamax.Context) -> None:
    chunks = list(
        ctx.chat_completion(
            USER,
            max_tokens=32,
            n=2,
            temperature=0.7,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    for index in (0, 1):
        mine = [c.choices[0] for c in parsed if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason in ("stop", "length")
        assert all(c.finish_reason is None for c in mine[:-1])
        assert "".join(c.delta.content or "" for c in mine)
    assert parsed[-1].choices == [] and parsed[-1].usage is not None
    assert parsed[-1].usage.prompt_tokens == len(ctx.chat_prompt(USER))


def test_text_completion_shapes(ctx: llamax.Context) -> None:
    response = ctx.completion("abc", max_tokens=3, temperature=0)
    assert OpenAICompletion.model_validate(response).choices[0].finish_reason == "length"
    chunks = list(ctx.completion("abc", max_tokens=3, temperature=0, stream=True))
    # OpenAI streams text chunks with finish_reason null until the last one; its SDK type
    # only admits the final value, so validate the last chunk and the keys of the rest.
    OpenAICompletion.model_validate(chunks[-1])
    assert all(set(c) == set(chunks[-1]) and c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == response["choices"][0]["text"]


def test_a_model_option_is_echoed_as_the_responses_model(ctx: llamax.Context) -> None:
    assert ctx.chat_completion(USER, max_tokens=2, model="my-model")["model"] == "my-model"
    chunks = list(ctx.chat_completion(USER, max_tokens=2, model="my-model", stream=True))
    assert {c["model"] for c in chunks} == {"my-model"}
    assert ctx.completion("abc", max_tokens=2, model="my-model")["model"] == "my-model"
    for model in (None, ""):  # none given: the GGUF's name
        assert ctx.chat_completion(USER, max_tokens=2, model=model)["model"] == "fake"


def test_async_twins_inside_a_running_loop() -> None:
    context = make(autostart=True)

    async def main() -> tuple[Any, list[Any]]:
        whole = await context.achat_completion(USER, max_tokens=32, temperature=0)
        stream = await context.achat_completion(USER, max_tokens=32, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        text = await context.acompletion("abc", max_tokens=3)
        assert text["object"] == "text_completion"
        return whole, chunks

    whole, chunks = asyncio.run(main())
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == whole["choices"][0]["message"]["content"] == "Hello there!"
    assert_idle(context)
    context.close()


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "url"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "'text' and 'image_url'"),
        ([{"content": "x"}], "role"),
        ("not a list", "list"),
    ],
)
def test_bad_messages_raise_clear_errors(ctx: llamax.Context, messages: Any, match: str) -> None:
    with pytest.raises(llamax.InvalidRequestError, match=match):
        ctx.chat_completion(messages)
    assert ctx.chat_completion(USER, max_tokens=4)["object"] == "chat.completion"


def test_text_parts_are_joined(ctx: llamax.Context) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
    ]
    assert ctx.chat_prompt(parts) == ctx.chat_prompt(USER)


def test_missing_template_says_how_to_pass_one() -> None:
    context = make(template="")
    with pytest.raises(TemplateError, match="chat_template="):
        context.chat_completion(USER)
    context.close()
    backend = FakeBackend(special_tokens=SPECIALS, next_token=replies("x"))
    override = llamax.Context(backend=backend, autostart=False, chat_template=TEMPLATE)
    assert override.chat_completion(USER, max_tokens=4, temperature=0)["choices"][0]["message"]
    override.close()


def test_over_long_conversation_needs_truncate(ctx: llamax.Context) -> None:
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(30):
        history += [
            {"role": "user", "content": f"question {i} " * 3},
            {"role": "assistant", "content": "ok"},
        ]
    history.append({"role": "user", "content": "last question"})
    with pytest.raises(llamax.ContextLengthError, match="truncate="):
        ctx.chat_completion(history, max_tokens=64)
    response = ctx.chat_completion(
        history, max_tokens=64, truncate="oldest_messages", temperature=0
    )
    assert response["usage"]["prompt_tokens"] + 64 <= ctx.n_ctx
    assert response["choices"][0]["message"]["content"] == "Hello there!"


def test_concurrent_chat_completions_batch_and_share_the_system_prompt() -> None:
    context = make(autostart=True, n_seq_max=8)
    system = {"role": "system", "content": "You are a careful assistant. " * 6}
    results: list[Any] = []

    def client(i: int) -> None:
        msgs = [system, {"role": "user", "content": f"{chr(65 + i)} question"}]
        results.append(context.chat_completion(msgs, max_tokens=16, temperature=0))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    assert (
        context.stats().num_cached_tokens
        >= 7 * len(context.chat_prompt([system], add_generation_prompt=False)) - 8
    )
    assert_idle(context)
    context.close()


# ---------------------------------------------------------------------- chat sessions
def run_chat(
    context: llamax.Context, turns: int, **chat_options: Any
) -> tuple[llamax.Chat, list[Any]]:
    chat = context.chat(system="You are terse.", **chat_options)
    stats = []
    for i in range(turns):
        chat.send(f"This is user message number {i}.")
        stats.append(chat.last_turn)
    return chat, stats


def test_chat_turns_compute_only_the_new_message(ctx: llamax.Context) -> None:
    params = llamax.SamplingParams(max_tokens=16, temperature=0)
    chat, stats = run_chat(ctx, 6, params=params)
    for turn in stats[1:]:
        assert turn.computed_tokens < 60  # the new message plus template glue, not the history
        assert turn.reused_tokens > 0
    chat.close()


def test_history_shift_drops_oldest_turns_and_matches_cold_prefill(ctx: llamax.Context) -> None:
    params = llamax.SamplingParams(max_tokens=16, temperature=0)
    chat, stats = run_chat(ctx, 12, params=params, max_context=256)
    shifted = [s for s in stats if s.dropped_messages]
    assert shifted and all(s.shifted_tokens > 0 for s in shifted)
    assert all(s.computed_tokens < 60 for s in stats[1:])
    messages = chat.messages
    assert messages[0]["role"] == "system" and len(messages) < 2 * 12 + 1
    assert ctx._backend.num_shifts == len(shifted)  # type: ignore[attr-defined]
    cold = make()
    last_prompt = messages[:-1]
    expected = cold.chat_completion(last_prompt, max_tokens=16, temperature=0)
    assert expected["choices"][0]["message"]["content"] == messages[-1]["content"]
    cold.close()
    chat.close()


def test_history_shift_without_a_system_message_keeps_the_default_one(
    ctx: llamax.Context,
) -> None:
    # SmolLM2's template adds a default system prompt when the conversation has none; the
    # shift must keep those cells and remove only the dropped turns.
    params = llamax.SamplingParams(max_tokens=16, temperature=0)
    chat = ctx.chat(params=params, max_context=256)
    stats = []
    for i in range(12):
        chat.send(f"This is user message number {i}.")
        stats.append(chat.last_turn)
    shifted = [s for s in stats if s and s.dropped_messages]
    assert shifted and all(s.shifted_tokens > 0 for s in shifted)
    assert all(s is not None and s.computed_tokens < 60 for s in stats[1:])
    assert chat.messages[0]["role"] == "user"
    cold = make()
    expected = cold.chat_completion(chat.messages[:-1], max_tokens=16, temperature=0)
    assert expected["choices"][0]["message"]["content"] == chat.messages[-1]["content"]
    cold.close()
    chat.close()


def test_without_shift_support_the_dropped_history_is_recomputed() -> None:
    context = make(can_shift=False)
    params = llamax.SamplingParams(max_tokens=16, temperature=0)
    chat, stats = run_chat(context, 10, params=params, max_context=256)
    dropped = [s for s in stats if s.dropped_messages]
    assert dropped and all(s.shifted_tokens == 0 for s in dropped)
    assert max(s.computed_tokens for s in dropped) > 60
    chat.close()
    assert_idle(context)
    context.close()


def test_template_that_renders_differently_recomputes_from_first_difference() -> None:
    numbered = (
        "{% for m in messages %}<|im_start|>{{ loop.index }} {{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    context = make(template=numbered)
    params = llamax.SamplingParams(max_tokens=16, temperature=0)
    chat, stats = run_chat(context, 10, params=params, max_context=200)
    assert any(s.dropped_messages for s in stats)
    cold = make(template=numbered)
    expected = cold.chat_completion(chat.messages[:-1], max_tokens=16, temperature=0)
    assert expected["choices"][0]["message"]["content"] == chat.messages[-1]["content"]
    cold.close()
    chat.close()
    assert_idle(context)
    context.close()


def test_chat_stream_updates_history(ctx: llamax.Context) -> None:
    with ctx.chat(system="s") as chat:
        text = "".join(
            e.text
            for e in chat.stream("hello", llamax.SamplingParams(max_tokens=16, temperature=0))
        )
        assert text == "Hello there!"
        assert chat.messages[-1] == {"role": "assistant", "content": "Hello there!"}
        with pytest.raises(llamax.InvalidParameterError, match="n must be 1"):
            chat.send("x", llamax.SamplingParams(n=2))


def test_unknown_options_raise_type_error_naming_the_closest(ctx: llamax.Context) -> None:
    with pytest.raises(TypeError, match=r"'max_token'.*did you mean 'max_tokens'"):
        ctx.chat_completion(USER, max_token=4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'temprature'.*did you mean 'temperature'"):
        ctx.completion("Hi", temprature=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'bogus'"):
        asyncio.run(ctx.achat_completion(USER, bogus=1))  # type: ignore[call-arg]
    assert ctx.chat_completion(USER, max_tokens=4, temperature=0)["choices"]


def test_closing_a_chunk_stream_cancels_the_request(ctx: llamax.Context) -> None:
    stream = ctx.chat_completion(USER, max_tokens=200, temperature=0, stream=True)
    first = next(stream)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    stream.close()
    while ctx.has_work():
        ctx.process()
    assert ctx.stats().num_running == 0 and ctx.stats().num_unsettled == 0


def test_llama_cpp_extensions_reach_the_sampler(ctx: llamax.Context) -> None:
    grammar = 'root ::= "Hel" "lo"'
    response = ctx.chat_completion(
        USER, max_tokens=8, top_k=5, min_p=0.1, repeat_penalty=1.1, grammar=grammar
    )
    assert response["choices"][0]["message"]["content"]


def test_closing_a_chunk_stream_before_its_first_chunk_cancels(ctx: llamax.Context) -> None:
    stream = ctx.chat_completion(USER, max_tokens=200, temperature=0, stream=True)
    stream.close()
    while ctx.has_work():
        ctx.process()
    assert ctx.stats().num_unsettled == 0

    async def async_close() -> None:
        background = make(autostart=True)
        astream = await background.achat_completion(USER, max_tokens=500, stream=True)
        await astream.aclose()
        assert_idle(background)
        background.close()

    asyncio.run(async_close())


def test_detokenize_refuses_ids_outside_the_vocabulary(ctx: llamax.Context) -> None:
    assert ctx.detokenize([105, 106]) == "hi"
    for bad in ([-1], [ctx.n_vocab], ["a"]):
        with pytest.raises(llamax.InvalidRequestError, match="token ids"):
            ctx.detokenize(bad)  # type: ignore[list-item]
