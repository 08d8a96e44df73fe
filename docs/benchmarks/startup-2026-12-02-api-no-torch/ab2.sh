#!/bin/bash
cd /tmp
export TOKENSERVE_CACHE_DIR=$OUT/cache
echo "steps api start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
PYTHONPATH=$AFTER_TREE python $AFTER_TREE/benchmarks/startup_steps.py --process api --pairs 2 --output $OUT/api_steps2.json $BEFORE_TREE $AFTER_TREE > $OUT/api_steps2.txt 2>&1
echo "steps engine start load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
PYTHONPATH=$AFTER_TREE python $AFTER_TREE/benchmarks/startup_steps.py --pairs 2 --output $OUT/engine_steps.json $BEFORE_TREE $AFTER_TREE > $OUT/engine_steps.txt 2>&1
for round in 1 2 3 4; do
  for tree in $BEFORE_TREE $AFTER_TREE; do
    name=$(basename $tree)
    echo "round $round $name load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
    PYTHONPATH=$tree python -m tokenserve.entrypoints.cli bench startup --num-runs 3 --cache-dir $OUT/cache --output-json $OUT/ab2_${name}_$round.json > $OUT/ab2_${name}_$round.txt 2>&1
  done
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T)"
