"""Issue 59 probe (raw llama.cpp, no llamax): what a prompt token costs by chunk size.

One sequence, a chunk of ``k`` tokens decoded at position 0 and at ``depth`` cells (a
filler prompt computed first), k in 1..512; the fastest of 3 timings each. The engine's
step-cost model prices a token alike in every chunk (plus a fixed cost a step and the
tiled attention's padding); this shows how far that is from the machine.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/chunk-curve/chunk_curve_probe.py > curve.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

from _common import model_path
from _loops import C, RawLoop

SIZES = (1, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def main() -> None:
    loop = RawLoop(Path(model_path(None)), n_ctx=4096, n_seq_max=1, n_batch=512, n_ubatch=512)
    tokens = [(i * 37) % 20000 + 100 for i in range(4096)]
    rows = []
    for depth in (0, 1024, 2560):
        C.llama_memory_clear(loop.memory, True)
        for start in range(0, depth, 512):
            end = min(depth, start + 512)
            loop.decode_rows([(tokens[p], p, 0, False) for p in range(start, end)])
        for k in SIZES:
            best = float("inf")
            for _ in range(3):
                C.llama_memory_seq_rm(loop.memory, 0, depth, -1)  # keep the filler only
                items = [(tokens[p], p, 0, p == depth + k - 1) for p in range(depth, depth + k)]
                started = time.perf_counter()
                loop.decode(items)
                best = min(best, time.perf_counter() - started)
            rows.append({"depth": depth, "tokens": k, "s": round(best, 5),
                         "ms_per_token": round(1000 * best / k, 3)})  # fmt: skip
            print(depth, k, round(best, 4), round(1000 * best / k, 3), file=sys.stderr)
    print(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
