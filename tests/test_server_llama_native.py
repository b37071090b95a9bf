"""llama-server's native routes (issue 41, part B) on the fake backend: ``/infill``,
``/slots`` and its actions, over HTTP through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import llamax
from llamax.server import create_app
from llamax.server.llama.infill import infill_tokens
from llamax.server.llama.slots import valid_filename
from llamax.testing import FakeBackend, assert_idle

FIM = {"<fim_prefix>": 300, "<fim_suffix>": 301, "<fim_middle>": 302, "<repo_name>": 303,
       "<file_sep>": 304}  # fmt: skip
BODY = {"input_prefix": "int main() {\n", "prompt": "  return ", "input_suffix": "}\n",
        "n_predict": 4, "temperature": 0}  # fmt: skip


def make(fim: bool = True) -> tuple[llamax.Context, FakeBackend]:
    backend = FakeBackend(n_ctx=1024, n_seq_max=4, special_tokens=FIM if fim else {})
    return llamax.Context(backend=backend), backend


@pytest.fixture
def fim() -> Iterator[tuple[llamax.Context, FakeBackend]]:
    ctx, backend = make()
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def is_llama_error(response: httpx.Response, status: int, kind: str) -> bool:
    body = response.json()
    return (
        response.status_code == status
        and set(body) == {"error"}
        and body["error"]["code"] == status
        and body["error"]["type"] == kind
        and isinstance(body["error"]["message"], str)
    )


# ---------------------------------------------------------------------- /infill
def test_fim_tokens_are_found_by_their_text() -> None:
    ctx, _ = make()
    with ctx:
        assert ctx.fim_tokens == llamax.FimTokens(prefix=300, suffix=301, middle=302,
                                                  repo=303, separator=304)  # fmt: skip
        assert ctx.fim_tokens.can_infill
    ctx, _ = make(fim=False)
    with ctx:
        assert ctx.fim_tokens == llamax.FimTokens() and not ctx.fim_tokens.can_infill


def test_infill_prompt_is_laid_out_as_llama_server_does(fim: Any) -> None:
    ctx, _ = fim
    extra = [{"filename": "a.h", "text": "int a();\n"}, {"text": "x"}]
    ids = infill_tokens(ctx, "PRE", [ord("P") + 1, "RE2"], extra, "mid", n_predict=8)
    assert ids == [
        303, *ctx.tokenize("myproject\n", add_special=False),
        304, *ctx.tokenize("a.h\n", add_special=False), *ctx.tokenize("int a();\n"),
        304, *ctx.tokenize("tmp\n", add_special=False), *ctx.tokenize("x"),
        304, *ctx.tokenize("filename\n", add_special=False),
        300, *ctx.tokenize("PREmid"), 301, *ctx.tokenize("PRE2"), 302,
    ]  # fmt: skip
    # the prefix keeps its last 3/4 n_batch tokens, the suffix its first n_batch/4 - 2 - prompt
    n_batch = ctx.config.n_batch
    ids = infill_tokens(ctx, "w" * 1000, "k" * 1000, [], "", n_predict=8)
    assert ids.count(ord("w") + 1) == 3 * (n_batch // 4)
    assert ids.count(ord("k") + 1) == n_batch // 4 - 2


def test_infill_answers_in_llama_servers_completion_shape(fim: Any) -> None:
    ctx, backend = fim
    response = call(create_app(ctx), "POST", "/infill", json=BODY)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["content"] == "abcd"  # the fake writes the alphabet after a non-letter
    assert body["stop"] is True and body["stop_type"] == "limit" and body["id_slot"] == 0
    prompt = infill_tokens(ctx, BODY["input_prefix"], BODY["input_suffix"], [], BODY["prompt"],
                           n_predict=4)  # fmt: skip
    assert body["tokens_predicted"] == 4 and body["tokens_evaluated"] == len(prompt)
    assert body["generation_settings"]["n_predict"] == 4
    assert set(body["timings"]) >= {"cache_n", "prompt_n", "predicted_n", "prompt_ms"}
    assert body["timings"]["prompt_n"] + body["timings"]["cache_n"] == body["tokens_evaluated"]
    prefill = [t for step in backend.decode_log for item in step for t in item.token_ids]
    assert prefill[: len(prompt)] == prompt and prompt[-1] == 302  # ends with FIM middle


def test_infill_streams_partials_then_the_final_answer(fim: Any) -> None:
    ctx, _ = fim
    response = call(create_app(ctx), "POST", "/infill", json=BODY | {"stream": True})
    events = [e for e in response.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and "[DONE]" not in response.text
    chunks = [json.loads(e[len("data: ") :]) for e in events]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks[:-1]) == "abcd"
    assert chunks[-1]["content"] == "" and chunks[-1]["tokens_predicted"] == 4


def test_infill_is_refused_on_a_model_without_fim_tokens() -> None:
    ctx, backend = make(fim=False)
    with ctx:
        response = call(create_app(ctx), "POST", "/infill", json=BODY)
        assert is_llama_error(response, 501, "not_supported_error")
        assert "Infill is not supported by this model" in response.json()["error"]["message"]
        assert "prefix token is missing" in response.json()["error"]["message"]
        assert backend.decode_log == []


@pytest.mark.parametrize(
    "change",
    [
        {"input_extra": [{}]},
        {"input_extra": [{"filename": "ok"}]},
        {"input_extra": [{"filename": 123}]},
        {"input_extra": [{"filename": 123, "text": "abc"}]},
        {"input_extra": [{"filename": 123, "text": 456}]},
        {"input_extra": {"text": "x"}},
        {"prompt": 5},
        {"input_prefix": None},
        {"input_suffix": {"a": 1}},
        {"stream": "yes"},
        {"mirostat": 2},
        {"n_probs": 3},
        {"temperature": -1},
        {"n_predict": "ten"},
        {"input_prefix": [10**9]},
    ],
)
def test_bad_infill_bodies_get_400_and_reach_nothing(fim: Any, change: dict[str, Any]) -> None:
    ctx, backend = fim
    body = {k: v for k, v in (BODY | change).items() if v is not None}
    response = call(create_app(ctx), "POST", "/infill", json=body)
    assert is_llama_error(response, 400, "invalid_request_error"), response.text
    assert backend.decode_log == []


def test_infill_missing_prefix_and_non_json_get_400(fim: Any) -> None:
    ctx, backend = fim
    app = create_app(ctx)
    for raw in (b"[1]", b"{not json", json.dumps({"input_suffix": "x"}).encode()):
        assert is_llama_error(call(app, "POST", "/infill", content=raw), 400,
                              "invalid_request_error")  # fmt: skip
    assert backend.decode_log == []


def test_concurrent_infills_share_the_file_prefix(fim: Any) -> None:
    ctx, backend = fim
    app = create_app(ctx)
    extra = [{"filename": "lib.c", "text": "int helper(int x) { return x; }\n" * 8}]

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.gather(*(
                client.post("/infill", json=BODY | {"input_extra": extra, "prompt": f"v{i}"})
                for i in range(8)
            ))  # fmt: skip

    bodies = [r.json() for r in asyncio.run(go())]
    assert all(b["stop"] for b in bodies)
    assert sum(b["timings"]["cache_n"] for b in bodies) > 0
    assert max(len({i.seq_id for i in step}) for step in backend.decode_log) > 1


# ---------------------------------------------------------------------- /slots
def test_get_slots_lists_each_slot_in_llama_servers_shape(fim: Any, tmp_path: Path) -> None:
    ctx, _ = fim
    app = create_app(ctx, slot_save_path=tmp_path)
    call(app, "POST", "/infill", json=BODY | {"id_slot": 2})
    slots = call(app, "GET", "/slots").json()
    assert [s["id"] for s in slots] == list(range(ctx.n_seq_max))
    assert all(s["n_ctx"] == ctx.n_ctx_seq and s["is_processing"] is False for s in slots)
    assert slots[2]["params"]["n_predict"] == 4 and slots[2]["next_token"][0]["n_decoded"] == 4
    assert slots[2]["n_prompt_tokens_processed"] == slots[2]["n_prompt_tokens"] > 0
    assert slots[2]["n_prompt_tokens_cache"] == 0
    assert slots[2]["n_cached_tokens"] > 0 and "params" not in slots[1]
    assert call(app, "POST", "/slots/2?action=erase").json()["n_erased"] > 0


def test_slot_actions_without_save_path_are_refused(fim: Any) -> None:
    ctx, _ = fim
    app = create_app(ctx)
    for action in ("save", "restore"):  # erase needs no folder (issue 54)
        response = call(app, "POST", f"/slots/0?action={action}", json={"filename": "a.bin"})
        assert is_llama_error(response, 501, "not_supported_error")
        assert "--slot-save-path" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "name",
    ["../escape.bin", "..", ".", "", "/etc/passwd", "a/b.bin", "a\\b.bin", "x\x00y", "C:x",
     " lead", "trail.", "a..b", "\u2215etc", "x" * 256, 7, None],
)  # fmt: skip
def test_traversing_file_names_are_refused(fim: Any, tmp_path: Path, name: object) -> None:
    ctx, _ = fim
    (tmp_path / "slots").mkdir()
    app = create_app(ctx, slot_save_path=tmp_path / "slots")
    for action in ("save", "restore"):
        response = call(app, "POST", f"/slots/0?action={action}", json={"filename": name})
        assert is_llama_error(response, 400, "invalid_request_error")
        assert response.json()["error"]["message"] == "Invalid filename"
    assert not valid_filename(name)
    assert list(tmp_path.iterdir()) == [tmp_path / "slots"]
    assert list((tmp_path / "slots").iterdir()) == []


@pytest.fixture
def tmp_slots(tmp_path: Path) -> Path:
    (tmp_path / "slots").mkdir()
    return tmp_path / "slots"


def test_bad_slot_ids_and_actions(fim: Any, tmp_slots: Path) -> None:
    ctx, _ = fim
    app = create_app(ctx, slot_save_path=tmp_slots)
    for path in ("/slots/9?action=erase", "/slots/-1?action=erase", "/slots/x?action=erase"):
        response = call(app, "POST", path)
        assert is_llama_error(response, 400, "invalid_request_error")
        assert response.json()["error"]["message"].startswith("Invalid slot ID")
    assert is_llama_error(call(app, "POST", "/slots/0?action=nap"), 400, "invalid_request_error")
    empty = call(app, "POST", "/slots/0?action=save", json={"filename": "a.bin"})
    assert is_llama_error(empty, 400, "invalid_request_error")
    missing = call(app, "POST", "/slots/0?action=restore", json={"filename": "nope.bin"})
    assert is_llama_error(missing, 400, "invalid_request_error")
    assert "Unable to restore slot" in missing.json()["error"]["message"]


def test_save_erase_restore_round_trip_continues_from_the_cache(fim: Any, tmp_slots: Path) -> None:
    ctx, _ = fim
    app = create_app(ctx, slot_save_path=tmp_slots)
    assert call(app, "POST", "/infill", json=BODY | {"id_slot": None}).json()["id_slot"] == 0
    first = call(app, "POST", "/infill", json=BODY | {"id_slot": 1}).json()
    assert first["timings"]["cache_n"] == 0
    saved = call(app, "POST", "/slots/1?action=save", json={"filename": "s1.bin"}).json()
    assert saved["id_slot"] == 1 and saved["filename"] == "s1.bin"
    assert saved["n_saved"] == first["tokens_evaluated"] + first["tokens_predicted"] - 1
    assert saved["n_written"] == (tmp_slots / "s1.bin").stat().st_size
    erased = call(app, "POST", "/slots/1?action=erase").json()
    assert erased == {"id_slot": 1, "n_erased": saved["n_saved"]}
    assert call(app, "GET", "/slots").json()[1].get("n_cached_tokens") is None
    restored = call(app, "POST", "/slots/0?action=restore", json={"filename": "s1.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    again = call(app, "POST", "/infill", json=BODY | {"id_slot": 0}).json()
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert again["timings"]["prompt_n"] == 1 and again["content"] == first["content"]
    call(app, "POST", "/slots/0?action=erase")


def test_completion_on_a_slot_continues_from_its_session_as_llama_cpps_slot_save_test(
    fim: Any, tmp_slots: Path
) -> None:
    """llama.cpp's test_slot_save.py on the fake: ``/completion`` with ``id_slot`` runs on
    that slot's session, so it continues from what the slot holds (its last request, or a
    file restored into it), and an erased slot computes everything again."""
    ctx, _ = fim
    app = create_app(ctx, slot_save_path=tmp_slots)
    france, germany = "What is the capital of France?", "What is the capital of Germany?"
    num_france, num_germany = len(ctx.tokenize(france)), len(ctx.tokenize(germany))
    num_common = len(ctx.tokenize("What is the capital of "))

    def complete(prompt: str, id_slot: int, **more: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "id_slot": id_slot, "n_predict": 4, "temperature": 0}
        response = call(app, "POST", "/completion", json=body | more)
        assert response.status_code == 200, response.text
        if not more.get("stream"):
            return dict(response.json())
        chunks = [json.loads(e[len("data: ") :]) for e in response.text.split("\n\n") if e]
        assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert all(c["id_slot"] == id_slot for c in chunks)
        return dict(chunks[-1])

    first = complete(france, 1)
    assert first["id_slot"] == 1 and first["timings"]["prompt_n"] == num_france
    saved = call(app, "POST", "/slots/1?action=save", json={"filename": "slot1.bin"}).json()
    assert saved["n_saved"] == num_france + 4 - 1
    second = complete(germany, 1)
    assert second["timings"]["prompt_n"] == num_germany - num_common
    restored = call(app, "POST", "/slots/0?action=restore", json={"filename": "slot1.bin"})
    assert restored.json()["n_restored"] == saved["n_saved"]
    third = complete(germany, 0)
    assert third["id_slot"] == 0 and third["timings"]["prompt_n"] == num_germany - num_common
    assert third["content"] == second["content"]
    assert complete(germany, 1)["timings"]["prompt_n"] == 1  # slot 1 was left as it was
    slots = call(app, "GET", "/slots").json()
    assert slots[1]["n_cached_tokens"] == num_germany + 4 - 1
    assert slots[1]["params"]["n_predict"] == 4 and not slots[1]["is_processing"]
    call(app, "POST", "/slots/1?action=erase")
    again = complete(germany, 1, stream=True)  # streamed: the same slot, the same counts
    assert again["timings"]["prompt_n"] == num_germany and again["timings"]["cache_n"] == 0
    for slot in (0, 1):
        call(app, "POST", f"/slots/{slot}?action=erase")


def test_completion_on_a_slot_takes_one_prompt_and_one_choice(fim: Any) -> None:
    ctx, backend = fim
    app = create_app(ctx)
    for more in ({"prompt": ["a", "b"]}, {"n_cmpl": 2}):
        body = {"prompt": "abc", "id_slot": 0} | more
        response = call(app, "POST", "/completion", json=body)
        assert is_llama_error(response, 400, "invalid_request_error")
        assert "id_slot" in response.json()["error"]["message"]
    assert backend.decode_log == []
    bad = call(app, "POST", "/completion", json={"prompt": "abc", "id_slot": 9})
    assert is_llama_error(bad, 400, "invalid_request_error") and backend.decode_log == []
    tokenized = call(app, "POST", "/completion", json={"prompt": "abc", "id_slot": 0,
                                                       "n_predict": 0})  # fmt: skip
    assert tokenized.status_code == 200 and tokenized.json()["tokens_evaluated"] == 3


# ---------------------------------------------------------------------- the router
def fake_model() -> llamax.Context:
    return llamax.Context(backend=FakeBackend(n_ctx=256, n_seq_max=2))


def test_router_loads_lists_and_unloads_models() -> None:
    from llamax.server import ModelPool

    pool = ModelPool({"a": fake_model, "b": fake_model})
    app = create_app(pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        async def status(name: str) -> str:
            listed = (await client.get("/models")).json()
            assert listed["object"] == "list"
            model = next(m for m in listed["data"] if m["id"] == name)
            assert {"aliases", "tags", "architecture", "object", "created"} <= set(model)
            return str(model["status"]["value"])

        assert await status("a") == "unloaded" and await status("b") == "unloaded"
        loaded = await client.post("/models/load", json={"model": "b"})
        assert loaded.status_code == 200 and loaded.json() == {"success": True}
        for _ in range(500):
            if await status("b") == "loaded":
                break
            await asyncio.sleep(0.01)
        assert await status("b") == "loaded" and await status("a") == "unloaded"
        assert [s["id"] for s in (await client.get("/slots?model=b")).json()] == [0, 1]
        assert (await client.get("/slots?model=a")).json() == []  # not loaded: no slots
        assert is_llama_error(await client.get("/slots?model=zzz"), 404, "not_found_error")
        again = await client.post("/models/load", json={"model": "b"})
        assert is_llama_error(again, 400, "invalid_request_error")
        unknown = await client.post("/models/load", json={"model": "zzz"})
        assert is_llama_error(unknown, 404, "not_found_error")
        for body in ({}, {"model": 3}, {"model": ""}):
            bad = await client.post("/models/load", json=body)
            assert is_llama_error(bad, 400, "invalid_request_error")
        gone = await client.post("/models/unload", json={"model": "zzz"})
        assert is_llama_error(gone, 400, "invalid_request_error")
        unloaded = await client.post("/models/unload", json={"model": "b"})
        assert unloaded.status_code == 200 and unloaded.json() == {"success": True}
        assert await status("b") == "unloaded"
        twice = await client.post("/models/unload", json={"model": "b"})
        assert is_llama_error(twice, 400, "invalid_request_error")

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await scenario(client)

    try:
        asyncio.run(go())
    finally:
        pool.close()


def test_an_unload_while_requests_hold_the_model_is_refused() -> None:
    from llamax.server import ModelPool

    pool = ModelPool({"a": fake_model})
    held = pool.acquire("a")
    try:
        held.result(60)
        with pytest.raises(llamax.InvalidRequestError, match="in use by 1 requests"):
            pool.unload("a")
    finally:
        pool.release(held)
    pool.unload("a")
    assert [m.state.value for m in pool.models()] == ["unloaded"]
    pool.close()


def test_one_model_has_no_router_routes(fim: Any) -> None:
    ctx, _ = fim
    assert call(create_app(ctx), "POST", "/models/load", json={"model": "x"}).status_code == 404


def test_a_client_that_leaves_a_stream_frees_its_request_and_slot(tmp_path: Path) -> None:
    import time

    from llamax.server import BackgroundServer

    backend = FakeBackend(n_ctx=4096, n_seq_max=4, special_tokens=FIM)
    backend.fault = lambda where: time.sleep(0.02) if where == "decode" else None
    ctx = llamax.Context(backend=backend)
    server = BackgroundServer(create_app(ctx, slot_save_path=tmp_path))
    server.start()
    try:
        body = BODY | {"n_predict": 2000, "stream": True, "id_slot": 1, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/infill", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 30
        while (
            ctx.stats().num_running or httpx.get(server.url + "/slots").json()[1]["is_processing"]
        ):
            assert time.monotonic() < deadline, "the request outlived its client"
            time.sleep(0.02)
        erased = httpx.post(server.url + "/slots/1?action=erase", timeout=30).json()
        assert 0 < erased["n_erased"] < 2000  # the slot's lock was given back
    finally:
        server.stop()
        assert_idle(ctx)
        ctx.close()


def test_an_infill_past_the_context_is_llama_servers_exceed_context_size_error(fim: Any) -> None:
    ctx, backend = fim
    response = call(create_app(ctx), "POST", "/infill", json=BODY | {"prompt": "x" * 2000})
    assert is_llama_error(response, 400, "exceed_context_size_error"), response.text
    assert backend.decode_log == []
