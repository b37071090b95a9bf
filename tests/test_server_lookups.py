"""The server's lookups by id, through the real ``openai`` client (issue 44): ``GET
/v1/models/{id}``, a response's ``input_items``, and what an unknown id gets (a 404 about
the id, in OpenAI's error shape), on the fake backend and in a pool of models."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from test_chat import make

import llamax
from llamax.server import BackgroundServer, ModelPool, create_app
from llamax.testing import assert_idle

HI = [{"role": "user", "content": "Hi!"}]


@pytest.fixture
def server() -> Iterator[tuple[llamax.Context, str]]:
    with make(autostart=True) as ctx, BackgroundServer(create_app(ctx)) as running:
        yield ctx, running.url
        assert_idle(ctx)


@pytest.fixture
def client(server: tuple[llamax.Context, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="-", max_retries=0)


# --- GET /v1/models/{id} ---------------------------------------------------------------------
def test_a_model_is_retrieved_by_its_id(
    server: tuple[llamax.Context, str], client: openai.OpenAI
) -> None:
    ctx, _ = server
    listed = client.models.list().data
    model = client.models.retrieve(ctx.model_name)
    assert model.id == ctx.model_name and model.object == "model"
    assert model.model_dump() == listed[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    error = missing.value.body
    assert error == {  # OpenAI's own words and code
        "message": "The model 'no-such-model' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_a_model_id_with_a_slash_is_one_id(server: tuple[llamax.Context, str]) -> None:
    reply = httpx.get(server[1] + "/v1/models/org/name.gguf")
    assert reply.status_code == 404 and "'org/name.gguf'" in reply.json()["error"]["message"]


def test_each_model_of_a_pool_is_retrieved_by_its_id() -> None:
    pool = ModelPool({"a": make, "b": make})
    try:
        with BackgroundServer(create_app(pool)) as running:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="-", max_retries=0)
            b = client.models.retrieve("b")
            assert b.id == "b" and b.model_extra["status"] == {"value": "unloaded"}  # type: ignore[index]
            with pytest.raises(openai.NotFoundError, match="'c' does not exist"):
                client.models.retrieve("c")
    finally:
        pool.close()


# --- GET /v1/responses/{id}/input_items ------------------------------------------------------
def _ids(page: Any) -> list[str]:
    return [item.id for item in page.data]


def test_input_items_list_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="m", input="Hi!", instructions="Be brief.", max_output_tokens=3, temperature=0
    )
    items = client.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [  # type: ignore[union-attr]
        ("message", "user", "Hi!")
    ]  # instructions are not an item
    assert items.data[0].content[0].type == "input_text"  # type: ignore[union-attr]
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Again"}]},
            {"type": "message", "role": "user", "content": "And again", "id": "msg_mine"},
        ],
        max_output_tokens=3,
    )
    newest_first = client.responses.input_items.list(second.id)
    texts = [(i.role, i.content[0].text) for i in newest_first.data]  # type: ignore[union-attr]
    assert texts == [("user", "And again"), ("user", "Again"), ("assistant", "Hel"),
                     ("user", "Hi!")]  # fmt: skip
    assert _ids(newest_first)[0] == "msg_mine"
    assert _ids(newest_first)[2] == first.output[0].id  # the earlier output, as it was
    assert len(set(_ids(newest_first))) == 4
    oldest_first = client.responses.input_items.list(second.id, order="asc")
    assert _ids(oldest_first) == _ids(newest_first)[::-1]
    # pages: limit and after; the client's auto-pagination walks them all
    page = client.responses.input_items.list(second.id, order="asc", limit=3)
    assert _ids(page) == _ids(oldest_first)[:3] and page.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert _ids(rest) == _ids(oldest_first)[3:] and not rest.has_more
    walked = client.responses.input_items.list(second.id, limit=1)
    assert [item.id for item in walked] == _ids(newest_first)
    included = client.responses.input_items.list(first.id, include=["reasoning.encrypted_content"])
    assert _ids(included) == _ids(items)


def test_input_items_hold_function_calls_and_outputs(client: openai.OpenAI) -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    response = client.responses.create(model="m", input=[*HI, call, output], max_output_tokens=3)
    items = client.responses.input_items.list(response.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == "call_1" and items[2].output == "42"  # type: ignore[union-attr]
    assert all(i.status == "completed" for i in items)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"order": "newest"}, "order"),
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"after": "msg_nope"}, "after"),
        ({"include[]": "everything"}, "include"),
    ],
)
def test_bad_input_items_queries_are_400s_naming_them(
    server: tuple[llamax.Context, str], client: openai.OpenAI, query: dict[str, str], param: str
) -> None:
    response = client.responses.create(model="m", input="Hi!", max_output_tokens=3)
    reply = httpx.get(f"{server[1]}/v1/responses/{response.id}/input_items", params=query)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


# --- unknown response ids: a 404 about the id -----------------------------------------------
def test_an_unknown_response_is_not_found_on_every_lookup(client: openai.OpenAI) -> None:
    lookups = (
        lambda: client.responses.retrieve("resp_nope"),
        lambda: client.responses.delete("resp_nope"),
        lambda: client.responses.input_items.list("resp_nope"),
    )
    for lookup in lookups:
        with pytest.raises(openai.NotFoundError) as missing:
            lookup()
        error = missing.value.body
        assert isinstance(error, dict) and error["param"] is None
        assert error["message"].startswith("no stored response has id 'resp_nope' (")
        assert "previous_response_id" not in error["message"]
    response = client.responses.create(model="m", input="Hi!", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(response.id)  # store: false keeps nothing
    with pytest.raises(openai.NotFoundError) as follow_up:  # this one is about the field
        client.responses.create(model="m", input="Hi!", previous_response_id="resp_nope")
    assert follow_up.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_streamed_retrieve_is_a_400_not_an_empty_stream(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="Hi!", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as refused:
        list(client.responses.retrieve(response.id, stream=True))
    assert refused.value.body["param"] == "stream"  # type: ignore[index]
