#!/bin/bash
# alternated latency.py runs, before (/work/wt/before) and after (/work/wt/after)
cd /tmp
PY=/work/main/.venv/bin/python
run() { # name tree cal tag
  local steal=$(head -1 /proc/stat | awk '{print $9}')
  echo "$1 $4 start $(date +%T) steal $steal load $(cat /proc/loadavg)" >> /tmp/r/lat/ab.log
  LLAMAX_CACHE_DIR=$3 PYTHONPATH=$2 $PY $2/benchmarks/latency.py --repeats 2 --skip-fixed \
     --json-out /tmp/r/lat/$1_$4.json --trace /tmp/r/lat/$1_$4_trace.json > /tmp/r/lat/$1_$4.out 2>&1
  echo "$1 $4 done $(date +%T) rc $? steal $(head -1 /proc/stat | awk '{print $9}')" >> /tmp/r/lat/ab.log
}
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then run after /work/wt/after /tmp/r/cal-epyc epyc$i; run before /work/wt/before /tmp/r/cal-epyc epyc$i
  else run before /work/wt/before /tmp/r/cal-epyc epyc$i; run after /work/wt/after /tmp/r/cal-epyc epyc$i; fi
done
for i in 1 2 3; do
  if [ $((i % 2)) = 1 ]; then run before /work/wt/before /tmp/r/cal-fresh fresh$i; run after /work/wt/after /tmp/r/cal-fresh fresh$i
  else run after /work/wt/after /tmp/r/cal-fresh fresh$i; run before /work/wt/before /tmp/r/cal-fresh fresh$i; fi
done
echo ALL DONE >> /tmp/r/lat/ab.log
