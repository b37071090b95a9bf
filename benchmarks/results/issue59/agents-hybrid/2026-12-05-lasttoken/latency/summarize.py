"""Summarize run.sh: the latency workload's worst and p95 gaps and TTFT over the lone
prefill, old and new code."""

import json
from pathlib import Path


def main() -> None:
    for tag in ("old_1", "new_1", "new_2", "old_2", "new_3", "old_3", "old_4", "new_4"):
        path = Path(f"latency_{tag}.json")
        if not path.exists() or not path.stat().st_size:
            continue
        mine = json.loads(Path(f"latency_{tag}.json").read_text())["systems"]["llamax"]
        print(
            f"{tag}: worst gap {mine['worst_gap_s']:.3f} s, p95 gap {mine['p95_gap_s']:.3f} s, "
            f"TTFT {mine['ttft_s']:.2f} s = {mine['ttft_over_lone']:.3f}x lone "
            f"({mine['lone_prefill_s']:.2f} s)"
        )


if __name__ == "__main__":
    main()
