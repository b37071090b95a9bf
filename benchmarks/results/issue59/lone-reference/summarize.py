"""Every sample of the alternated ``latency.py`` runs in this folder: TTFT over the run's
median lone prefill, worst and p95 gap, and the unstretched steps before the first
stretched one (steps predicted over 0.35 s); then medians by code and calibration.

    python summarize.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def samples() -> list[tuple[str, str, int, float, float, float, int]]:
    rows = []
    for path in sorted(HERE.glob("*_*[0-9].json")):
        code, tag = path.stem.split("_", 1)
        llamax = json.loads(path.read_text())["systems"]["llamax"]
        lone = statistics.median(llamax["lone_samples_s"])
        trace = json.loads(path.with_name(path.stem + "_trace.json").read_text())
        starts = [i for i, r in enumerate(trace) if r.get("mark") == "long prompt submitted"]
        ends = [i for i, r in enumerate(trace) if r.get("mark") == "long prompt's first token"]
        for k, sample in enumerate(llamax["samples"]):
            steps = [
                r for r in trace[starts[k] + 1 : ends[k]] if "mark" not in r and r["tokens"] > 4
            ]
            first = next((i for i, r in enumerate(steps) if r["predicted"] > 0.35), len(steps))
            ratio = round(sample["ttft_s"] / lone, 3)
            rows.append((tag, code, k, ratio, sample["worst_gap_s"], sample["p95_gap_s"], first))
    return rows


def main() -> None:
    rows = samples()
    print("run code sample ttft/lone worst_gap p95_gap unstretched_first_steps")
    for row in sorted(rows):
        print(*row)
    for code in ("before", "after"):
        for group in ("epyc", "fresh", ""):
            chosen = [r for r in rows if r[1] == code and r[0].startswith(group)]
            ttft = [r[3] for r in chosen]
            gaps = [r[4] for r in chosen]
            print(
                f"{code} {group or 'all'}: {len(chosen)} samples, TTFT/lone median "
                f"{statistics.median(ttft):.3f} ({sum(t > 1.35 for t in ttft)} over 1.35), "
                f"worst gap median {statistics.median(gaps):.3f} s "
                f"({sum(g <= 0.5 for g in gaps)} at most 0.5 s)"
            )


if __name__ == "__main__":
    main()
