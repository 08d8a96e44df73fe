#!/usr/bin/env bash
# KV connector figures (docs/KV_CONNECTORS.md), on the default model, one sitting:
#   W3 after a restart: SharedStorageConnector tier vs no tier (servers restarted each run,
#      the tier's directory filled by one earlier run), interleaved, ROUNDS times;
#   W4: one instance vs prefill/decode (P2pConnector, `tokenserve proxy`), interleaved.
# Usage: OUT=dir [ROUNDS=2] [PHASES="w3 w4"] [SERVE_FLAGS="..."] benchmarks/kv_connectors.sh
# SERVE_FLAGS: more `tokenserve serve` flags for every server (e.g. --max-num-batched-tokens 512).
set -euo pipefail
OUT=${OUT:?set OUT to a results directory}
ROUNDS=${ROUNDS:-2}
PHASES=${PHASES:-"w3 w4"}
read -r -a SERVE_FLAGS <<< "${SERVE_FLAGS:-}"
PY=${PY:-python}
mkdir -p "$OUT"
TIER="$OUT/kv-tier"
export TOKENSERVE_KV_SECRET=${TOKENSERVE_KV_SECRET:-benchmark-secret-0123456789abcdef}
PIDS=()

serve() {  # port, log, extra flags...
  local port=$1 log=$2; shift 2
  $PY -m tokenserve.entrypoints.cli serve --port "$port" --served-model-name m \
    --max-model-len 4096 --kv-cache-memory 1GiB --disable-log-stats "${SERVE_FLAGS[@]}" "$@" \
    >"$OUT/$log.log" 2>&1 &
  PIDS+=($!)
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
}
stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

w3() {  # port, json
  $PY -m tokenserve.entrypoints.cli bench serve --base-url "http://127.0.0.1:$1" --model m --prompt-format token-ids \
    --ignore-eos --dataset shared-prefix --prefix-len 1024 --input-len 64 --output-len 32 \
    --num-prompts 64 --request-rate inf --dataset-seed 3 --output-json "$OUT/$2.json" \
    >"$OUT/$2.txt"
}
w4() {  # port, json
  $PY -m tokenserve.entrypoints.cli bench serve --base-url "http://127.0.0.1:$1" --model m --prompt-format token-ids \
    --ignore-eos --dataset mixed --num-prompts 36 --mixed-long-requests 4 \
    --mixed-long-input-len 2048 --mixed-long-output-len 16 --input-len 64 --output-len 64 \
    --request-rate 4 --seed 0 --dataset-seed 4 --output-json "$OUT/$2.json" >"$OUT/$2.txt"
}

TIER_CONFIG="{\"kv_connector\":\"SharedStorageConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"shared_storage_path\":\"$TIER\"}}"
if [[ " $PHASES " == *" w3 "* ]]; then
  rm -rf "$TIER"
  serve 18401 w3_fill --kv-transfer-config "$TIER_CONFIG"; w3 18401 w3_fill; stop_all
  for round in $(seq "$ROUNDS"); do
    serve 18401 "w3_tier_$round" --kv-transfer-config "$TIER_CONFIG"; w3 18401 "w3_tier_$round"; stop_all
    serve 18401 "w3_plain_$round"; w3 18401 "w3_plain_$round"; stop_all
  done
fi

p2p() { echo "{\"kv_connector\":\"P2pConnector\",\"kv_role\":\"$1\",\"kv_ip\":\"127.0.0.1\",\"kv_port\":$2}"; }
if [[ " $PHASES " == *" w4 "* ]]; then
  for round in $(seq "$ROUNDS"); do
    serve 18411 "w4_single_$round"; w4 18411 "w4_single_$round"; stop_all
    serve 18412 "w4_prefill_$round" --kv-transfer-config "$(p2p kv_producer 18490)"
    serve 18413 "w4_decode_$round" --kv-transfer-config "$(p2p kv_consumer 18491)"
    $PY -m tokenserve.entrypoints.cli proxy --prefill http://127.0.0.1:18412 \
      --decode http://127.0.0.1:18413 --port 18414 >"$OUT/w4_proxy_$round.log" 2>&1 &
    PIDS+=($!)
    until curl -sf http://127.0.0.1:18414/health >/dev/null; do sleep 1; done
    w4 18414 "w4_pd_$round"; stop_all
  done
fi
