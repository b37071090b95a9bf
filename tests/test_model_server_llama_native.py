"""llama-server's ``/infill`` and ``/slots`` over HTTP on SmolLM2 (issue 41, part B).

SmolLM2-135M-Instruct has no FIM tokens, so ``/infill`` on it is refused (501, as
llama-server refuses it); the other tests run on a copy whose metadata names three of its
unused control tokens as FIM tokens (``scripts/make_fim_model.py``). The refusal, a
restored slot and the router are the default selection's; the FIM copy's editor batching,
slot round trip and four slots are ``integration`` (issue 55).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from script_modules import load_script

import llamax
from llamax.server import create_app
from llamax.testing import assert_idle

pytest.importorskip("gguf")
pytestmark = pytest.mark.model

HEADER = "".join(f"int helper_{i}(int x) {{ return x * {i}; }}\n" for i in range(24))
BODY = {"input_prefix": '#include "lib.h"\n\nint main() {\n', "input_suffix": "}\n",
        "prompt": "    int n = helper_", "n_predict": 8, "temperature": 0}  # fmt: skip


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    module = load_script("make_fim_model")
    out: Path = module.write_fim_model(tmp_path_factory.mktemp("fim") / "fim.gguf", model_path)
    return out


@pytest.fixture
def fim_ctx(fim_model: Path) -> Iterator[llamax.Context]:
    ctx = llamax.Context(fim_model, n_ctx=4096, n_seq_max=8, n_batch=512)
    yield ctx
    assert_idle(ctx)
    ctx.close()


async def post_all(app: Any, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=600) as client:
        return await asyncio.gather(*(client.post("/infill", json=b) for b in bodies))


def post(app: Any, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def test_infill_is_refused_on_smollm2(real_ctx: llamax.Context) -> None:
    assert not real_ctx.fim_tokens.can_infill and real_ctx.fim_tokens.repo is not None
    before = real_ctx.stats().num_steps
    response = post(create_app(real_ctx), "/infill", BODY)
    assert response.status_code == 501
    assert response.json() == {"error": {
        "code": 501, "type": "not_supported_error",
        "message": "Infill is not supported by this model: prefix token is missing. suffix "
                   "token is missing. middle token is missing. ",
    }}  # fmt: skip
    assert real_ctx.stats().num_steps == before


@pytest.mark.integration
def test_editor_requests_are_batched_and_share_the_file_prefix(
    fim_ctx: llamax.Context,
) -> None:
    """Eight editors' requests at once, as many as the context's sequences (32 on 16 before
    issue 55: the same batching and prefix sharing, at a quarter of the prefill)."""
    app = create_app(fim_ctx)
    extra = [{"filename": "lib.h", "text": HEADER}]
    bodies = [BODY | {"input_extra": extra, "prompt": f"    int n{i} = helper_{i % 24}("}
              for i in range(8)]  # fmt: skip
    before = fim_ctx.stats()
    responses = asyncio.run(post_all(app, bodies))
    after = fim_ctx.stats()
    assert all(r.status_code == 200 for r in responses), responses[0].text
    answers = [r.json() for r in responses]
    assert all(a["stop"] and a["tokens_predicted"] == 8 for a in answers)
    prompt_n = [a["tokens_evaluated"] for a in answers]
    cached = [a["timings"]["cache_n"] for a in answers]
    assert min(prompt_n) > 300  # the shared file is most of each prompt
    assert sum(c > 300 for c in cached) >= len(bodies) - 1, cached  # all but the first copy it
    steps = after.num_steps - before.num_steps
    decoded = after.num_decode_tokens - before.num_decode_tokens
    assert decoded / steps > 2, (decoded, steps)  # several sequences per step


@pytest.mark.integration
def test_slot_round_trip_on_smollm2(fim_ctx: llamax.Context, tmp_path: Path) -> None:
    app = create_app(fim_ctx, slot_save_path=tmp_path)
    first = post(app, "/infill", BODY | {"id_slot": 1, "cache_prompt": True}).json()
    assert first["timings"]["cache_n"] == 0 and first["id_slot"] == 1
    saved = post(app, "/slots/1?action=save", {"filename": "slot1.bin"}).json()
    assert saved["n_saved"] == first["tokens_evaluated"] + first["tokens_predicted"] - 1
    assert post(app, "/slots/1?action=erase").json()["n_erased"] == saved["n_saved"]
    bad = post(app, "/slots/0?action=restore", {"filename": "../slot1.bin"})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "Invalid filename"
    restored = post(app, "/slots/0?action=restore", {"filename": "slot1.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    again = post(app, "/infill", BODY | {"id_slot": 0, "cache_prompt": True}).json()
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert again["timings"]["prompt_n"] == 1 and again["content"] == first["content"]
    post(app, "/slots/0?action=erase")


def test_completion_on_a_restored_slot_continues_from_it_on_smollm2(
    real_ctx: llamax.Context, tmp_path: Path
) -> None:
    """llama.cpp's test_slot_save.py on SmolLM2: ``/completion`` with ``id_slot`` runs on
    the slot's session; a file restored into another slot continues from that slot's KV
    (only the differing tail is computed) and gives the same greedy words."""
    app = create_app(real_ctx, slot_save_path=tmp_path)
    france, germany = "What is the capital of France?", "What is the capital of Germany?"
    num_common = len(real_ctx.tokenize("What is the capital of"))

    def complete(prompt: str, id_slot: int) -> dict[str, Any]:
        body = {"prompt": prompt, "id_slot": id_slot, "cache_prompt": True, "n_predict": 8,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = post(app, "/completion", body)
        assert response.status_code == 200, response.text
        return dict(response.json())

    first = complete(france, 1)
    assert first["timings"]["prompt_n"] == len(real_ctx.tokenize(france))
    saved = post(app, "/slots/1?action=save", {"filename": "slot1.bin"}).json()
    assert saved["n_saved"] == first["tokens_evaluated"] + 8 - 1
    second = complete(germany, 1)
    num_tail = second["tokens_evaluated"] - num_common
    assert second["timings"]["prompt_n"] == num_tail  # only the differing part
    assert post(app, "/slots/0?action=restore", {"filename": "slot1.bin"}).status_code == 200
    third = complete(germany, 0)
    assert third["timings"]["prompt_n"] == num_tail and third["content"] == second["content"]
    assert complete(germany, 1)["timings"]["prompt_n"] == 1  # slot 1 kept its own KV
    for slot in (0, 1):
        post(app, f"/slots/{slot}?action=erase")


@pytest.mark.integration
def test_four_slots_never_lock_others_out_on_smollm2(model_path: Path) -> None:
    """Issue 54: ``id_slot`` 0..3 on ``n_seq_max=4``, then a plain request and a chat are
    served (before: 500, every id held by a slot's session); the slot that yielded its
    sequence continues from its retained prefix with the words a plain request gives."""
    ctx = llamax.Context(model_path, n_ctx=2048, n_seq_max=4, n_batch=256)
    try:
        app = create_app(ctx)
        prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(4)]
        for id_slot, prompt in enumerate(prompts):
            body = {"prompt": prompt, "id_slot": id_slot, "n_predict": 1, "temperature": 0}
            assert post(app, "/completion", body).status_code == 200
        more = {"n_predict": 8, "temperature": 0, "ignore_eos": True}
        plain = post(app, "/completion", {"prompt": prompts[0] + " It is", **more})
        assert plain.status_code == 200, plain.text
        chat = post(app, "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})  # fmt: skip
        assert chat.status_code == 200, chat.text
        again = post(app, "/completion", {"prompt": prompts[0] + " It is", "id_slot": 0, **more})
        assert again.status_code == 200, again.text
        assert again.json()["timings"]["cache_n"] > 0
        assert again.json()["content"] == plain.json()["content"]
        for id_slot in range(4):
            assert post(app, f"/slots/{id_slot}?action=erase").status_code == 200
        assert_idle(ctx)
    finally:
        ctx.close()


def test_router_load_and_unload_on_smollm2(model_path: Path) -> None:
    from llamax.server import ModelPool

    pool = ModelPool({"a": model_path, "b": model_path}, n_ctx=512, n_seq_max=2)
    app = create_app(pool)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:

            async def status(name: str) -> str:
                listed = (await c.get("/models")).json()["data"]
                return str(next(m for m in listed if m["id"] == name)["status"]["value"])

            assert (await c.post("/models/load", json={"model": "b"})).json() == {"success": True}
            for _ in range(1200):
                if await status("b") == "loaded":
                    break
                await asyncio.sleep(0.05)
            assert await status("b") == "loaded" and await status("a") == "unloaded"
            text = await c.post("/v1/completions", json={"model": "b", "prompt": "Hi",
                                                         "max_tokens": 2})  # fmt: skip
            assert text.status_code == 200 and text.json()["model"] == "b"
            assert (await c.post("/models/unload", json={"model": "b"})).status_code == 200
            assert await status("b") == "unloaded"

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
