"""Summarize run.sh: W1 tokens a second and llamax's ratios to the raw loop and llama-server,
at N=1 and 16, per run (old 18ed89d, new main)."""

import json
from pathlib import Path


def main() -> None:
    for tag in ("1_old", "1_new", "2_new", "2_old"):
        path = Path(f"w1_{tag}.json")
        if not path.exists() or not path.stat().st_size:
            continue
        report = json.loads(path.read_text())
        tps, ratios = report["median_tokens_per_s"], report["ratios"]
        for n in ("1", "16"):
            print(
                f"{tag} N={n}: llamax {tps['llamax'][n]:.1f} tok/s, raw {tps['raw'][n]:.1f}, "
                f"llama-server {tps['llama_server'][n]:.1f}; llamax/raw "
                f"{ratios['llamax_over_raw'][n]:.3f}, llamax/llama-server "
                f"{ratios['llamax_over_llama_server'][n]:.3f}"
            )


if __name__ == "__main__":
    main()
