# Session 1, call 05 (timeout_s 600): target pretraining, 8 minutes of steps; the first call starts the run.
# carry: []
# runs: a target slice on DEV/corpus/pieces from DEV/target-state (updated there), validation and held-out
#       perplexity, the target's bf16 export into DEV/target (what regeneration decodes with)
# returns: target_metrics.json (tokens_per_s, stop, next_piece, perplexities),
#          target-state/{state.json, model-*.safetensors} (fp32 weights and the run: about 41 MB in 4 files)
source scripts/flagship/common.sh
sync_in
target_slice "${FLAGSHIP_MINUTES:-8}"
