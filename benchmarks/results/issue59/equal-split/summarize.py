"""Summarize ab.sh's runs: agent_turns (wall and TTFT ratios to llama-server) and latency."""

import glob
import json
from pathlib import Path


def main() -> None:
    for path in sorted(glob.glob("agent_4conv_*.json")):
        result = json.loads(Path(path).read_text())["results"]["hybrid_350m"]
        mine, peer = result["llamax"], result["llama_server"]
        print(
            f"{path}: wall {mine['wall_s']:.2f} / {peer['wall_s']:.2f} = "
            f"{mine['wall_s'] / peer['wall_s']:.3f}; TTFT turns 4+ "
            f"{mine['ttft_median_from_turn_4_s']:.3f} / {peer['ttft_median_from_turn_4_s']:.3f}; "
            f"computed {mine['computed_tokens_total']} / {peer['computed_tokens_total']}"
        )
    for path in sorted(glob.glob("latency_[0-9]_*.json")):
        mine = json.loads(Path(path).read_text())["systems"]["llamax"]
        print(
            f"{path}: worst gap {mine['worst_gap_s']:.3f} s, p95 gap {mine['p95_gap_s']:.3f} s, "
            f"TTFT {mine['ttft_s']:.2f} s = {mine['ttft_over_lone']:.3f}x lone "
            f"({mine['lone_prefill_s']:.2f} s)"
        )


if __name__ == "__main__":
    main()
