#!/bin/bash
cd /tmp
export TOKENSERVE_CACHE_DIR=/tmp/s34/cache
echo "steps api start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
PYTHONPATH=/work/wt-start /work/tvenv/bin/python /work/wt-start/benchmarks/startup_steps.py --process api --pairs 2 --output /tmp/s34/api_steps2.json /work/main /work/wt-start > /tmp/s34/api_steps2.txt 2>&1
echo "steps engine start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
PYTHONPATH=/work/wt-start /work/tvenv/bin/python /work/wt-start/benchmarks/startup_steps.py --pairs 2 --output /tmp/s34/engine_steps.json /work/main /work/wt-start > /tmp/s34/engine_steps.txt 2>&1
for round in 1 2 3 4; do
  for tree in /work/main /work/wt-start; do
    name=$(basename $tree)
    echo "round $round $name load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    PYTHONPATH=$tree /work/tvenv/bin/python -m tokenserve.entrypoints.cli bench startup --num-runs 3 --cache-dir /tmp/s34/cache --output-json /tmp/s34/ab2_${name}_$round.json > /tmp/s34/ab2_${name}_$round.txt 2>&1
  done
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
