"""Issue 59 probe: what a calibrating construction's OpenMP pool cost the engine's steps.

Each sample is a fresh process (``--child``) that builds ``llamax.Context(SmolLM2,
n_ctx=4096, n_seq_max=16, n_threads=2)`` on its main thread and then runs, in the
background loop: one request of 128 greedy tokens (end-of-generation ignored) twice, the
decode's ms a token from the token iterator's times; and W1 at N=16 (16 short prompts x 64
greedy tokens at once), tokens/s. ``cold``: an empty calibration cache, so the constructor
calibrates (decodes) on the main thread; ``warm``: the cache the cold sample left. The
parent alternates the code (``--old PATH``: a checkout of the code before the change, put
first on ``PYTHONPATH``; the new is this repository) and the cache state, ``--repeats``
rounds, and prints JSON with every sample. Also counts the threads Python did not start
(OpenMP's workers) after construction and after the runs.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/openmp-pools/pool_probe.py \\
        --old /work/wt/old --repeats 3 > pool_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))


def native() -> int:
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def child() -> None:
    from _common import short_prompts

    import llamax

    out: dict[str, object] = {"llamax": llamax.__file__}
    started = time.perf_counter()
    ctx = llamax.Context(llamax.default_model_path(), n_ctx=4096, n_seq_max=16, n_threads=2)
    out["construct_s"] = round(time.perf_counter() - started, 3)
    out["calibrated"] = ctx.calibration is not None
    out["native_after_construct"] = native()
    params = llamax.SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    prompt = "Write a long story about a lighthouse keeper and the sea."
    decode = []
    for _ in range(2):
        handle = ctx.add_request(prompt, params)
        times = [time.perf_counter() for _ in handle]
        handle.result(timeout=300)
        decode.append(round(1000 * (times[-1] - times[0]) / (len(times) - 1), 2))
    out["n1_decode_ms_per_token"] = decode
    w1 = llamax.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = short_prompts(16)
    ctx.clear_cache()
    started = time.perf_counter()
    handles = [ctx.add_request(p, w1) for p in prompts]
    tokens = sum(len(h.result(timeout=300).choices[0].token_ids) for h in handles)
    out["w1_n16_tok_s"] = round(tokens / (time.perf_counter() - started), 1)
    out["native_after_runs"] = native()
    ctx.close()
    print(json.dumps(out))


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
    samples: dict[str, list[dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            names = ["old", "new"] if repeat % 2 == 0 else ["new", "old"]
            for name in names:
                cache = Path(folder) / f"{name}-{repeat}"
                for state in ("cold", "warm"):  # warm: the cache cold just wrote
                    env = {**os.environ, "PYTHONPATH": codes[name], "LLAMAX_CACHE_DIR": str(cache)}
                    done = subprocess.run(
                        [sys.executable, __file__, "--child"], capture_output=True, text=True,
                        env=env, cwd="/tmp", timeout=600,
                    )  # fmt: skip
                    if done.returncode != 0:
                        raise RuntimeError(done.stderr[-3000:])
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    samples.setdefault(f"{name}_{state}", []).append(row)
                    print(name, state, row, file=sys.stderr, flush=True)
    medians = {
        key: {
            "n1_decode_ms_per_token": statistics.median(
                v
                for r in rows
                for v in r["n1_decode_ms_per_token"]  # type: ignore[attr-defined]
            ),
            "w1_n16_tok_s": statistics.median(float(r["w1_n16_tok_s"]) for r in rows),  # type: ignore[arg-type]
        }
        for key, rows in samples.items()
    }
    from _common import cpu_description

    print(json.dumps({"cpu": cpu_description()["model"], "medians": medians,
                      "samples": samples}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
