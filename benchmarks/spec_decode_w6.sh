#!/usr/bin/env bash
# W6 (input-grounded: repeat or lightly edit a ~300-token passage, 256 tokens out) at batch 1
# and 8, without and with speculative decoding, interleaved: ROUNDS rounds of off / ngram /
# draft_model each, every run its own process (tokenserve bench throughput, model load timed
# apart). Results: $OUT/w6_b<batch>_<mode>_r<round>.json; summary: spec_decode_w6_report.py.
# The draft model defaults to the target itself (no smaller SmolLM2 is at hand here).
set -euo pipefail
OUT=${OUT:-/tmp/w6}
ROUNDS=${ROUNDS:-2}
BATCHES=${BATCHES:-"1 8"}
MODES=${MODES:-"off ngram draft_model"}
DRAFT_MODEL=${DRAFT_MODEL:-$(python -c "from tokenserve.model.loader import default_model_path; print(default_model_path())")}
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
DRAFT="{\"method\": \"draft_model\", \"model\": \"$DRAFT_MODEL\", \"num_speculative_tokens\": 4}"
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for batch in $BATCHES; do
    for mode in $MODES; do
      spec=()
      [ "$mode" = ngram ] && spec=(--speculative-config "$NGRAM")
      [ "$mode" = draft_model ] && spec=(--speculative-config "$DRAFT")
      python -m tokenserve.entrypoints.cli bench throughput --dataset grounded-edit \
        --num-prompts "$batch" --output-len 256 --max-num-seqs "$batch" "${spec[@]}" \
        --output-json "$OUT/w6_b${batch}_${mode}_r${round}.json" | tail -n 3
    done
  done
done
