"""The latency frontier of ggml's CPU kernels: worst gap against TTFT, with perfect steps.

A model, not a measurement: it asks what the best scheduler could do on this machine if
every step took exactly its predicted time. Four streams decode while a 3,414-token prompt
prefills; each step takes the largest chunk whose step fits ``G`` seconds, and the prompt's
time under load is compared with its lone prefill in 512-token chunks. A step costs

    fixed + rows x per_row + tiles(rows) x kv_tiles x per_tile_pair

where ``tiles`` counts ggml's padded 64-row query tiles (``llamax.engine.step_budget``'s
``tile_waste_table``, 9 heads, 2 threads) and ``kv_tiles`` the 64-cell KV tiles the rows
attend. The coefficients are fitted (least squares, relative errors) to the 283 measured
steps of ``latency_fair_at_end_trace.json`` and ``latency_final_trace.json`` (AMD EPYC, 2
threads; lone prefills in 512-token chunks, and chunks beside 4 decode rows): 2.6 ms a row,
0.33 ms a tile pair (all 30 layers), 0.16 ms a row and KV tile when computed row by row
(under 64 rows), 3 ms a step, and 150 cells of the streams' own. They price those steps
within 5% (one standard deviation) and their sums within 1%. An earlier hand fit (3 ms a
row, 0.3 ms a tile pair, 6 ms a step, 400 stream cells) priced loaded steps 11% and lone
ones 7.5% too high, so the frontier it drew was about 0.04 too pessimistic.

::

    .venv/bin/python benchmarks/latency_frontier.py
"""

from __future__ import annotations

import json
import math

from llamax.engine.step_budget import TILE_ROWS, tile_waste_table

PROMPT, DECODE_ROWS, STREAM_CELLS, N_HEAD, N_THREADS = 3414, 4, 150, 9, 2
FIXED_S, ROW_S, TILE_PAIR_S, ROW_PAIR_S = 0.003, 0.0026, 0.00033, 0.00016
WASTE = tile_waste_table(1024, N_HEAD, N_THREADS)


def tiles(rows: int) -> float:
    """Padded query tiles of a micro-batch of 64 rows or more."""
    return (WASTE[rows] + 1) * rows * N_HEAD / TILE_ROWS


def step_s(position: int, chunk: int) -> float:
    """A chunk at ``position`` beside the decode rows, in the unified cache."""
    rows = chunk + DECODE_ROWS
    kv_tiles = (position + chunk + STREAM_CELLS) / 64
    if rows < TILE_ROWS:  # row by row
        return FIXED_S + rows * ROW_S + rows * kv_tiles * ROW_PAIR_S
    return FIXED_S + rows * ROW_S + tiles(rows) * kv_tiles * TILE_PAIR_S


def lone_s(chunk: int = 512) -> float:
    """The prompt alone, in ``chunk``-token steps (causal: each query tile sees the cells up
    to its own end, so a chunk's tiles see ``position + 64``, ``+ 128``, ... cells)."""
    total, position = 0.0, 0
    while position < PROMPT:
        n = min(chunk, PROMPT - position)
        q_tiles = math.ceil(n / TILE_ROWS)
        kv_tiles = sum((position + TILE_ROWS * (j + 1)) / 64 for j in range(q_tiles)) / q_tiles
        total += FIXED_S + n * ROW_S + tiles(n) * kv_tiles * TILE_PAIR_S
        position += n
    return total


def under_load(bound_s: float) -> tuple[float, int]:
    """Prefill time and steps when every step takes the largest chunk that fits."""
    total, position, steps = 0.0, 0, 0
    while position < PROMPT:
        fits = [
            c for c in range(1, min(512, PROMPT - position) + 1) if step_s(position, c) <= bound_s
        ]
        chunk = fits[-1] if fits else 1
        total += step_s(position, chunk)
        position, steps = position + chunk, steps + 1
    return total, steps


def main() -> None:
    lone = lone_s()
    rows = []
    for bound in (0.45, 0.5, 0.55, 0.6, 0.65, 0.7):
        loaded, steps = under_load(bound)
        rows.append(
            {"worst_step_s": bound, "ttft_over_lone": round(loaded / lone, 3), "steps": steps}
        )
    print(json.dumps({"lone_prefill_s": round(lone, 2), "frontier": rows}, indent=1))


if __name__ == "__main__":
    main()
