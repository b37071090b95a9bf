#!/bin/bash
# 1 conversation x 8 turns on the hybrid, llamax (a6c9662+) beside llama-server, its order alternated, 6 runs
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04-1conv
cd /tmp
for run in 1 2 3 4 5 6; do
  first=""; if [ $((run % 2)) = 0 ]; then first="--llama-server-first"; fi
  echo "run $run $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) steal $(grep '^cpu ' /proc/stat | awk '{print $9}')" >> $OUT/ab.log
  PYTHONPATH=/work/main /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
    --conversations 1 --turns 8 --nocache-turns 4 --kv-layout auto --llama-server $S $first --json-out $OUT/agent_1conv_$run.json > /dev/null 2>> /tmp/ag2/err_1conv.log
  echo "rc $? $(date +%T)" >> $OUT/ab.log
done
