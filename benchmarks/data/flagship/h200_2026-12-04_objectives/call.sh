# DFlash arms from the shipped drafter on the seed-1 rows (4 epochs): CE (control), CE + KL, 0.1 CE + 0.9 L1.
source scripts/flagship/common.sh
set +e
sync_in > /dev/null
check_pieces "$DEV/regen"
T=blockspec/assets/default/target
arm() {  # name minutes extra-flags...
  local name=$1 minutes=$2 t0=$SECONDS; shift 2
  flagship drafter --method dflash --target $T --rows "$DEV/regen" --state "$DEV/$name" --minutes "$minutes" \
    --out "$DEV/m/$name" --epochs 4 --init blockspec/assets/default/dflash --ship "" "$@" 2>&1 | tail -3
  flagship export-drafter --state "$DEV/$name" --target $T --out "$DEV/x/$name" 2>&1 | tail -1
  echo "== arm $name done in $((SECONDS - t0)) s"
}
arm ce 1.6
arm ce_kl 1.6 --kl-alpha 1.0
arm l1 1.6 --ce-alpha 0.1 --l1-alpha 0.9
cd "$DEV" && tar cf "$OUT/kd.tar" m x && ls -la "$OUT"
