#!/usr/bin/env bash
# The flagship run's local (CPU) side, around the device calls. From the repository root:
#   bash scripts/flagship/local.sh prepare          # once: re-cut the corpus (<= 20 MiB pieces) and the prompts
#   bash scripts/flagship/local.sh collect DIR      # after each call: its returned files (files_at) into out/flagship
#   bash scripts/flagship/local.sh export-target    # out/flagship/target (bf16, one file) from the returned weights
#   bash scripts/flagship/local.sh export-drafters  # out/flagship/{dflash,dspark} from the returned states' best
#   bash scripts/flagship/local.sh carry PATH...    # would a call carrying these paths fit in 64 MiB?
set -euo pipefail
flagship() { python -m blockspec.train.recipes.flagship "$@"; }
case "${1:?command}" in
  prepare)
    flagship recut --corpus out/corpus --out out/flagship/corpus --max-piece-mib 20
    flagship prompts --corpus out/flagship/corpus --out out/flagship/prompts ;;
  collect) flagship collect "${2:?the folder of the returned files}" --into out/flagship ;;
  export-target)
    flagship export-target --state out/flagship/target-state --tokenizer out/flagship/corpus/tokenizer \
      --out out/flagship/target ;;
  export-drafters)
    for m in dflash dspark; do
      flagship export-drafter --state "out/flagship/$m-state" --target out/flagship/target --out "out/flagship/$m"
    done ;;
  carry) shift; flagship carry "$@" ;;
  *) echo "unknown command $1" >&2; exit 2 ;;
esac
