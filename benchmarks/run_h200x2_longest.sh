#!/usr/bin/env bash
# Longest trainable context (llama3-8b, llama-7b) on 2 GPUs (nvidia-h200-x2), ours against both baselines
# (issue #7 item 3: per model and GPU count, against each baseline). Two calls, cuDNN kernel (no fa4:
# the kernel does not change what fits). Each attempt is a benchmarks/longest.py process: the AdamW
# state allocated first, then one step (seqpar) / two steps (baselines); descending S, the first
# that trains is the record.
#
#   STAGE=1: ours: full checkpointing, head_chunks 4, chunked CE; 320K, 288K, 256K.
#   STAGE=2: FSDP2 + torch CP + full AC (96K, 80K, 64K, 48K), then Megatron-style TP+SP
#            (128K, 96K, 80K, 64K) with what time is left.
#   STAGE=3: llama-7b (MHA, vocab 32K): ours at 384K (one step, ~230 s).
#   STAGE=4: llama-7b: torch CP at 256K, then 192K (one step each: two steps at 256K take ~200 s).
#   STAGE=5: llama-7b: TP+SP (160K, 128K, 96K, 80K, 64K; one step each).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x2_longest.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NPROC=2

if [ "$STAGE" = 1 ]; then
  longest seqpar 327680:300,294912:270,262144:240 -- --ac full --head-chunks 4 --warmup 0 --steps 1 --backend cudnn
elif [ "$STAGE" = 2 ]; then
  longest torch_cp 98304:100,81920:90,65536:80,49152:70
  longest tp_sp 131072:110,98304:100,81920:90,65536:80
elif [ "$STAGE" = 3 ]; then
  MODEL=llama-7b longest seqpar 393216:300 -- --ac full --head-chunks 4 --warmup 0 --steps 1 --backend cudnn
elif [ "$STAGE" = 4 ]; then
  MODEL=llama-7b longest torch_cp 262144:200,196608:150 -- --warmup 0 --steps 1
elif [ "$STAGE" = 5 ]; then
  MODEL=llama-7b longest tp_sp 163840:110,131072:100,98304:90,81920:80,65536:70 -- --warmup 0 --steps 1
fi
echo "== done in $(( $(date +%s) - START ))s"
