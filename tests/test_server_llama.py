"""llama-server's native API (``/completion``, ``/props`` ...) on the fake backend, over HTTP
(httpx's ASGI transport); the same on SmolLM2 is in the ``model`` tests at the end."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server_fake import SPECIALS, TEMPLATE, call

import llamax
from llamax.server import create_app
from llamax.testing import FakeBackend, assert_idle


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(
        n_ctx=256, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )


@pytest.fixture
def app(backend: FakeBackend) -> Iterator[Any]:
    ctx = llamax.Context(backend=backend)
    yield create_app(ctx)
    assert_idle(ctx)
    ctx.close()


def post(app: Any, path: str, body: object) -> httpx.Response:
    return call(app, "POST", path, json=body)


def test_completion_native_shape(app: Any) -> None:
    r = post(app, "/completion", {"prompt": "Hello", "n_predict": 4, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["tokens_predicted"] == len(body["tokens"]) == 4
    assert body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_evaluated"] > 0 and body["prompt"]
    assert {"prompt_n", "predicted_n", "predicted_ms", "cache_n"} <= set(body["timings"])
    assert body["generation_settings"]["n_predict"] == 4


def test_completion_without_return_tokens_has_empty_tokens(app: Any) -> None:
    body = post(app, "/completions", {"prompt": "Hello", "n_predict": 2}).json()
    assert body["tokens"] == [] and body["tokens_predicted"] == 2


def test_prompt_as_ids_mixed_and_list(app: Any) -> None:
    assert post(app, "/completion", {"prompt": [5, 6, 7], "n_predict": 1}).status_code == 200
    assert post(app, "/completion", {"prompt": [5, "ab", 7], "n_predict": 1}).status_code == 200
    results = post(app, "/completion", {"prompt": ["a", [5, 6]], "n_predict": 2}).json()
    assert [r["index"] for r in results] == [0, 1]
    one = {"prompt_string": "ab"}
    assert post(app, "/completion", {"prompt": one, "n_predict": 1}).status_code == 200
    assert len(post(app, "/completion", {"prompt": [one, "c"], "n_predict": 1}).json()) == 2
    media = {"prompt_string": "ab", "multimodal_data": ["AAAA"]}
    assert post(app, "/completion", {"prompt": media}).status_code == 400


def test_n_cmpl_gives_prompts_times_n_results(app: Any) -> None:
    results = post(app, "/completion", {"prompt": ["a", "b"], "n_cmpl": 2, "n_predict": 1}).json()
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]


def test_n_predict_zero_generates_nothing(app: Any, backend: FakeBackend) -> None:
    body = post(app, "/completion", {"prompt": "Hello", "n_predict": 0}).json()
    assert body["content"] == "" and body["tokens_predicted"] == 0
    assert backend.decode_log == []


def test_n_probs_gives_completion_probabilities(app: Any) -> None:
    body = post(app, "/completion", {"prompt": "Hi", "n_predict": 2, "n_probs": 3}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 2
    assert {"id", "token", "bytes", "logprob", "top_logprobs"} <= set(probs[0])
    assert len(probs[0]["top_logprobs"]) == 3


def test_post_sampling_probs_are_probabilities_after_the_sampler_chain() -> None:
    """llama.cpp's test_n_probs_post_sampling and test_n_probs_post_backend_sampling: with
    ``post_sampling_probs`` each token has ``prob`` and ``top_probs`` (none at 0), from the
    distribution the chain drew from; ``backend_sampling`` (where llama-server samples)
    changes nothing. At temperature 1 the fake's chain keeps the model's distribution (a
    fake without special tokens: every id it may draw has a piece)."""
    ctx = llamax.Context(backend=FakeBackend(n_ctx=256))
    app = create_app(ctx)
    base = {"prompt": "Today was the day", "n_probs": 10, "n_predict": 5, "seed": 4242,
            "temperature": 1.0}  # fmt: skip
    after = post(app, "/completion", base | {"post_sampling_probs": True}).json()
    model = post(app, "/completion", base).json()
    assert len(after["completion_probabilities"]) == 5
    for tok, plain in zip(after["completion_probabilities"], model["completion_probabilities"],
                          strict=True):  # fmt: skip
        assert set(tok) == {"id", "token", "bytes", "prob", "top_probs"}
        assert tok["id"] == plain["id"] and 0.0 < tok["prob"] <= 1.0
        assert tok["prob"] == pytest.approx(math.exp(plain["logprob"]), abs=1e-5)
        assert 0 < len(tok["top_probs"]) <= 10
        assert all(0.0 < p["prob"] <= 1.0 and set(p) == {"id", "token", "bytes", "prob"}
                   for p in tok["top_probs"])  # fmt: skip
    on_backend = post(app, "/completion", base | {"post_sampling_probs": True,
                                                  "backend_sampling": True}).json()  # fmt: skip
    assert on_backend["completion_probabilities"] == after["completion_probabilities"]
    greedy = post(app, "/completion", base | {"post_sampling_probs": True, "temperature": 0,
                                              "stream": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in greedy.text.splitlines() if line.startswith("data")]
    probs = [p for e in events for p in e.get("completion_probabilities", [])]
    assert len(probs) == 5 and all(p["prob"] == 1.0 and len(p["top_probs"]) == 1 for p in probs)
    assert_idle(ctx)
    ctx.close()


def test_stop_word_is_reported(app: Any) -> None:
    free = post(app, "/completion", {"prompt": "Hi", "n_predict": 6, "temperature": 0}).json()
    word = free["content"][2:4]
    body = post(
        app, "/completion", {"prompt": "Hi", "n_predict": 6, "temperature": 0, "stop": [word]}
    ).json()
    assert body["stop_type"] == "word" and body["stopping_word"] == word
    assert body["content"] == free["content"][: free["content"].index(word)]


def test_streaming_form(app: Any) -> None:
    r = post(app, "/completion", {"prompt": "Hi", "n_predict": 3, "stream": True,
                                  "timings_per_token": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in r.text
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert all("timings" in e for e in events)
    assert "".join(e["content"] for e in events[:-1]) and events[-1]["content"] == ""
    assert events[-1]["tokens_predicted"] == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "mirostat": 2}, "mirostat"),
        ({"prompt": "Hi", "dry_multiplier": 0.5}, "dry_multiplier"),
        ({"prompt": "Hi", "xtc_probability": 0.5}, "xtc_probability"),
        ({"prompt": "Hi", "dynatemp_range": 0.5}, "dynatemp_range"),
        ({"prompt": "Hi", "post_sampling_probs": "yes"}, "post_sampling_probs"),
        ({"prompt": "Hi", "samplers": ["temperature", "top_k"]}, "samplers"),
        ({"prompt": "Hi", "samplers": ["bogus"]}, "samplers"),
        ({"prompt": "Hi", "top_p": 7}, "top_p"),
        ({"prompt": "Hi", "n_predict": "4"}, "n_predict"),
        ({"prompt": "Hi", "nonsense": 1}, "nonsense"),
        ({"prompt": {"x": 1}}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "Hi", "lora": [{"id": 0}]}, "lora"),
    ],
)
def test_bad_bodies_get_llama_server_400s_before_the_engine(
    app: Any, backend: FakeBackend, body: dict[str, Any], param: str
) -> None:
    r = post(app, "/completion", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert param in error["message"]
    assert backend.decode_log == []


def test_off_values_of_missing_samplers_are_accepted(app: Any) -> None:
    body = {"prompt": "Hi", "n_predict": 1, "mirostat": 0, "dry_multiplier": 0,
            "xtc_probability": 0.0, "samplers": ["top_k", "temperature"], "cache_prompt": False,
            "id_slot": -1, "dry_sequence_breakers": ["\n"], "n_keep": 4}  # fmt: skip
    assert post(app, "/completion", body).status_code == 200


def test_prompt_past_the_context_is_exceed_context_size_error(
    app: Any, backend: FakeBackend
) -> None:
    for path, body in (("/completion", {"prompt": "x" * 400}),
                       ("/chat/completions", {"messages": [{"role": "user",
                                                            "content": "x" * 400}]})):  # fmt: skip
        r = post(app, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "exceed_context_size_error"
        assert error["n_ctx"] == 256 and error["n_prompt_tokens"] > 256
    assert backend.decode_log == []


def test_v1_chat_keeps_openai_error_shape(app: Any) -> None:
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 400}]})
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_response_fields(app: Any) -> None:
    fields = ["content", "generation_settings/n_ctx"]
    body = post(app, "/completion", {"prompt": "Hi", "n_predict": 1, "response_fields": fields})
    assert set(body.json()) == {"content", "generation_settings/n_ctx"}


def test_logit_bias_by_id_and_by_text_bans(app: Any) -> None:
    free = post(app, "/completion", {"prompt": "Hi", "n_predict": 4, "temperature": 0,
                                     "return_tokens": True}).json()  # fmt: skip
    first = free["tokens"][0]
    text = post(app, "/detokenize", {"tokens": [first]}).json()["content"]
    for bias in ([[first, False]], [[text, False]], {str(first): -100}):
        request = {"prompt": "Hi", "n_predict": 4, "temperature": 0, "return_tokens": True}
        body = post(app, "/completion", request | {"logit_bias": bias}).json()
        assert body["tokens"][0] != first, bias


def test_a_refused_value_names_the_field_as_given(app: Any, backend: FakeBackend) -> None:
    error = post(app, "/completion", {"prompt": "Hi", "n_probs": 99}).json()["error"]
    assert error["message"].startswith("n_probs ")
    assert backend.decode_log == []


def test_tokenize_options_and_detokenize(app: Any) -> None:
    plain = post(app, "/tokenize", {"content": "<|im_start|>a", "parse_special": False}).json()
    special = post(app, "/tokenize", {"content": "<|im_start|>a"}).json()
    assert special["tokens"][0] == 300 and 300 not in plain["tokens"]
    pieces = post(app, "/tokenize", {"content": "ab", "with_pieces": True}).json()["tokens"]
    assert all({"id", "piece"} <= set(p) for p in pieces)
    ids = post(app, "/tokenize", {"content": "abc"}).json()["tokens"]
    assert post(app, "/detokenize", {"tokens": ids}).json()["content"] == "abc"


def test_apply_template_props_and_aliases(app: Any) -> None:
    hey = [{"role": "user", "content": "hey"}]
    prompt = post(app, "/apply-template", {"messages": hey})
    assert prompt.json()["prompt"].endswith(
        "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n"
    )
    bare = post(app, "/apply-template", {"messages": hey, "add_generation_prompt": False})
    assert bare.json()["prompt"].endswith("hey<|im_end|>\n")
    props = call(app, "GET", "/props").json()
    assert props["total_slots"] >= 1 and props["default_generation_settings"]["n_ctx"] == 256
    assert "chat_template" in props
    refused = call(app, "POST", "/props", json={})
    assert refused.status_code == 501 and refused.json()["error"]["type"] == "not_supported_error"
    counted = post(app, "/chat/completions/input_tokens",
                   {"messages": [{"role": "user", "content": "hey"}]}).json()  # fmt: skip
    assert counted["object"] == "response.input_tokens" and counted["input_tokens"] > 0
    assert call(app, "GET", "/v1/health").status_code == 200
    assert call(app, "GET", "/models").json()["object"] == "list"
    chat = post(app, "/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
    assert chat.json()["object"] == "chat.completion"
    assert post(app, "/responses", {"input": "hi", "max_output_tokens": 2}).status_code == 200


def test_apply_template_joins_text_parts(app: Any) -> None:
    """Content as a list of text parts is one string to the template, as in a chat request
    (the list itself went to SmolLM2's template, which cannot concatenate it: 400)."""
    parts = [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]
    prompt = post(app, "/apply-template", {"messages": [{"role": "user", "content": parts}]})
    assert prompt.status_code == 200, prompt.text
    assert prompt.json()["prompt"].endswith(
        "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n"
    )


def test_apply_template_bad_messages_is_400(app: Any) -> None:
    r = post(app, "/apply-template", {"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


@pytest.mark.model
def test_completion_on_smollm2_over_http(model_path: Path) -> None:
    from openai import OpenAI

    ctx = llamax.Context(model_path, n_ctx=512, n_seq_max=2)
    try:
        app = create_app(ctx)
        body = post(app, "/completion", {"prompt": "The capital of France is", "n_predict": 4,
                                         "temperature": 0, "n_probs": 2}).json()  # fmt: skip
        assert body["tokens_predicted"] == 4 and body["stop_type"] == "limit"
        assert len(body["completion_probabilities"]) == 4
        again = post(app, "/completion", {"prompt": "The capital of France is", "n_predict": 4,
                                          "temperature": 0}).json()  # fmt: skip
        assert again["content"] == body["content"] and again["tokens_cached"] > 0
        assert post(app, "/completion", {"prompt": "word " * 600}).json()["error"]["type"] == (
            "exceed_context_size_error"
        )
        transport = httpx.Client(transport=_SyncASGI(app), base_url="http://t")
        client = OpenAI(base_url="http://t", api_key="x", http_client=transport)
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.choices[0].message.content is not None
        assert_idle(ctx, timeout=60)
    finally:
        ctx.close()


@pytest.mark.model
def test_post_sampling_probs_on_smollm2_over_http(real_ctx: llamax.Context) -> None:
    """llama.cpp's test_n_probs_post_sampling on SmolLM2, with its default samplers (top-k
    40, top-p 0.95, min-p 0.05): ten candidates for the first token of a vague prompt, each
    above 0, and fewer only when they are all the chain kept (summing to 1)."""
    app = create_app(real_ctx)
    body = post(app, "/completion", {"prompt": "Today was the day. Today I would finally become a",
                                     "n_probs": 10, "temperature": 1.0, "n_predict": 5,
                                     "post_sampling_probs": True, "seed": 4242}).json()  # fmt: skip
    probs = body["completion_probabilities"]
    assert len(probs) == 5
    for i, tok in enumerate(probs):
        assert tok["id"] > 0 and 0.0 < tok["prob"] <= 1.0 and isinstance(tok["bytes"], list)
        assert all(0.0 < p["prob"] <= 1.0 for p in tok["top_probs"])
        if i == 0:
            assert len(tok["top_probs"]) == 10
        if len(tok["top_probs"]) < 10:
            assert sum(p["prob"] for p in tok["top_probs"]) == pytest.approx(1.0, abs=1e-4)


class _SyncASGI(httpx.BaseTransport):
    """httpx's ASGI transport for a sync client (the ``openai`` client on ``/chat/completions``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        import asyncio

        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.request(
                    request.method, str(request.url), content=request.read(),
                    headers=dict(request.headers),
                )  # fmt: skip
                return httpx.Response(r.status_code, headers=r.headers, content=r.content)

        return asyncio.run(go())
