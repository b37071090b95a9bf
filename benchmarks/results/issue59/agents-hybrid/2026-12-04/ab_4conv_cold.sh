#!/bin/bash
# 4 conversations x 12 turns, kv_layout auto; alternated code; an empty calibration cache each run (a fresh machine's first run)
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04
cd /tmp
i=0
for code in old new new old; do
  i=$((i+1))
  if [ $code = old ]; then PP=/work/wt/old; else PP=/work/main; fi
  first=""; if [ $((i % 2)) = 0 ]; then first="--llama-server-first"; fi
  cache=$(mktemp -d)
  echo "run $i $code $first cold-cache $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) steal $(grep '^cpu ' /proc/stat | awk '{print $9}')" >> $OUT/ab_4conv_cold.log
  LLAMAX_CACHE_DIR=$cache PYTHONPATH=$PP /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
    --nocache-turns 4 --kv-layout auto --llama-server $S $first --json-out $OUT/agent_4conv_cold_${i}_${code}.json > /dev/null 2>> /tmp/ag/err4.log
  echo "rc $? $(date +%T) steal $(grep '^cpu ' /proc/stat | awk '{print $9}')" >> $OUT/ab_4conv_cold.log
  rm -rf $cache
done
