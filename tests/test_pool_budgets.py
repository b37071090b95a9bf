"""A model pool's host-RAM tier budgets are shares of one budget (issue 54, finding 11): a
pool of 5 fake-backed contexts gave each the whole default budget, 125% of the memory
available in all; a budget given to the pool was each model's."""

from __future__ import annotations

from typing import Any

import pytest

import llamax
from llamax.server import ModelPool
from llamax.testing import FakeBackend, assert_idle

DEFAULT = 5_000
"""The machine's default RAM-tier budget in these tests (a quarter of the memory)."""


def fake(**options: Any) -> llamax.Context:
    """A model source that takes the pool's options (its share of the budgets with them)."""
    return llamax.Context(backend=FakeBackend(), **options)


def budgets_loaded_together(pool: ModelPool, names: list[str]) -> list[int]:
    """Load ``names`` at once and read each one's RAM-tier budget."""
    futures = [pool.acquire(name) for name in names]
    try:
        contexts = [future.result(60) for future in futures]
        budgets = [ctx.stats().prefix_ram_budget_bytes for ctx in contexts]
        for ctx in contexts:
            assert_idle(ctx)
        return budgets
    finally:
        for future in futures:
            pool.release(future)


@pytest.fixture(autouse=True)
def _default_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llamax.engine.kv.prefix.default_budget", lambda: DEFAULT)


def test_five_fake_contexts_share_the_default_budget() -> None:
    """Before: 5 x 5,000 bytes (the function source was called without the options)."""
    names = [f"m{i}" for i in range(5)]
    pool = ModelPool(dict.fromkeys(names, fake))
    try:
        budgets = budgets_loaded_together(pool, names)
        assert budgets == [DEFAULT // 5] * 5 and sum(budgets) <= DEFAULT
    finally:
        pool.close()


def test_a_budget_given_to_a_pool_is_divided_among_the_models_loaded_at_once() -> None:
    """Before: each of the two models loaded at once took the whole 8,000 bytes."""
    names = ["a", "b", "c"]
    pool = ModelPool(dict.fromkeys(names, fake), max_loaded=2, prefix_ram_bytes=8_000)
    try:
        assert pool.context_options["prefix_ram_bytes"] == 4_000
        assert budgets_loaded_together(pool, names[:2]) == [4_000, 4_000]
    finally:
        pool.close()


def test_a_source_that_takes_no_options_builds_its_context_as_it_likes() -> None:
    made: list[llamax.Context] = []

    def plain() -> llamax.Context:
        made.append(llamax.Context(backend=FakeBackend(), prefix_ram_bytes=123))
        return made[-1]

    pool = ModelPool({"a": plain, "b": plain})
    try:
        assert budgets_loaded_together(pool, ["a"]) == [123]
    finally:
        pool.close()
