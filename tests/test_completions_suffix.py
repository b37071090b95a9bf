"""``suffix`` on ``/v1/completions`` (issue 44): a fill-in-the-middle prompt made with the
model's FIM tokens, through the real ``openai`` client; a 400 naming ``suffix`` on a model
without them, before anything is queued. On the fake backend (the prompt the model saw),
then on SmolLM2 and its FIM copy (``scripts/make_fim_model.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_model_server_llama_native import fim_model

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.server.routes import fim_prompt
from llamax.testing import FakeBackend, assert_idle

__all__ = ["fim_model"]  # the FIM copy of SmolLM2, a module-scoped fixture

PRE, SUF, MID = 300, 301, 302
FIM = {"<fim_prefix>": PRE, "<fim_suffix>": SUF, "<fim_middle>": MID}


def _text(text: str) -> list[int]:
    return [b + 1 for b in text.encode()]  # the fake's tokens: one per byte


class Recorder:
    """A fake model that writes ``x`` and remembers every prompt it was first asked about."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def __call__(self, history: Sequence[int]) -> int:
        if history and history[-1] != ord("x") + 1:
            self.prompts.append(list(history))
        return ord("x") + 1


def serve(fim: bool) -> tuple[llamax.Context, Recorder]:
    recorder = Recorder()
    backend = FakeBackend(
        n_ctx=1024, n_seq_max=4, next_token=recorder, special_tokens=FIM if fim else {}
    )
    return llamax.Context(backend=backend, autostart=True), recorder


@pytest.fixture
def fim_server() -> Iterator[tuple[llamax.Context, Recorder, str]]:
    ctx, recorder = serve(fim=True)
    with ctx, BackgroundServer(create_app(ctx)) as running:
        yield ctx, recorder, running.url
        assert_idle(ctx)


def test_a_suffix_is_a_fim_prompt(fim_server: tuple[llamax.Context, Recorder, str]) -> None:
    ctx, recorder, url = fim_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    reply = client.completions.create(
        model="m", prompt="def f():\n", suffix="\n<fim_middle>", max_tokens=3, temperature=0
    )
    assert reply.choices[0].text == "xxx"
    # the prompt, then the suffix, each plain (the suffix's special-token text is text)
    expected = [PRE, *_text("def f():\n"), SUF, *_text("\n<fim_middle>"), MID]
    assert recorder.prompts == [expected]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    assert fim_prompt(ctx, "def f():\n", "\n<fim_middle>") == expected
    streamed = client.completions.create(
        model="m",
        prompt=[*_text("a")],
        suffix="b",
        max_tokens=2,
        echo=True,
        stream=True,
        temperature=0,
    )
    assert "".join(c.choices[0].text for c in streamed) == "axx"  # echo: the prompt first
    assert recorder.prompts[-1] == [PRE, *_text("a"), SUF, *_text("b"), MID]
    for no_suffix in (None, ""):
        recorder.prompts.clear()
        client.completions.create(
            model="m", prompt="ab", suffix=no_suffix, max_tokens=1, temperature=0
        )
        assert recorder.prompts == [_text("ab")]


def test_a_suffix_without_fim_tokens_is_a_400_naming_it() -> None:
    ctx, recorder = serve(fim=False)
    with ctx, BackgroundServer(create_app(ctx)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="m", prompt="ab", suffix="cd", max_tokens=2)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "suffix"
        assert "fill-in-the-middle" in error["message"]
        assert "no FIM prefix, suffix, middle token" in error["message"]
        stream = httpx.post(
            running.url + "/v1/completions",
            json={"prompt": "ab", "suffix": "cd", "stream": True},
        )
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "suffix"
        assert recorder.prompts == [] and ctx.stats().num_steps == 0  # nothing was queued
        assert_idle(ctx)


# --- SmolLM2 ---------------------------------------------------------------------------------
SMOL_BODY = {"prompt": "def add(a, b):\n", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 8}


@pytest.mark.model
def test_a_suffix_on_smollm2_is_a_400_naming_it(real_ctx: llamax.Context) -> None:
    """SmolLM2 has no FIM tokens: ``suffix`` is refused before anything is queued."""
    before = real_ctx.stats().num_steps
    with BackgroundServer(create_app(real_ctx)) as running:
        refused = httpx.post(running.url + "/v1/completions", json=SMOL_BODY)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "suffix"
    assert real_ctx.stats().num_steps == before


@pytest.mark.model
@pytest.mark.integration
def test_a_suffix_on_the_fim_copy_of_smollm2(fim_model: Path) -> None:
    """The FIM copy answers with the prompt ``fim_prompt`` builds (split from the refusal
    above in issue 55: the copy is written and loaded for this test alone)."""
    body = SMOL_BODY
    with (
        llamax.Context(fim_model, n_ctx=1024, n_seq_max=2) as fim_ctx,
        BackgroundServer(create_app(fim_ctx)) as running,
    ):
        reply = httpx.post(running.url + "/v1/completions", json={**body, "temperature": 0})
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        prompt = fim_prompt(fim_ctx, body["prompt"], body["suffix"])
        head = fim_ctx.tokenize("", add_special=True)  # SmolLM2 adds no BOS
        assert prompt[len(head)] == fim_ctx.fim_tokens.prefix
        assert prompt[-1] == fim_ctx.fim_tokens.middle
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        direct = fim_ctx.completion(prompt, max_tokens=8, temperature=0)
        assert answer["choices"][0]["text"] == direct["choices"][0]["text"]  # the same prompt
        assert json.dumps(answer)  # a plain JSON answer
        assert_idle(fim_ctx)
