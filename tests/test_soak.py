"""Soak: many requests from 32 threads with random parameters and 25% random cancels.

Nothing is lost (every handle settles), resident memory stays flat, and the context ends
idle. The default suite runs 1,000 requests; the full 10,000 is marked ``soak``:

    .venv/bin/python -m pytest -m soak tests/test_soak.py
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import llamax
from llamax.testing import assert_idle

WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "light", "garden", "window"]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def random_params(rng: random.Random) -> llamax.SamplingParams:
    return llamax.SamplingParams(
        max_tokens=rng.randint(1, 6),
        temperature=rng.choice([0.0, 0.7, 1.2]),
        top_k=rng.choice([0, 20, 40]),
        stop=rng.choice([(), (".",), ("\n", "the")]),
        n=rng.choice([1, 1, 1, 2]),
        logprobs=rng.choice([None, None, 2]),
        seed=rng.randint(0, 2**31),
    )


def soak(ctx: llamax.Context, num_requests: int, num_threads: int = 32) -> None:
    per_thread = num_requests // num_threads
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        rng = random.Random(k)
        for _ in range(per_thread):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            handle = ctx.add_request(prompt, random_params(rng))
            if rng.random() < 0.25:
                handle.cancel()
            done = handle.result(timeout=600)
            with lock:
                outcomes.append(str(done.finish_reason))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == per_thread * num_threads  # every request settled
    assert set(outcomes) <= {"stop", "length", "cancelled"}


def run_soak(make_real: Callable[..., llamax.Context], num_requests: int) -> None:
    ctx = make_real(n_ctx=2048, n_seq_max=16, n_threads=2)
    soak(ctx, 160)  # warm-up: allocators, caches, samplers reach their steady size
    before = rss_mib()
    soak(ctx, num_requests)
    grown = rss_mib() - before
    assert grown < 64, f"RSS grew by {grown:.1f} MiB over {num_requests} requests"
    assert_idle(ctx, timeout=120)


@pytest.mark.model
@pytest.mark.timeout(900)
def test_soak_short(make_real: Callable[..., llamax.Context]) -> None:
    run_soak(make_real, 1_000)


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.timeout(7200)
def test_soak_full(make_real: Callable[..., llamax.Context]) -> None:
    run_soak(make_real, int(os.environ.get("LLAMAX_SOAK_REQUESTS", "10000")))
