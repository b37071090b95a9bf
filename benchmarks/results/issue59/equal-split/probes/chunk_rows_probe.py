"""Issue 59 probe (llama.cpp through llamax's backend, no scheduler): what a step costs with
a prompt chunk of k tokens for sequence 0 beside r one-token decode rows of sequences 1..r.

Four sequences of ``depth`` tokens are computed first; then, REPS rounds over every (k, r),
sequence 0's chunk continues where it is (a recurrent memory cannot be cut back) and the
rows advance one token each. Prints the median ms of each (k, r).

Usage, from /tmp (model, depth, layout; sizes and rows comma-separated)::

    .venv/bin/python .../chunk_rows_probe.py MODEL 1024 streams 32,64,65,128 0,3 [REPS]
"""

import statistics
import sys
import time

from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig


def main() -> None:
    model, depth, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sizes = [int(x) for x in sys.argv[4].split(",")]
    row_counts = [int(x) for x in sys.argv[5].split(",")]
    reps = int(sys.argv[6]) if len(sys.argv) > 6 else 3
    config = ContextConfig(
        model_path=model, n_ctx=32768, n_seq_max=4, kv_layout=layout, n_threads=2
    )
    backend = LlamaCppBackend(config)
    filler = [(i * 37) % 20000 + 100 for i in range(depth)]
    for seq in range(4):
        for start in range(0, depth, 512):
            chunk = filler[start : start + 512]
            assert backend.decode([BatchItem(seq, chunk, start, (len(chunk) - 1,))]) == 0
    pos = [depth] * 4
    times: dict[tuple[int, int], list[float]] = {}
    for rep in range(reps):
        for k in sizes:
            for r in row_counts:
                if k == 0 and r == 0:
                    continue
                items = []
                if k:
                    tokens = [(i * 37) % 20000 + 100 for i in range(k)]
                    items.append(BatchItem(0, tokens, pos[0], (k - 1,)))
                for seq in range(1, r + 1):
                    items.append(BatchItem(seq, [700 + rep], pos[seq], (k + seq - 1,)))
                started = time.perf_counter()
                assert backend.decode(items) == 0
                times.setdefault((k, r), []).append(1000 * (time.perf_counter() - started))
                pos[0] += k
                for seq in range(1, r + 1):
                    pos[seq] += 1
    for key in sorted(times):
        print(layout, key, f"median ms {statistics.median(times[key]):.1f}", flush=True)
    backend.close()


if __name__ == "__main__":
    main()
