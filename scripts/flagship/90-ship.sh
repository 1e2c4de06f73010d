# Fallback, before a lease ends with a stage unfinished: return part K of a state's AdamW moments.
# Usage: bash scripts/flagship/90-ship.sh STATE K   (STATE: target-state | dflash-state | dspark-state;
#        `flagship ship --state DEV/STATE --groups optimizer` lists the parts: the target's 81 MB are 2)
# carry: []
# returns: STATE/{state.json, optimizer-*.safetensors} (part K); local.sh collect merges the parts
source scripts/flagship/common.sh
flagship ship --state "$DEV/${1:?state}" --groups optimizer
flagship ship --state "$DEV/$1" --groups optimizer --part "${2:?part}" --out "$OUT"
