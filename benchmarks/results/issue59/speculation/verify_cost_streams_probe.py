"""Issue 59 probe (raw llama.cpp, no llamax): what verifying drafts costs at 4 and 16 streams.

Part 3's second target asks speculation for >= 1.3x at 4 concurrent copy-heavy streams.
At ``n`` streams a speculative step decodes, for every sequence, its pending token and
``k - 1`` draft tokens, every row's logits read. ``n`` sequences each hold a filler prompt of
``depth`` cells; a step of ``n x k`` tokens (``k = 1..11``; ``max_draft`` is 10) is timed
(decode and each row's argmax), 7 times, in both KV layouts. If every draft were accepted,
a step of ``k`` tokens a sequence gives ``k x c(1) / c(k)`` of the plain step's tokens per
second: the ceiling of any draft policy at that width on this machine.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/speculation/verify_cost_streams_probe.py \\
        > verify_streams.json
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

from _common import cpu_description, model_path
from _loops import C, RawLoop

WIDTHS = (4, 16)
DEPTH = 300
SIZES = tuple(range(1, 12))
REPEATS = 7
N_CTX = 8192


def measure(n_seq: int, unified: bool) -> list[dict[str, object]]:
    loop = RawLoop(
        Path(model_path(None)), n_ctx=N_CTX, n_seq_max=n_seq, n_batch=1024, n_ubatch=512,
        kv_unified=unified,
    )  # fmt: skip
    n_vocab = loop.n_vocab
    tokens = [(i * 37) % 20000 + 100 for i in range(2048)]
    for seq in range(n_seq):  # each its own filler (no shared cells)
        loop.decode_rows([(tokens[p + seq], p, seq, False) for p in range(DEPTH)])
    rows = []
    for k in SIZES:
        times = []
        for _ in range(REPEATS):
            items = []
            for seq in range(n_seq):
                C.llama_memory_seq_rm(loop.memory, seq, DEPTH, -1)
                items += [(tokens[p + seq], p, seq, True) for p in range(DEPTH, DEPTH + k)]
            started = time.perf_counter()
            loop.decode(items)
            for row in range(len(items)):
                logits = C.llama_get_logits_ith(loop.ctx, row)
                array = np.ctypeslib.as_array(
                    ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
                )
                int(array.argmax())
            times.append(time.perf_counter() - started)
        row = {"streams": n_seq, "unified": unified, "tokens_per_seq": k,
               "fastest_s": round(min(times), 5), "median_s": round(statistics.median(times), 5),
               "all_s": [round(t, 5) for t in times]}  # fmt: skip
        rows.append(row)
        print(n_seq, unified, k, row["fastest_s"], row["median_s"], file=sys.stderr, flush=True)
    loop.close()
    return rows


def main() -> None:
    rows: list[dict[str, object]] = []
    for n_seq in WIDTHS:
        for unified in (False, True):
            rows += measure(n_seq, unified)
    ceiling: dict[str, dict[int, float]] = {}
    for n_seq in WIDTHS:
        for unified in (False, True):
            mine = {r["tokens_per_seq"]: r for r in rows
                    if r["streams"] == n_seq and r["unified"] == unified}  # fmt: skip
            for key in ("fastest_s", "median_s"):
                one = float(mine[1][key])  # type: ignore[arg-type]
                name = f"{n_seq}_{'unified' if unified else 'streams'}_{key}"
                ceiling[name] = {
                    k: round(k * one / float(mine[k][key]), 3)  # type: ignore[arg-type]
                    for k in SIZES
                }
    out = {"cpu": cpu_description()["model"], "depth": DEPTH, "n_ctx": N_CTX, "rows": rows,
           "all_accepted_speedup": ceiling}  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
