"""Issue 59: does a context that also serves plain requests draft less for speculative ones?

Code N=1 (``speculative.py``'s first code prompt, 400 greedy tokens) on SmolLM2, 2 threads,
on one ``Context(n_ctx=8192, n_seq_max=4)``: ``spec-only`` runs the speculative request 3
times, ``mixed`` alternates a plain and a speculative one 3 times. Prints (drafted, accepted,
tok/s) of each run and the context's draft-pricing averages (ms by step size, one row).

    .venv/bin/python benchmarks/results/issue59/speculation/one_context_probe.py spec-only
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/

from _common import model_path
from speculative import code_prompt

import llamax

PLAIN = llamax.SamplingParams(max_tokens=400, temperature=0.0)
SPEC = llamax.SamplingParams(max_tokens=400, temperature=0.0, speculative=llamax.PromptLookup())


def run(ctx: llamax.Context, params: llamax.SamplingParams) -> tuple[int, int, float]:
    ctx.clear_cache()
    before = ctx.stats().speculation
    started = time.perf_counter()
    ctx.add_request(code_prompt(0), params).result()
    seconds = time.perf_counter() - started
    after = ctx.stats().speculation
    return (
        after.num_drafted_tokens - before.num_drafted_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        round(400 / seconds, 1),
    )


def pricing(ctx: llamax.Context) -> dict[int, float]:
    cost = ctx._engine.scheduler.drafts.planner.decode_cost
    return {n: round(s * 1e3, 2) for n, s in sorted(cost._rows_mean.get(1, {}).items())}


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "spec-only"
    with llamax.Context(model_path(None), n_ctx=8192, n_seq_max=4, n_threads=2) as ctx:
        for _ in range(3):
            if mode == "mixed":
                print("plain", run(ctx, PLAIN), pricing(ctx), flush=True)
            print("spec", run(ctx, SPEC), pricing(ctx), flush=True)


if __name__ == "__main__":
    main()
