#!/bin/bash
# 4 conversations x 12 turns on the hybrid, old code (127cfb3) and new (29bd5cb), each beside
# llama-server (its order alternated by round), 2 rounds.
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-agent-turns
cd /tmp
for round in 1 2; do
  for tag in old new; do
    if [ $tag = old ]; then code=/work/wt/old; else code=/work/main; fi
    first=""; if [ $((round % 2)) = 0 ]; then first="--llama-server-first"; fi
    echo "round $round $tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab_4conv.log
    PYTHONPATH=$code /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
      --nocache-turns 4 --kv-layout auto --llama-server $S $first --json-out $OUT/agent_4conv_${round}_$tag.json > /dev/null 2>> /tmp/ag3/err4.log
    echo "rc $? $(date +%T)" >> $OUT/ab_4conv.log
  done
done
