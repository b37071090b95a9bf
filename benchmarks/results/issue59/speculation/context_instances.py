"""Issue 59: two llama.cpp contexts in one process, step by step.

Code N=4 (``speculative.py``'s prompts, 200 greedy tokens each) on SmolLM2, 2 threads, on
two contexts built one after the other, ``--spec``: the first with ``PromptLookup()``, else
both plain; 4 runs each, alternated. Every ``llama_decode`` is timed by its token count;
prints, per context, ``{tokens: (steps, median ms, total s)}``.

    .venv/bin/python benchmarks/results/issue59/speculation/context_instances.py [--spec]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

from _common import model_path
from llama_cpp import llama_cpp as C
from speculative import code_prompt

import llamax

LOG: list[tuple[int, float]] = []
_ORIGINAL = C.llama_decode


def _timed(ctx: Any, batch: Any) -> int:
    started = time.perf_counter()
    status = _ORIGINAL(ctx, batch)
    LOG.append((int(batch.n_tokens), time.perf_counter() - started))
    return int(status)


def main() -> None:
    spec = "--spec" in sys.argv[1:]
    C.llama_decode = _timed
    for module in list(sys.modules.values()):
        if getattr(module, "llama_decode", None) is _ORIGINAL:
            module.llama_decode = _timed
    model = model_path(None)
    names = ("speculative (built first)", "plain") if spec else ("plain A (first)", "plain B")
    contexts = [
        llamax.Context(
            model,
            n_ctx=8192,
            n_seq_max=4,
            n_threads=2,
            autostart=False,
            speculative=llamax.PromptLookup() if spec and i == 0 else None,
        )
        for i in range(2)
    ]
    steps: list[dict[int, list[float]]] = [{}, {}]
    params = llamax.SamplingParams(max_tokens=200, temperature=0.0)
    for repeat in range(4):
        for i in (0, 1) if repeat % 2 == 0 else (1, 0):
            ctx = contexts[i]
            ctx.clear_cache()
            LOG.clear()
            handles = [ctx.add_request(code_prompt(k), params) for k in range(4)]
            while ctx.has_work():
                ctx.process()
            for handle in handles:
                handle.result()
            for tokens, seconds in LOG:
                steps[i].setdefault(tokens, []).append(seconds)
    for name, seen in zip(names, steps, strict=True):
        table = {
            n: (len(v), round(statistics.median(v) * 1e3, 2), round(sum(v), 2))
            for n, v in sorted(seen.items())
            if n in (1, 2, 3, 4, 16, 512)
        }
        print(f"{name}: {table}", flush=True)
    for ctx in contexts:
        ctx.close()


if __name__ == "__main__":
    main()
