"""Issue 59 probe (llama.cpp through llamax's backend, no scheduler): a decode step of 1..4
one-token rows (one per sequence) in one ``llama_decode``, after 4 sequences of ``depth``
tokens; the streams and the unified layout. Prints the fastest and median ms of 8.

Usage, from /tmp::

    .venv/bin/python .../rows_probe.py MODEL 1024
"""

import statistics
import sys
import time

from llamax.backend.base import BatchItem
from llamax.backend.llama_cpp import LlamaCppBackend
from llamax.config import ContextConfig

REPS = 8


def main() -> None:
    model, depth = sys.argv[1], int(sys.argv[2])
    for layout in ("streams", "unified"):
        config = ContextConfig(
            model_path=model, n_ctx=16384, n_seq_max=4, kv_layout=layout, n_threads=2
        )
        backend = LlamaCppBackend(config)
        filler = [(i * 37) % 20000 + 100 for i in range(depth)]
        for seq in range(4):
            for start in range(0, depth, 512):
                chunk = filler[start : start + 512]
                assert backend.decode([BatchItem(seq, chunk, start, (len(chunk) - 1,))]) == 0
        pos = [depth] * 4
        times: dict[int, list[float]] = {}
        for rep in range(REPS):
            for n in (1, 2, 3, 4):
                items = [BatchItem(seq, [500 + rep], pos[seq], (seq,)) for seq in range(n)]
                started = time.perf_counter()
                assert backend.decode(items) == 0
                times.setdefault(n, []).append(1000 * (time.perf_counter() - started))
                for seq in range(n):
                    pos[seq] += 1
        summary = {n: (round(min(v), 2), round(statistics.median(v), 2)) for n, v in times.items()}
        print(layout, summary, flush=True)
        backend.close()


if __name__ == "__main__":
    main()
