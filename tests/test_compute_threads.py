"""A thread that stops computing gives back its compute workers (issue 59, the first run).

llama.cpp's CPU backend runs each graph on GNU OpenMP workers pooled per calling thread for
that thread's life; while more are pooled than there are CPUs, libgomp throttles every
barrier, and a one-token step took 1.6-2.4x as long (``llamax.backend.openmp``). So every
thread llamax computes on gives its pool back when it is done: the constructor's
calibration, the background loop when it goes idle, a manual context's caller when no work
is left, a request's thread after encoding its image, ``Embedder.embed``'s caller.

On the fake (:attr:`FakeBackend.pooled_threads`: the threads that computed and did not
release since), and on SmolLM2 in a fresh process: after a calibrating construction, a
request and an embedding, no OpenMP worker is left (the process's native threads are back
to what they were before the context).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from vision_files import pixels, png

import llamax
from llamax.testing import FakeBackend, assert_idle

GREEDY = llamax.SamplingParams(max_tokens=6, temperature=0.0)


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_background_loop_gives_its_workers_back_when_it_goes_idle() -> None:
    backend = FakeBackend()
    with llamax.Context(backend=backend) as ctx:
        engine = ctx._engine._thread
        assert engine is not None
        for _ in range(3):
            ctx.add_request("hello there", GREEDY).result(timeout=60)
            assert _wait_for(lambda: engine.ident not in backend.pooled_threads)
        assert backend.decode_log, "the loop decoded"
        assert 1 <= backend.num_thread_releases <= 6  # once an idle spell, not once a step
        assert_idle(ctx)


def test_a_busy_loop_keeps_its_workers_between_steps() -> None:
    backend = FakeBackend()
    with llamax.Context(backend=backend, autostart=False) as ctx:
        handle = ctx.add_request("count", llamax.SamplingParams(max_tokens=20, temperature=0.0))
        steps = 0
        while ctx.process():
            steps += 1
            if not handle.done():
                assert threading.get_ident() in backend.pooled_threads
                assert backend.num_thread_releases == 0  # no thread made again every step
        assert steps >= 20
        assert handle.result(timeout=5).choices[0].token_ids
        assert threading.get_ident() not in backend.pooled_threads  # the last step gave back
        assert backend.num_thread_releases == 1
        assert_idle(ctx)


def test_calibrating_on_the_constructing_thread_gives_its_workers_back() -> None:
    backend = FakeBackend(n_ctx=2048, n_seq_max=4)
    with llamax.Context(backend=backend, autostart=False, calibrate=True) as ctx:
        assert ctx.calibration is not None, "the fake was calibrated (decodes on this thread)"
        assert backend.decode_log
        assert threading.get_ident() not in backend.pooled_threads
        assert_idle(ctx)


def test_a_waiting_handle_that_stepped_gives_its_workers_back() -> None:
    backend = FakeBackend()
    with llamax.Context(backend=backend, autostart=False) as ctx:
        out = ctx.add_request("abc", GREEDY).result(timeout=60)  # steps in this thread
        assert out.choices[0].token_ids
        assert threading.get_ident() not in backend.pooled_threads
        assert_idle(ctx)


def test_a_manual_drain_at_close_gives_its_workers_back() -> None:
    backend = FakeBackend()
    ctx = llamax.Context(backend=backend, autostart=False)
    handle = ctx.add_request("abc", GREEDY)
    ctx.close(drain=True)  # steps here until the request is done
    assert handle.result(timeout=5).choices[0].token_ids
    assert threading.get_ident() not in backend.pooled_threads


@pytest.mark.parametrize("fails", [False, True])
def test_a_request_thread_that_encoded_an_image_gives_its_workers_back(fails: bool) -> None:
    backend = FakeBackend(image_tokens=8)
    if fails:

        def fault(where: str) -> object:
            if where == "encode_image":
                raise RuntimeError("injected encode failure")
            return None

        backend.fault = fault
    with llamax.Context(backend=backend) as ctx:
        image = llamax.Image(png(pixels(3, 4, 5)))
        results: list[object] = []
        idents: list[int] = []

        def client() -> None:  # a server's request thread, say
            idents.append(threading.get_ident())
            try:
                results.append(ctx.add_request(["see ", image, " now"], GREEDY))
            except llamax.LlamaxError as exc:
                results.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        thread.join(60)
        assert idents and idents[0] not in backend.pooled_threads
        if fails:
            assert isinstance(results[0], llamax.RequestFailedError)
        else:
            handle = results[0]
            assert isinstance(handle, llamax.RequestHandle)
            assert handle.result(timeout=60).choices[0].token_ids
        engine = ctx._engine._thread
        assert engine is not None
        assert _wait_for(lambda: not backend.pooled_threads), backend.pooled_threads
        assert_idle(ctx)


_PROBE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import llamax
    from llamax.backend.openmp import release_threads

    def native():  # threads Python did not start: OpenMP's workers among them
        return len(os.listdir("/proc/self/task")) - threading.active_count()

    model = sys.argv[1]
    out = {}
    before = native()
    with llamax.Context(model, n_ctx=1024, n_seq_max=2, n_threads=2) as ctx:
        out["calibrated"] = ctx.calibration is not None
        out["after_construction"] = native() - before
        params = llamax.SamplingParams(max_tokens=8, temperature=0.0)
        ctx.add_request("Hello there", params).result(timeout=120)
        deadline = time.monotonic() + 20
        while native() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        out["after_idle"] = native() - before
        with llamax.Embedder(model, n_threads=2) as embedder:
            embedder.embed(["one text", "another text"])
            out["after_embed"] = native() - before
    out["libgomp"] = release_threads()
    print(json.dumps(out))
    """
)


@pytest.mark.integration
def test_smollm2_leaves_no_openmp_worker_behind(model_path: Path, tmp_path: Path) -> None:
    """A fresh process (an empty calibration cache, so the constructor calibrates on its
    thread): no OpenMP worker outlives the construction, an idle spell or an embedding.
    Before, the constructing thread kept one worker for its life (``after_construction``
    was 1, ``after_idle`` 2 with n_threads=2) and the engine's steps were throttled."""
    if not sys.platform.startswith("linux"):
        pytest.fail("this check reads /proc: Linux only (our CI's machines are)")
    env = {**os.environ, "LLAMAX_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(model_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["libgomp"], "llama.cpp here runs on GNU OpenMP (scripts/bootstrap.sh builds so)"
    assert out["calibrated"]
    assert out == {"calibrated": True, "after_construction": 0, "after_idle": 0,
                   "after_embed": 0, "libgomp": True}  # fmt: skip
