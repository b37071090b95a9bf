"""latency.py with ``MAX_STRETCH`` patched from ``$STRETCH`` (the first sitting of
gap-margin: 1.8 against main's 2.0); run from /tmp with the repository on sys.path."""

import os
import runpy
import sys

sys.path.insert(0, "/work/main/benchmarks")
import llamax.engine.timing.chunk_budget as cb

if stretch := os.environ.get("STRETCH"):
    cb.MAX_STRETCH = float(stretch)
sys.argv = ["latency.py", *sys.argv[1:]]
runpy.run_path("/work/main/benchmarks/latency.py", run_name="__main__")
