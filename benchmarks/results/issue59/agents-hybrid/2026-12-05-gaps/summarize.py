"""Summarize run.sh: wall, TTFT and the gaps between streamed tokens, llamax (default budget
and max_step_ms=None) beside llama-server."""

import json
from pathlib import Path


def main() -> None:
    for tag in ("default", "none"):
        result = json.loads(Path(f"agent_{tag}.json").read_text())["results"]["hybrid_350m"]
        for system in ("llamax", "llama_server"):
            row = result[system]
            name = f"llamax ({tag})" if system == "llamax" else "llama-server"
            print(
                f"{tag} run, {name}: wall {row['wall_s']:.2f} s, TTFT turns 4+ "
                f"{row['ttft_median_from_turn_4_s']:.3f} s, gap p95 {row['gap_p95_s']:.3f} s, "
                f"worst {row['gap_worst_s']:.3f} s"
            )


if __name__ == "__main__":
    main()
