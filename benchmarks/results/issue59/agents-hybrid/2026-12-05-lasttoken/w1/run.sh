#!/bin/bash
# W1 (throughput.py at N=1 and 16 beside the raw loop and llama-server) with the code before
# the last-token change (18ed89d) and after it (main), alternated (ABBA): "the W1 numbers
# must not drop" (issue 59). W1's prompts are short and distinct on a plain model: no step
# has a last-prompt-token row without streaming rows, so the plans are the same.
OUT=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-05-lasttoken/w1
TP=/work/main/benchmarks/throughput.py
LS=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
cd /tmp
run() {  # version round
  local v=$1 r=$2 tree=/work/main
  [ "$v" = old ] && tree=/work/wt/old
  echo "$v $r $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/run.log
  PYTHONPATH=$tree /work/main/.venv/bin/python $TP --n 1 16 --repeats 3 \
    --skip llama_cpp_python raw_streams llamax_unified --llama-server $LS > $OUT/w1_${r}_$v.json 2> $OUT/w1_${r}_$v.log
  echo "rc $? $(date +%T)" >> $OUT/run.log
}
run old 1; run new 1; run new 2; run old 2
echo "done $(date +%T)" >> $OUT/run.log
