"""Shared fixtures. Every context a test makes is checked for leaks, then closed."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import llamax
from llamax.testing import FakeBackend, assert_idle

# The suite's exact-output checks compare runs at the same batch composition and thread
# count; beside a busy process the default thread adaptation would change the count mid-run
# (and so llama.cpp's sums). Its own tests turn it on by name (test_contention.py,
# test_model_threads.py); `LLAMAX_ADAPT_THREADS=1 pytest` runs the suite with it on.
os.environ.setdefault("LLAMAX_ADAPT_THREADS", "0")


def _share_the_cores() -> None:
    """Under ``pytest -n N`` (pytest-xdist) each worker keeps its own share of the CPUs, so
    llama.cpp's threads in one worker do not fight the other workers' (a context's default
    thread count is its affinity)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_getaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return
    index = int(worker[2:])
    share = cpus[index * len(cpus) // count : (index + 1) * len(cpus) // count]
    os.sched_setaffinity(0, share)


_share_the_cores()

_MOST_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, see pyproject's ``addopts``): one worker per CPU this
    process may use, at most eight; none (the tests run in this process) for a run that
    names single tests (``file.py::test``), or with one CPU, or with
    ``$PYTEST_XDIST_AUTO_NUM_WORKERS`` set to ``0``."""
    named = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if named:
        return int(named)
    if any("::" in str(arg) for arg in config.args):
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    workers = min(cpus, _MOST_WORKERS)
    return workers if workers >= 2 else 0

NO_RAY = (
    "{} starts (or runs beside) Ray without the `cluster` marker: a Ray cluster takes "
    "minutes to start and does not belong in the default selection (mark the test "
    "`@pytest.mark.cluster`)"
)
_RAY_INIT = pytest.StashKey[tuple[Any, Any]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """No test without the ``cluster`` marker starts Ray: ``ray.init`` fails it at once
    (before its fixtures start a cluster), and :func:`pytest_runtest_teardown` fails it if
    Ray was started some other way."""
    ray = sys.modules.get("ray")
    if ray is None or item.get_closest_marker("cluster") is not None:
        return
    init = ray.init

    def refuse(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(NO_RAY.format(item.nodeid), pytrace=False)

    ray.init = refuse
    item.stash[_RAY_INIT] = (ray, init)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Restore ``ray.init`` and fail a test without the ``cluster`` marker that left Ray
    running (see :func:`pytest_runtest_setup`)."""
    try:
        yield
    finally:
        saved = item.stash.get(_RAY_INIT, None)
        if saved is not None:
            saved[0].init = saved[1]
    ray = sys.modules.get("ray")
    if ray is not None and item.get_closest_marker("cluster") is None and ray.is_initialized():
        pytest.fail(NO_RAY.format(item.nodeid), pytrace=False)


@pytest.fixture
def kv_layout() -> str:
    """The fake's KV layout; modules that cover both override this with a parametrized one."""
    return "unified"


@pytest.fixture
def make_fake(kv_layout: str) -> Iterator[Callable[..., tuple[llamax.Context, FakeBackend]]]:
    """Build ``(Context, FakeBackend)`` pairs; each is leak-checked and closed after the test.

    With ``kv_layout == "streams"`` every sequence gets a stream of the ``n_ctx`` cells the
    test asked for (the fake's total is ``n_ctx * n_seq_max``), so a test's prompts fit in
    either layout. ``speculative`` is the context's default (see docs/speculative.md).
    """
    made: list[llamax.Context] = []

    def make(
        *,
        autostart: bool = False,
        speculative: llamax.PromptLookup | None = None,
        **backend_options: Any,
    ) -> tuple[llamax.Context, FakeBackend]:
        if kv_layout == "streams" and "kv_layout" not in backend_options:
            n_seq_max = backend_options.get("n_seq_max", 4)
            backend_options["n_ctx"] = backend_options.get("n_ctx", 256) * n_seq_max
            backend_options["kv_layout"] = "streams"
        backend = FakeBackend(**backend_options)
        ctx = llamax.Context(backend=backend, autostart=autostart, speculative=speculative)
        made.append(ctx)
        return ctx, backend

    yield make
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx)
        ctx.close()


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model (SmolLM2-135M-Instruct Q4_1), or $LLAMAX_MODEL."""
    return Path(os.environ.get("LLAMAX_MODEL") or llamax.default_model_path())


@pytest.fixture(scope="session")
def shared_ctx(model_path: Path) -> Iterator[llamax.Context]:
    """One real context for the whole session (n_ctx=4096, n_seq_max=16)."""
    ctx = llamax.Context(model_path, n_ctx=4096, n_seq_max=16, n_batch=512)
    yield ctx
    ctx.close()


@pytest.fixture
def real_ctx(shared_ctx: llamax.Context) -> Iterator[llamax.Context]:
    """The shared real context, asserted idle (nothing leaked) after the test."""
    assert_idle(shared_ctx)
    yield shared_ctx
    assert_idle(shared_ctx, timeout=60)


@pytest.fixture
def make_real(model_path: Path) -> Iterator[Callable[..., llamax.Context]]:
    """Build real contexts with custom options; each is leak-checked and closed after the test."""
    made: list[llamax.Context] = []

    def make(**options: Any) -> llamax.Context:
        ctx = llamax.Context(model_path, **options)
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        if not ctx.closed:
            assert_idle(ctx, timeout=60)
        ctx.close()
