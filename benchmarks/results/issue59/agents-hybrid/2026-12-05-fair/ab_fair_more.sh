#!/bin/bash
# Rounds 4 and 5 of ab_fair.sh, the agent run only.
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-fair
PY=/work/main/.venv/bin/python
B=/work/main/benchmarks
cd /tmp
for round in 4 5; do
  if [ $((round % 2)) = 1 ]; then order="1.25 1.10"; else order="1.10 1.25"; fi
  for f in $order; do
    echo "round $round fair $f agent $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    PYTHONPATH=/work/main $PY $OUT/with_fair.py $f $B/agent_turns.py --memory-kind hybrid_350m --skip-default \
      --nocache-turns 4 --kv-layout auto --json-out $OUT/agent_${round}_$f.json > /dev/null 2>> $OUT/agent_${round}_$f.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
done
echo "done $(date +%T)" >> $OUT/ab.log
