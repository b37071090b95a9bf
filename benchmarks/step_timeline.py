"""Where a prefix-sharing burst's time goes (issue 59): the burst of ``prefix_cache.py``
(16 requests sharing a ~1,300-token system prompt, 32 greedy tokens each, at once) on
llamax, with every backend call timed, beside the raw loop's floor (the prefix once,
``seq_cp``, the suffixes in one batch, then 16 rows a step) timed the same way.

Per llamax decode: its rows (items), tokens, the cells in use before it, and its time; per
KV operation (``seq_cp``, queued copies, a layout move, ``seq_rm``, state reads and
writes): its time. The report sums them by kind and by phase (prefill: decodes holding a
chunk of more than one token; decode: one-token rows only) and says how much of the wall
time the backend calls do not account for (the engine's own work, sampling, waiting).

    python benchmarks/step_timeline.py --n-ctx 32768 [--kv-layout streams] > timeline.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
from _common import add_common_args, emit_report, greedy, load_average, log, model_path
from _loops import RawLoop
from prefix_cache import MAX_TOKENS, N_BATCH, N_SEQ_MAX, build_workload

import llamax
from llamax.backend.llama_cpp import LlamaCppBackend

TIMED = ("decode", "seq_cp", "run_queued_copies", "relayout", "seq_rm", "state_seq_get",
         "state_seq_set")  # fmt: skip


class Recorder:
    """Backend calls as they happen: (kind, seconds, details)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict[str, Any]]] = []
        self.on = False

    def wrap(self, cls: type, name: str) -> None:
        original = getattr(cls, name)

        def timed(backend: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(backend, *args, **kwargs)
            details: dict[str, Any] = {}
            if name == "decode":
                items = args[0]
                details = {"items": len(items), "tokens": sum(len(i.token_ids) for i in items),
                           "cells": backend.num_cells_used}  # fmt: skip
            started = time.perf_counter()
            try:
                return original(backend, *args, **kwargs)
            finally:
                self.calls.append((name, time.perf_counter() - started, details))

        setattr(cls, name, timed)


RECORDER = Recorder()
"""Wraps the backend's methods once (:func:`main`); each run clears and reads it."""


def run_llamax(path: Path, prompts: list[str], n_ctx: int, layout: str) -> dict[str, Any]:
    recorder = RECORDER
    recorder.calls = []
    with llamax.Context(path, n_ctx=n_ctx, n_seq_max=N_SEQ_MAX, n_threads=2,
                        kv_layout=layout) as ctx:  # fmt: skip
        ctx.add_request("Hello there!", greedy(4)).result()
        ctx.clear_cache()
        before = ctx.stats()
        recorder.on = True
        start = time.perf_counter()
        handles = [ctx.add_request(p, greedy(MAX_TOKENS)) for p in prompts]
        for handle in handles:
            handle.result()
        wall = time.perf_counter() - start
        recorder.on = False
        after = ctx.stats()
        moved = after.kv.num_relayouts - before.kv.num_relayouts
        facts = {"kv_layout": after.kv.layout, "relayouts": moved,
                 "steps": after.num_steps - before.num_steps}  # fmt: skip
    return summarize(recorder.calls, wall) | facts


def summarize(calls: list[tuple[str, float, dict[str, Any]]], wall: float) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = defaultdict(list)
    phases: dict[str, list[float]] = defaultdict(list)
    timeline = []
    for kind, seconds, details in calls:
        by_kind[kind].append(seconds)
        if kind == "decode":
            phase = "prefill" if details["tokens"] > details["items"] else "decode"
            phases[phase].append(seconds)
            timeline.append({"ms": round(seconds * 1000, 2), **details})
    backend = sum(sum(v) for v in by_kind.values())
    return {
        "wall_s": round(wall, 3),
        "backend_s": round(backend, 3),
        "outside_backend_s": round(wall - backend, 3),
        "by_kind": {k: {"calls": len(v), "s": round(sum(v), 3)} for k, v in by_kind.items()},
        "decode_phases": {k: {"decodes": len(v), "s": round(sum(v), 3)} for k, v in phases.items()},
        "timeline": timeline,
    }


def run_floor(path: Path, prompts: list[str], n_ctx: int, unified: bool) -> dict[str, Any]:
    loop = RawLoop(path, n_ctx=n_ctx, n_seq_max=N_SEQ_MAX, n_batch=N_BATCH, n_ubatch=N_BATCH,
                   kv_unified=unified)  # fmt: skip
    calls: list[tuple[str, float, dict[str, Any]]] = []
    original: Callable[..., Any] = C.llama_decode

    def timed(ctx: Any, batch: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(ctx, batch)
        finally:
            tokens = batch.n_tokens
            details = {"items": min(tokens, N_SEQ_MAX), "tokens": tokens, "cells": None}
            calls.append(("decode", time.perf_counter() - started, details))

    try:
        loop.generate_shared(["<|im_start|>user\nHello there!<|im_end|>\n"], 4)
        C.llama_decode = timed  # the raw loop calls it through this module
        start = time.perf_counter()
        loop.generate_shared(prompts, MAX_TOKENS)
        wall = time.perf_counter() - start
    finally:
        C.llama_decode = original
        loop.close()
    return summarize(calls, wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--n-ctx", type=int, default=32768)
    parser.add_argument("--kv-layout", default="auto", choices=["auto", "unified", "streams"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = model_path(args.model)
    for name in TIMED:
        RECORDER.wrap(LlamaCppBackend, name)
    prompts, workload = build_workload(path)
    runs: dict[str, list[dict[str, Any]]] = {"llamax": [], "floor_unified": []}
    load = [load_average()]
    for repeat in range(args.repeats):
        log(f"[timeline] repeat {repeat + 1}: llamax n_ctx={args.n_ctx} {args.kv_layout}")
        runs["llamax"].append(run_llamax(path, prompts, args.n_ctx, args.kv_layout))
        log(f"[timeline] repeat {repeat + 1}: raw floor")
        runs["floor_unified"].append(run_floor(path, prompts, args.n_ctx, True))
        load.append(load_average())
    walls = {k: [r["wall_s"] for r in v] for k, v in runs.items()}
    ratio = [round(a / b, 3) for a, b in zip(walls["llamax"], walls["floor_unified"], strict=True)]
    report = {"benchmark": "step_timeline", "n_ctx": args.n_ctx, "kv_layout": args.kv_layout,
              "workload": workload, "walls_s": walls, "llamax_over_floor": ratio,
              "load_averages": load, "runs": runs}  # fmt: skip
    emit_report(report, sys.stdout, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
