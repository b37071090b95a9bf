"""The checkpoint interval K (issue 40): what a long prefill's checkpoints cost, and what
they save a prompt that shares only part of it.

On a hybrid model (default: the random LFM2 in LFM2-350M's shape that
``scripts/make_memory_model.py --kind hybrid_350m`` writes), for each interval K of
``--intervals`` (the engine's ``interval_for``, patched for the run; ``0`` stands for none,
only the prompt's last checkpoint; ``-1`` for the engine's own rule
(:func:`llamax.engine.kv.checkpoints.interval_for`, which
spreads a slot's 8 checkpoints over the prompt, at least 256 tokens apart):

1. *cold*: a ~``--doc-tokens`` document prompt (1 greedy token) on an empty cache: its time
   to first token, the checkpoints it took and their bytes;
2. *partial hits*: four prompts that share the first 30%, 50%, 70% and 90% of the
   document's tokens, then ask their own question (in that order, so each one's longest
   match is the document): per prompt the tokens computed and the TTFT.

A smaller K costs more checkpoints (bytes in the prefix budget, one state read each, a
prompt chunk ended at each) and saves more recomputation (at most K tokens past the
shared part's last checkpoint). Every repeat and the medians go in the JSON.

::

    .venv/bin/python benchmarks/checkpoint_interval.py --json-out checkpoint_interval.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    N_THREADS,
    add_common_args,
    base_config,
    emit_report,
    filler_sentences,
    load_average,
    log,
    model_path,
    stdout_to_stderr,
)
from agent_turns import memory_model

import llamax
from llamax.engine.kv import checkpoints

FRACTIONS = (0.3, 0.5, 0.7, 0.9)
NONE = 10**9
"""The interval that stands for "no interval checkpoints" (``--intervals 0``)."""
RULE = checkpoints.interval_for
"""The engine's own interval rule (``--intervals -1``)."""


def document(ctx: llamax.Context, target: int) -> list[int]:
    """About ``target`` tokens of varied sentences, as token ids."""
    lines: list[str] = ["Read the records below."]
    sentences = filler_sentences("Record")
    ids: list[int] = []
    while len(ids) < target:
        lines.extend(next(sentences) for _ in range(20))
        ids = ctx.tokenize("\n".join(lines))
    return ids[:target]


def ttft(ctx: llamax.Context, prompt: list[int]) -> tuple[float, int]:
    """Time to the first token of ``prompt`` (1 greedy token) and the tokens computed."""
    params = llamax.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    done = ctx.add_request(prompt, params).result(timeout=1800)
    return time.perf_counter() - start, done.usage.prompt_tokens - done.usage.cached_tokens


def one_interval(ctx: llamax.Context, doc: list[int], interval: int | None) -> dict[str, Any]:
    """The cold run and the partial hits with checkpoints every ``interval`` tokens (None:
    the engine's own choice, :func:`llamax.engine.kv.checkpoints.interval_for`)."""
    checkpoints.interval_for = RULE if interval is None else (lambda _n: interval)
    ctx.clear_cache()
    taken = ctx.stats().num_checkpoints
    cold_s, cold_computed = ttft(ctx, doc)
    stats = ctx.stats()
    out: dict[str, Any] = {
        "interval": checkpoints.interval_for(len(doc)),
        "cold_ttft_s": round(cold_s, 3),
        "cold_computed": cold_computed,
        "num_checkpoints": stats.num_checkpoints - taken,
        "checkpoint_bytes": stats.checkpoint_bytes,
        "partial": [],
    }
    for k, fraction in enumerate(FRACTIONS):
        shared = int(len(doc) * fraction)
        question = ctx.tokenize(f"\nQuestion {k}: what does record {k} say?", add_special=False)
        seconds, computed = ttft(ctx, doc[:shared] + question)
        out["partial"].append(
            {
                "shared": shared,
                "new": len(question),
                "computed": computed,
                "recomputed": computed - len(question),
                "ttft_s": round(seconds, 3),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--memory-kind", default="hybrid_350m", choices=("hybrid", "hybrid_350m"))
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--intervals", type=int, nargs="*", default=[-1, 256, 512, 1024, 2048, 0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    load_at_start = load_average()
    with stdout_to_stderr() as stdout, tempfile.TemporaryDirectory() as folder:
        path = memory_model(args.memory_kind, model_path(args.model), Path(folder))
        runs: dict[str, list[dict[str, Any]]] = {}
        with llamax.Context(
            path,
            n_ctx=2 * args.doc_tokens + 512,
            n_seq_max=len(FRACTIONS) + 2,  # the document stays retained
            kv_layout="unified",
            n_threads=N_THREADS,
        ) as ctx:
            doc = document(ctx, args.doc_tokens)
            ttft(ctx, doc[:64])  # warm-up
            for repeat in range(args.repeats):
                for interval in args.intervals:
                    name = {-1: "engine", 0: "none"}.get(interval, str(interval))
                    result = one_interval(ctx, doc, None if interval < 0 else interval or NONE)
                    runs.setdefault(name, []).append(result)
                    log(f"repeat {repeat + 1} K={name}: {result}")
        checkpoints.interval_for = RULE
        summary = {
            name: {
                "cold_ttft_s": statistics.median(r["cold_ttft_s"] for r in rs),
                "interval": rs[0]["interval"],
                "num_checkpoints": rs[0]["num_checkpoints"],
                "checkpoint_bytes": rs[0]["checkpoint_bytes"],
                "partial_recomputed_total": rs[0]["partial"]
                and sum(p["recomputed"] for p in rs[0]["partial"]),
                "partial_ttft_median_s": statistics.median(
                    p["ttft_s"] for r in rs for p in r["partial"]
                ),
            }
            for name, rs in runs.items()
        }
        emit_report(
            {
                "config": base_config(args, load_at_start),
                "doc_tokens": args.doc_tokens,
                "summary": summary,
                "runs": runs,
            },
            stdout,
            args.json_out,
        )


if __name__ == "__main__":
    main()
