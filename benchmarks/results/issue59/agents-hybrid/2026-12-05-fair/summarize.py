"""Summarize ab_fair.sh: the fair-chunk slowdown 1.25 against 1.10, by round."""

import json
from pathlib import Path


def main() -> None:
    for round_ in range(1, 6):
        for fair in ("1.25", "1.10"):
            path = Path(f"agent_{round_}_{fair}.json")
            if path.exists():
                mine = json.loads(path.read_text())["results"]["hybrid_350m"]["llamax"]
                print(
                    f"round {round_} fair {fair} agent: wall {mine['wall_s']:.2f} s, TTFT turns "
                    f"4+ {mine['ttft_median_from_turn_4_s']:.3f} s, computed "
                    f"{mine['computed_tokens_total']}"
                )
        for fair in ("1.25", "1.10"):
            path = Path(f"latency_{round_}_{fair}.json")
            if path.exists() and path.stat().st_size:
                mine = json.loads(path.read_text())["systems"]["llamax"]
                print(
                    f"round {round_} fair {fair} latency: worst gap {mine['worst_gap_s']:.3f} s, "
                    f"p95 gap {mine['p95_gap_s']:.3f} s, TTFT {mine['ttft_s']:.2f} s = "
                    f"{mine['ttft_over_lone']:.3f}x lone ({mine['lone_prefill_s']:.2f} s)"
                )


if __name__ == "__main__":
    main()
