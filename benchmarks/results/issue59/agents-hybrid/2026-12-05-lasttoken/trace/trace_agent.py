"""Time every ``llama_decode`` of the 4-conversation hybrid agent run (llamax alone).

Writes ``{"decodes": [[t, seconds, [[seq_id, start_pos, tokens], ...]], ...], "tokens":
[[conversation, submitted_at, [token times...]], ...]}`` (seconds from the first decode).
``steps_old.json`` and ``steps_none.json`` were written by an earlier form of this script
that recorded the decodes only (a bare list).

    PYTHONPATH=<tree> python trace_agent.py --model hybrid_350m.gguf --out steps.json

(the model: ``make_memory_model.write_memory_model(path, kind="hybrid_350m", ...)``, as
``agent_turns.py`` writes it)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))  # benchmarks/

import agent_turns

from llamax.backend.llama_cpp import LlamaCppBackend

decodes: list[Any] = []
replies: list[Any] = []
origin: list[float] = []
_decode = LlamaCppBackend.decode
_submit = agent_turns.llamax_submit


def timed_decode(self: LlamaCppBackend, items: Any) -> int:
    started = time.perf_counter()
    if not origin:
        origin.append(started)
    try:
        return _decode(self, items)
    finally:
        rows = [(i.seq_id, i.start_pos, len(i.token_ids)) for i in items]
        seconds = time.perf_counter() - started
        decodes.append((round(started - origin[0], 4), round(seconds, 4), rows))


def timed_submit(ctx: Any, max_tokens: int) -> Any:
    inner = _submit(ctx, max_tokens)

    def submit(c: int, prompt: list[int]) -> Any:
        start = time.perf_counter()
        out = inner(c, prompt)
        zero = origin[0] if origin else start
        at = start + out[2] - zero
        times = [round(at, 3)]
        for gap in out[3]:
            at += gap
            times.append(round(at, 3))
        replies.append((c, round(start - zero, 3), times))
        return out

    return submit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/hybrid.gguf"))
    parser.add_argument("--max-step-ms", type=float, help="0: None (default: llamax's own)")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    LlamaCppBackend.decode = timed_decode  # type: ignore[method-assign]
    agent_turns.llamax_submit = timed_submit
    args = argparse.Namespace(
        n_ctx=16384,
        conversations=4,
        turns=a.turns,
        turn_tokens=200,
        max_tokens=24,
        kv_layout="auto",
        max_step_ms=a.max_step_ms,
    )
    result = agent_turns.run_llamax(a.model, args, cache=True)
    keys = ("wall_s", "gap_p95_s", "gap_worst_s", "ttft_median_from_turn_4_s")
    print(json.dumps({k: result[k] for k in keys}))
    a.out.write_text(json.dumps({"decodes": decodes, "tokens": replies}))


if __name__ == "__main__":
    main()
