#!/bin/bash
# Two more latency rounds (3, 4), old and new alternated, after the agent rounds.
OUT=/work/main/benchmarks/results/issue59/equal-split
cd /tmp
for round in 3 4; do
  if [ $round = 3 ]; then order="old new"; else order="new old"; fi
  for tag in $order; do
    if [ $tag = old ]; then code=/work/wt/base; else code=/work/main; fi
    echo "round $round $tag latency $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    PYTHONPATH=$code /work/main/.venv/bin/python /work/main/benchmarks/latency.py > $OUT/latency_${round}_$tag.json 2> $OUT/latency_${round}_$tag.log
    echo "rc $? $(date +%T)" >> $OUT/ab.log
  done
done
