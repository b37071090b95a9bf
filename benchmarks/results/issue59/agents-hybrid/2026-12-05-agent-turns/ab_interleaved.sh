#!/bin/bash
# One conversation x 8 turns on the hybrid, interleaved turn by turn with llama-server
# (agent_turns.py --interleave); old code (127cfb3) and new (29bd5cb: interval checkpoints
# counted from where a prompt starts computing; a next turn parting in the reply cut in
# its slot) alternated, 10 runs.
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-agent-turns
OLD=/work/wt/old
NEW=/work/main
cd /tmp
for run in 1 2 3 4 5 6 7 8 9 10; do
  if [ $((run % 2)) = 1 ]; then code=$OLD; tag=old; else code=$NEW; tag=new; fi
  echo "run $run $tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
  PYTHONPATH=$code /work/main/.venv/bin/python /work/main/benchmarks/agent_turns.py --memory-kind hybrid_350m --skip-default \
    --conversations 1 --turns 8 --kv-layout auto --llama-server $S --interleave \
    --json-out $OUT/agent_1conv_interleaved_${tag}_$run.json > /dev/null 2>> /tmp/ag3/err.log
  echo "rc $? $(date +%T)" >> $OUT/ab.log
done
