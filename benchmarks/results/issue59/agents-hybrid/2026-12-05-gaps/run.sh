#!/bin/bash
# What the step budget keeps: the gaps between a reply's streamed tokens in the
# 4-conversation hybrid agent run (agent_turns.py now records them), llamax with the default
# budget and with max_step_ms=None, each beside llama-server (its order alternated).
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-gaps
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
cd /tmp
run() {  # tag extra-args...
  local tag=$1; shift
  echo "$tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/run.log
  PYTHONPATH=/work/main /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m \
    --skip-default --nocache-turns 4 --kv-layout auto --llama-server $S --json-out $OUT/agent_$tag.json "$@" > /dev/null 2>> $OUT/agent_$tag.log
  echo "rc $? $(date +%T)" >> $OUT/run.log
}
run default
run none --max-step-ms 0 --llama-server-first
echo "done $(date +%T)" >> $OUT/run.log
