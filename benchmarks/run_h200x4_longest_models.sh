#!/usr/bin/env bash
# Longest trainable context of llama-7b (MHA, vocab 32K) and llama-33h on 4 GPUs, and of llama-33h on
# 2 GPUs, ours against FSDP2 + torch CP + full AC and Megatron-style TP+SP (issue #7 item 3: per model
# and GPU count, against each baseline; llama3-8b on 2 and 4 GPUs and llama-7b on 2 GPUs are measured).
# Each attempt is a benchmarks/longest.py process (AdamW state allocated first, then ONE step here,
# --warmup 0 --steps 1); descending S, the first that trains is the record. Ours runs the settings of
# the llama3-8b 1M record (fa4 ring, Selective Checkpoint++, offloaded block inputs, 32K MLP slices,
# head chunks; 1M is the first and only attempt, so a success is a lower bound). Six calls on
# nvidia-h200-x4, each <= 10 min, three per session of ~28 device minutes (1-3, then 4-6); fa4's
# wheels come in two parts (.whl, .whl2) and stages 2-3 / 5-6 need the machine still warm. The
# 2-GPU runs go side by side (GPUs 0,1 | 2,3) in what a 4-GPU search leaves of its call; an attempt
# whose limit no longer fits is skipped (benchmarks/longest.py), and stages 7-8 run them alone.
#
#   STAGE=1 (carry .whl):  copy the first fa4 wheels; llama-7b torch CP on 4 GPUs (576K, 512K, 448K);
#                          then 2 GPUs side by side, cuDNN: llama-33h torch CP | TP+SP (34 heads).
#   STAGE=2 (carry .whl2): install fa4; ours llama-7b at 1M on 4 GPUs (~500 s).
#   STAGE=3:               llama-7b TP+SP on 4 GPUs (576K, 512K, 448K); then 2 GPUs side by side:
#                          ours llama-33h at 384K | ours llama-7b at 448K (full AC, cuDNN, the 2-GPU
#                          settings of run_h200x2_longest.sh; llama-7b's 393,216 there was its only attempt).
#   STAGE=4 (carry .whl):  copy; llama-33h torch CP on 4 GPUs (544K, 480K, 416K).
#   STAGE=5 (carry .whl2): install fa4; ours llama-33h at 1M on 4 GPUs (head chunks 3).
#   STAGE=6:               llama-33h TP+SP (36 heads) on 4 GPUs (512K, 448K, 384K).
#   STAGE=7 / 8:           the 2-GPU pairs of stage 1 / stage 3 alone (those not run yet).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_longest_models.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-575}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"
source "$(dirname "$0")/longest_models.env"

baselines_2gpu() {
  CUDA_VISIBLE_DEVICES=0,1 NPROC=2 LABEL=a MODEL=llama-33h longest torch_cp $L33_CP_2GPU -- $ONE &
  CUDA_VISIBLE_DEVICES=2,3 NPROC=2 LABEL=b MODEL=llama-33h longest tp_sp $L33_TPSP_2GPU -- $ONE &
  wait
}
ours_2gpu() {
  CUDA_VISIBLE_DEVICES=0,1 NPROC=2 LABEL=a MODEL=llama-33h longest seqpar $L33_OURS_2GPU -- $OURS_2GPU --head-chunks 3 &
  CUDA_VISIBLE_DEVICES=2,3 NPROC=2 LABEL=b MODEL=llama-7b longest seqpar 458752:340 -- $OURS_2GPU --head-chunks 4 &
  wait
}

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  MODEL=llama-7b longest torch_cp $L7_4GPU -- $ONE
  baselines_2gpu
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  MODEL=llama-7b longest seqpar 1048576:$(( $(left) - 5 )) -- $OURS_1M --head-chunks 4
elif [ "$STAGE" = 3 ]; then
  MODEL=llama-7b longest tp_sp $L7_4GPU -- $ONE
  ours_2gpu
elif [ "$STAGE" = 4 ]; then
  copy_fa4_part1
  MODEL=llama-33h longest torch_cp $L33_CP_4GPU -- $ONE
elif [ "$STAGE" = 5 ]; then
  install_fa4_part2
  MODEL=llama-33h longest seqpar 1048576:$(( $(left) - 5 )) -- $OURS_1M --head-chunks 3
elif [ "$STAGE" = 6 ]; then
  MODEL=llama-33h longest tp_sp $L33_TPSP_4GPU -- $ONE
elif [ "$STAGE" = 7 ]; then
  baselines_2gpu
elif [ "$STAGE" = 8 ]; then
  ours_2gpu
fi
longest_summary
