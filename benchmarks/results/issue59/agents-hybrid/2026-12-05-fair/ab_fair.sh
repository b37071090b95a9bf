#!/bin/bash
# The fair-chunk rule's slowdown 1.25 (the default) against 1.10, llamax alone (1c29088):
# the 4-conversation hybrid agent run (wall, TTFT) and the latency workload (SmolLM2, a
# 3,400-token prompt among 4 streams: worst gap, TTFT over its lone prefill), ABBA.
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-fair
PY=/work/main/.venv/bin/python
B=/work/main/benchmarks
cd /tmp
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="1.25 1.10"; else order="1.10 1.25"; fi
  for f in $order; do
    echo "round $round fair $f agent $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    PYTHONPATH=/work/main $PY $OUT/with_fair.py $f $B/agent_turns.py --memory-kind hybrid_350m --skip-default \
      --nocache-turns 4 --kv-layout auto --json-out $OUT/agent_${round}_$f.json > /dev/null 2>> $OUT/agent_${round}_$f.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
  for f in $order; do
    echo "round $round fair $f latency $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    PYTHONPATH=/work/main $PY $OUT/with_fair.py $f $B/latency.py > $OUT/latency_${round}_$f.json 2>> $OUT/latency_${round}_$f.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
done
echo "done $(date +%T)" >> $OUT/ab.log
