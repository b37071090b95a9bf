"""Per-request LoRA adapters on the fake backend (issue 26, item 1): one decode carries one
adapter set, the sets take turns, a prefix is shared only within a set, and bad adapters
or names get typed errors while the engine goes on.

The fake's adapters move the lower-case letters its model picks along the alphabet (see
``FakeBackend.load_adapter``), and it tags every KV cell with the set it was computed
under: a decode that reads cells of another set fails the test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

LONG = "a shared system prompt that is long enough to be worth caching. " * 2


@pytest.fixture
def adapter_files(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("a", "b"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"GGUF fake adapter")
        files[name] = str(path)
    return files


@pytest.fixture
def lora_ctx(adapter_files: dict[str, str]) -> Iterator[tuple[llamax.Context, FakeBackend]]:
    backend = FakeBackend(n_ctx=1024, n_seq_max=8, n_batch=256)
    ctx = llamax.Context(backend=backend, lora=adapter_files)
    yield ctx, backend
    assert_idle(ctx)
    ctx.close()


def greedy(max_tokens: int = 12, **options: Any) -> llamax.SamplingParams:
    return llamax.SamplingParams(max_tokens=max_tokens, temperature=0, **options)


def test_scale_zero_is_the_base_model_and_an_adapter_changes_the_output(
    lora_ctx: tuple[llamax.Context, FakeBackend],
) -> None:
    ctx, _ = lora_ctx
    base = ctx.add_request("hello", greedy()).result().text
    assert ctx.add_request("hello", greedy(lora={"a": 0.0})).result().text == base
    assert ctx.add_request("hello", greedy(lora={})).result().text == base
    with_a = ctx.add_request("hello", greedy(lora={"a": 1.0})).result().text
    assert with_a != base
    assert ctx.add_request("hello", greedy(lora={0: 1.0})).result().text == with_a  # by index
    assert ctx.adapters == {"a": ctx.adapters["a"], "b": ctx.adapters["b"]}
    assert list(ctx.adapters) == ["a", "b"]


def test_mixed_requests_run_together_give_what_each_gives_alone(
    lora_ctx: tuple[llamax.Context, FakeBackend],
) -> None:
    ctx, backend = lora_ctx
    sets: list[dict[str, float] | None] = [None, {"a": 1}, {"b": 1}, {"a": 1, "b": 0.5}] * 2
    alone = [ctx.add_request(f"{i} hi", greedy(lora=s)).result().text for i, s in enumerate(sets)]
    backend.decode_log.clear()
    backend.decode_adapters.clear()
    handles = [ctx.add_request(f"{i} hi", greedy(lora=s)) for i, s in enumerate(sets)]
    assert [h.result().text for h in handles] == alone
    assert len(set(backend.decode_adapters)) == 4
    assert len(alone) == len(set(alone)) * 2


def test_the_sets_take_turns_and_none_starves(adapter_files: dict[str, str]) -> None:
    # the caller drives the loop, so every request is queued before the first step (with
    # the background loop, a loaded CI machine ran base steps before "tuned" arrived)
    backend = FakeBackend(n_ctx=1024, n_seq_max=8, n_batch=256)
    ctx = llamax.Context(backend=backend, lora=adapter_files, autostart=False)
    with ctx:
        base = [ctx.add_request(f"{i} base", greedy(40)) for i in range(5)]
        tuned = ctx.add_request("tuned", greedy(40, lora={"a": 1}))
        for _ in range(1000):
            if all(h.done() for h in (*base, tuned)):
                break
            ctx.process()
        for handle in (*base, tuned):
            handle.result()
        assert_idle(ctx)
    steps = backend.decode_adapters
    # while both sets had work, no set ran two steps in a row
    both = steps[: 2 * 40]
    assert all(x != y for x, y in itertools.pairwise(both)), steps
    assert steps.count((("a", 1.0),)) >= 40


def test_a_prefix_is_shared_only_within_its_adapter_set(
    lora_ctx: tuple[llamax.Context, FakeBackend],
) -> None:
    ctx, _ = lora_ctx
    prompt = LONG + "question one"
    first = ctx.add_request(prompt, greedy(4)).result()
    assert first.usage.cached_tokens == 0
    # the base model's prefix is in the cache, but not for adapter a
    other = ctx.add_request(prompt, greedy(4, lora={"a": 1})).result()
    assert other.usage.cached_tokens == 0
    again = ctx.add_request(prompt, greedy(4, lora={"a": 1})).result()
    assert again.usage.cached_tokens == len(ctx.tokenize(prompt)) - 1
    base_again = ctx.add_request(prompt, greedy(4)).result()
    assert base_again.usage.cached_tokens == len(ctx.tokenize(prompt)) - 1
    # another scale is another set
    scaled = ctx.add_request(prompt, greedy(4, lora={"a": 0.5})).result()
    assert scaled.usage.cached_tokens == 0


def test_a_session_switching_adapters_recomputes(
    lora_ctx: tuple[llamax.Context, FakeBackend],
) -> None:
    ctx, _ = lora_ctx
    with ctx.session() as session:
        first = session.add_request(LONG, greedy(4)).result()
        same = session.add_request(LONG, greedy(4)).result()
        switched = session.add_request(LONG, greedy(4, lora={"b": 1})).result()
    assert same.usage.cached_tokens > 0
    assert switched.usage.cached_tokens == 0
    assert first.text == same.text != switched.text


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"zz": 1.0}, "no adapter named 'zz' is loaded"),
        ({5: 1.0}, "no adapter with index 5"),
        ({"a": 1.0, 0: 0.5}, "'a' is given twice"),
    ],
)
def test_an_adapter_that_is_not_loaded_is_refused(
    lora_ctx: tuple[llamax.Context, FakeBackend], lora: dict[Any, float], match: str
) -> None:
    ctx, _ = lora_ctx
    with pytest.raises(llamax.InvalidParameterError, match=match):
        ctx.add_request("hello", greedy(lora=lora))
    assert ctx.add_request("hello", greedy(lora={"a": 1})).result().text


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"a": float("nan")}, "finite number"),
        ({"a": "1"}, "finite number"),
        ({"a": 1e39}, r"finite number in \[-100, 100\]"),  # a float32 infinity in llama.cpp
        ({"a": -1e39}, r"finite number in \[-100, 100\]"),
        ({"a": 100.5}, r"finite number in \[-100, 100\]"),
        ({"a": 10**400}, "lora is out of range"),  # float() would raise OverflowError
        ({10**400: 1.0}, "lora is out of range"),
        ({"": 1.0}, "adapter names or load indices"),
        ({-1: 1.0}, "adapter names or load indices"),
        (["a"], "dict of name -> scale"),
    ],
)
def test_bad_lora_params_are_refused(lora: Any, match: str) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=match):
        llamax.SamplingParams(lora=lora)


def test_lora_scales_at_the_bound_are_accepted() -> None:
    assert llamax.SamplingParams(lora={"a": 100, "b": -100.0}).lora == {"a": 100.0, "b": -100.0}


def test_bad_adapter_files_and_names_get_typed_errors(
    lora_ctx: tuple[llamax.Context, FakeBackend], tmp_path: Path
) -> None:
    ctx, _ = lora_ctx
    lying = tmp_path / "lying.gguf"
    lying.write_bytes(b"not a gguf at all")
    with pytest.raises(llamax.ModelLoadError, match="not a GGUF"):
        ctx.load_adapter("c", lying)
    with pytest.raises(llamax.ModelLoadError, match="cannot read"):
        ctx.load_adapter("c", tmp_path / "missing.gguf")
    with pytest.raises(llamax.InvalidParameterError, match="already loaded"):
        ctx.load_adapter("a", lying)
    with pytest.raises(llamax.InvalidParameterError, match="non-empty str"):
        ctx.load_adapter("", lying)
    assert list(ctx.adapters) == ["a", "b"]
    assert ctx.add_request("still serving", greedy(lora={"b": 1})).result().text


def test_a_context_whose_adapter_fails_to_load_frees_everything(tmp_path: Path) -> None:
    backend = FakeBackend()
    with pytest.raises(llamax.ModelLoadError):
        llamax.Context(backend=backend, lora={"a": str(tmp_path / "missing.gguf")})
    assert backend.closed
    with pytest.raises(llamax.InvalidParameterError, match="dict of adapter name"):
        llamax.Context(backend=FakeBackend(), lora={"a": 3})


def test_an_adapter_loaded_while_serving_is_usable(
    lora_ctx: tuple[llamax.Context, FakeBackend], tmp_path: Path
) -> None:
    ctx, _ = lora_ctx
    running = ctx.add_request("long one", greedy(60))
    extra = tmp_path / "c.gguf"
    extra.write_bytes(b"GGUF")
    ctx.load_adapter("c", extra)
    assert ctx.add_request("x", greedy(4, lora={"c": 1})).result().text
    assert running.result().finish_reason == "length"


def test_a_failing_set_adapters_fails_the_engine_cleanly(adapter_files: dict[str, str]) -> None:
    backend = FakeBackend(n_ctx=512)

    def fault(where: str) -> None:
        if where == "set_adapters" and backend.fault_calls[where] > 1:
            raise RuntimeError("injected set_adapters failure")

    ctx = llamax.Context(backend=backend, lora=adapter_files)
    assert ctx.add_request("ok", greedy(4)).result().text
    backend.fault = fault
    handle = ctx.add_request("boom", greedy(4, lora={"a": 1}))
    with pytest.raises(llamax.EngineError, match="set_adapters"):
        handle.result(timeout=60)
    ctx.close()
    assert backend.closed


def test_serve_refuses_bad_lora_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from llamax.server.cli import main

    assert main(["--lora", "no-equals-sign"]) == 2
    assert "expected NAME=PATH" in capsys.readouterr().err
    assert main(["--lora", "a=x.gguf", "--lora", "a=y.gguf"]) == 2
    assert main(["--lora", "=x.gguf"]) == 2


def test_a_request_lacking_room_is_not_overtaken_by_another_sets_newcomers(
    adapter_files: dict[str, str],
) -> None:
    # two sequence ids, held by the base model and by set b; a request under a waits for
    # one, and three later base requests arrive. The sets take turns, the base model first
    # after b, so when b's request ended the base newcomers took its id, and each id freed
    # after, and the a request waited for all of them.
    backend = FakeBackend(n_ctx=1024, n_seq_max=2, n_batch=256)
    ctx = llamax.Context(backend=backend, lora=adapter_files, autostart=False, prefix_cache=False)
    with ctx:
        running = [
            ctx.add_request("base", greedy(40)),
            ctx.add_request("b", greedy(4, lora={"b": 1})),
        ]
        ctx.process()  # a step plans one set: the base model's, then b's
        ctx.process()
        tuned = ctx.add_request("a", greedy(4, lora={"a": 1}))
        late = [ctx.add_request(f"late {i}", greedy(4)) for i in range(3)]
        handles = (*running, tuned, *late)
        finished: list[Any] = []
        for _ in range(400):
            if len(finished) == len(handles):
                break
            ctx.process()
            finished += [h for h in handles if h.done() and h not in finished]
        names = {
            id(h): n for h, n in zip(handles, ["base", "b", "a", "l0", "l1", "l2"], strict=True)
        }
        order = [names[id(h)] for h in finished]
        assert order.index("a") < min(order.index(n) for n in ("l0", "l1", "l2")), order
        assert all(h.result().usage.completion_tokens > 0 for h in handles)
        assert_idle(ctx)


# ---------------------------------------------------------------------- issue 36, item 2
def test_a_fork_keeps_the_adapter_set_its_cells_were_computed_under(
    lora_ctx: tuple[llamax.Context, FakeBackend],
) -> None:
    """Regression (issue 36, item 2): a fork copied the cells of a session that ran under
    adapter a but not their mark, so a base request on the fork (and another user's plain
    request sharing the prefix) read adapter a's KV (the fake fails such a decode)."""
    ctx, _ = lora_ctx
    with ctx.session() as session:
        session.add_request(LONG, greedy(4, lora={"a": 1})).result()
        with session.fork() as fork:
            plain = ctx.add_request(LONG + "other", greedy(4)).result()
            base = fork.add_request(LONG + "more", greedy(4)).result()
            tuned = fork.add_request(LONG + "more", greedy(4, lora={"a": 1})).result()
    assert base.usage.cached_tokens == 0
    assert plain.usage.cached_tokens == 0
    assert tuned.usage.cached_tokens == 0  # the base request on the fork replaced its cells
    assert base.text == ctx.add_request(LONG + "more", greedy(4)).result().text


def test_a_loaded_session_keeps_its_adapter_set(
    lora_ctx: tuple[llamax.Context, FakeBackend], tmp_path: Path
) -> None:
    """Regression (issue 36, item 2): the session file stored no adapter set, so a loaded
    session's adapter cells were reused by base requests, its own and other users'."""
    ctx, _ = lora_ctx
    path = tmp_path / "tuned.llamax"
    with ctx.session() as session:
        session.add_request(LONG, greedy(4, lora={"a": 1})).result()
        session.save(path)
    ctx.clear_cache()
    with ctx.load_session(path) as loaded:
        plain = ctx.add_request(LONG + "other", greedy(4)).result()
        base = loaded.add_request(LONG + "more", greedy(4)).result()
    with ctx.load_session(path) as loaded:
        tuned = loaded.add_request(LONG + "more", greedy(4, lora={"a": 1})).result()
    assert plain.usage.cached_tokens == 0
    assert base.usage.cached_tokens == 0
    assert tuned.usage.cached_tokens > 0


def test_a_session_saved_under_adapters_is_refused_where_they_are_not_loaded(
    adapter_files: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "tuned.llamax"
    with llamax.Context(backend=FakeBackend(n_ctx=1024), lora=adapter_files) as ctx:
        with ctx.session() as session:
            session.add_request(LONG, greedy(4, lora={"a": 0.5})).result()
            session.save(path)
        assert_idle(ctx)
    with llamax.Context(backend=FakeBackend(n_ctx=1024)) as bare:
        with pytest.raises(llamax.SessionLoadError, match=r"adapter 'a' \(scale 0.5\).*not loaded"):
            bare.load_session(path)
        assert bare.add_request(LONG, greedy(4)).result().text  # still serving
        other = tmp_path / "other.gguf"
        other.write_bytes(b"GGUF another adapter")
        bare.load_adapter("a", other)
        with pytest.raises(llamax.SessionLoadError, match="'a' is another file"):
            bare.load_session(path)
        assert_idle(bare)
