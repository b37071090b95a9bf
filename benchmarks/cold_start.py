"""What a fresh machine's first context pays (issue 59): W1 from the first request.

Each sample is a fresh process (``--child``) that builds one ``llamax.Context`` and runs
W1 twice without any warm-up (N short prompts x 64 greedy tokens at once, as
``throughput.py`` does): the first run is what a user's first requests get, the second
what later ones get. A sample is **cold** or **warm**:

``cold``
    Before the process starts, the model file is dropped from the page cache
    (``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed for clean pages) and the
    process gets an empty calibration cache (``$LLAMAX_CACHE_DIR``), so its context
    calibrates (docs/performance.md) and reads the weights from disk, as on a fresh
    machine after ``pip install``.
``warm``
    The page cache and the calibration cache as a previous process left them.

Cold and warm samples alternate. Per sample: the context's construction seconds, the
first request's time to its first token, and each W1 run's tokens/s; the report gives
medians and each W1 run's ratio to the warm second run (the issue's target: a cold first
run within 5% of later ones).

::

    .venv/bin/python benchmarks/cold_start.py --repeats 3 --json-out cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    N_THREADS,
    TokenTimes,
    add_common_args,
    base_config,
    emit_report,
    greedy,
    load_average,
    log,
    machine,
    model_path,
    short_prompts,
    stdout_to_stderr,
)

import llamax

MAX_TOKENS = 64
N_CTX = 8192


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (clean pages; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def w1(ctx: llamax.Context, prompts: list[str]) -> tuple[float, float]:
    """One W1 run: tokens/s, and the first token's time from the first submit."""
    start = time.perf_counter()
    handles = [ctx.add_request(p, greedy(MAX_TOKENS)) for p in prompts]
    first = TokenTimes(handles[0])
    tokens = sum(h.result().usage.completion_tokens for h in handles)
    seconds = time.perf_counter() - start
    return tokens / seconds, first.wait()[0] - start


def child(model: Path, n: int) -> dict[str, Any]:
    """One sample, in this (fresh) process."""
    prompts = short_prompts(n)
    started = time.perf_counter()
    with llamax.Context(model, n_ctx=N_CTX, n_seq_max=n, n_threads=N_THREADS) as ctx:
        build_s = time.perf_counter() - started
        first_tps, first_ttft = w1(ctx, prompts)
        ctx.clear_cache()
        second_tps, second_ttft = w1(ctx, prompts)
        calibrated = ctx.calibration is not None
    return {"build_s": round(build_s, 3), "first_tok_s": round(first_tps, 2),
            "first_ttft_s": round(first_ttft, 3), "second_tok_s": round(second_tps, 2),
            "second_ttft_s": round(second_ttft, 3), "calibrated": calibrated}  # fmt: skip


def sample(kind: str, model: Path, n: int) -> dict[str, Any]:
    """Run one cold or warm sample in a fresh process."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="llamax-cold-") as empty:
        if kind == "cold":
            evict(model)
            env["LLAMAX_CACHE_DIR"] = empty
        load = load_average()
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--model", str(model), "--n", str(n)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return {"kind": kind, "load_average": load, **result}


def median(samples: list[dict[str, Any]], kind: str, key: str) -> float | None:
    values = [s[key] for s in samples if s["kind"] == kind]
    return round(statistics.median(values), 3) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--n", type=int, default=16, help="W1's concurrent requests")
    parser.add_argument("--repeats", type=int, default=3, help="cold and warm samples each")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = model_path(args.model)
    if args.child:
        with stdout_to_stderr() as stdout:
            print(json.dumps(child(model, args.n)), file=stdout)
        return 0
    load = load_average()
    with stdout_to_stderr() as stdout:
        sample("warm", model, args.n)  # the page cache and calibration a user's later runs see
        samples = []
        for repeat in range(args.repeats):
            for kind in ("cold", "warm") if repeat % 2 == 0 else ("warm", "cold"):
                samples.append(result := sample(kind, model, args.n))
                log(f"repeat {repeat + 1}/{args.repeats}: {result}")
        later = median(samples, "warm", "second_tok_s")
        summary = {
            f"{kind}_{key}": median(samples, kind, key)
            for kind in ("cold", "warm")
            for key in ("build_s", "first_ttft_s", "first_tok_s", "second_tok_s")
        }
        ratios = {
            f"{kind}_{run}_over_warm_second": round(value / later, 3)
            for kind in ("cold", "warm")
            for run in ("first", "second")
            if later and (value := median(samples, kind, f"{run}_tok_s")) is not None
        }
        report = {
            "machine": machine(),
            "benchmark": "cold_start",
            "config": base_config(args, load, n_ctx=N_CTX, max_tokens=MAX_TOKENS),
            "summary": summary,
            "ratios": ratios,
            "samples": samples,
        }
        emit_report(report, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
