"""LangChain's ``ChatOpenAI`` and ``ChatAnthropic`` pointed at ``llamax serve`` on SmolLM2
(issue 44): a pydantic tool whose fields have bounds, bound with ``bind_tools`` and forced
with ``tool_choice`` (the tiny model must call it), and ``with_structured_output`` on a
pydantic model with bounds. Each is a 200 and a parse that satisfies the bounds: the integer
and float bounds, multiples and string lengths become grammar rules, so the sampled JSON
cannot leave them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import langchain_anthropic
import langchain_openai
import pytest
from pydantic import BaseModel, Field

import llamax
from llamax.server import BackgroundServer, create_app
from llamax.testing import assert_idle

pytestmark = [pytest.mark.model, pytest.mark.integration]


class SetAge(BaseModel):
    """Record the age of a person."""

    name: str = Field(max_length=16, description="the person's first name")
    age: int = Field(gt=17, lt=31, description="the age in years")


class Review(BaseModel):
    """A short review of a film."""

    title: str = Field(max_length=24)
    stars: int = Field(ge=1, le=5)
    year: int = Field(gt=1900, lt=2030)


class Measure(BaseModel):
    """Record a measurement."""

    fraction: float = Field(gt=0, lt=1, description="the share measured, between 0 and 1")
    offset: float = Field(ge=-2.5, le=1e3, multiple_of=0.5, description="the offset")


ASK_AGE = "Alice is 25 years old. Record her age."
ASK_MEASURE = "A third of the tank is full, 12 litres above the mark. Record it."
ASK_REVIEW = "Review the film Jaws in one line."


@pytest.fixture(scope="module")
def server_ctx(model_path: Path) -> Iterator[llamax.Context]:
    """This module's context, on one thread (2 cores are shared with other work)."""
    with llamax.Context(model_path, n_ctx=4096, n_seq_max=4, n_threads=1) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def url(server_ctx: llamax.Context) -> Iterator[str]:
    with BackgroundServer(create_app(server_ctx)) as running:
        yield running.url


@pytest.fixture(autouse=True)
def idle_engine(server_ctx: llamax.Context) -> Iterator[None]:
    assert_idle(server_ctx)
    yield
    assert_idle(server_ctx, timeout=60)


def _in_bounds(age: SetAge) -> None:
    assert 17 < age.age < 31 and len(age.name) <= 16


def _options() -> dict[str, Any]:
    return {"model": "smollm2", "api_key": "-", "temperature": 0, "max_retries": 0}


# --- ChatOpenAI --------------------------------------------------------------------------------
def test_chat_openai_calls_a_bounded_tool(url: str) -> None:
    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", max_tokens=96, **_options())
    several = llm.bind_tools([SetAge], tool_choice="SetAge").invoke(ASK_AGE).tool_calls
    assert several and all(call["name"] == "SetAge" for call in several)
    for call in several:  # forced, and parallel calls allowed: each one within the bounds
        _in_bounds(SetAge.model_validate(call["args"]))
    bound = llm.bind_tools([SetAge], tool_choice="SetAge", parallel_tool_calls=False)
    (call,) = bound.invoke(ASK_AGE).tool_calls
    _in_bounds(SetAge.model_validate(call["args"]))
    streamed = None
    for chunk in bound.stream(ASK_AGE):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls[0]["args"] == call["args"]


def test_chat_openai_structured_output_with_bounds(url: str) -> None:
    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", max_tokens=96, **_options())
    for method in ("json_schema", "function_calling"):  # json_mode sends no schema
        review = llm.with_structured_output(Review, method=method).invoke(ASK_REVIEW)
        assert isinstance(review, Review), method
        assert 1 <= review.stars <= 5 and 1900 < review.year < 2030 and len(review.title) <= 24


def test_chat_openai_float_bounds_over_several_seeds(url: str) -> None:
    options = {**_options(), "temperature": 1.2}
    for seed in range(4):
        llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", max_tokens=96, seed=seed, **options)
        bound = llm.bind_tools([Measure], tool_choice="Measure", parallel_tool_calls=False)
        (call,) = bound.invoke(ASK_MEASURE).tool_calls
        measured = Measure.model_validate(call["args"])  # pydantic checks gt/lt/multiple_of
        assert 0 < measured.fraction < 1 and -2.5 <= measured.offset <= 1000
        structured = llm.with_structured_output(Measure, method="json_schema")
        assert isinstance(structured.invoke(ASK_MEASURE), Measure)


# --- ChatAnthropic -----------------------------------------------------------------------------
def test_chat_anthropic_calls_a_bounded_tool(url: str) -> None:
    llm = langchain_anthropic.ChatAnthropic(base_url=url, max_tokens=96, **_options())
    bound = llm.bind_tools([SetAge], tool_choice="SetAge", parallel_tool_calls=False)
    (call,) = bound.invoke(ASK_AGE).tool_calls  # disable_parallel_tool_use: one call
    assert call["name"] == "SetAge" and call["id"].startswith("toolu_")
    _in_bounds(SetAge.model_validate(call["args"]))
    streamed = None
    for chunk in bound.stream(ASK_AGE):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls[0]["args"] == call["args"]


def test_chat_anthropic_structured_output_with_bounds(url: str) -> None:
    llm = langchain_anthropic.ChatAnthropic(base_url=url, max_tokens=96, **_options())
    review = llm.with_structured_output(Review).invoke(ASK_REVIEW)  # a forced tool call
    assert isinstance(review, Review)
    assert 1 <= review.stars <= 5 and 1900 < review.year < 2030 and len(review.title) <= 24
    # method="json_schema" (output_config.format): the anthropic SDK's transform_schema moves
    # the bounds into the descriptions before sending (Anthropic's structured outputs take
    # none), so no server can enforce them; the reply follows the schema that was sent
    raw = llm.with_structured_output(Review, method="json_schema", include_raw=True)
    sent = json.loads(raw.invoke(ASK_REVIEW)["raw"].text)
    assert set(sent) == {"title", "stars", "year"}
    assert isinstance(sent["stars"], int) and isinstance(sent["year"], int)
