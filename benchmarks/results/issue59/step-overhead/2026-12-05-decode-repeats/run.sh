#!/bin/bash
# One stream's decode on the hybrid (LFM2-350M shape), llamax (35a7a8f) beside the raw loop
# and llama-server, hybrid_decode_probe.py run 5 times in a row (each: 3 samples a system,
# interleaved inside the probe), to settle "decode steps within 5% of llama-server's".
OUT=/work/main/benchmarks/results/issue59/step-overhead/2026-12-05-decode-repeats
HYB=/work/main/benchmarks/results/issue59/agents-hybrid/2026-12-04/hybrid_decode_probe.py
LS=/root/.cache/llamax/llama-server/0d21f601b194068b/llama-server
cd /tmp
for i in 1 2 3 4 5; do
  echo "== $i $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/run.log
  PYTHONPATH=/work/main /work/main/.venv/bin/python $HYB --llama-server $LS > $OUT/hybrid_decode_$i.json 2>> $OUT/run.log
done
echo "done $(date +%T)" >> $OUT/run.log
