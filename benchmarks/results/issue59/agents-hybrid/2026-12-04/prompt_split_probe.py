"""Issue 59 part 5 probe (raw llama.cpp, no llamax): does cutting a turn's prompts cost?

At 4 conversations llamax computed the hybrid's prompt tokens ~8% dearer than llama-server
with one chunk a turn. A turn there is the four conversations' new messages (~226 tokens
each) after their histories, which llamax decoded in 3 steps (366, 435, 105 tokens) where
llama-server's batch of 2,048 takes them at once (in ubatches of 512). Here, on the random
LFM2-350M-shape hybrid in streams (``n_ctx=16384, n_seq_max=4``, ``n_batch=2048``,
``n_ubatch=512``), each sequence holds a 600-token history (restored from a saved state
before every timing), then its 226 new tokens are decoded (last row's logits read) either
in **one** decode of 904 tokens or in **three** decodes (each sequence's tokens cut at 40%
and 88%, as 362, 434 and 108 tokens), alternated, ``--repeats`` times. Prints JSON.

    .venv/bin/python .../prompt_split_probe.py --repeats 5 > prompt_split.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/

from _common import cpu_description, load_script, model_path
from _loops import C, RawLoop

HISTORY, NEW, N_SEQ = 600, 226, 4
CUTS = (0.4, 0.88)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = load_script("make_memory_model").write_memory_model(
            Path(folder) / "hybrid_350m.gguf", kind="hybrid_350m", tokenizer_from=model_path(None)
        )
        loop = RawLoop(path, n_ctx=16384, n_seq_max=N_SEQ, n_batch=2048, n_ubatch=512,
                       kv_unified=False)  # fmt: skip
        tokens = [(i * 37) % 20000 + 100 for i in range(4096)]
        states = []
        for seq in range(N_SEQ):
            loop.decode_rows([(tokens[p + 7 * seq], p, seq, False) for p in range(HISTORY)])
            size = C.llama_state_seq_get_size(loop.ctx, seq)
            buf = (ctypes.c_uint8 * size)()
            C.llama_state_seq_get_data(loop.ctx, buf, size, seq)
            states.append(buf)

        def restore() -> None:
            C.llama_memory_clear(loop.memory, True)
            for seq, buf in enumerate(states):
                if C.llama_state_seq_set_data(loop.ctx, buf, len(buf), seq) == 0:
                    raise RuntimeError("state not restored")

        def new_items(seq: int, lo: int, hi: int) -> list[tuple[int, int, int, bool]]:
            return [(tokens[HISTORY + p + 7 * seq], HISTORY + p, seq, p == NEW - 1)
                    for p in range(lo, hi)]  # fmt: skip

        bounds = [0, int(NEW * CUTS[0]), int(NEW * CUTS[1]), NEW]
        plans = {
            "one": [[i for s in range(N_SEQ) for i in new_items(s, 0, NEW)]],
            "three": [
                [i for s in range(N_SEQ) for i in new_items(s, bounds[k], bounds[k + 1])]
                for k in range(3)
            ],
        }
        samples: dict[str, list[float]] = {name: [] for name in plans}
        for repeat in range(args.repeats):
            for name in ("one", "three") if repeat % 2 == 0 else ("three", "one"):
                restore()
                started = time.perf_counter()
                for batch in plans[name]:
                    loop.decode(batch)
                samples[name].append(round(time.perf_counter() - started, 4))
                print(name, samples[name][-1], file=sys.stderr, flush=True)
        loop.close()
    print(json.dumps({"cpu": cpu_description()["model"],
                      "sizes": {k: [len(b) for b in v] for k, v in plans.items()},
                      "median_s": {k: statistics.median(v) for k, v in samples.items()},
                      "samples": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
