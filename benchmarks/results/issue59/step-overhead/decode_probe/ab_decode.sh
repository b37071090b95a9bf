#!/bin/bash
# old (a6d9eff) and new alternated: hybrid_decode_probe (llamax, raw loop, llama-server; 3 repeats each)
OUT=/work/main/benchmarks/results/issue59/step-overhead/decode_probe
PROBE=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04/hybrid_decode_probe.py
LS=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
for round in 1 2; do
  for v in old new; do
    if [ $v = old ]; then R=/work/wt/old; else R=/work/main; fi
    echo "== round $round $v $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=$R /work/main/.venv/bin/python $PROBE --llama-server $LS > $OUT/round${round}_$v.json 2> $OUT/round${round}_$v.log
    echo "rc $?"
  done
done
