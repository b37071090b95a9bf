"""Issue 59: what speculation costs outside ``llama_decode`` at 4 streams that barely draft.

Code N=4 (``speculative.py``'s prompts, 200 greedy tokens each) on SmolLM2, 2 threads, with
``speculative=PromptLookup()`` and without, ``process()`` on this thread, alternated, 3 runs
each; every ``llama_decode`` timed. Prints wall, decode and outside-decode seconds, steps,
draft tokens verified and accepted.

    .venv/bin/python benchmarks/results/issue59/speculation/engine_overhead_n4.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

from _common import model_path
from llama_cpp import llama_cpp as C
from speculative import code_prompt

import llamax

DECODE_S = [0.0]
_ORIGINAL = C.llama_decode


def _timed(ctx: Any, batch: Any) -> int:
    started = time.perf_counter()
    status = _ORIGINAL(ctx, batch)
    DECODE_S[0] += time.perf_counter() - started
    return int(status)


def main() -> None:
    C.llama_decode = _timed
    for module in list(sys.modules.values()):
        if getattr(module, "llama_decode", None) is _ORIGINAL:
            module.llama_decode = _timed
    model = model_path(None)
    contexts = {
        spec: llamax.Context(
            model,
            n_ctx=8192,
            n_seq_max=4,
            n_threads=2,
            autostart=False,
            speculative=llamax.PromptLookup() if spec else None,
        )
        for spec in (True, False)
    }
    params = llamax.SamplingParams(max_tokens=200, temperature=0.0)
    for repeat in range(3):
        for spec in (True, False) if repeat % 2 == 0 else (False, True):
            ctx = contexts[spec]
            ctx.clear_cache()
            before = ctx.stats().speculation
            DECODE_S[0] = 0.0
            started = time.perf_counter()
            handles = [ctx.add_request(code_prompt(i), params) for i in range(4)]
            steps = 0
            while ctx.has_work():
                ctx.process()
                steps += 1
            for handle in handles:
                handle.result()
            wall = time.perf_counter() - started
            after = ctx.stats().speculation
            drafted = after.num_drafted_tokens - before.num_drafted_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            print(f"speculative={spec}: wall {wall:.2f} s, decode {DECODE_S[0]:.2f} s, "
                  f"outside {wall - DECODE_S[0]:.2f} s, {steps} steps, "
                  f"drafted {drafted}, accepted {accepted}", flush=True)  # fmt: skip
    for ctx in contexts.values():
        ctx.close()


if __name__ == "__main__":
    main()
