"""Issue 59 part 1 probe (raw llama.cpp, no llamax): the 16 suffixes of prefix_cache.py's
burst decoded in one batch after the shared prefix, in streams (as they come, seq ids
sorted by suffix length, all cut to the shortest) and unified; then one 16-row step.

Usage, from the repository root::

    [FA=0|1] .venv/bin/python benchmarks/results/issue59/suffix-streams/suffix_decode_probe.py 65536

``FA`` sets ``flash_attn_type`` (unset: -1, llama.cpp's auto, on for a CPU). Prints
``layout variant suffix_decode_s one_step_s tokens`` lines to stderr, JSON to stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

import prefix_cache
from _common import model_path
from _loops import C, RawLoop, common_prefix_len, tokenize

N_SEQ = 16


def run(
    loop: RawLoop, variant: str, lists: list[list[int]], prefix: int
) -> tuple[float, float, int]:
    C.llama_memory_clear(loop.memory, True)
    loop.decode_rows([(t, pos, 0, False) for pos, t in enumerate(lists[0][:prefix])])
    for seq in range(1, N_SEQ):  # whole-stream copies: a partial cross-stream copy aborts
        C.llama_memory_seq_cp(loop.memory, 0, seq, -1, -1)
    lens = [len(t) - prefix for t in lists]
    if variant == "sorted":
        lists = [lists[o] for o in sorted(range(N_SEQ), key=lambda s: -lens[s])]
    elif variant == "equal":
        lists = [t[: prefix + min(lens)] for t in lists]
    items = [
        (t[p], p, s, p == len(t) - 1) for s, t in enumerate(lists) for p in range(prefix, len(t))
    ]
    started = time.perf_counter()
    loop.decode(items)
    suffix_s = time.perf_counter() - started
    started = time.perf_counter()
    loop.decode([(lists[s][-1], len(lists[s]), s, True) for s in range(N_SEQ)])
    return suffix_s, time.perf_counter() - started, len(items)


def main() -> None:
    path = Path(model_path(None))
    prompts, _ = prefix_cache.build_workload(path)
    n_ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    flash = int(os.environ.get("FA", "-1"))
    results: dict[str, Any] = {}
    original = C.llama_init_from_model

    def init(model: Any, params: Any) -> Any:
        params.flash_attn_type = flash
        return original(model, params)

    for unified in (False, True):
        C.llama_init_from_model = init
        try:
            loop = RawLoop(path, n_ctx=n_ctx, n_seq_max=N_SEQ, n_batch=1024, n_ubatch=1024,
                           kv_unified=unified)  # fmt: skip
        finally:
            C.llama_init_from_model = original
        lists = [tokenize(loop.vocab, p) for p in prompts]
        prefix = min(common_prefix_len(lists[0], t) for t in lists)
        layout = "unified" if unified else "streams"
        for _ in range(2):
            for variant in ("asis", "equal") if unified else ("asis", "sorted", "equal"):
                row = run(loop, variant, lists, prefix)
                results.setdefault(f"{layout}_{variant}", []).append(row)
                print(layout, variant, *(round(x, 3) for x in row), file=sys.stderr)
        loop.close()
    print(json.dumps({"n_ctx": n_ctx, "flash_attn_type": flash, "runs": results}))


if __name__ == "__main__":
    main()
