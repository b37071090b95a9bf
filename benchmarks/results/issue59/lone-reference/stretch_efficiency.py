"""Seconds a prompt token costs beside running streams, stretched steps against unstretched
ones at the same depth, over ``latency.py --trace`` files (steps predicted over 0.35 s are
the stretched ones at ``max_step_ms=250``).

    python stretch_efficiency.py TRACE.json...
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

STREAMS, BUCKET = 4, 500


def main(paths: list[str]) -> None:
    buckets: defaultdict[tuple[int, bool], list[float]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        starts = [i for i, r in enumerate(rows) if r.get("mark") == "long prompt submitted"]
        ends = [i for i, r in enumerate(rows) if r.get("mark") == "long prompt's first token"]
        for start, end in zip(starts, ends, strict=False):
            done = 0
            for row in rows[start + 1 : end]:
                if "mark" in row or row["tokens"] <= STREAMS:
                    continue
                chunk = row["tokens"] - STREAMS
                buckets[(done // BUCKET, row["predicted"] > 0.35)].append(
                    row["measured"] / chunk * 1e3
                )
                done += chunk
    for depth in range(7):
        cells = []
        for stretched in (True, False):
            values = buckets.get((depth, stretched), [])
            median = f"{statistics.median(values):.2f}" if values else "-"
            cells.append(f"{median} ms ({len(values)} steps)")
        print(f"depth {depth * BUCKET}-{depth * BUCKET + BUCKET}: stretched {cells[0]}, "
              f"unstretched {cells[1]}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
