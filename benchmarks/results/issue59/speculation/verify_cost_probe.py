"""Issue 59 probe (raw llama.cpp, no llamax): what verifying a draft costs at one stream.

Prompt-lookup speculation at N=1 decodes the pending token and ``d`` draft tokens in one
step, every row's logits read. One sequence holds a filler prompt of ``depth`` cells; a step
of ``k = 1..11`` tokens (``max_draft`` is 10) with logits on every row is timed (decode and
reading each row's argmax), 7 times, and the fastest and the median are kept. From them:
the speedup a step of ``k`` tokens gives if every draft is accepted, ``k x c(1) / c(k)``,
the ceiling of any draft policy at that depth on this machine.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/speculation/verify_cost_probe.py > verify.json
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

from _common import model_path
from _loops import C, RawLoop

DEPTHS = (400, 800)
SIZES = tuple(range(1, 12))
REPEATS = 7


def main() -> None:
    loop = RawLoop(Path(model_path(None)), n_ctx=2048, n_seq_max=1, n_batch=512, n_ubatch=512)
    n_vocab = loop.n_vocab
    tokens = [(i * 37) % 20000 + 100 for i in range(2048)]
    rows = []
    for depth in DEPTHS:
        C.llama_memory_clear(loop.memory, True)
        for start in range(0, depth, 512):
            end = min(depth, start + 512)
            loop.decode_rows([(tokens[p], p, 0, False) for p in range(start, end)])
        for k in SIZES:
            times = []
            for _ in range(REPEATS):
                C.llama_memory_seq_rm(loop.memory, 0, depth, -1)  # keep the filler only
                items = [(tokens[p], p, 0, True) for p in range(depth, depth + k)]
                started = time.perf_counter()
                loop.decode(items)
                for row in range(k):
                    logits = C.llama_get_logits_ith(loop.ctx, row)
                    array = np.ctypeslib.as_array(
                        ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)
                    )
                    int(array.argmax())
                times.append(time.perf_counter() - started)
            rows.append({"depth": depth, "tokens": k, "fastest_s": round(min(times), 5),
                         "median_s": round(statistics.median(times), 5)})  # fmt: skip
            fastest, median = round(min(times), 4), round(statistics.median(times), 4)
            print(depth, k, fastest, median, file=sys.stderr)
    ceiling = {}
    for depth in DEPTHS:
        mine = {r["tokens"]: r for r in rows if r["depth"] == depth}
        for key in ("fastest_s", "median_s"):
            one = mine[1][key]
            ceiling[f"{depth}_{key}"] = {k: round(k * one / mine[k][key], 3) for k in SIZES}
    print(json.dumps({"rows": rows, "all_accepted_speedup": ceiling}, indent=1))


if __name__ == "__main__":
    main()
