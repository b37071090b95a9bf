"""Summarize ab_llamax_only.sh's runs: llamax's wall and TTFT, old against new, by round."""

import json
import statistics
from pathlib import Path


def main() -> None:
    walls: dict[str, list[float]] = {"old": [], "new": []}
    ratios = []
    for round_ in range(1, 9):
        row = {}
        for tag in ("old", "new"):
            path = Path(f"agent_{round_}_{tag}.json")
            if not path.exists():
                continue
            result = json.loads(path.read_text())["results"]["hybrid_350m"]
            mine, nocache = result["llamax"], result["llamax_nocache"]
            row[tag] = mine["wall_s"]
            walls[tag].append(mine["wall_s"])
            print(
                f"round {round_} {tag}: wall {mine['wall_s']:.2f} s, TTFT turns 4+ "
                f"{mine['ttft_median_from_turn_4_s']:.3f} s, computed "
                f"{mine['computed_tokens_total']}; no-cache run wall {nocache['wall_s']:.2f} s"
            )
        if len(row) == 2:
            ratios.append(row["new"] / row["old"])
            print(f"  new / old {ratios[-1]:.3f}")
    for tag, values in walls.items():
        if values:
            print(f"{tag}: median wall {statistics.median(values):.2f} s of {len(values)}")
    if ratios:
        print(
            f"new / old by round: median {statistics.median(ratios):.3f}, "
            f"{sum(r < 1 for r in ratios)} of {len(ratios)} rounds favour new"
        )


if __name__ == "__main__":
    main()
