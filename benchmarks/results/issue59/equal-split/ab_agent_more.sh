#!/bin/bash
# Rounds 3 and 4 of ab.sh's agent runs (no latency runs): the equal-split pricing (new)
# against 902d1a4 (old), 4 hybrid conversations x 12 turns beside llama-server, alternated.
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/equal-split
cd /tmp
for round in 3 4; do
  if [ $round = 3 ]; then order="old new"; else order="new old"; fi
  for tag in $order; do
    if [ $tag = old ]; then code=/work/wt/base; else code=/work/main; fi
    first=""; if [ $round = 4 ]; then first="--llama-server-first"; fi
    echo "round $round $tag agent $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    PYTHONPATH=$code /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
      --nocache-turns 4 --kv-layout auto --llama-server $S $first --json-out $OUT/agent_4conv_${round}_$tag.json > /dev/null 2>> $OUT/agent_${round}_$tag.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
done
