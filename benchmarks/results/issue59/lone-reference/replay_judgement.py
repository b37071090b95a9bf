"""Replay a ``latency.py --trace`` file into llamax's step-cost fit and chunk budget.

The trace holds every measured step with the fit's prediction before it. The calibration
the context started from is recovered by matching the first steps' predictions (Gauss-Newton
over the four coefficients), then every step is observed in order, and at each step of the
loaded long prompt the budget is asked what chunk it would take and whether it would judge
the chunk unfair (stretch). Prints, per sample, the chunk taken in the trace, the replayed
chunk, the judgement and the fit's token and attended-cell coefficients.

    python replay_judgement.py TRACE.json [--sample 0]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from llamax.engine.timing.chunk_budget import ChunkBudget
from llamax.engine.timing.step_budget import StepCostModel, StepFeatures, tile_waste_table

WASTE = tile_waste_table(512, 9, 2)  # SmolLM2: 9 heads, 2 threads
STREAMS = 4


def features(row: dict[str, Any]) -> StepFeatures:
    return StepFeatures(row["tokens"], row["attention"], row["row_attention"], row["tile_waste"])


def predictions(theta: np.ndarray, steps: list[dict[str, Any]]) -> np.ndarray:
    model = StepCostModel(waste=WASTE)
    model.start_from((float(theta[0]), float(theta[1]), float(theta[2]), float(theta[3])))
    out = []
    for row in steps:
        out.append(model.predict(features(row)))
        model.observe(features(row), row["measured"])
    return np.array(out)


def calibration(steps: list[dict[str, Any]], n: int = 27) -> np.ndarray:
    """The start coefficients whose replay reproduces the first ``n`` predictions."""
    target = np.array([row["predicted"] for row in steps[:n]])
    scale = np.maximum(target, 1e-3)
    theta = np.array([0.004, 0.0035, 1.5e-6, 2e-6])
    for _ in range(60):
        residual = (predictions(theta, steps[:n]) - target) / scale
        jacobian = np.zeros((n, 4))
        for j in range(4):
            moved = theta.copy()
            h = max(abs(theta[j]) * 1e-4, 1e-12)
            moved[j] += h
            jacobian[:, j] = ((predictions(moved, steps[:n]) - target) / scale - residual) / h
        step, *_ = np.linalg.lstsq(jacobian, -residual, rcond=None)
        theta = np.maximum(theta + step, 0.0)
        if np.abs(step).max() < 1e-12:
            break
    return theta


def replay(rows: list[dict[str, Any]], sample: int) -> None:
    steps = [row for row in rows if "mark" not in row]
    theta = calibration(steps)
    print("calibration (fixed, token, cell, row-by-row cell):", theta)
    budget = ChunkBudget(512, 250.0, waste=WASTE)
    budget.cost.start_from((float(theta[0]), float(theta[1]), float(theta[2]), float(theta[3])))
    starts = [i for i, row in enumerate(rows) if row.get("mark") == "long prompt submitted"]
    start, computed, decode_cells = starts[sample], 0, 0
    for index, row in enumerate(rows):
        if "mark" in row:
            if row["mark"] == "long prompt's first token" and index > start:
                break
            continue
        if index > start and row["tokens"] > STREAMS:
            chunk = row["tokens"] - STREAMS
            own = decode_cells + STREAMS  # each stream's row attends one cell more
            cells_used = (row["attention"] - own) // chunk - row["tokens"]
            fixed = budget.start_step([(own - STREAMS) // STREAMS] * STREAMS, unified=True)
            assert fixed is not None
            pending = 3414 - computed
            limit = min(pending, 512 - STREAMS)
            take, _ = budget.chunk(
                fixed,
                limit,
                num_pending=pending,
                num_computed=computed,
                num_cells_used=cells_used,
                num_decode=STREAMS,
                unified=True,
            )
            _, token, cell, _ = budget.cost.coefficients
            print(f"step {index}: trace {chunk}, replayed {take}, token {token * 1e3:.2f} ms, "
                  f"cell {cell:.2e} s")  # fmt: skip
            computed += chunk
            decode_cells = own
        elif row["tokens"] == STREAMS:
            decode_cells = row["attention"]
        budget.cost.observe(features(row), row["measured"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--sample", type=int, default=0)
    args = parser.parse_args()
    with open(args.trace) as f:
        replay(json.load(f), args.sample)


if __name__ == "__main__":
    main()
