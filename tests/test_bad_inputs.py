"""A table of bad inputs through the public API, on the fake backend.

Every entry must raise a typed error (a :class:`llamax.LlamaxError` subclass, or
``TypeError`` for an unknown keyword) and leave the context serving: after each one the
same context answers a normal request and is idle (nothing leaked).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import llamax
from llamax.batch import generate
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
USER = [{"role": "user", "content": "Hi!"}]
P = llamax.SamplingParams

Bad = Callable[[llamax.Context], object]


def _session_op(op: Callable[[llamax.Session], object]) -> Bad:
    def run(ctx: llamax.Context) -> object:
        with ctx.session() as session:
            session.add_request("abc", P(max_tokens=2, temperature=0)).result()
            return op(session)

    return run


def _closed_session(ctx: llamax.Context) -> object:
    session = ctx.session()
    session.close()
    return session.add_request("abc")


def _duplicate_id(ctx: llamax.Context) -> object:
    # The first request is held in the engine (its logits processor waits) until the
    # duplicate has been tried: a fast fake backend could otherwise finish it first.
    tried = threading.Event()

    def hold(token_ids: Any, logits: Any) -> None:
        tried.wait(timeout=60)

    first = ctx.add_request(
        "abc", P(max_tokens=900, ignore_eos=True, logits_processors=[hold]), request_id="same"
    )
    try:
        return ctx.add_request("abd", P(max_tokens=2), request_id="same")
    finally:
        tried.set()
        first.cancel()
        first.result(timeout=60)


def _generate(prompts: Any, params: Any) -> Bad:
    return lambda ctx: generate(ctx, prompts, params)


def _new_context(**options: Any) -> Bad:
    return lambda ctx: llamax.Context(backend=FakeBackend(), autostart=False, **options)


BAD_INPUTS: list[tuple[str, Bad, type[BaseException]]] = [
    # add_request: the prompt
    ("prompt None", lambda c: c.add_request(None), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("prompt int", lambda c: c.add_request(5), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("prompt bytes", lambda c: c.add_request(b"abc"), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("prompt empty str", lambda c: c.add_request(""), llamax.EmptyPromptError),
    ("prompt empty list", lambda c: c.add_request([]), llamax.EmptyPromptError),
    ("prompt negative id", lambda c: c.add_request([1, -2]), llamax.InvalidRequestError),
    ("prompt id >= n_vocab", lambda c: c.add_request([10**6]), llamax.InvalidRequestError),
    ("prompt float ids", lambda c: c.add_request([1.5, 2.0]), llamax.InvalidRequestError),  # type: ignore[list-item]
    ("prompt str ids", lambda c: c.add_request(["a", "b"]), llamax.InvalidRequestError),  # type: ignore[list-item]
    ("prompt bool ids", lambda c: c.add_request([True]), llamax.InvalidRequestError),  # type: ignore[list-item]
    (
        "prompt 2-D array",
        lambda c: c.add_request(np.ones((2, 2), np.int32)),
        llamax.InvalidRequestError,
    ),  # type: ignore[arg-type]
    ("prompt float array", lambda c: c.add_request(np.ones(3)), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("prompt too long", lambda c: c.add_request("x" * 2000), llamax.ContextLengthError),
    # add_request: params, priority, request_id
    ("params dict", lambda c: c.add_request("a", {"max_tokens": 2}), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("params str", lambda c: c.add_request("a", "greedy"), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("priority str", lambda c: c.add_request("a", priority="high"), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("priority float", lambda c: c.add_request("a", priority=1.5), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("priority None", lambda c: c.add_request("a", priority=None), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("request_id int", lambda c: c.add_request("a", request_id=7), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("request_id in use", _duplicate_id, llamax.InvalidRequestError),
    ("add_request unknown kwarg", lambda c: c.add_request("a", max_tokens=2), TypeError),  # type: ignore[call-arg]
    # SamplingParams fields
    ("max_tokens 0", lambda c: P(max_tokens=0), llamax.InvalidParameterError),
    ("max_tokens str", lambda c: P(max_tokens="8"), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("temperature negative", lambda c: P(temperature=-1), llamax.InvalidParameterError),
    ("temperature nan", lambda c: P(temperature=float("nan")), llamax.InvalidParameterError),
    ("temperature str", lambda c: P(temperature="hot"), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("top_p 2", lambda c: P(top_p=2.0), llamax.InvalidParameterError),
    ("top_k negative", lambda c: P(top_k=-5), llamax.InvalidParameterError),
    ("min_p negative", lambda c: P(min_p=-0.1), llamax.InvalidParameterError),
    ("n 0", lambda c: P(n=0), llamax.InvalidParameterError),
    ("n float", lambda c: P(n=1.5), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("logprobs negative", lambda c: P(logprobs=-1), llamax.InvalidParameterError),
    ("stop str with empty", lambda c: P(stop=["a", ""]), llamax.InvalidParameterError),
    ("stop ints", lambda c: P(stop=[1, 2]), llamax.InvalidParameterError),  # type: ignore[list-item]
    ("logit_bias str key", lambda c: P(logit_bias={"x": 1.0}), llamax.InvalidParameterError),  # type: ignore[dict-item]
    (
        "logit_bias id out of vocab",
        lambda c: c.add_request("a", P(logit_bias={10**6: 1.0})),
        llamax.InvalidRequestError,
    ),
    (
        "stop_token_ids out of vocab",
        lambda c: c.add_request("a", P(stop_token_ids=[10**6])),
        llamax.InvalidRequestError,
    ),
    ("seed str", lambda c: P(seed="x"), llamax.InvalidParameterError),  # type: ignore[arg-type]
    (
        "logits_processors not callable",
        lambda c: P(logits_processors=[1]),
        llamax.InvalidParameterError,
    ),  # type: ignore[list-item]
    ("grammar refused", lambda c: c.add_request("a", P(grammar="INVALID")), llamax.GrammarError),
    ("SamplingParams unknown field", lambda c: P(max_token=3), TypeError),  # type: ignore[call-arg]
    ("logit_bias str value", lambda c: P(logit_bias={1: "y"}), llamax.InvalidParameterError),  # type: ignore[dict-item]
    ("logit_bias list", lambda c: P(logit_bias=[1, 2]), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("stop int", lambda c: P(stop=5), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("stop_token_ids int", lambda c: P(stop_token_ids=5), llamax.InvalidParameterError),  # type: ignore[arg-type]
    (
        "logits_processors callable",
        lambda c: P(logits_processors=print),
        llamax.InvalidParameterError,
    ),  # type: ignore[arg-type]
    # chat_completion / completion
    (
        "chat logit_bias str value",
        lambda c: c.chat_completion(USER, logit_bias={"5": "y"}),
        llamax.InvalidRequestError,
    ),  # type: ignore[dict-item]
    (
        "chat logit_bias list",
        lambda c: c.chat_completion(USER, logit_bias=[5]),
        llamax.InvalidRequestError,
    ),  # type: ignore[arg-type]
    (
        "completion logprobs str",
        lambda c: c.completion("a", logprobs="x"),
        llamax.InvalidRequestError,
    ),  # type: ignore[arg-type]
    ("chat messages str", lambda c: c.chat_completion("hi"), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("chat messages empty", lambda c: c.chat_completion([]), llamax.InvalidRequestError),
    (
        "chat message no role",
        lambda c: c.chat_completion([{"content": "x"}]),
        llamax.InvalidRequestError,
    ),  # type: ignore[list-item]
    (
        "chat message bad role",
        lambda c: c.chat_completion([{"role": "wizard", "content": "x"}]),
        llamax.InvalidRequestError,
    ),  # type: ignore[list-item]
    (
        "chat content int",
        lambda c: c.chat_completion([{"role": "user", "content": 5}]),
        llamax.InvalidRequestError,
    ),  # type: ignore[list-item]
    (
        "chat max_tokens -1",
        lambda c: c.chat_completion(USER, max_tokens=-1),
        llamax.InvalidRequestError,
    ),
    (
        "chat temperature str",
        lambda c: c.chat_completion(USER, temperature="x"),
        llamax.InvalidRequestError,
    ),  # type: ignore[arg-type]
    ("chat n 0", lambda c: c.chat_completion(USER, n=0), llamax.InvalidRequestError),
    ("chat stop int", lambda c: c.chat_completion(USER, stop=5), llamax.InvalidRequestError),  # type: ignore[arg-type]
    (
        "chat top_logprobs without logprobs",
        lambda c: c.chat_completion(USER, top_logprobs=2),
        llamax.InvalidRequestError,
    ),
    (
        "chat response_format bad type",
        lambda c: c.chat_completion(USER, response_format={"type": "xml"}),
        llamax.InvalidRequestError,
    ),  # type: ignore[typeddict-item]
    ("chat unknown kwarg", lambda c: c.chat_completion(USER, max_tokenz=3), TypeError),  # type: ignore[call-arg]
    ("completion prompt None", lambda c: c.completion(None), llamax.InvalidRequestError),  # type: ignore[arg-type]
    (
        "completion logit_bias bad",
        lambda c: c.completion("a", logit_bias={"x": "y"}),
        llamax.InvalidRequestError,
    ),  # type: ignore[dict-item]
    ("completion seed float", lambda c: c.completion("a", seed=1.5), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("completion unknown kwarg", lambda c: c.completion("a", temprature=0.0), TypeError),  # type: ignore[call-arg]
    # sessions
    ("rewind negative", _session_op(lambda s: s.rewind(-1)), llamax.InvalidParameterError),
    ("rewind str", _session_op(lambda s: s.rewind("2")), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("rewind past start", _session_op(lambda s: s.rewind(10**4)), llamax.InvalidParameterError),
    ("shift reversed", _session_op(lambda s: s.shift(2, 1)), llamax.InvalidParameterError),
    ("shift past end", _session_op(lambda s: s.shift(0, 10**4)), llamax.InvalidParameterError),
    ("shift negative", _session_op(lambda s: s.shift(-1, 1)), llamax.InvalidParameterError),
    ("shift str", _session_op(lambda s: s.shift("0", 1)), llamax.InvalidParameterError),  # type: ignore[arg-type]
    ("closed session request", _closed_session, llamax.SessionError),
    # detokenize
    ("detokenize negative", lambda c: c.detokenize([-1]), llamax.InvalidRequestError),
    ("detokenize huge", lambda c: c.detokenize([10**9]), llamax.InvalidRequestError),
    ("detokenize str", lambda c: c.detokenize("abc"), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("detokenize None", lambda c: c.detokenize(None), llamax.InvalidRequestError),  # type: ignore[arg-type]
    ("tokenize bytes", lambda c: c.tokenize(b"abc"), llamax.InvalidRequestError),  # type: ignore[arg-type]
    # generate()
    (
        "generate params too short",
        _generate(["a", "b"], [P(max_tokens=1)]),
        llamax.InvalidParameterError,
    ),
    ("generate prompts str", _generate("abc", None), llamax.InvalidRequestError),
    ("generate params dict", _generate(["a"], {"max_tokens": 1}), llamax.InvalidRequestError),
    # Context options
    ("Context unknown option", _new_context(n_ctxx=5), TypeError),
    ("Context n_threads 0", _new_context(n_threads=0), llamax.InvalidParameterError),
    ("Context n_ctx str", _new_context(n_ctx="big"), llamax.InvalidParameterError),
    ("Context max_step_ms negative", _new_context(max_step_ms=-1), llamax.InvalidParameterError),
    # close options
    (
        "close timeout str",
        lambda c: _make().close(drain=True, timeout="soon"),
        llamax.InvalidParameterError,
    ),  # type: ignore[arg-type]
]


def _make() -> llamax.Context:
    backend = FakeBackend(
        n_ctx=1024,
        n_seq_max=4,
        metadata={"tokenizer.chat_template": TEMPLATE},
        special_tokens=SPECIALS,
    )
    return llamax.Context(backend=backend, autostart=True)


@pytest.fixture(scope="module")
def ctx() -> Any:
    context = _make()
    yield context
    assert_idle(context)
    context.close()


def test_the_table_is_large() -> None:
    assert len(BAD_INPUTS) >= 40
    assert len({name for name, _, _ in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize(("name", "bad", "error"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_typed_error_and_context_serves(
    ctx: llamax.Context, name: str, bad: Bad, error: type[BaseException]
) -> None:
    with pytest.raises(error) as raised:
        bad(ctx)
    assert isinstance(raised.value, (llamax.LlamaxError, TypeError)), name
    assert not ctx.closed
    done = ctx.add_request("abc", P(max_tokens=3, temperature=0)).result(timeout=60)
    assert done.choices[0].finish_reason in ("length", "stop")
    assert_idle(ctx)
