"""Summarize run.sh: per run, llamax's wall, TTFT from turn 4, and the gaps between streamed
tokens (and llama-server's beside the new code); the new/old wall ratio of each pair."""

import json
import statistics
from pathlib import Path


def row(tag: str, system: str = "llamax") -> dict:
    return json.loads(Path(f"agent_{tag}.json").read_text())["results"]["hybrid_350m"][system]


def line(name: str, r: dict) -> str:
    return (
        f"{name}: wall {r['wall_s']:.2f} s, TTFT turns 4+ {r['ttft_median_from_turn_4_s']:.3f} s, "
        f"gap p95 {r['gap_p95_s']:.3f} s, worst {r['gap_worst_s']:.3f} s"
    )


def main() -> None:
    walls: dict[str, list[float]] = {"old": [], "new": []}
    for r in (1, 2):
        for half in ("a", "b"):
            old, new = row(f"old_{half}{r}"), row(f"new_{half}{r}")
            print(line(f"round {r}{half} old", old))
            print(line(f"round {r}{half} new", new))
            print(f"  new/old wall {new['wall_s'] / old['wall_s']:.3f}")
            walls["old"].append(old["wall_s"])
            walls["new"].append(new["wall_s"])
    for code, values in walls.items():
        print(f"{code}: median wall {statistics.median(values):.2f} s of {values}")
    for tag in ("new_server1", "new_server2", "new_server3", "new_server4"):
        path = Path(f"agent_{tag}.json")
        if not path.exists() or not path.stat().st_size:
            continue
        ours, theirs = row(tag), row(tag, "llama_server")
        print(line(f"{tag} llamax", ours))
        print(line(f"{tag} llama-server", theirs))
        print(
            f"  llamax/llama-server wall {ours['wall_s'] / theirs['wall_s']:.3f}, TTFT "
            f"{ours['ttft_median_from_turn_4_s'] / theirs['ttft_median_from_turn_4_s']:.3f}"
        )


if __name__ == "__main__":
    main()
