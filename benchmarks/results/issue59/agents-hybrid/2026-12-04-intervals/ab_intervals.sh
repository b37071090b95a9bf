#!/bin/bash
# 4 conversations x 12 turns on the hybrid, default (interval checkpoints) and without interval checkpoints, each beside llama-server, alternated
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04-intervals
AT=/work/main/benchmarks/agent_turns.py
cd /tmp
for round in 1 2; do
  for v in default nointerval; do
    first=""; if [ $round = 2 ]; then first="--llama-server-first"; fi
    script=$AT; if [ $v = nointerval ]; then script=$OUT/no_interval_agent_turns.py; fi
    echo "round $round $v $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) steal $(grep '^cpu ' /proc/stat | awk '{print $9}')" >> $OUT/ab.log
    PYTHONPATH=/work/main /work/main/.venv/bin/python $script --memory-kind hybrid_350m --skip-default \
      --nocache-turns 4 --kv-layout auto --llama-server $S $first --json-out $OUT/agent_4conv_${round}_$v.json > /dev/null 2>> /tmp/ag2/err_ab.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
done
