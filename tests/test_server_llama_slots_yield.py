"""Slots never lock other clients out (issue 54, finding 5 and the restore path of 11), on
the fake backend in-process: a slot's session yields its sequence to any request that
needs it, idle slots close, ``erase`` needs no save folder, capacity is 503 in every
dialect, and a failed restore never names the slot folder."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server_fake import HELLO, SPECIALS, TEMPLATE, call

import llamax
from llamax.server import create_app
from llamax.testing import FakeBackend, assert_idle


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    backend = FakeBackend(
        n_ctx=1024,
        n_seq_max=4,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SPECIALS,
    )
    context = llamax.Context(backend=backend)
    yield context
    assert_idle(context)
    context.close()


def fill_slots(app: Any, num: int = 4) -> None:
    for id_slot in range(num):
        body = {"prompt": f"slot {id_slot} says", "id_slot": id_slot, "n_predict": 1}
        response = call(app, "POST", "/completion", json=body)
        assert response.status_code == 200, response.text


def others_are_served(app: Any) -> None:
    """A plain native request, an OpenAI chat and a text completion, each 200."""
    plain = call(app, "POST", "/completion", json={"prompt": "anyone", "n_predict": 2})
    assert plain.status_code == 200, plain.text
    chat = call(app, "POST", "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    text = call(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert text.status_code == 200, text.text


def erase_all(app: Any, num: int = 4) -> None:
    for id_slot in range(num):
        assert call(app, "POST", f"/slots/{id_slot}?action=erase").status_code == 200


def test_four_slots_do_not_lock_out_other_requests(ctx: llamax.Context) -> None:
    """Before: after ``id_slot`` 0..3 every other request got 500 "every one of the 4
    sequence ids is held by an open session"."""
    app = create_app(ctx)
    fill_slots(app)
    others_are_served(app)
    fill_slots(app)  # the slots still work, each again, after yielding
    others_are_served(app)
    erase_all(app)


def test_a_slot_that_yielded_reuses_its_prefix_if_it_survived(ctx: llamax.Context) -> None:
    app = create_app(ctx)
    fill_slots(app)
    others_are_served(app)
    body = {"prompt": "slot 0 says more", "id_slot": 0, "n_predict": 1}
    again = call(app, "POST", "/completion", json=body).json()
    assert again["timings"]["cache_n"] > 0  # its own (now retained) prefix, or a copy
    erase_all(app)


def test_idle_slots_close_after_slot_idle_seconds(ctx: llamax.Context) -> None:
    app = create_app(ctx, slot_idle_seconds=1e-9)  # every slot is idle by its next look
    fill_slots(app)
    slots = call(app, "GET", "/slots").json()
    assert [s.get("n_cached_tokens") for s in slots] == [None] * 4
    assert call(app, "POST", "/slots/0?action=erase").json()["n_erased"] == 0
    others_are_served(app)
    fill_slots(app)
    others_are_served(app)
    erase_all(app)


def test_erase_needs_no_save_path(ctx: llamax.Context) -> None:
    """Before: 501 without ``--slot-save-path``, so only a restart freed a slot."""
    app = create_app(ctx)
    fill_slots(app, 1)
    erased = call(app, "POST", "/slots/0?action=erase")
    assert erased.status_code == 200, erased.text
    assert erased.json()["id_slot"] == 0 and erased.json()["n_erased"] > 0


def test_a_failed_restore_names_the_file_not_the_folder(
    ctx: llamax.Context, tmp_path: Path
) -> None:
    folder = tmp_path / "secret-folder"
    folder.mkdir()
    (folder / "bad.bin").write_bytes(b"not a session file at all")
    (folder / "dir.bin").mkdir()
    app = create_app(ctx, slot_save_path=folder)
    for name in ("bad.bin", "dir.bin", "missing.bin"):
        response = call(app, "POST", "/slots/0?action=restore", json={"filename": name})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("Unable to restore slot")
        assert str(tmp_path) not in message and "secret-folder" not in message, message
    bad = call(app, "POST", "/slots/0?action=restore", json={"filename": "bad.bin"})
    assert "bad.bin" in bad.json()["error"]["message"]


ROUTES = {
    "/completion": ({"prompt": "x", "n_predict": 1}, lambda b: b["error"]["code"] == 503),
    "/v1/chat/completions": (
        {"messages": HELLO, "max_tokens": 1},
        lambda b: set(b["error"]) >= {"message", "type"},
    ),
    "/v1/completions": ({"prompt": "x", "max_tokens": 1}, lambda b: "message" in b["error"]),
    "/v1/messages": (
        {"messages": HELLO, "max_tokens": 1},
        lambda b: b["type"] == "error" and "message" in b["error"],
    ),
    "/v1/responses": ({"input": "x", "max_output_tokens": 16}, lambda b: "message" in b["error"]),
}


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_capacity_is_503_in_the_dialects_body(ctx: llamax.Context, path: str) -> None:
    """Sessions a library user pinned hold every id: a request is 503 in its API's shape
    (before: 500 "inference failed")."""
    body, shaped = ROUTES[path]
    held = [ctx.session() for _ in range(4)]
    try:
        response = call(create_app(ctx), "POST", path, json=body)
    finally:
        for session in held:
            session.close()
    assert response.status_code == 503, response.text
    assert shaped(response.json()), response.text


def test_slots_and_others_at_once_are_all_served(ctx: llamax.Context) -> None:
    """24 requests at once on 4 sequence ids: slot requests (each slot twice), plain native
    requests and chats; every one is 200 and the engine ends idle."""
    app = create_app(ctx)

    async def go() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            bodies: list[tuple[str, dict[str, Any]]] = []
            for i in range(8):
                slot = {"prompt": f"slot {i % 4} x", "id_slot": i % 4, "n_predict": 5}
                bodies += [
                    ("/completion", slot),
                    ("/completion", {"prompt": f"plain {i}", "n_predict": 5}),
                    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 3}),
                ]
            answers = await asyncio.gather(*(client.post(p, json=b) for p, b in bodies))
            return [a.status_code for a in answers]

    assert asyncio.run(go()) == [200] * 24
    erase_all(app)


def test_a_slot_that_yielded_has_nothing_to_save(ctx: llamax.Context, tmp_path: Path) -> None:
    app = create_app(ctx, slot_save_path=tmp_path)
    fill_slots(app)
    others_are_served(app)  # slot 0, the least recently used, gave its sequence back
    slots = call(app, "GET", "/slots").json()
    assert slots[0]["n_cached_tokens"] == 0 and slots[3]["n_cached_tokens"] > 0
    empty = call(app, "POST", "/slots/0?action=save", json={"filename": "s0.bin"})
    assert empty.status_code == 400 and "holds no tokens" in empty.json()["error"]["message"]
    saved = call(app, "POST", "/slots/3?action=save", json={"filename": "s3.bin"})
    assert saved.status_code == 200 and saved.json()["n_saved"] > 0
    assert list(tmp_path.iterdir()) == [tmp_path / "s3.bin"]
    erase_all(app)
