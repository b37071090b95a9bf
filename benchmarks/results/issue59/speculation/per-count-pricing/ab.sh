#!/bin/bash
cd /tmp
PY=/work/main/.venv/bin/python
run() {
  echo "$1 $2 start $(date +%T) steal $(head -1 /proc/stat | awk '{print $9}') load $(cat /proc/loadavg)" >> /tmp/r/spec/ab.log
  PYTHONPATH=$3 $PY $3/benchmarks/speculative.py --n 1 4 --n-throughput --repeats 2 \
    --skip llama_cpp_python_lookup llama_cpp_python --json-out /tmp/r/spec/$1_$2.json > /tmp/r/spec/$1_$2.log 2>&1
  echo "$1 $2 done $(date +%T) rc $? steal $(head -1 /proc/stat | awk '{print $9}')" >> /tmp/r/spec/ab.log
}
run after r1 /work/wt/after2; run before r1 /work/wt/before
run before r2 /work/wt/before; run after r2 /work/wt/after2
echo ALL DONE >> /tmp/r/spec/ab.log
