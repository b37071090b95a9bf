#!/bin/bash
# The equal-split pricing (new, d4c69f0) against the code before it (old, 902d1a4), llamax
# alone (no llama-server: half the time a run, twice the rounds), 4 hybrid conversations x
# 12 turns, ABBA-alternated, each from its own worktree.
OUT=/work/main/benchmarks/results/issue59/equal-split/longer-ab
cd /tmp
for round in 1 2 3 4 5 6 7 8; do
  if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for tag in $order; do
    code=/work/wt/$tag
    echo "round $round $tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    PYTHONPATH=$code /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
      --nocache-turns 4 --kv-layout auto --json-out $OUT/agent_${round}_$tag.json > /dev/null 2>> $OUT/agent_${round}_$tag.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
done
