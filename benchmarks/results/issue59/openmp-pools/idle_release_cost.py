"""Issue 59 probe: what giving the pool back at every idle spell costs a chatty caller.

The background loop now frees its OpenMP workers whenever it goes idle, and its next step
makes them again. The worst case for that is a caller that sends one short request at a
time: every request starts after an idle spell. Here: ``Context(SmolLM2, n_ctx=2048,
n_seq_max=2, n_threads=2)``, 40 requests one after another (the same 30-token prompt, so
the prefix cache serves all but its last token; 4 greedy tokens each), the seconds from
``add_request`` to the result, median of the last 30; fresh processes, the code before the
change (``--old PATH``) and after alternated, ``--repeats`` rounds. Prints JSON.

    .venv/bin/python benchmarks/results/issue59/openmp-pools/idle_release_cost.py \\
        --old /work/wt/old --repeats 3 > idle_release_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def child() -> None:
    import llamax

    params = llamax.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = "Answer in one word. What colour is the sky on a clear summer day at noon?"
    with llamax.Context(llamax.default_model_path(), n_ctx=2048, n_seq_max=2, n_threads=2) as ctx:
        times = []
        for _ in range(40):
            started = time.perf_counter()
            ctx.add_request(prompt, params).result(timeout=120)
            times.append(time.perf_counter() - started)
            time.sleep(0.02)  # the loop goes idle between requests
    print(json.dumps({"llamax": llamax.__file__,
                      "median_ms": round(1000 * statistics.median(times[10:]), 2)}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--old", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child()
        return
    assert args.old is not None
    codes = {"old": str(args.old), "new": str(ROOT)}
    samples: dict[str, list[float]] = {"old": [], "new": []}
    for repeat in range(args.repeats):
        for name in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
            env = {**os.environ, "PYTHONPATH": codes[name]}
            done = subprocess.run([sys.executable, __file__, "--child"], capture_output=True,
                                  text=True, env=env, cwd="/tmp", timeout=600)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-3000:])
            row = json.loads(done.stdout.strip().splitlines()[-1])
            samples[name].append(row["median_ms"])
            print(name, row, file=sys.stderr, flush=True)
    print(json.dumps({"median_ms": {k: statistics.median(v) for k, v in samples.items()},
                      "samples": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
