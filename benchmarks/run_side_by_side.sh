#!/usr/bin/env bash
# tokenserve, vLLM's CPU build (float32 and bfloat16) and llama.cpp (F32 and F16) side by
# side on M0: the workloads W1-W5 of WORKLOADS.md, in one sitting, with the same client
# (`tokenserve bench serve`) for every server. Each workload runs on one engine right after
# the other, so that all see the same machine. The sitting records the CPU (lscpu: model,
# flags) in meta.json, each server's start time and resident memory (its processes'
# RSS, peak RSS and PSS) in server_<session>_<engine>.json, and what the host charges for fresh
# memory at the sitting's start and end (benchmarks/first_touch.py: first_touch_start.json,
# first_touch_end.json) and, also at both, the machine's matmul ceiling on M0's shapes and its
# read rates (benchmarks/matmul_ceiling.py: ceilings_start.json, ceilings_end.json); the
# report prints them, and W1 as a fraction of the ceiling.
#
# usage: benchmarks/run_side_by_side.sh [OUT_DIR]      (default: /tmp/side_by_side/DATE)
#        DRY_RUN=1 benchmarks/run_side_by_side.sh OUT_DIR   prints every command, runs none
#
# env knobs:
#   ENGINES=tokenserve,vllm,vllm_bf16,llamacpp,llamacpp_f16,transformers   engines to run,
#                                   in this order (W1 and every server session follow it:
#                                   reverse it in every other sitting so that no engine
#                                   always gets the same slot); also tokenserve_fp32
#                                   (tokenserve with --dtype float32; `tokenserve` is its
#                                   --dtype auto, bfloat16 on an avx512_bf16 / amx CPU)
#                                   (transformers: W1 only). vllm: --dtype float32;
#                                   vllm_bf16: --dtype bfloat16, run only on a CPU with
#                                   native bf16 (avx512_bf16 or amx_bf16; VLLM_BF16=1 forces
#                                   it; 5-7x slower without); llamacpp: F32 weights + F32 KV;
#                                   llamacpp_f16: F16 weights + F16 KV (its fastest on
#                                   AVX-512). llama.cpp is built by the install phase.
#   PHASES=export,install,startup,w1,w2,w3,w4,w5   (startup: `tokenserve bench startup`,
#                                   STARTUP_RUNS=3 warm starts of tokenserve serve)
#   TS_MODEL=<the default GGUF>     what tokenserve loads: M0's own GGUF file, whose weights it
#                                   multiplies by in float32 (the Q4_1 blocks are expanded in
#                                   registers for decode); TS_MODEL=$MODEL_DIR gives it the
#                                   export instead, as vLLM gets
#   TS_FLAGS=""                     more tokenserve server flags, for every session (an A/B of
#                                   one option: e.g. TS_FLAGS=--disable-cascade-attn)
#   W2_LONG_PREFILL="128"           thresholds of the W2 sessions w2_lpt_N (W2 at 2 req/s, every
#                                   engine with --long-prefill-token-threshold N); "": none
#   MODEL_DIR=$OUT/m0_hf            M0 as a HF directory (benchmarks/export_hf.py writes it
#                                   once; both engines load this very directory)
#   PEERS=<repo>/../shared/peers/vllm_cpu.sh   its `install` phase builds the vLLM venv
#   VENV=/tmp/peers/vllm  WHEEL_DIR=/tmp/peers/wheels   (passed on to it)
#   LLAMA_CPP_DIR=/tmp/peers/llama.cpp   llama-server and llama-batched-bench in its bin/
#                                   (benchmarks/build_llama_cpp.sh builds them there)
#   LLAMA_GGUF=${MODEL_DIR}-f32.gguf   what llama.cpp loads: M0's GGUF with its tensors
#                                   dequantized to F32 (benchmarks/gguf_to_f32.py, in the
#                                   export phase), run with a float32 KV cache, so that it
#                                   computes in float32 as the other engines do (on M0's Q4_1
#                                   file it rounds activations to 8-bit blocks, and was slower
#                                   on W1: docs/BENCHMARKS.md)
#   LLAMA_KV_FLAGS="-ctk f32 -ctv f32"   llama.cpp's KV cache type (its default is f16)
#   LLAMA_GGUF_F16=${MODEL_DIR}-f16.gguf  LLAMA_F16_KV_FLAGS="-ctk f16 -ctv f16"   llamacpp_f16's
#                                   model (gguf_to_f32.py --outtype f16) and KV cache
#   LLAMA_SLOTS=64  LLAMA_SLOT_CTX=2304   llama-server's parallel slots and each one's context
#                                   (a slot holds one request: W2, W3 and W5 send 64 or 32 at
#                                   once; W4's long prompts are 2,048 tokens)
#   PORT=8300  MAX_MODEL_LEN=4096 (W4's long prompts are 2048 tokens)
#   LOCK=/tmp/cpu.lock              held from the first benchmark to the last (flock)
#   LOCK_WAIT=7200  START_TIMEOUT=900  RUN_TIMEOUT=1800  SERVER_LIFETIME=7200   (seconds)
#   QUICK=1                         an eighth of the requests: checks the plumbing only
#   FIRST_TOUCH_GIB=2.5             fresh memory benchmarks/first_touch.py writes at the start
#                                   and at the end (0: not measured; the cheap price ~1 s a
#                                   GiB, the dear one ~12 s)
#   CEILING_REPEATS=5               repeats of each GEMM and read of benchmarks/matmul_ceiling.py
#                                   at the start and at the end (0: not measured; ~10 s each)
#   SESSIONS=""                     only these server sessions (names as in the logs: main,
#                                   w2_lpt_N, prefix_cache_off, w4_mbt_256, w4_mbt_512,
#                                   w4_mbt_2048, w5_unconstrained, kv_2048), e.g. to run
#                                   again one that failed;
#                                   empty: all
#   VLLM_W5_ARGS="--block-size 32 --num-gpu-blocks-override 64 --max-model-len 2016"
#                                   vLLM's 2,048-token KV cache for W5. vLLM 0.32's CPU
#                                   attention refused block size 16 (it wants multiples of
#                                   32), --max-model-len 2048 on 128 blocks of 16 (it
#                                   estimated 2032) and 2032 on 64 blocks of 32 (it
#                                   estimated 2016); it accepted 2016
#
#   DRY_RUN=1                       print the commands (preparation, servers, clients) and the
#                                   report of whatever OUT_DIR holds; run nothing heavy, take
#                                   no lock
#
# Servers listen on 127.0.0.1 only and are stopped by their PID (then process group).
# Results: OUT/<workload>_<engine>.json, logs in OUT/logs, summary in OUT/summary.md.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/tmp/side_by_side/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
ENGINES=${ENGINES:-tokenserve,vllm,vllm_bf16,llamacpp,llamacpp_f16,transformers}
PHASES=${PHASES:-export,install,startup,w1,w2,w3,w4,w5}
DRY_RUN=${DRY_RUN:-0}
STARTUP_RUNS=${STARTUP_RUNS:-3}
MODEL_DIR=${MODEL_DIR:-$OUT/m0_hf}
PYTHON=${PYTHON:-python3}
TS_FLAGS=${TS_FLAGS:-}
W2_LONG_PREFILL=${W2_LONG_PREFILL-128}
DEFAULT_GGUF=$("$PYTHON" -c "from tokenserve.model.loader import default_model_path; print(default_model_path())")
[ -n "$DEFAULT_GGUF" ] || { echo "PYTHON=$PYTHON cannot import tokenserve: set PYTHON to the" \
    "interpreter of its venv (e.g. PYTHON=/work/tvenv/bin/python)" >&2; exit 2; }
TS_MODEL=${TS_MODEL:-$DEFAULT_GGUF}
PEERS=${PEERS:-$REPO/../shared/peers/vllm_cpu.sh}
export VENV=${VENV:-/tmp/peers/vllm}
export WHEEL_DIR=${WHEEL_DIR:-/tmp/peers/wheels}
PORT=${PORT:-8300}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
LOCK=${LOCK:-/tmp/cpu.lock}
LOCK_WAIT=${LOCK_WAIT:-7200}
START_TIMEOUT=${START_TIMEOUT:-900}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
SERVER_LIFETIME=${SERVER_LIFETIME:-7200}
QUICK=${QUICK:-0}
FIRST_TOUCH_GIB=${FIRST_TOUCH_GIB:-2.5}
CEILING_REPEATS=${CEILING_REPEATS:-5}
SESSIONS=${SESSIONS:-}
VLLM_W5_ARGS=${VLLM_W5_ARGS:---block-size 32 --num-gpu-blocks-override 64 --max-model-len 2016}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/tmp/peers/llama.cpp}
LLAMA_GGUF=${LLAMA_GGUF:-${MODEL_DIR%/}-f32.gguf}
LLAMA_KV_FLAGS=${LLAMA_KV_FLAGS:--ctk f32 -ctv f32}
LLAMA_GGUF_F16=${LLAMA_GGUF_F16:-${MODEL_DIR%/}-f16.gguf}
LLAMA_F16_KV_FLAGS=${LLAMA_F16_KV_FLAGS:--ctk f16 -ctv f16}
LLAMA_SLOTS=${LLAMA_SLOTS:-64}
LLAMA_SLOT_CTX=${LLAMA_SLOT_CTX:-2304}
TOKENSERVE=("$PYTHON" -m tokenserve.entrypoints.cli)
VLLM=("$VENV/bin/vllm-cpu-cli")
cd "$REPO" || exit 1

has() { [[ ",$PHASES," == *",$1,"* ]]; }
runs() { [[ ",$ENGINES," == *",$1,"* ]]; }
KNOWN_ENGINES=" tokenserve tokenserve_fp32 vllm vllm_bf16 llamacpp llamacpp_f16 transformers "
IFS=, read -ra ENGINE_LIST <<< "$ENGINES"
for engine in "${ENGINE_LIST[@]}"; do
  [[ -z $engine || $KNOWN_ENGINES == *" $engine "* ]] && continue
  echo "unknown engine '$engine' in ENGINES (known:$KNOWN_ENGINES)" >&2; exit 2
done
runs_vllm() { runs vllm || runs vllm_bf16; }
runs_llamacpp() { runs llamacpp || runs llamacpp_f16; }
log() { echo "[side_by_side $(date +%H:%M:%S)] $*" | tee -a "$OUT/logs/run.log"; }
# x CMD...: run CMD, or with DRY_RUN=1 print it (to the terminal, whatever CMD's redirections).
exec 8>&1
x() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '+' >&8; printf ' %q' "$@" >&8; printf '\n' >&8
  else
    "$@"
  fi
}
dry() { [ "$DRY_RUN" = 1 ]; }
prompts() { if [ "$QUICK" = 1 ]; then echo $(( $1 / 8 > 2 ? $1 / 8 : 2 )); else echo "$1"; fi; }

# vLLM in bfloat16 only where the CPU computes bf16 natively (peers/README.md).
if runs vllm_bf16 && [ "${VLLM_BF16:-0}" != 1 ] && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  log "no avx512_bf16 / amx_bf16 on this CPU: vLLM bfloat16 not run (VLLM_BF16=1 runs it)"
  ENGINES=${ENGINES//vllm_bf16/}
  IFS=, read -ra ENGINE_LIST <<< "$ENGINES"
fi
# tokenserve_fp32: tokenserve in float32, whatever this CPU's --dtype auto takes.
ts_flags() { echo "$TS_FLAGS"; if [ "$1" = tokenserve_fp32 ]; then echo --dtype float32; fi; }
vllm_dtype() { if [ "$1" = vllm_bf16 ]; then echo bfloat16; else echo float32; fi; }
llama_gguf() { if [ "$1" = llamacpp_f16 ]; then echo "$LLAMA_GGUF_F16"; else echo "$LLAMA_GGUF"; fi; }
llama_kv() { if [ "$1" = llamacpp_f16 ]; then echo "$LLAMA_F16_KV_FLAGS"; else echo "$LLAMA_KV_FLAGS"; fi; }

# The settings peers/README.md measured best for vLLM on this CPU: all cores to OMP,
# tcmalloc and vLLM's libiomp5 preloaded, telemetry and hub access off.
VLLM_ENV=(env VLLM_CPU_OMP_THREADS_BIND="0-$(( $(nproc) - 1 ))" VLLM_CPU_KVCACHE_SPACE=4
          LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so"
          VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1)

# ------------------------------------------------------------------- preparation
# In a dry run a missing file is reported, not fatal: nothing will read it.
need() {  # $1 test result (0: present), rest: the message
  local present=$1; shift
  (( present == 0 )) && return 0
  log "$*"; dry || exit 1
}
if has export && { dry || [ ! -f "$MODEL_DIR/model.safetensors" ]; }; then
  log "export M0 -> $MODEL_DIR"
  x timeout 900 "$PYTHON" benchmarks/export_hf.py "$MODEL_DIR" > "$OUT/logs/export.log" 2>&1 \
    || { log "export failed, see $OUT/logs/export.log"; exit 1; }
fi
[ -f "$MODEL_DIR/config.json" ]; need $? "no model at $MODEL_DIR (run the export phase)"
for engine in llamacpp llamacpp_f16; do
  runs "$engine" || continue
  gguf=$(llama_gguf "$engine"); outtype=f32; [ "$engine" = llamacpp_f16 ] && outtype=f16
  if has export && { dry || [ ! -f "$gguf" ]; }; then
    log "M0 as an $outtype GGUF -> $gguf"
    x timeout 900 "$PYTHON" benchmarks/gguf_to_f32.py "$DEFAULT_GGUF" "$gguf" --outtype "$outtype" \
        > "$OUT/logs/gguf_to_$outtype.log" 2>&1 \
      || { log "conversion failed, see $OUT/logs/gguf_to_$outtype.log"; exit 1; }
  fi
done

if has install && runs_vllm; then
  [ -f "$PEERS" ]; need $? "missing $PEERS (set PEERS=.../vllm_cpu.sh)"
  log "install vLLM CPU into $VENV (via $PEERS)"
  x env OUT="$OUT/logs/peers" timeout 3600 bash "$PEERS" "$MODEL_DIR" "$PORT" install \
      > "$OUT/logs/install_vllm.log" 2>&1 || { log "install failed, see logs/install_vllm.log"; exit 1; }
fi
if runs_vllm; then
  [ -x "${VLLM[0]}" ]; need $? "no vLLM CLI at ${VLLM[0]} (run the install phase)"
fi
if has install && runs_llamacpp && { dry || [ ! -x "$LLAMA_CPP_DIR/bin/llama-server" ]; }; then
  log "build llama.cpp into $LLAMA_CPP_DIR"
  x timeout 3600 bash benchmarks/build_llama_cpp.sh "$LLAMA_CPP_DIR" \
      > "$OUT/logs/build_llama_cpp.log" 2>&1 \
    || { log "llama.cpp build failed, see logs/build_llama_cpp.log"; exit 1; }
fi
if runs_llamacpp; then
  [ -x "$LLAMA_CPP_DIR/bin/llama-server" ]
  need $? "no llama-server in $LLAMA_CPP_DIR/bin (run the install phase)"
fi
PLOT=1
"$PYTHON" -c "import matplotlib" 2>/dev/null || { PLOT=0; log "no matplotlib: no plots"; }

# One lock from the first benchmark to the last: nothing else CPU-heavy runs meanwhile.
if ! dry; then
  exec 9>"$LOCK"
  log "waiting for $LOCK"
  flock -w "$LOCK_WAIT" 9 || { log "could not take $LOCK in $LOCK_WAIT s"; exit 1; }
fi
"$PYTHON" - "$OUT/meta.json" "$ENGINES" "$QUICK" "$MODEL_DIR" "$TS_MODEL" "$TS_FLAGS" <<'EOF'
import json, os, subprocess, sys, time
def lscpu():
    # The CPU as lscpu names it (model, caches, flags), for the report's header.
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())
            if v.strip()}
meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "engines": sys.argv[2],
        "quick": sys.argv[3] == "1", "model_dir": sys.argv[4], "tokenserve_model": sys.argv[5],
        "tokenserve_flags": sys.argv[6],
        "nproc": os.cpu_count(),
        # The CPU's model name and flags: every figure is named by the CPU it ran on.
        **{key.strip(): value.strip() for key, _, value in (
            line.partition(":") for line in open("/proc/cpuinfo").read().split("\n\n")[0]
            .splitlines()) if key.strip() in ("model name", "flags")},
        "lscpu": lscpu(),
        "loadavg_start": os.getloadavg(),
        "tokenserve_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True).stdout.strip(),
        "tokenserve_uncommitted_changes": bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
            text=True).stdout.strip())}
json.dump(meta, open(sys.argv[1], "w"), indent=2)
EOF
# The host's price for fresh memory: a KV block written for the first time pays it inside a
# step, so it can move the figures as much as the engines do (docs/PERFORMANCE_CPU.md).
first_touch() {  # $1: start | end
  [ "$FIRST_TOUCH_GIB" = 0 ] && return 0
  log "first touch ($1): $FIRST_TOUCH_GIB GiB of fresh memory"
  x "$PYTHON" benchmarks/first_touch.py --gib "$FIRST_TOUCH_GIB" \
      --json "$OUT/first_touch_$1.json" > "$OUT/logs/first_touch_$1.log" 2>&1 \
    || log "first_touch.py failed, see logs/first_touch_$1.log"
  dry || tail -n 1 "$OUT/logs/first_touch_$1.log" | sed "s/^/    /"
}
# The machine's matmul ceiling (M0's GEMMs in float32, and bfloat16 where native) and read
# rates: on a shared host they move from hour to hour, and W1 is stated against the ceiling.
ceilings() {  # $1: start | end
  [ "$CEILING_REPEATS" = 0 ] && return 0
  log "matmul ceiling and read rates ($1)"
  x "$PYTHON" benchmarks/matmul_ceiling.py --model "$TS_MODEL" --dtypes native \
      --repeats "$CEILING_REPEATS" --json "$OUT/ceilings_$1.json" \
      > "$OUT/logs/ceilings_$1.log" 2>&1 \
    || log "matmul_ceiling.py failed, see logs/ceilings_$1.log"
  dry || tail -n 2 "$OUT/logs/ceilings_$1.log" | sed "s/^/    /"
}
first_touch start
ceilings start

# -------------------------------------------------------------------- servers
SERVER_PID=""
# Free means a server can bind it as servers do (SO_REUSEADDR), not merely that nothing answers
# there: after a llama-server session the port refused binds for ~40 s with nothing listening,
# and the next server (tokenserve, vLLM) died of "Address already in use".
port_free() {
  "$PYTHON" -c 'import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))' "$PORT" 2> /dev/null
}
wait_port_free() {
  local _
  for _ in $(seq 120); do port_free && return 0; sleep 1; done
  return 1
}
start_server() {  # $1 engine, $2 session name, rest: engine flags
  local engine=$1 session=$2; shift 2
  local logf="$OUT/logs/server_${session}_${engine}.log"
  if ! dry && ! wait_port_free; then
    log "port $PORT is still taken after 120 s: another server is running there"; return 1
  fi
  local started cmd; started=$(date +%s.%N)
  if [[ $engine == tokenserve* ]]; then
    cmd=("${TOKENSERVE[@]}" serve "$TS_MODEL" --host 127.0.0.1 --port "$PORT"
         --served-model-name M0 --max-model-len "$MAX_MODEL_LEN" --disable-log-stats
         --uvicorn-log-level warning "$@")
  elif [[ $engine == llamacpp* ]]; then
    # Its defaults otherwise (flash attention off: -fa was slower here; docs/BENCHMARKS.md).
    # shellcheck disable=SC2207  # the KV flags are a word list
    cmd=("$LLAMA_CPP_DIR/bin/llama-server" -m "$(llama_gguf "$engine")" --host 127.0.0.1
         --port "$PORT" -a M0 --metrics -np "$LLAMA_SLOTS" -c $(( LLAMA_SLOTS * LLAMA_SLOT_CTX ))
         -t "$(nproc)" -tb "$(nproc)" $(llama_kv "$engine") "$@")
  else
    cmd=("${VLLM_ENV[@]}" "${VLLM[@]}" serve "$MODEL_DIR" --host 127.0.0.1 --port "$PORT"
         --served-model-name M0 --dtype "$(vllm_dtype "$engine")"
         --max-model-len "$MAX_MODEL_LEN" --enable-prompt-tokens-details
         --disable-uvicorn-access-log "$@")
  fi
  cmd=(setsid timeout "$SERVER_LIFETIME" "${cmd[@]}")
  if dry; then x "${cmd[@]}"; return 0; fi
  # Started as a plain command, not through x: a function in the background runs in a
  # subshell, whose PID ($!) is then neither setsid's session nor the server's group.
  "${cmd[@]}" > "$logf" 2>&1 9>&- &
  SERVER_PID=$!
  local t0=$SECONDS
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      log "$engine server ($session) died, see $logf"; SERVER_PID=""; return 1
    fi
    if (( SECONDS - t0 > START_TIMEOUT )); then
      log "$engine server ($session) not healthy in $START_TIMEOUT s"; stop_server; return 1
    fi
    sleep 0.5
  done
  SERVER_READY_S=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
  log "$engine server ($session) pid $SERVER_PID ready in $SERVER_READY_S s"
}
# The server's start time and memory: the RSS, peak RSS (VmHWM) and PSS of every process of
# its process group (the engine's workers included), summed, in KiB, once its benchmarks ran.
# The RSS sum counts a page shared by several of the processes (a library's, a model file
# mapped twice) once per process; the PSS sum counts it once, shared out among them: the
# memory the server holds, comparable between a one-process server and a multi-process one.
record_server() {  # $1 engine, $2 session name
  [ -n "$SERVER_PID" ] || return 0
  local rss=0 peak=0 pss=0 pid value
  for pid in $(pgrep -g "$SERVER_PID"); do
    value=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null); rss=$(( rss + ${value:-0} ))
    value=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null); peak=$(( peak + ${value:-0} ))
    value=$(awk '/^Pss:/ { print $2 }' "/proc/$pid/smaps_rollup" 2>/dev/null); pss=$(( pss + ${value:-0} ))
  done
  printf '{"engine": "%s", "session": "%s", "ready_s": %s, "rss_kib": %d, "peak_rss_kib": %d, "pss_kib": %d}\n' \
      "$1" "$2" "${SERVER_READY_S:-null}" "$rss" "$peak" "$pss" > "$OUT/server_$2_$1.json"
  log "$1 server ($2): RSS $(( rss / 1024 )) MiB, peak $(( peak / 1024 )) MiB, PSS $(( pss / 1024 )) MiB"
}
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null  # timeout passes it on to the server
  for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null
  SERVER_PID=""
  wait_port_free || log "port $PORT still taken after its server stopped"
}
trap stop_server EXIT
# bash runs a trap once the foreground command ends (each is bounded by RUN_TIMEOUT).
trap 'log "stopped by a signal"; exit 143' TERM INT

bench_serve() {  # $1 result name (workload_engine), rest: client flags
  local name=$1; shift
  local plot=() backend=()
  [ "$PLOT" = 1 ] && plot=(--plot "$OUT/$name.png")
  [[ $name == *_llamacpp* ]] && backend=(--backend llama.cpp)
  log "bench serve $name"
  x timeout "$RUN_TIMEOUT" "${TOKENSERVE[@]}" bench serve --base-url "http://127.0.0.1:$PORT" \
      --tokenizer "$MODEL_DIR" --ignore-eos --output-json "$OUT/$name.json" "${plot[@]}" \
      "${backend[@]}" "$@" \
      > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  (( rc == 0 )) || log "$name: rc=$rc, see logs/$name.log"
  sed -n '/Serving benchmark/,/^====*$/p' "$OUT/logs/$name.log" | grep -E \
      "Successful|Request throughput|Output token|TTFT|ITL|^----" | sed "s/^/    /"
}

# One server session per engine configuration, on every engine in turn.
session() {  # $1 name, $2 tokenserve flags, $3 vLLM flags, $4 llama.cpp flags ("skip": none
             # of its), $5 benchmark function, rest: its args
  local name=$1 ts_flags=$2 vllm_flags=$3 llama_flags=$4 body=$5 engine flags
  shift 5
  [ -z "$SESSIONS" ] || [[ ",$SESSIONS," == *",$name,"* ]] || return 0
  for engine in "${ENGINE_LIST[@]}"; do
    [[ -z $engine || $engine == transformers ]] && continue
    flags="$ts_flags $(ts_flags "$engine")"
    [[ $engine == vllm* ]] && flags=$vllm_flags
    if [[ $engine == llamacpp* ]]; then
      [ "$llama_flags" = skip ] && continue
      flags=$llama_flags
    fi
    # shellcheck disable=SC2086  # the flags are word lists
    start_server "$engine" "$name" $flags || continue
    "$body" "$engine" "$@"
    record_server "$engine" "$name"
    stop_server
  done
}

W2_N=$(prompts 64); W3_N=$(prompts 64); W4_SHORT=$(prompts 32); W5_N=$(prompts 32)
W4_LONG=4; [ "$QUICK" = 1 ] && W4_LONG=2
w2() {
  bench_serve "w2_rate_inf_$1" --num-prompts "$W2_N" --input-len 256 --output-len 64 \
      --request-rate inf --dataset-seed 21
  bench_serve "w2_rate_2_$1" --num-prompts "$W2_N" --input-len 256 --output-len 64 \
      --request-rate 2 --seed 0 --dataset-seed 22
}
w2_long_prefill() {  # $2: the session's threshold. W2 at 2 req/s, a prompt's tokens capped
  bench_serve "w2_lpt_$2_rate_2_$1" --num-prompts "$W2_N" --input-len 256 --output-len 64 \
      --request-rate 2 --seed 0 --dataset-seed 22
}
w3() {  # $2: on | off
  bench_serve "w3_prefix_cache_$2_$1" --dataset shared-prefix --prefix-len 1024 \
      --input-len 64 --output-len 32 --num-prompts "$W3_N" --request-rate inf --dataset-seed 3
}
w4() {  # $2: max_num_batched_tokens
  bench_serve "w4_mbt_$2_$1" --dataset mixed --num-prompts $((W4_LONG + W4_SHORT)) \
      --mixed-long-requests "$W4_LONG" --mixed-long-input-len 2048 --mixed-long-output-len 16 \
      --input-len 64 --output-len 64 --request-rate 4 --seed 0 --dataset-seed 4
}
w5() {  # $2: constrained | unconstrained
  bench_serve "w5_$2_$1" --num-prompts "$W5_N" --input-len 256 --output-len 256 \
      --request-rate inf --dataset-seed 5
}

# ------------------------------------------------------------------- startup
# tokenserve's start: seconds to /health and to a first chat answer, warm (docs/STARTUP.md).
# The peers' start times and every server's memory are in server_<session>_<engine>.json.
if has startup && runs tokenserve; then
  log "startup tokenserve: bench startup, $STARTUP_RUNS warm starts"
  # shellcheck disable=SC2086  # TS_FLAGS is a word list
  x timeout "$RUN_TIMEOUT" "${TOKENSERVE[@]}" bench startup --num-runs "$STARTUP_RUNS" \
      --output-json "$OUT/startup_tokenserve.json" -- "$TS_MODEL" \
      --max-model-len "$MAX_MODEL_LEN" $TS_FLAGS > "$OUT/logs/startup_tokenserve.log" 2>&1 \
    || log "startup tokenserve failed, see logs/startup_tokenserve.log"
  dry || sed -n '/^tokenserve bench startup/,$p' "$OUT/logs/startup_tokenserve.log" | sed "s/^/    /"
fi

# ------------------------------------------------------------------------ W1
w1() {  # $1 engine
  local engine=$1
  case $engine in
    tokenserve*)
      log "W1 $engine: bench throughput, $N1 x (256 in, 128 out)"
      # shellcheck disable=SC2046  # its flags are a word list
      x timeout "$RUN_TIMEOUT" "${TOKENSERVE[@]}" bench throughput --model "$TS_MODEL" \
          --max-model-len "$MAX_MODEL_LEN" --num-prompts "$N1" --input-len 256 --output-len 128 \
          --output-json "$OUT/w1_$engine.json" $(ts_flags "$engine") \
          > "$OUT/logs/w1_$engine.log" 2>&1 \
        || log "W1 $engine failed, see logs/w1_$engine.log"
      dry || grep -E "^Throughput" "$OUT/logs/w1_$engine.log" | sed "s/^/    /"
      ;;
    vllm*)
      log "W1 $engine: vllm bench throughput --dtype $(vllm_dtype "$engine"), $N1 x (256 in, 128 out)"
      x timeout "$RUN_TIMEOUT" "${VLLM_ENV[@]}" "${VLLM[@]}" bench throughput --model "$MODEL_DIR" \
          --dtype "$(vllm_dtype "$engine")" --max-model-len "$MAX_MODEL_LEN" --dataset-name random \
          --random-input-len 256 --random-output-len 128 --num-prompts "$N1" \
          --output-json "$OUT/w1_$engine.json" > "$OUT/logs/w1_$engine.log" 2>&1 \
        || log "W1 $engine failed, see logs/w1_$engine.log"
      dry || grep -E "^Throughput" "$OUT/logs/w1_$engine.log" | sed "s/^/    /"
      ;;
    llamacpp*)
      # llama.cpp's offline batch benchmark on W1's shape: 64 sequences of 256 prompt tokens
      # (its own filler tokens, not random ones) decoded together for 128 tokens each.
      log "W1 $engine: llama-batched-bench, $N1 x (256 in, 128 out)"
      # shellcheck disable=SC2046  # the KV flags are a word list
      if x timeout "$RUN_TIMEOUT" "$LLAMA_CPP_DIR/bin/llama-batched-bench" -m "$(llama_gguf "$engine")" \
          -c $(( N1 * 384 )) -b 2048 -ub 512 -t "$(nproc)" -tb "$(nproc)" $(llama_kv "$engine") \
          -npp 256 -ntg 128 -npl "$N1" --output-format jsonl \
          > "$OUT/logs/w1_$engine.jsonl" 2> "$OUT/logs/w1_$engine.log"; then
        dry || grep '^{' "$OUT/logs/w1_$engine.jsonl" | tail -n 1 > "$OUT/w1_$engine.json"
      else
        log "W1 $engine failed, see logs/w1_$engine.log"
      fi
      [ -s "$OUT/w1_$engine.json" ] && sed "s/^/    /" "$OUT/w1_$engine.json"
      ;;
    transformers)
      log "W1 transformers: generate, static batches of 64, $N1 x (256 in, 128 out)"
      x timeout "$RUN_TIMEOUT" "$PYTHON" benchmarks/transformers_generate.py "$MODEL_DIR" \
          --num-prompts "$N1" --input-len 256 --output-len 128 --batch-size 64 \
          --output-json "$OUT/w1_transformers.json" > "$OUT/logs/w1_transformers.log" 2>&1 \
        || log "W1 transformers failed, see logs/w1_transformers.log"
      dry || grep -E "^Throughput" "$OUT/logs/w1_transformers.log" | sed "s/^/    /"
      ;;
  esac
}
if has w1; then
  N1=$(prompts 64)
  for engine in "${ENGINE_LIST[@]}"; do
    [ -n "$engine" ] && w1 "$engine"
  done
fi

# ------------------------------------------------------------------- W2, W3, W5
main_session() {
  has w2 && w2 "$1"
  has w3 && w3 "$1" on
}
if has w2 || has w3; then
  session main "--enable-prefix-caching" "--enable-prefix-caching" "" main_session
fi
# W2 at 2 req/s with each prompt spread over steps of at most N of its tokens while other
# requests run, for each N of W2_LONG_PREFILL (--long-prefill-token-threshold, vLLM's and
# tokenserve's; llama-server's batch of N tokens splits a prompt the same way): the steps
# that carry a prompt delay the running decodes less, its first token comes later.
if has w2; then
  for lpt in $W2_LONG_PREFILL; do
    session "w2_lpt_$lpt" "--long-prefill-token-threshold $lpt" \
        "--enable-prefix-caching --long-prefill-token-threshold $lpt" "-b $lpt -ub $lpt" \
        w2_long_prefill "$lpt"
  done
fi
# llama-server has no switch that turns its prompt cache off (a request's cache_prompt does).
has w3 && session prefix_cache_off "--no-enable-prefix-caching" "--no-enable-prefix-caching" \
    skip w3 off

# ------------------------------------------------------------------------ W4
if has w4; then
  for mbt in 256 512 2048; do
    # llama-server's logical and physical batch: the most tokens of one step.
    session "w4_mbt_$mbt" "--max-num-batched-tokens $mbt" "--max-num-batched-tokens $mbt" \
        "-b $mbt -ub $mbt" w4 "$mbt"
  done
fi

# ------------------------------------------------------------------------ W5
# Each engine's run on its default cache right before the one on a 2,048-token cache: the
# figure is their ratio, and runs half an hour apart would hold the machine's drift.
# tokenserve: 16 blocks of 128 tokens = 2,048 tokens of KV cache, in blocks of the size the
# unconstrained run has (the default), so that the two runs differ in the cache's size only.
# llama-server splits its cache into fixed slots (2,048 tokens in 32 slots is 64 tokens a slot,
# less than one prompt) and does not preempt: it has no run of this shape.
if has w5; then
  ALL_ENGINES=("${ENGINE_LIST[@]}")
  for engine in "${ALL_ENGINES[@]}"; do
    [[ -z $engine || $engine == transformers ]] && continue
    ENGINE_LIST=("$engine")
    session w5_unconstrained "--enable-prefix-caching" "--enable-prefix-caching" skip \
        w5 unconstrained
    session kv_2048 "--num-kv-blocks 16 --block-size 128 --max-model-len 2048" \
        "$VLLM_W5_ARGS" skip w5 constrained
  done
  ENGINE_LIST=("${ALL_ENGINES[@]}")
fi

first_touch end
ceilings end
"$PYTHON" - "$OUT/meta.json" <<'EOF'
import json, os, sys, time
meta = json.load(open(sys.argv[1]))
meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S"), loadavg_end=os.getloadavg())
json.dump(meta, open(sys.argv[1], "w"), indent=2)
EOF
dry || flock -u 9
"$PYTHON" benchmarks/side_by_side_report.py "$OUT" | tee "$OUT/summary.md"
log "done; results in $OUT"
