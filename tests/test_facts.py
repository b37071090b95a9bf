"""``llamax.ModelFacts`` (issue 58): the model's and the context's facts, computed once by
the backend where it makes the model and the context, and held by every layer above (the
engine, the template binding, the embedder, the facade) instead of each re-defining a
property that asks the layer below. Fake backend; tests/test_model_facts.py checks them on
SmolLM2."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import llamax
from llamax.testing import FakeBackend
from llamax.testing.vision import FAKE_N_EMBD

GREEDY = llamax.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
FIM = {"<fim_prefix>": 300, "<fim_suffix>": 301, "<fim_middle>": 302, "<file_sep>": 303}
CONTEXT_FACTS = ("n_ctx", "n_ctx_seq", "n_seq_max", "n_vocab", "model_name", "fim_tokens",
                 "sees_images")  # fmt: skip
"""The facts the context also answers as properties of its own."""


def test_the_fake_backend_computes_them_from_its_settings() -> None:
    """What the fake's properties returned before: ``n_vocab`` covers every piece, FIM
    tokens found by their text among the special tokens, ``n_ctx_seq`` a stream's cells
    with ``kv_layout="streams"``, ``sees_images`` with a projector."""
    backend = FakeBackend(
        n_ctx=512, n_seq_max=4, model_name="tiny", special_tokens=FIM, kv_layout="streams"
    )
    assert backend.facts == llamax.ModelFacts(
        model_name="tiny",
        n_vocab=304,
        n_embd=FAKE_N_EMBD,
        n_ctx_train=512,
        n_ctx=512,
        n_ctx_seq=128,
        n_seq_max=4,
        fim_tokens=llamax.FimTokens(prefix=300, suffix=301, middle=302, separator=303),
        sees_images=False,
        bos_token_id=None,
        eos_token_id=0,
    )
    assert backend.facts.fim_tokens.can_infill
    plain = FakeBackend(image_tokens=4).facts
    assert (plain.n_vocab, plain.n_ctx_seq, plain.sees_images) == (257, 256, True)
    assert plain.fim_tokens == llamax.FimTokens() and not plain.fim_tokens.can_infill


def test_they_are_frozen() -> None:
    facts = FakeBackend().facts
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.n_ctx = 1  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):  # slots: no new attribute either
        facts.extra = 1  # type: ignore[attr-defined]
    assert hash(facts) == hash(dataclasses.replace(facts))


def test_the_context_holds_the_backends_one_object_and_its_properties_read_it() -> None:
    backend = FakeBackend(n_ctx=512, n_seq_max=2, model_name="tiny", special_tokens=FIM)
    with llamax.Context(backend=backend, autostart=False) as ctx:
        assert ctx.facts is backend.facts
        assert ctx._chat.facts is backend.facts  # the template binding passes it down
        for name in CONTEXT_FACTS:
            assert getattr(ctx, name) == getattr(ctx.facts, name), name
        assert (ctx.n_ctx, ctx.n_seq_max, ctx.model_name, ctx.n_vocab) == (512, 2, "tiny", 304)
        assert ctx.fim_tokens.can_infill and not ctx.sees_images
    assert ctx.facts is backend.facts  # known at load: answers after close


def test_a_move_between_layouts_changes_no_fact() -> None:
    """``kv_layout`` is not a fact: ``"auto"`` moves the cache to the unified layout for a
    prompt longer than a stream; ``n_ctx``, ``n_ctx_seq`` and the rest stay."""
    backend = FakeBackend(n_ctx=256, n_seq_max=4, n_batch=64, kv_layout="auto")
    with llamax.Context(backend=backend, autostart=False, max_step_ms=None) as ctx:
        before = ctx.facts
        assert ctx.kv_layout == "streams" and ctx.stats().kv_cells_total == 256
        handle = ctx.add_request("x" * 100, GREEDY)  # more than a stream's 64 cells
        while ctx.has_work():
            ctx.process()
        assert handle.result().finish_reason == "length"
        assert ctx.kv_layout == "unified" and backend.num_relayouts == 1
        assert ctx.facts is before and ctx.n_ctx == 256 and ctx.n_ctx_seq == 256


# Where the package still defines a property (or method) named after a fact, by class
# (not by file, so a module may move): the public faces that read ``facts`` (the facade,
# the embedder), the llama.cpp calls the backend computes the facts from, and the server's
# served name (another thing: the alias). Chat preparation's ``ChatModel``, a ``Chat``'s
# ``ChatHost`` and the template binding read ``facts``. The list may only shrink.
FACT_NAMES = frozenset(f.name for f in dataclasses.fields(llamax.ModelFacts))
DEFINED_LEFT = {
    "Context": {*CONTEXT_FACTS},
    "Embedder": {"model_name", "n_embd", "n_ctx", "n_seq_max"},
    "NativeModel": {"n_ctx_train", "n_embd", "n_vocab"},
    "NativeContext": {"n_ctx", "n_ctx_seq", "n_seq_max"},
    "ServerState": {"model_name"},
}


def test_no_layer_re_defines_a_fact_it_could_read_from_the_one_object() -> None:
    """Issue 58: ``n_vocab``, ``model_name``, ``n_ctx_seq`` and friends were defined in 11
    files, each layer (backends, engine protocol, template binding, embedder, facade)
    forwarding the one below. Now the backend computes :class:`llamax.ModelFacts` once."""
    package = Path(llamax.__file__).resolve().parent
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {
                    item.name
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name in FACT_NAMES
                }
                if names:
                    found.setdefault(node.name, set()).update(names)
    assert found == DEFINED_LEFT
