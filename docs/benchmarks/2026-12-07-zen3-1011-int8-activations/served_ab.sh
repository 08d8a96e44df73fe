#!/bin/bash
# tokenserve alone, W3 (caching on) and W5, default and with the 8-bit kernel for every product, in turns twice
cd /work/main
for turn in 1 2; do
  for mode in off on; do
    flags=""
    [[ $mode == on ]] && flags="--int8-activation-max-rows 1024"
    echo "=== turn $turn $mode $(date +%H:%M:%S)"
    env -u PYTHONDONTWRITEBYTECODE MODEL_DIR=/tmp/sitting0/m0_hf ENGINES=tokenserve PHASES=w3,w5 \
      SESSIONS=main,w5_unconstrained,kv_2048 TS_FLAGS="$flags" FIRST_TOUCH_GIB=0 CEILING_REPEATS=0 \
      PYTHON=/work/tvenv/bin/python PATH=/work/tvenv/bin:$PATH PYTHONPATH=/work/main \
      bash benchmarks/run_side_by_side.sh /tmp/s83/served-$mode-$turn > /tmp/s83/served-$mode-$turn.log 2>&1
    echo "rc=$? $(date +%H:%M:%S)"
  done
done
