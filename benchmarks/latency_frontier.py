"""The latency frontier on this machine: worst gap against TTFT, with perfect steps.

A model, not a measurement: it asks what the best scheduler could do here if every step
took exactly its predicted time. Four streams decode while a 3,414-token prompt prefills in
the unified cache (as in ``latency.py``); for each bound ``G`` on a step, every step takes
the prompt chunk that makes progress fastest among those whose step fits ``G``, and the
prompt's time under load is compared with its lone prefill in 512-token chunks. A step is
priced as the engine prices it (``llamax.engine.timing.step_budget``: fixed + tokens + attended
cells, tiles padded as ggml pads them, + cells attended row by row under 64 rows) with
*this machine's* coefficients: the model's calibration (``Context.calibration``: a few
timed steps, attention over up to 2,048 cells of filler), measured here unless
``--coefficients`` gives them. So the frontier is drawn for the CPU the script runs on; a
target beyond it (say TTFT <= 1.35x at G = 0.6 s) is out of reach on that CPU for any
scheduler, and ``latency.py``'s measured point can be compared with it.

Also reported, ``scheduler``: what the engine's own chunk policy (``ChunkBudget``, with
``max_step_ms=250``) does under the same prices, so its distance to the frontier shows.

::

    .venv/bin/python benchmarks/latency_frontier.py
    .venv/bin/python benchmarks/latency_frontier.py --coefficients 0.004 0.003 1e-6 2e-6
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import _common as bench

import llamax
from llamax.engine.timing.chunk_budget import ChunkBudget
from llamax.engine.timing.step_budget import (
    StepCostModel,
    StepFeatures,
    micro_batch,
    step_with_chunk,
    tile_waste_table,
)

PROMPT, DECODE_ROWS, N_BATCH, N_THREADS = 3414, 4, 512, bench.N_THREADS
BOUNDS = (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8)


def lone_s(cost: StepCostModel) -> float:
    """The prompt alone, in 512-token chunks (unified: each chunk attends to the span)."""
    total, position = 0.0, 0
    while position < PROMPT:
        n = min(N_BATCH, PROMPT - position)
        total += cost.predict(
            step_with_chunk(StepFeatures(), n, position, unified=True, waste=cost.waste)
        )
        position += n
    return total


def decode_rows(cost: StepCostModel, position: int) -> StepFeatures:
    """The streams' decode rows beside a prompt at ``position`` (their own ~100 cells)."""
    return micro_batch(DECODE_ROWS, DECODE_ROWS * (position + 400), waste=cost.waste)


def under_load(cost: StepCostModel, bound_s: float) -> tuple[float, int, float]:
    """Prefill seconds, steps and the worst step when every step takes the chunk that
    advances fastest within ``bound_s`` (the cheapest step when none fits)."""
    total, position, steps, worst = 0.0, 0, 0, 0.0
    while position < PROMPT:
        fixed = decode_rows(cost, position)
        sizes = range(1, min(N_BATCH, PROMPT - position) + 1)
        priced = [
            (cost.predict(step_with_chunk(fixed, c, position, unified=True, waste=cost.waste)), c)
            for c in sizes
        ]
        fits = [(c / s, c, s) for s, c in priced if s <= bound_s]
        _, chunk, seconds = max(fits) if fits else max((c / s, c, s) for s, c in priced)
        total, position, steps = total + seconds, position + chunk, steps + 1
        worst = max(worst, seconds)
    return total, steps, worst


def scheduler(cost: StepCostModel, max_step_ms: float) -> tuple[float, int, float]:
    """The engine's chunk policy under the same prices: prefill seconds, steps, worst step."""
    budget = ChunkBudget(N_BATCH, max_step_ms, waste=cost.waste)
    budget.cost = cost
    total, position, steps, worst = 0.0, 0, 0, 0.0
    while position < PROMPT:
        computed = [position // 8 + 100] * DECODE_ROWS
        fixed = budget.start_step(computed, unified=True)
        chunk, features = budget.chunk(
            fixed,
            min(N_BATCH - DECODE_ROWS, PROMPT - position),
            num_pending=PROMPT - position,
            num_computed=position,
            num_cells_used=position + 400,
            num_decode=DECODE_ROWS,
            unified=True,
        )
        assert features is not None
        seconds = cost.predict(features)
        total, position, steps = total + seconds, position + chunk, steps + 1
        worst = max(worst, seconds)
    return total, steps, worst


def coefficients(args: argparse.Namespace) -> tuple[tuple[float, float, float, float], str]:
    if args.coefficients:
        a, b, c, d = args.coefficients
        return (a, b, c, d), "--coefficients"
    bench.log("calibrating the model on this machine ...")
    started = time.perf_counter()
    with llamax.Context(
        bench.model_path(args.model),
        n_ctx=8192,
        n_seq_max=1,
        n_threads=N_THREADS,
        calibrate=True,
    ) as ctx:
        calibration = ctx.calibration
    if calibration is None:
        sys.exit("this model could not be calibrated")
    bench.log(f"  {calibration} ({time.perf_counter() - started:.2f} s with the load)")
    return calibration.coefficients, f"calibration (depth {calibration.depth})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_common_args(parser)
    parser.add_argument(
        "--coefficients",
        type=float,
        nargs=4,
        metavar=("FIXED", "TOKEN", "CELL", "ROW_CELL"),
        help="seconds, instead of calibrating",
    )
    parser.add_argument(
        "--n-head", type=int, default=9, help="the model's attention heads (tile waste; SmolLM2: 9)"
    )
    args = parser.parse_args()
    load = bench.load_average()
    with bench.stdout_to_stderr() as stdout:
        theta, source = coefficients(args)
        cost = StepCostModel(waste=tile_waste_table(N_BATCH, args.n_head, N_THREADS))
        cost.start_from(theta)
        lone = lone_s(cost)
        rows = []
        for bound in BOUNDS:
            loaded, steps, worst = under_load(cost, bound)
            rows.append(
                {
                    "bound_s": bound,
                    "worst_step_s": round(worst, 3),
                    "ttft_over_lone": round(loaded / lone, 3),
                    "steps": steps,
                }
            )
        engine_s, engine_steps, engine_worst = scheduler(cost, 250.0)
        report = {
            "config": bench.base_config(args, load, coefficients_from=source),
            "coefficients_s": {
                "fixed": theta[0],
                "token": theta[1],
                "cell": theta[2],
                "row_cell": theta[3],
            },
            "lone_prefill_s": round(lone, 2),
            "frontier": rows,
            "scheduler": {
                "max_step_ms": 250,
                "worst_step_s": round(engine_worst, 3),
                "ttft_over_lone": round(engine_s / lone, 3),
                "steps": engine_steps,
            },
            "targets": {
                "worst_gap_s": 0.6,
                "ttft_over_lone": 1.35,
                "reachable": any(
                    r["worst_step_s"] <= 0.6 and r["ttft_over_lone"] <= 1.35 for r in rows
                ),
            },
        }
        if not math.isfinite(lone):
            sys.exit("no prediction")
        bench.emit_report(report, stdout, args.json_out)


if __name__ == "__main__":
    main()
