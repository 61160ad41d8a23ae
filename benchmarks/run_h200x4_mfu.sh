#!/usr/bin/env bash
# MFU work on nvidia-h200-x4 (issue #7): llama3-8b at 128K, where the step's time goes (profile with
# idle-gap causes) and what compile / fused AdamW / more uncheckpointed blocks buy. flash-attn 4's
# wheels come in two carries (../shared/tools/fa4_wheels.sh), as in run_h200x4_fa4.sh.
#
#   STAGE=1 (carry .whl):  copy the first wheels to /tmp/whl; bf16 matmul peak; torch CP baseline;
#           ours with cuDNN (+10 uncheckpointed blocks), eager and compiled, each profiled.
#   STAGE=2 (carry .whl2): install flash-attn 4 into /tmp/site; ours with fa4, eager and compiled.
#   STAGE=3: RUNS="args;args;..." — one train.py run per ;-separated argument list (warm machine;
#           NPROC=2 SEQ=65536 for a 2-GPU machine).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_mfu.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-570} TRAIN_MIN_S=${TRAIN_MIN_S:-70}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"
PEAK=$(peak_tflops /tmp/matmul.json)

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  timeout 60 python benchmarks/matmul_peak.py --sizes 8192 --iters 20 --out /tmp/matmul.json 2>&1 | grep -v -i warn | tee -a "$OUT/train.log"
  cp /tmp/matmul.json "$OUT/matmul.json"
  PEAK=$(peak_tflops /tmp/matmul.json)
  train 150 --system torch_cp
  train 170 --system seqpar --backend cudnn --uncheckpointed-blocks 10 --profile "$OUT/prof" --tag cudnn-u10
  train 230 --system seqpar --backend cudnn --uncheckpointed-blocks 10 --compile --profile "$OUT/prof" --tag cudnn-u10-compile
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  train 170 --system seqpar --backend fa4 --uncheckpointed-blocks 10 --profile "$OUT/prof" --tag fa4-u10
  train 200 --system seqpar --backend fa4 --uncheckpointed-blocks 10 --compile --tag fa4-u10-compile
  train 200 --system seqpar --backend fa4 --uncheckpointed-blocks 14 --compile --tag fa4-u14-compile
elif [ "$STAGE" = 3 ]; then
  IFS=';' read -ra runs <<< "${RUNS:-}"
  for r in "${runs[@]}"; do
    # shellcheck disable=SC2086
    train 300 --system seqpar $r
  done
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -30
echo "== done in $(( $(date +%s) - START ))s"
