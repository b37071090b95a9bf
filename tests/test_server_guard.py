"""Cross-site writes and DNS rebinding (issue 54, finding 6) and absolute paths shown to other
origins (finding 11): :mod:`llamax.server.guard` on the fake backend, in-process (httpx's
ASGI transport, whose ``Host`` is ``test``, the address the app is told it serves as)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_server_fake import HELLO, SPECIALS, TEMPLATE, call

import llamax
from llamax.server import ModelPool, create_app
from llamax.server.cli import build_parser, server_config
from llamax.server.guard import SitePolicy, path_free
from llamax.testing import FakeBackend, FakeSampler, assert_idle

EVIL = "http://evil.example"
TEXT = {"Content-Type": "text/plain;charset=UTF-8"}  # what fetch() sends a string as
MODEL = "/srv/models/private/secret-model.gguf"


class CountingBackend(FakeBackend):
    """Counts the samplers built: one per sequence a request runs."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.num_samplers = 0

    def new_sampler(
        self, params: llamax.SamplingParams, seed: int, history: Sequence[int], **kw: Any
    ) -> FakeSampler:
        self.num_samplers += 1
        return super().new_sampler(params, seed, history, **kw)


@pytest.fixture
def backend() -> CountingBackend:
    return CountingBackend(n_ctx=512, n_seq_max=4, metadata={"tokenizer.chat_template": TEMPLATE},
                           special_tokens=SPECIALS)  # fmt: skip


@pytest.fixture
def ctx(backend: CountingBackend) -> Iterator[llamax.Context]:
    context = llamax.Context(MODEL, backend=backend)
    yield context
    assert_idle(context)
    context.close()


def cross(body: str, origin: str = EVIL, **headers: str) -> dict[str, Any]:
    """A simple (no-preflight) request a page on ``origin`` can send: ``fetch(url, {method:
    "POST", body})`` from a string."""
    return {"content": body, "headers": {"Origin": origin, **TEXT, **headers}}


# ------------------------------------------------------------- cross-site writes
def test_a_cross_site_page_cannot_save_a_slot_reset_the_cache_chat_or_load(
    ctx: llamax.Context, backend: CountingBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit's reproducers: each was 200 from ``Origin: http://evil.example``."""
    app = create_app(ctx, slot_save_path=tmp_path)
    opened = call(app, "POST", "/completion", json={"prompt": "abc", "n_predict": 2, "id_slot": 0})
    assert opened.status_code == 200
    cleared: list[int] = []
    monkeypatch.setattr(ctx, "clear_cache", lambda: cleared.append(1) or 0)
    num_samplers = backend.num_samplers
    saved = call(app, "POST", "/slots/0?action=save", **cross('{"filename": "x.bin"}'))
    assert saved.status_code == 403 and saved.json()["error"]["type"] == "permission_error"
    assert "--cors-origin" in saved.json()["error"]["message"]
    assert list(tmp_path.iterdir()) == []
    reset = call(app, "POST", "/reset_prefix_cache", **cross(""))
    assert reset.status_code == 403 and cleared == []
    chat = call(app, "POST", "/v1/chat/completions",
                **cross('{"messages": [{"role": "user", "content": "Hi"}]}'))  # fmt: skip
    assert chat.status_code == 403 and chat.json()["error"]["code"] == "cross_origin_refused"
    form = call(
        app, "POST", "/v1/messages", headers={"Origin": EVIL}, data={"model": "m"}
    )  # a form: application/x-www-form-urlencoded
    assert form.status_code == 403 and form.json()["type"] == "error"  # Anthropic's shape
    assert form.json()["error"]["type"] == "permission_error"
    native = call(app, "POST", "/completion", **cross('{"prompt": "abc", "n_predict": 2}'))
    assert native.status_code == 415 and native.json()["error"]["code"] == 415  # llama's shape
    assert "application/json" in native.json()["error"]["message"]
    bare = call(
        app, "POST", "/completion", content=b'{"prompt": "a"}', headers={"Origin": "null"}
    )  # a Blob with no type: no Content-Type at all
    assert bare.status_code == 415
    assert backend.num_samplers == num_samplers  # the engine ran nothing
    # the same, as local clients send them, still work
    assert call(app, "POST", "/slots/0?action=save", json={"filename": "x.bin"}).is_success
    assert call(app, "POST", "/reset_prefix_cache").is_success and cleared == [1]
    assert call(app, "POST", "/v1/chat/completions",
                json={"messages": HELLO, "max_tokens": 1}).is_success  # fmt: skip
    call(app, "POST", "/slots/0?action=erase")


def test_a_cross_site_page_cannot_load_a_model() -> None:
    pool = ModelPool({"a": _fake_model, "b": _fake_model})
    app = create_app(pool)
    try:
        refused = call(app, "POST", "/models/load", **cross('{"model": "b"}'))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == 403
        json_too = call(app, "POST", "/models/load", json={"model": "b"}, headers={"Origin": EVIL})
        assert json_too.status_code == 403  # CORS is off here: no page may write at all
        assert all(m.context is None for m in pool.models())
        assert call(app, "POST", "/models/load", json={"model": "b"}).is_success
    finally:
        pool.close()


def _fake_model() -> llamax.Context:
    return llamax.Context(backend=FakeBackend(n_ctx=256, n_seq_max=2))


def test_preflighted_json_from_any_origin_still_reaches_llama_servers_routes(
    ctx: llamax.Context,
) -> None:
    """llama.cpp's web UI on another port sends JSON (after a preflight that native CORS
    answers): it keeps working, as on llama-server."""
    app = create_app(ctx)
    body = {"prompt": "abc", "n_predict": 1}
    for path in ("/completion", "/completions", "/infill", "/tokenize"):
        preflight = call(
            app,
            "OPTIONS",
            path,
            headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
    ok = call(app, "POST", "/completion", json=body, headers={"Origin": "http://localhost:3000"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert call(app, "POST", "/tokenize", json={"content": "a"},
                headers={"Origin": EVIL}).is_success  # fmt: skip
    fetch_metadata = call(app, "POST", "/completion", content=b'{"prompt": "a"}',
                          headers={"Sec-Fetch-Site": "cross-site", **TEXT})  # fmt: skip
    assert fetch_metadata.status_code == 415  # no Origin, but the browser says cross-site


def test_clients_without_an_origin_and_same_origin_pages_are_not_cross_site(
    ctx: llamax.Context,
) -> None:
    app = create_app(ctx)
    body = '{"prompt": "abc", "n_predict": 1}'
    curl_d = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d's default
    assert call(app, "POST", "/completion", content=body, headers=curl_d).is_success
    v1 = '{"prompt": "abc", "max_tokens": 1}'
    assert call(app, "POST", "/v1/completions", content=v1, headers=TEXT).is_success
    same = {"Origin": "http://test", **TEXT}  # the chat page at / (Host: test)
    assert call(app, "POST", "/v1/completions", content=v1, headers=same).is_success
    assert call(app, "POST", "/completion", content=body,
                headers={"Sec-Fetch-Site": "same-origin", **TEXT}).is_success  # fmt: skip


def test_origins_allowed_by_cors_origins_may_write(ctx: llamax.Context) -> None:
    app = create_app(ctx, cors_origins=["http://mine.example"])
    mine = {"Origin": "http://mine.example"}
    body = {"messages": HELLO, "max_tokens": 1}
    assert call(app, "POST", "/v1/chat/completions", json=body, headers=mine).is_success
    other = call(app, "POST", "/v1/chat/completions", json=body, headers={"Origin": EVIL})
    assert other.status_code == 403
    native = call(app, "POST", "/completion", json={"prompt": "a", "n_predict": 1},
                  headers={"Origin": EVIL})  # fmt: skip
    assert native.status_code == 403  # --cors-origin replaces native CORS: none for evil
    anyone = create_app(ctx, cors_origins=["*"])
    assert call(anyone, "POST", "/reset_prefix_cache", **cross("")).is_success


def test_the_api_key_and_the_guard_both_hold(ctx: llamax.Context) -> None:
    app = create_app(ctx, api_key="k")
    key = {"Authorization": "Bearer k"}
    assert call(app, "POST", "/reset_prefix_cache", **cross("", **key)).status_code == 403
    assert call(app, "POST", "/reset_prefix_cache", headers=key).is_success
    rebound = call(app, "GET", "/v1/models", headers={"Host": "evil.example:8000", **key})
    assert rebound.status_code == 403


# ------------------------------------------------------------------ DNS rebinding
def test_a_rebinding_host_is_refused_and_local_names_are_served(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil"):
        for method, path in (("GET", "/props"), ("GET", "/v1/models"), ("GET", "/slots"),
                             ("POST", "/v1/completions"), ("GET", "/")):  # fmt: skip
            kw: dict[str, Any] = {"json": {"prompt": "a"}} if method == "POST" else {}
            r = call(app, method, path, headers={"Host": host}, **kw)
            assert r.status_code == 403, (host, path)
            assert r.json()["error"]["code"] in ("host_not_allowed", 403), r.text
            assert "--allowed-hosts" in r.json()["error"]["message"]
    for host in ("localhost:8080", "LOCALHOST", "app.localhost:1", "127.0.0.1:8000",
                 "127.9.9.9", "[::1]:8000", "10.1.2.3:80", "[fe80::1]", "test"):  # fmt: skip
        assert call(app, "GET", "/v1/models", headers={"Host": host}).is_success, host
    body = {"prompt": "a", "max_tokens": 1}
    assert call(app, "POST", "/v1/completions", json=body,
                headers={"Host": "localhost:8080"}).is_success  # fmt: skip


def test_allowed_hosts_adds_names_or_turns_the_check_off(ctx: llamax.Context) -> None:
    named = create_app(ctx, allowed_hosts=["llm.lan", "*.corp.example"])
    for host, status in (("llm.lan:8000", 200), ("a.b.corp.example", 200),
                         ("corp.example", 403), ("evil.example", 403)):  # fmt: skip
        assert call(named, "GET", "/props", headers={"Host": host}).status_code == status, host
    anyone = create_app(ctx, allowed_hosts=["*"])
    assert call(anyone, "GET", "/props", headers={"Host": "evil.example"}).is_success
    for bad in (["http://x"], ["x:80"], ["a b"], [""]):
        with pytest.raises(ValueError, match="allowed_hosts"):
            create_app(ctx, allowed_hosts=bad)


def test_llamax_serve_passes_allowed_hosts_and_its_bind_name() -> None:
    def allowed_hosts(ns: argparse.Namespace) -> list[str]:
        return list(server_config(ns).allowed_hosts)

    ns = build_parser().parse_args(["m.gguf", "--allowed-hosts", "llm.lan, *.corp.example"])
    assert allowed_hosts(ns) == ["llm.lan", "*.corp.example", "127.0.0.1"]
    ns = build_parser().parse_args(["m.gguf", "--host", "box.lan"])
    assert allowed_hosts(ns) == ["box.lan"]
    assert SitePolicy.of(allowed_hosts(ns), None, True).allows_host("box.lan", None)
    ns = build_parser().parse_args(["m.gguf", "--host", "::", "--allowed-hosts", "*"])
    assert SitePolicy.of(allowed_hosts(ns), None, True).allows_host("evil.example", None)


# ------------------------------------------------------ absolute paths, other origins
def test_props_gives_other_origins_the_file_name_only(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    assert call(app, "GET", "/props").json()["model_path"] == MODEL  # llama-server's, locally
    for headers in ({"Origin": EVIL}, {"Origin": "http://localhost:3000"},
                    {"Sec-Fetch-Site": "cross-site"}):  # fmt: skip
        props = call(app, "GET", "/props", headers=headers)
        assert props.status_code == 200 and props.json()["model_path"] == "secret-model.gguf"
        assert "/srv" not in props.text


def test_errors_and_model_lists_name_no_server_folder_to_other_origins(tmp_path: Path) -> None:
    def broken() -> llamax.Context:
        raise OSError(f"cannot read {tmp_path}/models/broken.gguf")

    pool = ModelPool({"a": broken})
    app = create_app(pool, slot_save_path=tmp_path)
    try:
        (tmp_path / "dir.bin").mkdir()
        failed = call(app, "POST", "/completion", json={"model": "a", "prompt": "x"},
                      headers={"Origin": EVIL})  # fmt: skip
        assert failed.status_code >= 400 and str(tmp_path) not in failed.text, failed.text
        for path in ("/models", "/v1/models"):
            listed = call(app, "GET", path, headers={"Origin": EVIL})
            error = listed.json()["data"][0]["status"]["last_error"]
            assert "broken.gguf" in error and str(tmp_path) not in listed.text, listed.text
        local = call(app, "GET", "/models").json()["data"][0]["status"]["last_error"]
        assert str(tmp_path) in local  # a local client still reads the whole message
    finally:
        pool.close()


def test_a_failed_slot_restore_names_the_file_not_the_folder(
    ctx: llamax.Context, tmp_path: Path
) -> None:
    app = create_app(ctx, slot_save_path=tmp_path)
    (tmp_path / "dir.bin").mkdir()
    (tmp_path / "junk.bin").write_bytes(b"not a session")
    for name in ("dir.bin", "junk.bin"):
        r = call(app, "POST", "/slots/0?action=restore", json={"filename": name})
        assert r.status_code == 400 and name in r.text, r.text
        assert str(tmp_path) not in r.text, r.text


def test_path_free_keeps_file_names_and_urls() -> None:
    assert path_free("open '/a/b/c.gguf': no") == "open 'c.gguf': no"
    assert path_free(r"C:\models\x.gguf failed") == "x.gguf failed"
    assert path_free("see https://h.example/a/b/ and </s> or a/b") == (
        "see https://h.example/a/b/ and </s> or a/b"
    )
