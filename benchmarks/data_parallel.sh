#!/usr/bin/env bash
# W1 and W2 (../shared/WORKLOADS.md) at DP=1 (one engine core, 2 threads) and DP=2 (two
# engine cores, 1 thread each), interleaved in one sitting: both servers run side by side
# (an idle one only waits), and each workload runs on one right after the other, in the
# order 1 2 | 2 1 | 1 2, with the same seeds. W1 goes through the server (offline DP is
# not built). docs/DATA_PARALLEL.md.
#
#   benchmarks/data_parallel.sh OUT        # OUT/summary.md, OUT/dp<N>_<rep>_<workload>.json
#
# Knobs: PYTHON, TS_MODEL (default: the default model), PORT (DP=1; DP=2 on PORT+1),
# REPEATS (1), KV_MIB (2048: the KV cache memory of each server, split between its
# engines), LOCK (/tmp/cpu.lock, held throughout), TS_FLAGS (added to both servers).
set -euo pipefail
OUT=${1:?usage: $0 OUT}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8330}
REPEATS=${REPEATS:-1}
LOCK=${LOCK:-/tmp/cpu.lock}
TS_FLAGS=${TS_FLAGS:-}
KV_MIB=${KV_MIB:-2048}  # KV cache memory in all, split between the engines
DEFAULT_GGUF=$("$PYTHON" -c "from tokenserve.model.loader import default_model_path; print(default_model_path())")
TS_MODEL=${TS_MODEL:-$DEFAULT_GGUF}
TOKENSERVE=("$PYTHON" -m tokenserve.entrypoints.cli)
mkdir -p "$OUT/logs"
cd "$REPO"
exec 9>"$LOCK"
flock -w 7200 9
log() { echo "[data_parallel $(date +%H:%M:%S)] $*" | tee -a "$OUT/logs/run.log"; }
SERVERS=()
trap 'kill -TERM "${SERVERS[@]}" 2> /dev/null; wait' EXIT

serve() {  # serve DP: start a server with DP engine cores on PORT + DP - 1, wait for /health
  local port=$((PORT + $1 - 1)) pid
  # shellcheck disable=SC2086
  "${TOKENSERVE[@]}" serve "$TS_MODEL" --port "$port" --max-model-len 4096 \
    --kv-cache-memory "$((KV_MIB / $1))MiB" -dp "$1" $TS_FLAGS > "$OUT/logs/server_dp$1.log" 2>&1 &
  pid=$!
  SERVERS+=("$pid")
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && return 0
    kill -0 "$pid" 2> /dev/null || { log "server dp=$1 exited"; exit 1; }
    sleep 1
  done
  log "server dp=$1 not healthy"; exit 1
}

bench() {  # bench DP NAME ARGS...: one client run against the DP server
  local dp=$1 name=$2; shift 2
  log "dp$dp $name"
  "${TOKENSERVE[@]}" bench serve --port $((PORT + dp - 1)) --ignore-eos --num-prompts 64 \
    --input-len 256 "$@" --output-json "$OUT/dp${dp}_$name.json" > "$OUT/logs/dp${dp}_$name.txt" 2>&1
}

serve 1
serve 2
for rep in $(seq "$REPEATS"); do
  for dp in 1 2; do bench "$dp" "${rep}_w1" --output-len 128 --request-rate inf --dataset-seed 11; done
  for dp in 2 1; do bench "$dp" "${rep}_w2_inf" --output-len 64 --request-rate inf --dataset-seed 21; done
  for dp in 1 2; do
    bench "$dp" "${rep}_w2_rate2" --output-len 64 --request-rate 2 --seed 0 --dataset-seed 22
  done
done

"$PYTHON" - "$OUT" "$REPEATS" <<'PY' | tee "$OUT/summary.md"
import json, sys
out, repeats = sys.argv[1], int(sys.argv[2])
rows = [
    ("W1 output tok/s", "w1", lambda s: s["output_throughput"]),
    ("W1 total tok/s", "w1", lambda s: s["total_token_throughput"]),
    ("W1 wall s", "w1", lambda s: s["duration_s"]),
    ("W2 inf: req/s", "w2_inf", lambda s: s["request_throughput"]),
    ("W2 inf: output tok/s", "w2_inf", lambda s: s["output_throughput"]),
    ("W2 inf: TTFT mean / p50 / p99 s", "w2_inf", lambda s: [s["ttft_ms"][k] / 1e3 for k in ("mean", "p50", "p99")]),
    ("W2 inf: TPOT mean ms", "w2_inf", lambda s: s["tpot_ms"]["mean"]),
    ("W2 inf: ITL mean / p99 ms", "w2_inf", lambda s: [s["itl_ms"][k] for k in ("mean", "p99")]),
    ("W2 2 req/s: output tok/s", "w2_rate2", lambda s: s["output_throughput"]),
    ("W2 2 req/s: TTFT mean / p50 / p99 s", "w2_rate2", lambda s: [s["ttft_ms"][k] / 1e3 for k in ("mean", "p50", "p99")]),
    ("W2 2 req/s: TPOT mean ms", "w2_rate2", lambda s: s["tpot_ms"]["mean"]),
    ("W2 2 req/s: ITL mean / p99 ms", "w2_rate2", lambda s: [s["itl_ms"][k] for k in ("mean", "p99")]),
]
def fmt(values):
    values = values if isinstance(values, list) else [values]
    return " / ".join(f"{v:,.1f}" if v >= 10 else f"{v:.2f}" for v in values)
def ratio(a, b):
    a = a if isinstance(a, list) else [a]
    b = b if isinstance(b, list) else [b]
    return " / ".join(f"{y / x:.2f}" if x else "-" for x, y in zip(a, b))
print("| figure | repeat | DP=1 (2 threads) | DP=2 (1 thread each) | DP=2 / DP=1 |")
print("|---|---|---|---|---|")
for label, workload, pick in rows:
    for rep in range(1, repeats + 1):
        try:
            one = pick(json.load(open(f"{out}/dp1_{rep}_{workload}.json"))["summary"])
            two = pick(json.load(open(f"{out}/dp2_{rep}_{workload}.json"))["summary"])
        except (OSError, KeyError):
            continue
        print(f"| {label} | {rep} | {fmt(one)} | {fmt(two)} | {ratio(one, two)} |")
PY
