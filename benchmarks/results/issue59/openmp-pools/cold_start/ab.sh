#!/bin/bash
OUT=/work/main/benchmarks/results/issue59/openmp-pools/cold_start
cd /tmp
i=0
for code in old new new old; do
  i=$((i+1))
  if [ $code = old ]; then PP=/work/wt/old; else PP=/work/main; fi
  echo "run $i $code $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
  PYTHONPATH=$PP /work/main/.venv/bin/python /work/main/benchmarks/cold_start.py --repeats 2 --json-out $OUT/cold_start_${i}_${code}.json > /dev/null 2>> /tmp/cs.err
  echo "rc $? $(date +%T)" >> $OUT/ab.log
done
