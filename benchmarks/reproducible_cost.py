"""Where the reproducible mode's cost on W1 goes (issue 60): W1 (N distinct short prompts,
64 greedy tokens each, 2 threads, n_batch 1024) on the default mode, the default mode with
flash attention off, and the reproducible mode, alternated; every run recorded.

    python benchmarks/reproducible_cost.py --json-out benchmarks/results/issue60/w1-attribution.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _common import add_common_args, emit_report, load_average, log, model_path, short_prompts

import llamax

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "default_flash_attn_off": {"flash_attn": False},
    "reproducible": {"reproducible": True},
}


def run(path: Any, n: int, options: dict[str, Any]) -> float:
    """Tokens/s of one W1 run on a fresh context (after a warm-up request)."""
    params = llamax.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with llamax.Context(path, n_ctx=8192, n_seq_max=n, n_batch=1024, n_threads=2, **options) as ctx:
        ctx.add_request("Warm up:", llamax.SamplingParams(max_tokens=8)).result()
        started = time.perf_counter()
        handles = [ctx.add_request(p, params) for p in short_prompts(n)]
        tokens = sum(len(h.result().token_ids) for h in handles)
        return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    path = model_path(args.model)
    samples: dict[str, dict[int, list[float]]] = {m: {n: [] for n in args.n} for m in MODES}
    loads = []
    for _ in range(args.repeats):
        for n in args.n:
            for mode, options in MODES.items():
                loads.append(load_average())
                tps = run(path, n, options)
                samples[mode][n].append(round(tps, 1))
                log(f"N={n} {mode}: {tps:.1f} tok/s")
    report = {"samples_tokens_per_s": samples, "load_averages": loads}
    emit_report(report, real_stdout, args.json_out)


if __name__ == "__main__":
    main()
