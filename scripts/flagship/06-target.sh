# Session 1, call 06 (timeout_s 600): target pretraining continued; repeat this call while target_metrics.json
# says "stop": "budget" (the estimate: once). "stop": "done" ends the stage.
# carry: []
# runs: a target slice on DEV/corpus/pieces from DEV/target-state (updated there), validation and held-out
#       perplexity, the target's bf16 export into DEV/target (what regeneration decodes with)
# returns: target_metrics.json (tokens_per_s, stop, next_piece, perplexities),
#          target-state/{state.json, model-*.safetensors} (fp32 weights and the run: about 41 MB in 4 files)
source scripts/flagship/common.sh
sync_in
target_slice "${FLAGSHIP_MINUTES:-8}"
