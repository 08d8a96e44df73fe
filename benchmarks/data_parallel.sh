#!/usr/bin/env bash
# W1 and W2 (../shared/WORKLOADS.md) on servers of several parallel layouts, back to back
# in one sitting: by default DP=1 (one engine core, 2 threads) and DP=2 (two engine cores,
# 1 thread each); LAYOUTS="dp1 tp2 pp2 dp2" adds TP=2 and PP=2 (two ranks of 1 thread).
# Each server runs W1, W2 at rate inf and W2 at Poisson 2 req/s with the same seeds
# (REPEATS > 1 alternates the order: the layouts forward, then backward, ...). One server at
# a time; a DP server splits one KV budget between its engines, to keep the memory of a
# shared machine. W1 goes through the server (offline DP is not built).
# docs/PARALLELISM.md ("Benchmarks", "Data parallel").
#
#   benchmarks/data_parallel.sh OUT        # OUT/summary.md, OUT/<layout>_<rep>_<workload>.json
#
# Knobs: PYTHON, TS_MODEL (default: the default model), PORT, REPEATS (1), KV_MIB (1536:
# the KV cache memory of each server, split between its engines), LOCK (/tmp/cpu.lock,
# held throughout), TS_FLAGS (added to both servers), NUM_PROMPTS (64; fewer scale both
# workloads down), WORKLOADS (the subset of "w1 w2_inf w2_rate2" to run), LAYOUTS (of
# dpN, tpN, ppN; default "dp1 dp2"; the report compares each with the first). TP needs a
# model whose heads split (TS_MODEL=<dir of benchmarks/make_m0_tp_model.py>, with
# MAX_MODEL_LEN=2048), MAX_MODEL_LEN (4096).
set -uo pipefail
OUT=${1:?usage: $0 OUT}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8330}
REPEATS=${REPEATS:-1}
LOCK=${LOCK:-/tmp/cpu.lock}
TS_FLAGS=${TS_FLAGS:-}
KV_MIB=${KV_MIB:-1536}
NUM_PROMPTS=${NUM_PROMPTS:-64}
WORKLOADS=${WORKLOADS:-w1 w2_inf w2_rate2}
LAYOUTS=${LAYOUTS:-dp1 dp2}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
DEFAULT_GGUF=$("$PYTHON" -c "from tokenserve.model.loader import default_model_path; print(default_model_path())")
TS_MODEL=${TS_MODEL:-$DEFAULT_GGUF}
TOKENSERVE=("$PYTHON" -m tokenserve.entrypoints.cli)
mkdir -p "$OUT/logs"
cd "$REPO" || exit 1
exec 9>"$LOCK"
flock -w 7200 9
log() { echo "[data_parallel $(date +%H:%M:%S)] $*" | tee -a "$OUT/logs/run.log"; }
SERVER=
trap '[ -n "$SERVER" ] && kill -TERM "$SERVER" 2> /dev/null; wait' EXIT

serve() {  # serve LAYOUT REP: start a server of LAYOUT (dpN, tpN, ppN), wait for /health
  local size=${1:2} kv=$KV_MIB
  case $1 in
    dp*) kv=$((KV_MIB / size)) ;;
    tp* | pp*) ;;
    *) log "unknown layout $1"; exit 1 ;;
  esac
  # shellcheck disable=SC2086
  "${TOKENSERVE[@]}" serve "$TS_MODEL" --port "$PORT" --max-model-len "$MAX_MODEL_LEN" \
    --kv-cache-memory "${kv}MiB" "-${1:0:2}" "$size" $TS_FLAGS > "$OUT/logs/server_$1_$2.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 "$SERVER" 2> /dev/null || { log "server $1 exited"; exit 1; }
    sleep 1
  done
  log "server $1 not healthy"; exit 1
}

bench() {  # bench NAME ARGS...: one client run against the server
  local name=$1; shift
  case " $WORKLOADS " in *" ${name##*_[0-9]_} "*) ;; *) return 0 ;; esac
  log "$name"
  "${TOKENSERVE[@]}" bench serve --port "$PORT" --ignore-eos --num-prompts "$NUM_PROMPTS" --input-len 256 \
    "$@" --output-json "$OUT/$name.json" > "$OUT/logs/$name.txt" 2>&1 || log "$name: failures"
}

read -ra forward <<< "$LAYOUTS"
for rep in $(seq "$REPEATS"); do
  order=("${forward[@]}")
  if [ $((rep % 2)) = 0 ]; then
    order=(); for ((i = ${#forward[@]} - 1; i >= 0; i--)); do order+=("${forward[i]}"); done
  fi
  for layout in "${order[@]}"; do
    serve "$layout" "$rep"
    bench "${layout}_${rep}_w1" --output-len 128 --request-rate inf --dataset-seed 11
    bench "${layout}_${rep}_w2_inf" --output-len 64 --request-rate inf --dataset-seed 21
    bench "${layout}_${rep}_w2_rate2" --output-len 64 --request-rate 2 --seed 0 --dataset-seed 22
    kill -TERM "$SERVER"; wait "$SERVER"; SERVER=
  done
done

"$PYTHON" benchmarks/data_parallel_report.py "$OUT" "$REPEATS" "${forward[@]}" | tee "$OUT/summary.md"
