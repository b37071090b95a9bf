"""Run ``benchmarks/agent_turns.py`` with a hybrid prompt's interval checkpoints switched off.

``llamax.engine.kv.checkpoints.interval_for`` is patched to return 10**9, so a prompt's
chunks end only at its last token but one (and at branch and head points), not every 256
tokens: what an agent's turn costs when llamax cuts only where the next turn will reuse.
The arguments go to ``agent_turns.py`` unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # benchmarks/

import agent_turns

import llamax.engine.kv.checkpoints as checkpoints


def main() -> None:
    checkpoints.interval_for = lambda num_prompt: 10**9
    agent_turns.main()


if __name__ == "__main__":
    main()
