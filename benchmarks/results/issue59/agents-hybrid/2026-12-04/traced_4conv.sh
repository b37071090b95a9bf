#!/bin/bash
# new code, traced: the default step budget and max_step_ms=None (fixed n_batch chunks), each beside llama-server
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04
cd /tmp
for v in nobudget default; do
  extra=""; if [ $v = nobudget ]; then extra="--max-step-ms 0"; fi
  echo "run $v $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) steal $(grep '^cpu ' /proc/stat | awk '{print $9}')" >> $OUT/traced_4conv.log
  PYTHONPATH=/work/main /work/main/.venv/bin/python $OUT/traced_agent_turns.py --trace $OUT/steps_4conv_$v.json --memory-kind hybrid_350m --skip-default \
    --nocache-turns 4 --kv-layout auto --llama-server $S $extra --json-out $OUT/agent_4conv_traced_$v.json > /dev/null 2>> /tmp/ag/err5.log
  echo "rc $? $(date +%T) steal $(grep '^cpu ' /proc/stat | awk '{print $9}')" >> $OUT/traced_4conv.log
done
