"""Run a benchmark script with the fair-chunk rule's slowdown changed (issue 59 part 5).

``StepCostModel.fair_chunk``'s keyword default (``FAIR_SLOWDOWN``, 1.25) is set to the
first argument, then the script named second runs with the rest of the arguments.

Usage::

    python with_fair.py 1.10 ../../../../agent_turns.py --memory-kind hybrid_350m ...
"""

import runpy
import sys
from pathlib import Path

from llamax.engine.timing import step_budget


def main() -> None:
    slowdown, script, *rest = sys.argv[1:]
    defaults = step_budget.StepCostModel.fair_chunk.__kwdefaults__
    assert defaults is not None and "slowdown" in defaults
    defaults["slowdown"] = float(slowdown)
    sys.argv = [script, *rest]
    sys.path.insert(0, str(Path(script).resolve().parent))  # the script's own imports
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
