"""Testing an application without a model: :class:`llamax.testing.FakeBackend`.

``FakeBackend`` is a deterministic, pure-Python stand-in for llama.cpp: one token per UTF-8
byte, token 0 ends generation, and its default "model" answers with the letters following
the last one (``"abc"`` -> ``"defg..."``; with ``temperature > 0`` it shifts tokens at
random, seeded, so tests use ``temperature=0``). Pass any ``next_token(history) -> token``
function to script replies. Everything else (threads, streaming, cancellation, stop
strings, the scheduler) is the real llamax code. ``assert_idle`` checks that nothing
leaked: no sequence, KV cell, sampler or unsettled request is left over.

    python examples/fake_backend.py      (or run it under pytest)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import llamax
from llamax.testing import FakeBackend, assert_idle


def summarise(ctx: llamax.Context, text: str) -> str:
    """The application code under test: asks the model for at most 5 tokens."""
    params = llamax.SamplingParams(max_tokens=5, temperature=0.0)
    return ctx.add_request(text, params).result(timeout=10).text


def test_summarise_with_the_default_fake_model() -> None:
    with llamax.Context(backend=FakeBackend()) as ctx:  # background loop, as in production
        assert summarise(ctx, "abc") == "defgh"
        assert_idle(ctx)


def canned(prompt: str, reply: str) -> Callable[[Sequence[int]], int]:
    """A scripted model: answers ``prompt`` with ``reply``, then ends (token = byte + 1)."""
    n = len(prompt.encode())
    tokens = [b + 1 for b in reply.encode()] + [0]
    return lambda history: tokens[min(len(history) - n, len(tokens) - 1)]


def test_scripted_model_in_manual_mode() -> None:
    backend = FakeBackend(next_token=canned("Is it ok?", "ok"))
    ctx = llamax.Context(backend=backend, autostart=False)
    handle = ctx.add_request("Is it ok?", llamax.SamplingParams(max_tokens=50, temperature=0))
    while ctx.has_work():
        ctx.process()
    completion = handle.result(timeout=0)
    assert (completion.text, completion.finish_reason) == ("ok", "stop")
    assert_idle(ctx)
    ctx.close()


if __name__ == "__main__":
    test_summarise_with_the_default_fake_model()
    test_scripted_model_in_manual_mode()
    print("fake backend tests passed")
