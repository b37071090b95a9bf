#!/bin/bash
# Rows that compute a prompt's last token no longer set the step budget (e40599f) against the
# code before (18ed89d): the 4-conversation hybrid agent run, llamax alone, ABBA over 4
# rounds, each from its own worktree; then the new code beside llama-server twice (order
# alternated).
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-lasttoken
S=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
cd /tmp
run() {  # tag tree extra-args...
  local tag=$1 tree=$2; shift 2
  echo "$tag $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/run.log
  PYTHONPATH=$tree /work/main/.venv/bin/python $tree/benchmarks/agent_turns.py --memory-kind hybrid_350m \
    --skip-default --nocache-turns 4 --kv-layout auto --json-out $OUT/agent_$tag.json "$@" > /dev/null 2>> $OUT/agent_$tag.log
  echo "rc $? $(date +%T)" >> $OUT/run.log
}
for r in $([ "$1" = more ] || echo 1 2); do
  run old_a$r /work/wt/old; run new_a$r /work/wt/new; run new_b$r /work/wt/new; run old_b$r /work/wt/old
done
if [ "$1" = more ]; then  # two more beside llama-server, later in the sitting
  run new_server3 /work/wt/new --llama-server $S --llama-server-first
  run new_server4 /work/wt/new --llama-server $S
  echo "done $(date +%T)" >> $OUT/run.log
  exit 0
fi
run new_server1 /work/wt/new --llama-server $S
run new_server2 /work/wt/new --llama-server $S --llama-server-first
echo "done $(date +%T)" >> $OUT/run.log
