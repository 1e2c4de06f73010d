# Sourced by every call script of the flagship run (see blockspec/train/recipes/flagship.py's docstring).
# DEV is the run's home on the device machine: it lives while the machine stays warm (30 s after a call).
# What a call carried under out/flagship lands in DEV without replacing anything there: within a lease
# DEV holds the newest state, and an older carried copy (still in the device's checkout) never wins.
source scripts/gpu/env.sh  # wheels, PYTHONPATH, OUT, device_info
DEV=${FLAGSHIP_DEV:-/tmp/flagship}
mkdir -p "$DEV"

sync_in() {
  if [ -d out/flagship ]; then cp -rn out/flagship/. "$DEV/"; fi
  echo "== DEV after sync:"; (cd "$DEV" && find . -maxdepth 3 -type f -printf '%8k KiB  %p\n' | sort -k3 | head -60)
}

flagship() { python -m blockspec.train.recipes.flagship "$@"; }

# every piece that is here is read back and its hashes checked, so a broken transfer fails now
check_pieces() {
  python - "$@" <<'PY'
import sys
from pathlib import Path
from blockspec.train.corpus import load_piece
for d in sys.argv[1:]:
    for p in sorted(Path(d).glob("*.u16.xz")):
        print(f"ok {p.name}: {len(load_piece(p)):,} tokens")
PY
}

target_slice() {  # $1: minutes of training; the target's bf16 export is refreshed in DEV/target each call.
  # FLAGSHIP_TARGET_SHIP=run (a target whose fp32 weights a call cannot return): the weights stay in DEV, and the
  # call that ends the stage returns the bf16 export (16 MiB shards, no tokenizer) as target/
  local groups=${FLAGSHIP_TARGET_SHIP:-model,run}
  flagship target --pieces "$DEV/corpus/pieces" --state "$DEV/target-state" --minutes "$1" \
    --export "$DEV/target" --out "$OUT" --ship "$groups"
  if [[ ",$groups," != *,model,* ]] && grep -q '"stop": "done"' "$OUT/target_metrics.json"; then
    mkdir -p "$OUT/target" && cp "$DEV"/target/{config,generation_config}.json "$DEV"/target/model*.safetensors* "$OUT/target/"
  fi
}

regen_slice() {  # $1: minutes of generation; this slice's pieces and the state go to OUT/regen and DEV/regen;
  # FLAGSHIP_PROMPTS: the prompts' folder under out/flagship (default prompts; prompts-seed1 gives rows that
  # the shipped drafters never saw)
  mkdir -p "$DEV/regen"
  [ -d "$DEV/target" ] || cp -r blockspec/assets/default/target "$DEV/target"  # the shipped target, once it is
  flagship regen --target "$DEV/target" --prompts "$DEV/${FLAGSHIP_PROMPTS:-prompts}" --state "$DEV/regen/regen_state.json" \
    --minutes "$1" --out "$OUT/regen"
  cp "$OUT"/regen/* "$DEV/regen/"
}

drafter_slice() {  # $1: dflash | dspark, $2: minutes; FLAGSHIP_EPOCHS, FLAGSHIP_LAYERS, FLAGSHIP_INIT (a new state
  # only: its epochs, depth, and the drafter export it starts from), FLAGSHIP_STATE, FLAGSHIP_SHIP (the state
  # groups returned; run,best is what an export needs)
  local state="${FLAGSHIP_STATE:-$1-state}"
  [ -d "$DEV/target" ] || cp -r blockspec/assets/default/target "$DEV/target"  # the shipped target, once it is
  flagship drafter --method "$1" --target "$DEV/target" --rows "$DEV/regen" --state "$DEV/$state" \
    --minutes "$2" --out "$OUT" ${FLAGSHIP_EPOCHS:+--epochs "$FLAGSHIP_EPOCHS"} ${FLAGSHIP_LAYERS:+--layers "$FLAGSHIP_LAYERS"} \
    ${FLAGSHIP_INIT:+--init "$FLAGSHIP_INIT"} ${FLAGSHIP_SHIP:+--ship "$FLAGSHIP_SHIP"}
}
