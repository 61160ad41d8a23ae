#!/usr/bin/env bash
# run_h200x4_longest_models.sh on nvidia-h200-x8: the same attempts (issue #7 item 3: the longest
# trainable context of llama-7b and llama-33h on 4 GPUs and of llama-33h on 2, ours against torch CP
# and TP+SP), two or three runs side by side on disjoint GPUs, so four calls instead of eight (~40
# device minutes with the start; stages 1-2 and 3-4 may go in different sessions, 2 needs 1's machine
# warm and 4 needs fa4 installed by 2 or a fresh 1-2). Ours at 1M offloads block inputs to pinned
# host memory (~71 GB per rank for llama3-8b); only one such run goes at a time (4 ranks, ~290 GB of
# the node's 560 GiB).
#
#   STAGE=1 (carry .whl):  copy the first fa4 wheels; GPUs 0-3 llama-7b torch CP | GPUs 4-7 llama-33h torch CP.
#   STAGE=2 (carry .whl2): install fa4; GPUs 0-3 llama-7b TP+SP | GPUs 4-7 llama-33h TP+SP (36 heads).
#   STAGE=3:               GPUs 0-3 ours llama-7b at 1M | GPUs 4,5 llama-33h torch CP | GPUs 6,7 llama-33h TP+SP (34 heads).
#   STAGE=4:               GPUs 0-3 ours llama-33h at 1M | GPUs 4,5 ours llama-33h 2-GPU | GPUs 6,7 ours llama-7b 2-GPU.
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x8_longest_models.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-575}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l) fa4=$(fa4)"
source "$(dirname "$0")/longest_models.env"
G4a=0,1,2,3; G4b=4,5,6,7

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  CUDA_VISIBLE_DEVICES=$G4a LABEL=a MODEL=llama-7b longest torch_cp $L7_4GPU -- $ONE &
  CUDA_VISIBLE_DEVICES=$G4b LABEL=b MODEL=llama-33h longest torch_cp $L33_CP_4GPU -- $ONE &
  wait
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  CUDA_VISIBLE_DEVICES=$G4a LABEL=a MODEL=llama-7b longest tp_sp $L7_4GPU -- $ONE &
  CUDA_VISIBLE_DEVICES=$G4b LABEL=b MODEL=llama-33h longest tp_sp $L33_TPSP_4GPU -- $ONE &
  wait
elif [ "$STAGE" = 3 ]; then
  CUDA_VISIBLE_DEVICES=$G4a LABEL=a MODEL=llama-7b longest seqpar 1048576:$(( $(left) - 5 )) -- $OURS_1M --head-chunks 4 &
  CUDA_VISIBLE_DEVICES=4,5 NPROC=2 LABEL=b MODEL=llama-33h longest torch_cp $L33_CP_2GPU -- $ONE &
  CUDA_VISIBLE_DEVICES=6,7 NPROC=2 LABEL=c MODEL=llama-33h longest tp_sp $L33_TPSP_2GPU -- $ONE &
  wait
elif [ "$STAGE" = 4 ]; then
  CUDA_VISIBLE_DEVICES=$G4a LABEL=a MODEL=llama-33h longest seqpar 1048576:$(( $(left) - 5 )) -- $OURS_1M --head-chunks 3 &
  CUDA_VISIBLE_DEVICES=4,5 NPROC=2 LABEL=b MODEL=llama-33h longest seqpar $L33_OURS_2GPU -- $OURS_2GPU --head-chunks 3 &
  CUDA_VISIBLE_DEVICES=6,7 NPROC=2 LABEL=c MODEL=llama-7b longest seqpar 458752:$(( $(left) - 10 )) -- $OURS_2GPU --head-chunks 4 &
  wait
fi
longest_summary
