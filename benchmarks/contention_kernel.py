"""Throughput beside busy processes *inside a Jupyter kernel*, where the collapse shows.

A process with nothing but llama.cpp's workers shares two cores with one busy loop at a few
times slower; an IPython kernel (its iopub, heartbeat, control and output-watching threads
wake now and then) collapsed: on a 2-core AMD EPYC, one 16-token request of the quickstart
notebook took 19-36 s with ``n_threads=2`` beside one busy loop, against 0.3 s with one
thread. This runs, in one fresh kernel per load (``--busy``: Python busy loops, default 0,
cores - 1 and cores), ``--requests`` short prompts x ``--tokens`` greedy tokens for each
system of ``contention.py`` (adapting, fixed ``n_threads=<cores>``, one thread), rotating
the order over ``--repeats``. JSON: medians, every repeat, the threads each ended with.

::

    .venv/bin/python benchmarks/contention_kernel.py --json-out out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _common import emit_report, load_average, log, short_prompts
from contention import CORES, SYSTEMS, busy_processes

CELL = """
import json, time
import llamax
systems, prompts, tokens, repeats = {systems!r}, {prompts!r}, {tokens}, {repeats}
params = llamax.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
size = dict(n_ctx=4096, n_seq_max=len(prompts))
contexts = {{n: llamax.Context(**size, **o) for n, o in systems.items()}}
for ctx in contexts.values():
    ctx.add_request(prompts[0], llamax.SamplingParams(max_tokens=2)).result()
samples = {{n: [] for n in systems}}
names = list(systems)
for r in range(repeats):
    for n in names[r % len(names):] + names[:r % len(names)]:
        ctx = contexts[n]
        ctx.clear_cache()
        t = time.perf_counter()
        made = sum(len(h.result().token_ids) for h in [ctx.add_request(p, params) for p in prompts])
        samples[n].append(made / (time.perf_counter() - t))
threads = {{n: [c.stats().n_threads, c.stats().num_thread_changes] for n, c in contexts.items()}}
for c in contexts.values():
    c.close()
print("RESULT" + json.dumps({{"samples": samples, "threads": threads}}))
"""


def in_kernel(code: str) -> dict[str, Any]:
    import nbclient
    from nbformat.v4 import new_code_cell, new_notebook

    notebook = new_notebook(cells=[new_code_cell(code)])
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=3600).execute()
    for output in notebook.cells[0].outputs:
        for line in str(output.get("text", "")).splitlines():
            if line.startswith("RESULT"):
                result: dict[str, Any] = json.loads(line[len("RESULT") :])
                return result
    raise RuntimeError(f"the kernel printed no result: {notebook.cells[0].outputs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, nargs="*", default=sorted({0, CORES - 1, CORES}))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    code = CELL.format(
        systems=SYSTEMS,
        prompts=short_prompts(args.requests),
        tokens=args.tokens,
        repeats=args.repeats,
    )
    loads: dict[str, Any] = {}
    for busy in args.busy:
        with busy_processes(busy, "loop"):
            result = in_kernel(code)
        medians = {n: statistics.median(s) for n, s in result["samples"].items()}
        log(f"busy={busy}: " + ", ".join(f"{n} {v:.1f} tok/s" for n, v in medians.items()))
        loads[f"busy_{busy}"] = {
            "load_average": load_average(),
            "median_tokens_per_s": medians,
            **result,
        }
    quiet = loads.get("busy_0", {}).get("median_tokens_per_s", {})
    one = loads.get(f"busy_{max(1, CORES - 1)}", {}).get("median_tokens_per_s", {})
    ratios = {
        "adaptive_busy1_over_one_thread_quiet": (
            one["llamax_adaptive"] / quiet["llamax_one_thread"] if quiet and one else None
        ),
        "adaptive_quiet_over_fixed_quiet": (
            quiet["llamax_adaptive"] / quiet["llamax_fixed"] if quiet else None
        ),
        "adaptive_busy1_over_fixed_busy1": (
            one["llamax_adaptive"] / one["llamax_fixed"] if one else None
        ),
    }
    report = {
        "benchmark": "contention_kernel",
        "config": vars(args) | {"json_out": str(args.json_out), "cores": CORES},
        "loads": loads,
        "ratios": ratios,
    }
    emit_report(report, sys.stdout, args.json_out)


if __name__ == "__main__":
    main()
