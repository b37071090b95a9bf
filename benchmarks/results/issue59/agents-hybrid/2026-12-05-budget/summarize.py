"""Summarize ab_budget.sh: llamax's wall and TTFT with the default step budget and with
``max_step_ms=None``, by round, and the two runs beside llama-server."""

import json
import statistics
from pathlib import Path


def main() -> None:
    walls: dict[str, list[float]] = {"default": [], "none": []}
    for round_ in range(1, 5):
        for tag in ("default", "none"):
            path = Path(f"agent_{round_}_{tag}.json")
            if not path.exists():
                continue
            mine = json.loads(path.read_text())["results"]["hybrid_350m"]["llamax"]
            walls[tag].append(mine["wall_s"])
            print(
                f"round {round_} {tag}: wall {mine['wall_s']:.2f} s, TTFT turns 4+ "
                f"{mine['ttft_median_from_turn_4_s']:.3f} s, computed "
                f"{mine['computed_tokens_total']}"
            )
    for tag, values in walls.items():
        if values:
            print(f"{tag}: median wall {statistics.median(values):.2f} s of {len(values)}")
    for tag in ("none", "default"):
        path = Path(f"agent_peer_{tag}.json")
        if not path.exists():
            continue
        result = json.loads(path.read_text())["results"]["hybrid_350m"]
        mine, peer = result["llamax"], result["llama_server"]
        print(
            f"beside llama-server, {tag}: wall {mine['wall_s']:.2f} / {peer['wall_s']:.2f} = "
            f"{mine['wall_s'] / peer['wall_s']:.3f}; TTFT turns 4+ "
            f"{mine['ttft_median_from_turn_4_s']:.3f} / {peer['ttft_median_from_turn_4_s']:.3f}"
        )


if __name__ == "__main__":
    main()
