"""A context nobody references is closed (issue 57): a notebook that re-runs
``ctx = llamax.Context(...)`` must not keep every earlier model, KV cache and loop thread.

On the fake: the engine of a dropped context closes (its loop thread exits) with a
``ResourceWarning``; a pending request's handle and an open session keep their context
alive until the request ends or the session is dropped; a closed context warns nothing. On
SmolLM2 (integration): six contexts made and dropped leave resident memory and the thread
count flat.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from pathlib import Path

import pytest

import llamax
from llamax.testing import FakeBackend

GREEDY = llamax.SamplingParams(max_tokens=4, temperature=0.0)


def _engine_threads() -> int:
    return sum(t.name == "llamax-engine" and t.is_alive() for t in threading.enumerate())


def _collect() -> None:
    for _ in range(3):
        gc.collect()


def test_a_dropped_context_is_closed_with_a_resource_warning() -> None:
    before = _engine_threads()
    ctx = llamax.Context(backend=FakeBackend())
    ctx.add_request("abc", GREEDY).result(timeout=60)
    engine, ref = ctx._engine, weakref.ref(ctx)
    assert _engine_threads() == before + 1
    with pytest.warns(ResourceWarning, match="was never closed"):
        del ctx
        _collect()
    assert ref() is None
    assert engine.state.value == "closed"
    assert engine._thread is not None
    engine._thread.join(60)
    assert _engine_threads() == before


def test_a_closed_context_warns_nothing_when_dropped() -> None:
    ctx = llamax.Context(backend=FakeBackend())
    ctx.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del ctx
        _collect()


def test_a_pending_requests_handle_keeps_its_context_alive() -> None:
    """``llamax.Context(...).add_request(...)`` in one expression still completes."""
    handle = llamax.Context(backend=FakeBackend(), autostart=False).add_request("abc", GREEDY)
    _collect()
    assert not handle.done()
    with pytest.warns(ResourceWarning):  # once the request has ended, nothing holds it
        assert handle.result(timeout=60).text == "defg"
        del handle
        _collect()


def test_a_background_request_nobody_holds_still_runs_to_its_end() -> None:
    ctx = llamax.Context(backend=FakeBackend())
    done = threading.Event()
    handle = ctx.add_request("abc", llamax.SamplingParams(max_tokens=50, temperature=0.0))
    handle.future.add_done_callback(lambda f: done.set())
    engine = ctx._engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del ctx, handle
        _collect()
        assert done.wait(60)
        _collect()
    assert engine._thread is not None
    engine._thread.join(60)
    assert engine.state.value == "closed"


def test_an_open_session_keeps_its_context_alive() -> None:
    ctx = llamax.Context(backend=FakeBackend())
    session = ctx.session()
    ref = weakref.ref(ctx)
    del ctx
    _collect()
    assert ref() is not None
    assert session.add_request("abc", GREEDY).result(timeout=60).text == "defg"
    with pytest.warns(ResourceWarning):
        del session
        _collect()
    assert ref() is None


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.model
@pytest.mark.integration
def test_dropped_contexts_hold_memory_and_threads_flat(model_path: Path) -> None:
    """The notebook cell re-run six times: RSS and threads stay where the first left
    them (before the finalizer: +170 MB and one more thread per context, so the three
    leaked after the third would be 510 MB against the 100 MB bound)."""
    rss: list[float] = []
    threads: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(6):
            ctx = llamax.Context(model_path, n_ctx=512, n_seq_max=2, n_threads=1)
            ctx.add_request("Hi", GREEDY).result(timeout=120)
            del ctx
            _collect()
            rss.append(_rss_mib())
            threads.append(threading.active_count())
    assert threads[-1] <= threads[0], threads
    assert rss[-1] - rss[2] < 100, rss
