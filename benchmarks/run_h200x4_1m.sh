#!/usr/bin/env bash
# Three back-to-back calls on nvidia-h200-x4 (each <= 10 min): the attention op at S = 1M on 4 GPUs
# (issue #7 item 1), the ring's bf16 equivalence at W = 2 with the block-decomposition criterion, and
# llama3-8b trained at 1M tokens on 4 GPUs (Selective Checkpoint++, block inputs offloaded to host
# memory, sequence-tiled MLP). flash-attn 4's wheels come in two parts (.whl, .whl2), as in
# run_h200x4_fa4.sh; stages 2-3 need the machine still warm.
#
#   STAGE=1 (carry .whl): copy the first fa4 wheels; tests/test_attention_gpu.py -k "ring and cudnn"
#           on 2 of the GPUs; attention fwd+bwd at S = 1M, heads 32/8, cuDNN: ours (ring + head_chunks 4,
#           Ulysses) against torch CP (all-gather, all-to-all).
#   STAGE=2 (carry .whl2): install fa4; attention at 1M with fa4 (ring + head_chunks 4, Ulysses);
#           one training step of llama3-8b at 512K with the 1M settings (peak GPU and host memory, step
#           time: the 1M step is ~4x the attention part).
#   STAGE=3 (carry nothing; fa4 stays in /tmp/site): one training step of llama3-8b at 1,048,576 tokens (benchmarks/longest.py).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_1m.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-570}
ATTN_ITERS=1
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"
LONG_ARGS="--ac selective++ --head-chunks 4 --offload --mlp-chunk 32768 --warmup 0 --steps 1 --backend auto"

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  echo "== GPU test ring cudnn at W=2 ($(left)s left)"
  CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 150 torchrun --nproc_per_node=2 -m pytest -s -q -p no:cacheprovider \
    tests/test_attention_gpu.py -k "ring and cudnn" > "$OUT/attention_gpu_ring_w2.log" 2>&1
  echo "== rc=$? ($(( $(date +%s) - START ))s)"; grep -E "gpu-equivalence|passed|failed" "$OUT/attention_gpu_ring_w2.log" | grep -E "FAIL|blocks|passed|failed" | head -20
  attention cudnn $(( $(left) - 10 )) \
    "seqs=1048576;heads=32/8;systems=seqpar:ring:chunks4,seqpar:ulysses,torch_cp:allgather,torch_cp:alltoall"
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  attention fa4 200 "seqs=1048576;heads=32/8;systems=seqpar:ring:fa4:chunks4,seqpar:ulysses:fa4"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True SEQ=524288 train $(( $(left) - 5 )) --system seqpar $LONG_ARGS --prealloc-optimizer --tag offload-512k
elif [ "$STAGE" = 3 ]; then
  echo "== longest seqpar 1M ($(left)s left)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 30 $(( $(left) + 10 )) python benchmarks/longest.py \
    --system seqpar --model llama3-8b --nproc 4 --seqs 1048576:$(( $(left) - 5 )) --deadline "$DEADLINE" \
    --out "$OUT/longest.json" --log "$OUT/longest.log" -- $LONG_ARGS
  grep -E "^\[train\]|OOM|Error" "$OUT/longest.log" | tail -5
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -30
echo "== done in $(( $(date +%s) - START ))s"
