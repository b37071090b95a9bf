"""Run ``benchmarks/agent_turns.py`` with llamax's step trace and engine log kept.

Every step llamax measures (``latency.StepTrace``: tokens, cells attended, predicted and
measured seconds) and every INFO record of the ``llamax`` logger (layout moves among them)
go to ``--trace PATH`` as JSON; the other arguments go to ``agent_turns.py`` unchanged.

Usage, from the repository root::

    .venv/bin/python benchmarks/results/issue59/agents-hybrid/2026-12-04/traced_agent_turns.py \\
        --trace steps.json --memory-kind hybrid_350m --skip-default --nocache-turns 4 \\
        --llama-server PATH --json-out run.json
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/

import agent_turns
from latency import StepTrace


class Records(logging.Handler):
    """INFO and above from ``llamax``, with when they came."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.rows.append({"t": time.perf_counter(), "logger": record.name,
                          "message": record.getMessage()})  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    at = argv.index("--trace")
    path = Path(argv[at + 1])
    del argv[at : at + 2]
    trace = StepTrace()
    records = Records()
    logger = logging.getLogger("llamax")
    logger.addHandler(records)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    sys.argv = [sys.argv[0], *argv]
    try:
        agent_turns.main()
    finally:
        path.write_text(json.dumps({"steps": trace.rows, "log": records.rows}))


if __name__ == "__main__":
    main()
