"""Issue 62, N = 1 on the CPU: one stream's step, its ``llama_decode`` and the rest, with
``backend_sampling`` off and on, greedy and sampled (temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05). A manual context (``process()`` on this thread), one request of ``--tokens``
tokens (end of generation ignored) after a warm-up request; ``llama_decode`` is timed by
wrapping the backend's ``decode`` (on the CPU backend it returns when the step is computed;
with backend sampling the graph's sampling is inside it). ``rest`` is a step's wall time
less the decode: planning, sampling on the host, the sequences' update, publishing.
Prints one JSON line per (mode, backend_sampling).

    .venv/bin/python benchmarks/results/issue62/n1-overhead/n1_probe.py [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import llamax

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}


def run(mode: str, on: bool, tokens: int) -> dict[str, Any]:
    with llamax.Context(
        n_ctx=2048, n_seq_max=1, n_threads=2, adapt_threads=False, autostart=False,
        backend_sampling=on, calibrate=False,
    ) as ctx:  # fmt: skip
        backend = ctx._backend  # type: ignore[attr-defined]
        decode = backend.decode
        spent: list[float] = []

        def timed(items: Any) -> int:
            t = time.perf_counter()
            status: int = decode(items)
            spent.append(time.perf_counter() - t)
            return status

        backend.decode = timed
        params = llamax.SamplingParams(max_tokens=tokens, ignore_eos=True, seed=1, **MODES[mode])
        warm = ctx.add_request("Hello", llamax.SamplingParams(max_tokens=16, seed=2, **MODES[mode]))
        while not warm.done():
            ctx.process()
        handle = ctx.add_request("Once upon a time", params)
        walls: list[float] = []
        spent.clear()
        while not handle.done():
            t = time.perf_counter()
            ctx.process()
            walls.append(time.perf_counter() - t)
        assert len(handle.result(0).token_ids) == tokens
        steps = walls[2:]  # the prompt's step and the first decode step left out
        decodes = spent[2 : 2 + len(steps)]
        rest = [w - d for w, d in zip(steps, decodes, strict=True)]
        chains = backend._graph
        return {
            "mode": mode,
            "backend_sampling": on,
            "steps": len(steps),
            "step_ms": round(1e3 * statistics.median(steps), 3),
            "decode_ms": round(1e3 * statistics.median(decodes), 3),
            "rest_ms": round(1e3 * statistics.median(rest), 3),
            "graph_draws": None if chains is None else chains.num_draws,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]  # ABBA
        for mode in MODES:
            for on in order:
                print(json.dumps({"round": r, **run(mode, on, args.tokens)}), flush=True)


if __name__ == "__main__":
    main()
