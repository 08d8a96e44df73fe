#!/bin/bash
# Interleaved whole-start A/B: A=/work/main, B=/work/wt-start; warm private cache.
cd /tmp
export TOKENSERVE_CACHE_DIR=/tmp/s34/cache
for tree in /work/main /work/wt-start; do
  PYTHONPATH=$tree /work/tvenv/bin/python -m tokenserve.entrypoints.cli bench startup --num-runs 1 --cache-dir /tmp/s34/cache > /tmp/s34/warm_$(basename $tree).txt 2>&1
done
for round in 1 2 3; do
  for tree in /work/main /work/wt-start; do
    name=$(basename $tree)
    echo "round $round $name load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    PYTHONPATH=$tree /work/tvenv/bin/python -m tokenserve.entrypoints.cli bench startup --num-runs 3 --cache-dir /tmp/s34/cache --output-json /tmp/s34/ab_${name}_$round.json > /tmp/s34/ab_${name}_$round.txt 2>&1
  done
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
