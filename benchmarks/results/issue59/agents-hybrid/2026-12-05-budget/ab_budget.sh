#!/bin/bash
# Is the 4-conversation wall gap the step budget's price? The default max_step_ms (250 ms)
# against max_step_ms=None (fixed n_batch chunks, as llama-server batches a whole prompt
# beside the rows), llamax alone, 35a7a8f, ABBA over 4 rounds; then each once beside
# llama-server (its order alternated).
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-budget
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
cd /tmp
run() {  # tag extra-args...
  local tag=$1; shift
  echo "$tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
  PYTHONPATH=/work/main /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m \
    --skip-default --nocache-turns 4 --kv-layout auto --json-out $OUT/agent_$tag.json "$@" > /dev/null 2>> $OUT/agent_$tag.log
  echo "rc $? $(date +%T)" >> $OUT/ab.log
}
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then order="default none"; else order="none default"; fi
  for v in $order; do
    if [ $v = none ]; then run ${round}_$v --max-step-ms 0; else run ${round}_$v; fi
  done
done
run peer_none --max-step-ms 0 --llama-server $S
run peer_default --llama-server $S --llama-server-first
echo "done $(date +%T)" >> $OUT/ab.log
