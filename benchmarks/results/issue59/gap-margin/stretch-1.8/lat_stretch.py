import os, sys, runpy
sys.path.insert(0, "/work/main/benchmarks")
import llamax.engine.timing.chunk_budget as cb
s = os.environ.get("STRETCH")
if s:
    cb.MAX_STRETCH = float(s)
sys.argv = ["latency.py"] + sys.argv[1:]
runpy.run_path("/work/main/benchmarks/latency.py", run_name="__main__")
