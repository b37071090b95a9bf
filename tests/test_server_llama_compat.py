"""What llama.cpp's own server suite asks of ``llamax serve`` beyond the routes themselves
(issue 41): the server-wide defaults (``-n``, ``--seed``, ``--alias``), CORS on the
native routes, and llama-server's extensions of its OpenAI chat route. On the fake
backend over HTTP (httpx's ASGI transport); the same on SmolLM2 is in the ``model`` tests
at the end."""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from test_server_fake import HELLO, SPECIALS, TEMPLATE, call

import llamax
from llamax.server import create_app
from llamax.server.cli import build_parser, server_config
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
    assert (
        post(app, "/completion", {"prompt": "abc", "n_predict": -1}).json()["tokens_predicted"] == 3
    )
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
    assert call(app, "GET", "/props").json()["default_generation_settings"]["params"]["seed"] == 42


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
    config = server_config(build_parser().parse_args(["m.gguf", "-n", "64", "--seed", "42",
                                                      "--alias", "x"]))  # fmt: skip
    assert (config.default_max_tokens, config.default_seed, config.model_alias) == (64, 42, "x")
    config = server_config(build_parser().parse_args(["m.gguf", "--n-predict", "-1"]))
    assert config.default_max_tokens is None  # -1: each API's own, as llama-server
    assert config.default_seed is None and config.model_alias is None


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
        names = {name for name, _ in r.headers.raw}  # spelled as llama-server spells them
        assert {b"Access-Control-Allow-Origin", b"Access-Control-Allow-Methods"} <= names
    auth = {"Origin": "http://localhost:3000", "Authorization": "Bearer k"}
    r = post(app, "/completion", {"prompt": "a", "n_predict": 1}, headers=auth)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == (
        "http://localhost:3000"
    )
    assert b"Access-Control-Allow-Origin" in {name for name, _ in r.headers.raw}
    refused = post(app, "/completion", {"prompt": "a"}, headers={"Origin": "http://x"})
    assert refused.status_code == 401  # the key still guards the route itself


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_llamax_serve_sends_cors_names_as_llama_server_on_the_wire(
    ctx: llamax.Context, http: Literal["h11", "httptools"], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's test_cors_* read the headers from a plain dict, so the names must reach
    the wire as llama-server spells them: ``llamax serve`` runs uvicorn's h11 writer by
    default (its httptools writer lowercases every name, which ``--http httptools``
    accepts)."""
    from llamax.server import BackgroundServer, cli

    configs: list[dict[str, Any]] = []
    loading: Future[llamax.Context] = Future()
    loading.set_result(ctx)
    args = ["m.gguf"] if http == "h11" else ["m.gguf", "--http", http]
    with monkeypatch.context() as patched:  # what `llamax serve` hands uvicorn
        patched.setattr(cli.uvicorn, "Config", lambda app, **kw: configs.append(kw))
        patched.setattr(cli, "GracefulServer", lambda config: _NoServer())
        patched.setattr(ctx, "close", lambda timeout=None: None)
        cli._serve(create_app(ctx), loading, build_parser().parse_args(args))
    assert configs[-1]["http"] == http
    with (
        BackgroundServer(create_app(ctx), http=http) as server,
        socket.create_connection((server.host, server.port), timeout=30) as conn,
    ):
        conn.sendall(
            b"OPTIONS /completions HTTP/1.1\r\nHost: localhost\r\nOrigin: http://w\r\n"
            b"Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n"
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
    spelled = b"\r\nAccess-Control-Allow-Origin: http://w\r\n" in head
    assert spelled == (http == "h11"), head
    assert b"access-control-allow-origin: http://w" in head.lower()


class _NoServer:
    force_exit = False

    def run(self) -> None:
        pass


def test_other_routes_keep_cors_off_by_default(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/metrics",
                 "/slots/0", "/models/load", "/reset_prefix_cache"):  # fmt: skip
        r = call(app, "OPTIONS", path, headers=PREFLIGHT)
        assert "access-control-allow-origin" not in r.headers, path
    r = post(app, "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=PREFLIGHT)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers  # issue 54


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


# --------------------------------------------- llama-server's extensions of the chat route
def sse_events(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_first_stream_chunk_carries_only_the_role(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    body = {"messages": HELLO, "max_tokens": 3, "stream": True, "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    chunks = sse_events(post(app, "/v1/chat/completions", body).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}  # OpenAI's: no text
    native = sse_events(post(app, "/chat/completions", body).text)
    assert native[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    rest = [c["choices"][0] for c in chunks[1:] if c["choices"]]
    assert rest and all("role" not in c["delta"] for c in rest)
    texts = [c for c in rest if c["finish_reason"] is None]
    assert all(c["logprobs"]["content"] for c in texts)
    assert "".join(c["delta"]["content"] for c in texts) == "".join(
        t["token"] for c in texts for t in c["logprobs"]["content"]
    )


def test_timings_per_token_puts_timings_on_the_usage_chunk(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    body = {"messages": HELLO, "max_tokens": 4, "stream": True, "timings_per_token": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = sse_events(post(app, "/chat/completions", body).text)
    assert "timings" not in chunks[0]
    last = chunks[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == 4
    assert (
        last["timings"]["prompt_n"] + last["timings"]["cache_n"] == (last["usage"]["prompt_tokens"])
    )
    assert {"prompt_per_second", "predicted_per_second", "predicted_ms"} <= set(last["timings"])


def test_verbose_carries_the_rendered_prompt(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "Hi"}]
    loud = post(app, "/chat/completions", {"messages": messages, "max_tokens": 2,
                                           "verbose": True}).json()  # fmt: skip
    assert "<|im_start|>system\nBook<|im_end|>" in loud["__verbose"]["prompt"]
    assert loud["__verbose"]["content"] == loud["choices"][0]["message"]["content"]
    quiet = post(app, "/chat/completions", {"messages": messages, "max_tokens": 2,
                                            "verbose": False}).json()  # fmt: skip
    assert "__verbose" not in quiet


def test_id_slot_and_return_progress_on_chat(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    two = post(app, "/chat/completions", {"messages": HELLO, "max_tokens": 2, "n": 2,
                                          "id_slot": 0}).json()  # fmt: skip
    assert len(two["choices"]) == 2
    off = post(app, "/chat/completions", {"messages": HELLO, "max_tokens": 1,
                                          "return_progress": False})  # fmt: skip
    assert off.status_code == 200
    for bad in ({"id_slot": -2}, {"id_slot": "0"}, {"return_progress": "yes"}):
        r = post(app, "/chat/completions", {"messages": HELLO, "max_tokens": 1} | bad)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == 400, r.text
        assert error["type"] == "invalid_request_error" and next(iter(bad)) in error["message"]


def test_return_progress_streams_the_prompts_progress_as_llama_servers_test() -> None:
    """llama.cpp's test_return_progress (chat) and test_responses_stream_with_llama_telemetry
    on the fake (chunks of 16 tokens): a first report where ``cache == processed``, then
    one per chunk with ``processed`` growing to ``total``, all before the reply; a cached
    prompt reports twice. The Responses stream reports in ``response.in_progress`` events,
    with ``timings`` on each text delta and on ``response.completed``; ``/completion``
    streams them as chunks of their own."""
    backend = FakeBackend(n_ctx=512, n_batch=16, metadata={"tokenizer.chat_template": TEMPLATE},
                          special_tokens=SPECIALS)  # fmt: skip
    ctx = llamax.Context(backend=backend)
    app = create_app(ctx)
    body = {"messages": [{"role": "user", "content": "This is a test" * 10}], "max_tokens": 4,
            "stream": True, "return_progress": True, "temperature": 0}  # fmt: skip

    def progress(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        shown = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
        first_text = next(i for i, c in enumerate(chunks) if _text_of(c))
        assert all(i < first_text for i, c in enumerate(chunks) if "prompt_progress" in c)
        assert (
            shown[0]["cache"] == shown[0]["processed"]
            and shown[-1]["processed"] == (shown[-1]["total"])
        )
        assert all(b["processed"] > a["processed"] and b["cache"] == a["cache"]
                   for a, b in itertools.pairwise(shown))  # fmt: skip
        return shown

    cold = progress(sse_events(post(app, "/chat/completions", body).text))
    assert cold[0]["cache"] == 0 and len(cold) == 1 + -(-cold[0]["total"] // 16)
    warm = progress(sse_events(post(app, "/v1/chat/completions", body).text))
    assert len(warm) == 2 and warm[0]["cache"] == warm[0]["total"] - 1
    quiet = sse_events(post(app, "/chat/completions", body | {"return_progress": False}).text)
    assert not any("prompt_progress" in c for c in quiet)
    telemetry = {"input": "This is a test" * 10, "max_output_tokens": 8, "stream": True,
                 "timings_per_token": True, "return_progress": True, "temperature": 0}  # fmt: skip
    events = sse_events(post(app, "/responses", telemetry).text)
    reports = [e for e in events if "prompt_progress" in e]
    assert reports and all(e["type"] == "response.in_progress" for e in reports)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    done = events[-1]  # cut at max_output_tokens: llama-server's alias still says completed
    assert done["type"] == "response.completed" and done["response"]["status"] == "incomplete"
    assert done["timings"]["predicted_n"] == done["response"]["usage"]["output_tokens"]
    openai = sse_events(post(app, "/v1/responses", telemetry).text)[-1]
    assert openai["type"] == "response.incomplete" and "timings" in openai
    plain = sse_events(
        post(
            app, "/responses", telemetry | {"timings_per_token": False, "return_progress": False}
        ).text
    )
    assert not any("timings" in e or "prompt_progress" in e for e in plain)  # fmt: skip
    native = sse_events(post(app, "/completion", {"prompt": "This is a test" * 10,
                                                  "n_predict": 2, "stream": True,
                                                  "return_progress": True,
                                                  "temperature": 0}).text)  # fmt: skip
    shown = [c for c in native if "prompt_progress" in c]
    assert shown and all(c["content"] == "" and c["tokens"] == [] for c in shown)
    assert shown[-1]["prompt_progress"]["processed"] == shown[-1]["prompt_progress"]["total"]
    assert_idle(ctx)
    ctx.close()


def _text_of(chunk: dict[str, Any]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for c in chunk["choices"])


def test_two_trailing_assistant_messages_are_refused_on_llama_servers_route(
    ctx: llamax.Context,
) -> None:
    app = create_app(ctx)
    two = [*HELLO, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = post(app, "/chat/completions", {"messages": two, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert "2 or more assistant messages" in r.json()["error"]["message"]
    assert post(app, "/v1/chat/completions", {"messages": two, "max_tokens": 1}).status_code == 200
    one = [*HELLO, {"role": "assistant", "content": "a"}]
    assert post(app, "/chat/completions", {"messages": one, "max_tokens": 1}).status_code == 200


def test_responses_input_tokens_counts_what_a_response_would_submit(
    ctx: llamax.Context,
) -> None:
    app = create_app(ctx)
    body = {"input": "What is the best book?", "instructions": "Be brief."}
    counted = post(app, "/responses/input_tokens", body).json()
    assert counted["object"] == "response.input_tokens"
    reply = post(app, "/v1/responses", body | {"max_output_tokens": 1}).json()
    assert counted["input_tokens"] == reply["usage"]["input_tokens"]
    follow = {"input": "And another?", "previous_response_id": reply["id"]}
    more = post(app, "/v1/responses/input_tokens", follow).json()["input_tokens"]
    assert more > counted["input_tokens"]  # the stored conversation is counted
    bad = post(app, "/v1/responses/input_tokens", {"input": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    missing = post(
        app, "/v1/responses/input_tokens", {"input": "x", "previous_response_id": "resp_no"}
    )
    assert missing.status_code == 404


# ------------------------------------------------------------------------ on SmolLM2
@pytest.mark.model
@pytest.mark.integration
def test_llama_server_flags_and_chat_extensions_on_smollm2(model_path: Path) -> None:
    from openai import OpenAI
    from test_server_llama import _SyncASGI

    ctx = llamax.Context(model_path, n_ctx=512, n_seq_max=2)
    try:
        app = create_app(ctx, default_max_tokens=6, default_seed=42, model_alias="tinyllama-2")
        http = httpx.Client(transport=_SyncASGI(app), base_url="http://t")
        client = OpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        assert [m.id for m in client.models.list()] == ["tinyllama-2"]
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is the best book?"}],
            temperature=0, logprobs=True, top_logprobs=3, stream=True,
        )  # fmt: skip
        chunks = [c for c in stream if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].choices[0].delta.content is None
        texts = [c.choices[0] for c in chunks[1:] if c.choices[0].finish_reason is None]
        assert all(c.delta.role is None and c.logprobs and c.logprobs.content for c in texts)
        text = "".join(c.delta.content or "" for c in texts)
        tokens = [
            t.token for c in texts for t in (c.logprobs.content if c.logprobs else None) or []
        ]
        assert text == "".join(tokens)
        assert chunks[-1].choices[0].finish_reason == "length"  # the server's -n: 6 tokens
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                "timings_per_token": True, "stream_options": {"include_usage": True}}  # fmt: skip
        last = sse_events(post(app, "/chat/completions", body).text)[-1]
        assert last["timings"]["predicted_n"] == last["usage"]["completion_tokens"] == 6
        first = post(app, "/completion", {"prompt": "Once upon a time", "temperature": 1})
        again = post(app, "/completion", {"prompt": "Once upon a time", "temperature": 1})
        assert first.json()["content"] == again.json()["content"]  # the server's seed
        assert first.json()["generation_settings"]["seed"] == 42
        preflight = call(app, "OPTIONS", "/completions", headers=PREFLIGHT)
        assert preflight.headers["access-control-allow-origin"] == "http://web.example"
        counted = post(app, "/responses/input_tokens", {"input": "What is the best book?"})
        assert counted.json()["input_tokens"] > 5
        assert_idle(ctx, timeout=60)
    finally:
        ctx.close()


@pytest.mark.model
@pytest.mark.integration
def test_return_progress_and_responses_telemetry_on_smollm2(model_path: Path) -> None:
    """llama.cpp's test_return_progress[64-2-True] and test_responses_stream_with_llama_
    telemetry on SmolLM2 (n_batch 32, so a prompt comes in chunks): the first report has
    ``cache == processed``, ``processed`` grows to ``total``; a repeated prompt reports
    twice (the cache, then its last token)."""
    ctx = llamax.Context(model_path, n_ctx=512, n_seq_max=2, n_batch=32)
    try:
        app = create_app(ctx)
        body = {"messages": [{"role": "user", "content": "This is a test" * 10}],
                "max_tokens": 10, "stream": True, "return_progress": True}  # fmt: skip
        cold = [c["prompt_progress"] for c in sse_events(post(app, "/chat/completions",
                                                              body).text)
                if "prompt_progress" in c]  # fmt: skip
        total = cold[0]["total"]
        assert cold[0]["processed"] == cold[0]["cache"] == 0 and total > 32
        assert [p["processed"] for p in cold] == [0, *range(32, total, 32), total]
        warm = [c["prompt_progress"] for c in sse_events(post(app, "/chat/completions",
                                                              body).text)
                if "prompt_progress" in c]  # fmt: skip
        assert [(p["cache"], p["processed"]) for p in warm] == [(total - 1,) * 2,
                                                                 (total - 1, total)]  # fmt: skip
        telemetry = {"input": "This is a test" * 10, "max_output_tokens": 8,
                     "temperature": 0.8, "stream": True, "timings_per_token": True,
                     "return_progress": True}  # fmt: skip
        events = sse_events(post(app, "/responses", telemetry).text)
        assert any("prompt_progress" in e and e["type"] == "response.in_progress" for e in events)
        assert any(e["type"] == "response.output_text.delta" and "timings" in e for e in events)
        assert events[-1]["type"] == "response.completed" and "timings" in events[-1]
        assert_idle(ctx, timeout=60)
    finally:
        ctx.close()
