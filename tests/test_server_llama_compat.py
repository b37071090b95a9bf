"""What llama.cpp's own server suite asks of ``llamax serve`` beyond the routes themselves
(issue 41): the server-wide defaults (``-n``, ``--seed``, ``--alias``), CORS on the
native routes, and llama-server's extensions of its OpenAI chat route. On the fake
backend over HTTP (httpx's ASGI transport); the same on SmolLM2 is in the ``model`` tests
at the end."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from test_server_fake import HELLO, SPECIALS, TEMPLATE, call

import llamax
from llamax.server import create_app
from llamax.server.cli import build_parser
from llamax.testing import FakeBackend, FakeSampler, assert_idle


class SeedRecorder(FakeBackend):
    """Records the seed each request's sampler is built with."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seeds: list[int | None] = []

    def new_sampler(
        self, params: llamax.SamplingParams, seed: int, history: Sequence[int], **kw: Any
    ) -> FakeSampler:
        self.seeds.append(params.seed)
        return super().new_sampler(params, seed, history, **kw)


@pytest.fixture
def backend() -> SeedRecorder:
    return SeedRecorder(
        n_ctx=512, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )


@pytest.fixture
def ctx(backend: SeedRecorder) -> Iterator[llamax.Context]:
    context = llamax.Context(backend=backend)
    yield context
    assert_idle(context)
    context.close()


def post(app: Any, path: str, body: object, **kw: Any) -> Any:
    return call(app, "POST", path, json=body, **kw)


# ------------------------------------------------- -n, --seed, --alias (server defaults)
def test_default_reply_length_applies_where_a_request_sets_none(ctx: llamax.Context) -> None:
    app = create_app(ctx, default_max_tokens=3)
    assert post(app, "/completion", {"prompt": "abc"}).json()["tokens_predicted"] == 3
    assert post(app, "/completion", {"prompt": "abc", "n_predict": -1}).json()[
        "tokens_predicted"
    ] == 3
    more = post(app, "/completion", {"prompt": "abc", "n_predict": 5}).json()
    assert more["tokens_predicted"] == 5  # a request may ask for more, as on llama-server
    text = post(app, "/v1/completions", {"prompt": "abc"}).json()  # not OpenAI's 16
    assert text["usage"]["completion_tokens"] == 3
    chat = post(app, "/chat/completions", {"messages": HELLO}).json()
    assert chat["usage"]["completion_tokens"] == 3 and chat["choices"][0]["finish_reason"] == (
        "length"
    )
    reply = post(app, "/v1/responses", {"input": "hi"}).json()
    assert reply["max_output_tokens"] == 3 and reply["usage"]["output_tokens"] == 3
    infill = post(app, "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert infill.status_code == 501  # no FIM tokens: refused before its length matters
    props = call(app, "GET", "/props").json()["default_generation_settings"]["params"]
    assert props["n_predict"] == 3


def test_default_seed_reaches_the_sampler_unless_a_request_sets_one(
    ctx: llamax.Context, backend: SeedRecorder
) -> None:
    app = create_app(ctx, default_seed=42)
    post(app, "/completion", {"prompt": "abc", "n_predict": 1})
    post(app, "/completion", {"prompt": "abc", "n_predict": 1, "seed": 7})
    post(app, "/completion", {"prompt": "abc", "n_predict": 1, "seed": -1})  # random
    post(app, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1})
    assert backend.seeds == [42, 7, None, 42]
    settings = post(app, "/completion", {"prompt": "abc", "n_predict": 1}).json()
    assert settings["generation_settings"]["seed"] == 42
    assert call(app, "GET", "/props").json()["default_generation_settings"]["params"][
        "seed"
    ] == 42


def test_alias_names_the_model_everywhere(ctx: llamax.Context) -> None:
    app = create_app(ctx, model_alias="tinyllama-2")
    assert [m["id"] for m in call(app, "GET", "/models").json()["data"]] == ["tinyllama-2"]
    assert call(app, "GET", "/v1/models").json()["data"][0]["id"] == "tinyllama-2"
    assert call(app, "GET", "/props").json()["model_alias"] == "tinyllama-2"
    chat = post(app, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1}).json()
    assert chat["model"] == "tinyllama-2"
    assert post(app, "/completion", {"prompt": "a", "n_predict": 1}).json()["model"] == (
        "tinyllama-2"
    )
    named = post(app, "/v1/chat/completions",
                 {"messages": HELLO, "max_tokens": 1, "model": "gpt-4o"}).json()  # fmt: skip
    assert named["model"] == "gpt-4o"  # a request's own name is echoed, as before


def test_bad_defaults_are_refused_when_the_app_is_built(ctx: llamax.Context) -> None:
    with pytest.raises(ValueError, match="default_max_tokens"):
        create_app(ctx, default_max_tokens=0)
    with pytest.raises(ValueError, match="seed"):
        create_app(ctx, default_seed=-5)
    with pytest.raises(ValueError, match="model_alias"):
        create_app(ctx, model_alias="")


def test_serve_flags_of_llama_server() -> None:
    ns = build_parser().parse_args(["m.gguf", "-n", "64", "--seed", "42", "--alias", "x"])
    assert (ns.n_predict, ns.seed, ns.alias) == (64, 42, "x")
    ns = build_parser().parse_args(["m.gguf", "--n-predict", "-1"])
    assert ns.n_predict == -1 and ns.seed is None and ns.alias is None


# ----------------------------------------------------------------------------- CORS
PREFLIGHT = {"Origin": "http://web.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "Authorization"}  # fmt: skip


def test_native_routes_answer_any_origin_as_llama_server(ctx: llamax.Context) -> None:
    app = create_app(ctx, api_key="k")
    for path in ("/completions", "/completion", "/chat/completions", "/infill", "/props"):
        r = call(app, "OPTIONS", path, headers=PREFLIGHT)  # no key: browsers send none
        assert r.status_code == 200 and r.text == ""
        assert r.headers["access-control-allow-origin"] == "http://web.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert r.headers["access-control-allow-headers"] == "*"
    auth = {"Origin": "http://localhost:3000", "Authorization": "Bearer k"}
    r = post(app, "/completion", {"prompt": "a", "n_predict": 1}, headers=auth)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == (
        "http://localhost:3000"
    )
    refused = post(app, "/completion", {"prompt": "a"}, headers={"Origin": "http://x"})
    assert refused.status_code == 401  # the key still guards the route itself


def test_other_routes_keep_cors_off_by_default(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/metrics",
                 "/slots/0", "/models/load", "/reset_prefix_cache"):  # fmt: skip
        r = call(app, "OPTIONS", path, headers=PREFLIGHT)
        assert "access-control-allow-origin" not in r.headers, path
    r = post(app, "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=PREFLIGHT)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_native_cors_can_be_turned_off_and_explicit_origins_win(ctx: llamax.Context) -> None:
    off = call(create_app(ctx, native_cors=False), "OPTIONS", "/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in off.headers
    only = create_app(ctx, cors_origins=["http://mine.example"])
    other = call(only, "OPTIONS", "/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in other.headers
    mine = call(only, "OPTIONS", "/v1/completions",
                headers=PREFLIGHT | {"Origin": "http://mine.example"})  # fmt: skip
    assert mine.headers["access-control-allow-origin"] == "http://mine.example"
    assert build_parser().parse_args(["--no-native-cors"]).native_cors is False
