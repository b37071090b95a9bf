#!/bin/bash
# old (abf617f) and new alternated, order swapped each round: the engine's time outside
# llama_decode (step_overhead_probe, SmolLM2 256 tokens and the hybrid 128), one stream's
# decode on the hybrid beside the raw loop and llama-server (hybrid_decode_probe), and W1
# at N=1 and 16 beside the raw loop and llama-server (throughput.py).
OUT=/work/main/benchmarks/results/issue59/step-overhead/2026-12-05-views
STEP=/work/main/benchmarks/results/issue59/step-overhead/step_overhead_probe.py
HYB=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04/hybrid_decode_probe.py
TP=/work/main/benchmarks/throughput.py
LS=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
PY=/work/main/.venv/bin/python
cd /tmp
run() {  # version label command...
  local v=$1; shift
  if [ $v = old ]; then R=/work/wt/old; else R=/work/main; fi
  echo "== $v $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg): $*" >&2
  PYTHONPATH=$R "$@"
}
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do
    run $v $PY $STEP > $OUT/step_smollm2_${round}_$v.txt 2>&1
    run $v $PY $STEP --tokens 128 --model /tmp/hybrid.gguf > $OUT/step_hybrid_${round}_$v.txt 2>&1
  done
done
for round in 1 2; do
  if [ $((round % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for v in $order; do
    run $v $PY $HYB --llama-server $LS > $OUT/hybrid_decode_${round}_$v.json 2> $OUT/hybrid_decode_${round}_$v.log
    run $v $PY $TP --n 1 16 --repeats 3 --skip llama_cpp_python raw_streams llamax_unified --llama-server $LS > $OUT/w1_${round}_$v.json 2> $OUT/w1_${round}_$v.log
  done
done
echo "done $(date +%T)" >&2
