#!/usr/bin/env bash
# One-GPU runs of benchmarks/hf.py families side by side: one lane per GPU of this machine, all lanes at once, each
# lane its lengths in order (a lane stops at its first failed length: its last record then says which length failed).
#
#   OUT=... SEQPAR_COMMIT=<hash> bash benchmarks/lanes.sh LIMIT_S \
#       "NAME|SITE|LENGTHS|hf.py families flags" ...      # lane i runs on GPU i
#
# SITE "fa4": flash-attention 4 carried into /tmp/site is importable (Note [Carrying flash-attention 4] in
# benchmarks/driver.py); "none": it is not (what a user without the `gpu` extra runs). Each lane writes
# $OUT/NAME.json (records) and $OUT/NAME.log; the lanes share nothing but the host (CPU cores, PCIe), which the
# records' "lanes" field names. LIMIT_S: seconds for all lanes (each lane is killed at the limit).
set -u
limit=$1; shift
OUT=${OUT:-.}; mkdir -p "$OUT"
commit=${SEQPAR_COMMIT:-unknown}
fa4="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache PYTHONUNBUFFERED=1
lanes=$#
failed() {  # did the last record of $1 fail?
  python -c "import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if r and r[-1].get('error') else 1)" "$1" 2>/dev/null
}
lane() {
  local gpu=$1 spec=$2 name site lengths flags s
  IFS='|' read -r name site lengths flags <<< "$spec"
  local path=$PWD; [ "$site" = fa4 ] && path="$fa4:$PWD"
  for s in ${lengths//,/ }; do
    echo "== lane $name (GPU $gpu, site $site) S=$s: $flags" >> "$OUT/$name.log"
    CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$path SEQPAR_LANES="$lanes" python benchmarks/hf.py families --shapes llama3.2-1b --seq "$s" \
      --commit "$commit" --out "$OUT/$name.json" $flags >> "$OUT/$name.log" 2>&1
    failed "$OUT/$name.json" && break
  done
}
i=0
for spec in "$@"; do
  timeout -k 5 "$limit" bash -c "$(declare -f lane failed); fa4='$fa4' OUT='$OUT' commit='$commit' lanes='$lanes'; lane $i '$spec'" &
  i=$((i + 1))
done
wait
for spec in "$@"; do
  name=${spec%%|*}
  echo "== $name"; grep -h "^\[hf\]" "$OUT/$name.log" || tail -3 "$OUT/$name.log"
done
