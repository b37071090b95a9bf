"""Run ``benchmarks/agent_turns.py`` recording every llamax decode and submission.

Each ``LlamaCppBackend.decode``: the backend's id, start and end (``perf_counter``), and its
items as ``(seq_id, start_pos, tokens, output rows)``; each submitted request: when, its id
and prompt tokens. Written to ``--trace PATH`` as JSON; the other arguments go to
``agent_turns.py`` unchanged.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/

import agent_turns

import llamax.backend.llama_cpp as llama_cpp_backend
import llamax.engine.loop as loop_module

DECODES: list[dict[str, Any]] = []
SUBMITS: list[dict[str, Any]] = []


def record() -> None:
    decode = llama_cpp_backend.LlamaCppBackend.decode

    def traced(self: Any, items: Sequence[Any]) -> int:
        start = time.perf_counter()
        status = decode(self, items)
        DECODES.append({
            "b": id(self), "t0": start, "t1": time.perf_counter(),
            "items": [(i.seq_id, i.start_pos, len(i.token_ids), len(i.rows)) for i in items],
        })  # fmt: skip
        return status

    llama_cpp_backend.LlamaCppBackend.decode = traced  # type: ignore[method-assign]
    for cls in vars(loop_module).values():
        if isinstance(cls, type) and hasattr(cls, "submit") and hasattr(cls, "_publish_snapshot"):
            submit = cls.submit

            def submitted(self: Any, request: Any, _submit: Any = submit) -> None:
                first = request.sequences[0].token_ids if request.sequences else ()
                SUBMITS.append({"t": time.perf_counter(), "id": request.request_id,
                                "n": len(first)})  # fmt: skip
                _submit(self, request)

            cls.submit = submitted


def main() -> None:
    argv = sys.argv[1:]
    at = argv.index("--trace")
    path = Path(argv[at + 1])
    del argv[at : at + 2]
    sys.argv = [sys.argv[0], *argv]
    record()
    try:
        agent_turns.main()
    finally:
        path.write_text(json.dumps({"decodes": DECODES, "submits": SUBMITS}))


if __name__ == "__main__":
    main()
