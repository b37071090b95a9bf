"""What does verifying k tokens of a sequence in one decode cost, against decoding one?

Speculative decoding pays off only if a decode of ``k`` tokens per sequence (the pending
token plus ``k - 1`` drafts) costs much less than ``k`` decodes of one token. This script
measures it on the raw ``llama_decode`` loop (no llamax): ``N`` sequences, each holding a
``--context``-token prompt, decode ``k`` tokens each with logits on every row; the cells
are removed again after each decode. Repeats are interleaved over ``k`` so a noisy
neighbour hits every ``k`` alike.

Reported per N and k: the median milliseconds of the decode, ``cost_over_one`` (time of
the k-token decode over the 1-token decode) and ``ceiling_speedup`` = ``k / cost_over_one``,
the speedup speculation would give if every draft were accepted. With SmolLM2 Q4_1 on a
2-thread CPU the decode is compute-bound even at one token (llama.cpp's CPU batch kernels
have no Q4_1 GEMM path), so each extra token costs nearly as much as the first and the
ceiling stays near 2x.

::

    .venv/bin/python benchmarks/verify_cost.py --json-out verify_cost.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import defaultdict

import _common as bench
from _loops import C, RawLoop, tokenize

KS = (1, 2, 3, 4, 6, 8, 12, 16)


def measure(loop: RawLoop, n_seqs: int, context: int, repeats: int) -> dict[int, float]:
    """Median seconds of a decode of k tokens for each of ``n_seqs`` sequences."""
    text = " ".join(itertools.islice(bench.filler_sentences(), context // 4))
    prompt = tokenize(loop.vocab, text)[:context]
    for seq in range(n_seqs):
        loop.decode_rows([(t, i, seq, False) for i, t in enumerate(prompt)])
    times: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for k in KS:
            items = [(prompt[i], context + i, seq, True) for seq in range(n_seqs) for i in range(k)]
            start = time.perf_counter()
            loop.decode(items)
            times[k].append(time.perf_counter() - start)
            for seq in range(n_seqs):
                C.llama_memory_seq_rm(loop.memory, seq, context, -1)
    for seq in range(n_seqs):
        C.llama_memory_seq_rm(loop.memory, seq, -1, -1)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_common_args(parser)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=400, help="tokens each sequence holds")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    load_at_start = bench.load_average()
    with bench.stdout_to_stderr() as stdout:
        path = bench.model_path(args.model)
        max_n = max(args.n)
        loop = RawLoop(path, n_ctx=max_n * (args.context + 64), n_seq_max=max_n, n_batch=512)
        results = {}
        for n in args.n:
            bench.log(f"N={n}: decoding k tokens per sequence at context {args.context}")
            seconds = measure(loop, n, args.context, args.repeats)
            results[str(n)] = {
                str(k): {
                    "decode_ms": round(1000 * s, 2),
                    "cost_over_one": round(s / seconds[1], 3),
                    "ceiling_speedup": round(k * seconds[1] / s, 3),
                }
                for k, s in seconds.items()
            }
        loop.close()
        report = {
            "config": bench.base_config(args, load_at_start, ks=list(KS)),
            "by_n_and_k": results,
        }
        bench.emit_report(report, stdout, args.json_out)


if __name__ == "__main__":
    main()
