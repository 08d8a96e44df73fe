#!/bin/bash
cd /tmp
export TOKENSERVE_CACHE_DIR=$OUT/cache
for round in 1 2 3; do
  for tree in $BEFORE_TREE $AFTER_TREE; do
    name=$(basename $tree)
    echo "round $round $name load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    PYTHONPATH=$tree python -m tokenserve.entrypoints.cli bench startup --num-runs 3 --cache-dir $OUT/cache --output-json $OUT/ab3_${name}_$round.json > $OUT/ab3_${name}_$round.txt 2>&1
  done
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
