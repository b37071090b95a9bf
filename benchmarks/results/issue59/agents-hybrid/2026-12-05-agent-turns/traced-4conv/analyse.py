"""Summarise the traced 4-conversation runs (old and new code, llamax alone).

``trace4_{old,new}.json`` come from ``../../2026-12-04-intervals/traced_decodes.py`` (every
decode's start, end and items; every submission), ``trace4_*_run.json`` from
``agent_turns.py`` itself. Prints, for each: the decodes, the time between them (the
engine's own work, admission included), and the time from each submission to the decode
that computed its prompt's last token (turns 4+ picked by prompt size, >= 1,300 tokens).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def prompt_done(decodes: list[dict[str, Any]], submit: dict[str, Any]) -> float | None:
    for decode in decodes:
        if decode["t0"] >= submit["t"] and any(
            start + num == submit["n"] and rows >= 1 for _, start, num, rows in decode["items"]
        ):
            return float(decode["t1"] - submit["t"])
    return None


def main() -> None:
    for tag in ("old", "new"):
        run = json.loads((HERE / f"trace4_{tag}_run.json").read_text())
        llamax = run["results"]["hybrid_350m"]["llamax"]
        trace = json.loads((HERE / f"trace4_{tag}.json").read_text())
        first = trace["decodes"][0]["b"]  # the prefix-cache context, not the no-cache one
        decodes = [d for d in trace["decodes"] if d["b"] == first]
        submits = [s for s in trace["submits"] if s["t"] <= decodes[-1]["t1"]]
        between = sum(decodes[i]["t0"] - decodes[i - 1]["t1"] for i in range(1, len(decodes)))
        busy = sum(d["t1"] - d["t0"] for d in decodes)
        late = [t for s in submits if s["n"] >= 1300 and (t := prompt_done(decodes, s))]
        print(
            f"{tag}: wall {llamax['wall_s']} s, agent_turns' TTFT median turns 4+ "
            f"{llamax['ttft_median_from_turn_4_s']} s; {len(decodes)} decodes, {busy:.2f} s in "
            f"them, {between:.2f} s between them; submission to prompt computed, turns 4+ "
            f"({len(late)}): median {statistics.median(late):.3f} s, "
            f"mean {statistics.mean(late):.3f} s"
        )


if __name__ == "__main__":
    main()
