#!/bin/bash
# alternated: code old/new, llama-server first on every other run
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04
cd /tmp
i=0
for code in old new new old; do
  i=$((i+1))
  if [ $code = old ]; then PP=/work/wt/old; else PP=/work/main; fi
  first=""; if [ $((i % 2)) = 0 ]; then first="--llama-server-first"; fi
  echo "run $i $code $first $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab_1conv.log
  PYTHONPATH=$PP /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
    --conversations 1 --turns 8 --nocache-turns 4 --llama-server $S $first --json-out $OUT/agent_1conv_${i}_${code}.json > /dev/null 2>> /tmp/ag/err1.log
  echo "rc $?" >> $OUT/ab_1conv.log
done
