"""Where ggml's CPU flash attention changes kernels, and what that costs a step.

llama.cpp's CPU flash attention computes a micro-batch of fewer than 64 query rows one row
at a time (each row skips the cells its mask hides) and a larger one in 64 x 64 tiles
(a tile is skipped only when no row of it sees any cell of it). Two measurements on the
raw ``llama_decode`` loop (no llamax), unified KV cache, median of ``--repeats``:

1. ``chunk``: one sequence holding P cells feeds a k-token chunk next to 4 decode rows of
   other sequences (the step of a long prompt prefilling beside 4 streams), for k around
   60, where the step crosses 64 rows.
2. ``decode``: 64 sequences of 80 cells each decode one token each: one call of 64 rows,
   two of 32 (what llamax's ``Scheduler.split`` does), and per-sequence streams.

::

    .venv/bin/python benchmarks/attention_kernels.py --json-out attention_kernels.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import _common as bench
from _loops import C, RawLoop, tokenize

CHUNKS = (20, 40, 56, 59, 60, 64, 96, 128)
CONTEXTS = (1000, 3400)


def median_ms(run: Callable[[], None], undo: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        undo()
    return round(1000 * statistics.median(times), 1)


def chunk_costs(loop: RawLoop, tokens: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """ms of a step: k prompt tokens of seq 0 at context P, plus 1 token each of seqs 1-4."""
    for seq in range(1, 5):
        loop.decode_rows([(t, i, seq, False) for i, t in enumerate(tokens[:100])])
    results: dict[str, dict[str, float]] = {}
    for p in CONTEXTS:
        C.llama_memory_seq_rm(loop.memory, 0, -1, -1)
        loop.decode_rows([(t, i, 0, False) for i, t in enumerate(tokens[:p])])

        def undo(p: int = p) -> None:
            C.llama_memory_seq_rm(loop.memory, 0, p, -1)
            for seq in range(1, 5):
                C.llama_memory_seq_rm(loop.memory, seq, 100, -1)

        results[str(p)] = {}
        for k in CHUNKS:
            items = [(tokens[p + i], p + i, 0, i == k - 1) for i in range(k)]
            items += [(tokens[100], 100, seq, True) for seq in range(1, 5)]
            results[str(p)][str(k)] = median_ms(
                lambda items=items: loop.decode(items), undo, repeats
            )
            bench.log(f"chunk P={p} k={k}: {results[str(p)][str(k)]} ms ({k + 4} rows)")
    return results


def decode_costs(path: Path, tokens: list[int], repeats: int) -> dict[str, float]:
    """ms of one decode step of 64 sequences holding 80 cells each."""
    n, cells = 64, 80
    results: dict[str, float] = {}
    for name, unified, groups in (
        ("unified_one_call_of_64", True, 1),
        ("unified_two_calls_of_32", True, 2),
        ("streams_one_call", False, 1),
    ):
        loop = RawLoop(path, n_ctx=8192, n_seq_max=n, n_batch=512, kv_unified=unified)
        for seq in range(n):
            loop.decode_rows([(t, i, seq, False) for i, t in enumerate(tokens[seq : seq + cells])])
        items = [(tokens[seq], cells, seq, True) for seq in range(n)]
        size = n // groups

        def run(
            items: list[tuple[int, int, int, bool]] = items, size: int = size, loop: RawLoop = loop
        ) -> None:
            for begin in range(0, len(items), size):
                loop.decode(items[begin : begin + size])

        def undo(loop: RawLoop = loop) -> None:
            for seq in range(n):
                C.llama_memory_seq_rm(loop.memory, seq, cells, -1)

        results[name] = median_ms(run, undo, repeats)
        bench.log(f"decode {name}: {results[name]} ms")
        loop.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_at_start = bench.load_average()
    with bench.stdout_to_stderr() as stdout:
        path = bench.model_path(args.model)
        text = " ".join(itertools.islice(bench.filler_sentences(), 2000))
        loop = RawLoop(path, n_ctx=8192, n_seq_max=5, n_batch=1024)
        tokens = tokenize(loop.vocab, text)
        chunk = chunk_costs(loop, tokens, args.repeats)
        loop.close()
        decode = decode_costs(path, tokens, args.repeats)
        args.model = path
        report = {
            "config": bench.base_config(args, load_at_start),
            "chunk_ms_by_context_and_tokens": chunk,
            "decode_64_streams_ms": decode,
        }
        bench.emit_report(report, stdout, args.json_out)


if __name__ == "__main__":
    main()
