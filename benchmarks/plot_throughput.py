"""Plot throughput against N from ``benchmarks/results/throughput.json``.

Draws tokens/s against the number of concurrent requests for llamax, the raw loop,
llama-cpp-python and (when the report has it) llama-server, and writes a PNG for the docs.

    .venv/bin/python benchmarks/plot_throughput.py [--json-in PATH] [--out PATH]

Needs matplotlib (``pip install '.[docs]'`` in a clone).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERIES = [  # (key in median_tokens_per_s, label, line style)
    ("raw", "raw llama_decode loop", "--"),
    ("llamax", "llamax", "-"),
    ("llama_server", "llama-server", "-."),
    ("llama_cpp_python", "llama-cpp-python (one at a time)", ":"),
]


def plot(report: dict[str, Any], out: Path) -> list[str]:
    """Draw the report's medians into ``out``; return the series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians: dict[str, dict[str, float]] = report["median_tokens_per_s"]
    config = report.get("config", {})
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    drawn = []
    for key, label, style in SERIES:
        series = medians.get(key) or medians.get(key.replace("_", "-"))
        if not series:
            continue
        points = sorted((int(n), rate) for n, rate in series.items() if rate is not None)
        ax.plot([n for n, _ in points], [r for _, r in points], style, marker="o", label=label)
        drawn.append(key)
    ax.set_xscale("log", base=2)
    ns = sorted({int(n) for key in drawn for n in medians.get(key, {})})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("generated tokens / s")
    model = Path(str(config.get("model", "model"))).name
    ax.set_title(
        f"{model}, {config.get('n_threads', '?')} threads, "
        f"{config.get('max_tokens', '?')} tokens per request"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return drawn


def main() -> None:
    """Read the JSON report and write the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-in", type=Path, default=ROOT / "benchmarks/results/throughput.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/img/throughput.png")
    args = parser.parse_args()
    drawn = plot(json.loads(args.json_in.read_text()), args.out)
    print(f"wrote {args.out} ({', '.join(drawn)})")


if __name__ == "__main__":
    main()
