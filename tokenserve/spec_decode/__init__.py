"""Speculative decoding: proposers of draft tokens and their configuration.

- `config.py`: `speculative_config` (vLLM's keys) → a validated `SpeculativeConfig`.
- `ngram_proposer.py`: prompt lookup (n-gram), no model.
- `draft_model_proposer.py`: a smaller model with the target's vocabulary and its own KV
  cache, kept in step with the target's through the same block tables.
- `proposer.py`: the interface the runner calls, the n-gram one behind it, shared rules;
  `selector.py`: `build_proposer`.

The counts (drafts, draft tokens, accepted tokens per position) are the scheduler's:
`SpecDecodingStats` in messages/engine_core.py, exported by metrics/.

The worker's model runner calls a proposer after sampling; the drafts travel back in
`ModelRunnerOutput.draft_token_ids` to `Scheduler.update_draft_token_ids`, and the next
step verifies them with `sample/rejection_sampler.py`.
"""
