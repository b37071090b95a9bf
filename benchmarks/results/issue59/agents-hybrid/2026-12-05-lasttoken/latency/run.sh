#!/bin/bash
# Part 4's latency workload (SmolLM2, a 3,400-token prompt among 4 streams: worst gap, TTFT
# over its lone prefill) with the code before (18ed89d) and after (e40599f), ABBA: its
# streams stream, so the change should not touch it. `run.sh more`: a second round, BAAB.
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-lasttoken/latency
cd /tmp
run() {  # tag tree
  echo "$1 $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/run.log
  PYTHONPATH=$2 /work/main/.venv/bin/python $2/benchmarks/latency.py > $OUT/latency_$1.json 2>> $OUT/latency_$1.log
  echo "rc $? $(date +%T)" >> $OUT/run.log
}
if [ "$1" = more ]; then
  run new_3 /work/wt/new; run old_3 /work/wt/old; run old_4 /work/wt/old; run new_4 /work/wt/new
else
  run old_1 /work/wt/old; run new_1 /work/wt/new; run new_2 /work/wt/new; run old_2 /work/wt/old
fi
echo "done $(date +%T)" >> $OUT/run.log
