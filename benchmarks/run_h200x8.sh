#!/usr/bin/env bash
# Issue #9 on nvidia-h200-x8 (one node, 8 GPUs, NVLink): LightSeq's single-node table (papers/lightseq.txt
# Table 1: 1x8 GPUs, 4K-32K tokens per GPU, i.e. S = 32K-256K; Llama-7B MHA, Llama-GQA (8 K/V heads),
# Llama-33H) for our ring against FSDP2 + torch-native context parallel + full AC and Megatron-style
# TP+SP (33 heads padded to 40); and the attention op at 8 ranks: 2D at hp x cp = 8x1 (Ulysses), 4x2,
# 2x4, 1x8 (the ring), the double ring (inner rings of 2 and 4), all-gather, torch CP and one GPU, with
# what attention="auto" picks next to each point. Three back-to-back calls (each <= 10 min, ~28 device
# minutes with the start); flash-attn 4's wheels come in two parts (.whl, .whl2) as in run_h200x4_fa4.sh,
# so stages 2-3 need the machine still warm.
#
# Each system trains all three models at all four lengths in ONE process (benchmarks/train.py --models
# --seqs: each length for every model before the next length; the records carry in_process and
# held_before_gb), warm-up 1, then 3/3/2/1 timed steps at 32K/64K/128K/256K.
#
#   STAGE=1 (carry .whl):  copy the first fa4 wheels; tests/test_attention_gpu.py at W = 8 (cuDNN: every
#                          algorithm, 2D at 2x4 and 4x2 in both orders, against the fp32 reference); torch CP
#                          (cuDNN SDPA) for the three models.
#   STAGE=2 (carry .whl2): install fa4; ours (fa4 ring, Selective Checkpoint++, last 8 blocks uncheckpointed)
#                          for the three models; then the attention grid at 128K (cuDNN; MHA and GQA, every system).
#   STAGE=3:               TP+SP for the three models; then, with what is left, the attention grid at 128K
#                          with 33 heads (the systems that run them) and at 512K (GQA).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x8.sh   (results under $OUT)
# Then here: python benchmarks/collect.py --kind nvidia-h200-x8 --date <yyyymmdd> <the JSON files>;
#   python benchmarks/lightseq_table.py benchmarks/results/*-nvidia-h200-x8.json       (LightSeq's Table 1)
#   python benchmarks/attention.py --table benchmarks/results/*-nvidia-h200-x8.json    (the attention grid)
#   python benchmarks/cost_model_check.py                                             (auto against the best)
set -u
BUDGET_S=${BUDGET_S:-575}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x$(nvidia-smi -L | wc -l) fa4=$(fa4)"
export NPROC=8 ATTN_NPROC=8
SEQS=32768:3,65536:3,131072:2,262144:1
MODELS=llama-7b,llama-7b-gqa,llama-33h
ONE_PROCESS="--seqs $SEQS --warmup 1"
OURS="--system seqpar --backend fa4 --algorithm ring --ac selective++ --uncheckpointed-blocks 8"
A128="seqs=131072;heads=32/32,32/8;systems=all,seqpar:2d:8x1,seqpar:2d:1x8"
A128_33="seqs=131072;heads=33/33;systems=single,seqpar:ring,seqpar:allgather,seqpar:ring:inner2,seqpar:ring:inner4,torch_cp:allgather,torch_cp:alltoall"
A512="seqs=524288;heads=32/8;systems=seqpar:ring,seqpar:ulysses,seqpar:2d:4x2,seqpar:2d:2x4,seqpar:ring:inner4,torch_cp:allgather;iters=1"

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  echo "== tests/test_attention_gpu.py on 8 GPUs, cuDNN"
  timeout -k 10 90 torchrun --nproc_per_node=8 -m pytest -s -q -p no:cacheprovider tests/test_attention_gpu.py -k cudnn \
    > "$OUT/gpu_tests_w8.log" 2>&1; echo "== rc=$? ($(( $(date +%s) - START ))s)"
  grep -E "passed|failed|FAIL" "$OUT/gpu_tests_w8.log" | tail -5
  train $(( $(left) - 5 )) --system torch_cp --models $MODELS $ONE_PROCESS
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  train 420 $OURS --models $MODELS $ONE_PROCESS
  [ "$(left)" -gt 40 ] && attention w8-128k $(( $(left) - 5 )) "$A128"
elif [ "$STAGE" = 3 ]; then
  train 450 --system tp_sp --models $MODELS $ONE_PROCESS
  [ "$(left)" -gt 40 ] && attention w8-33h-512k $(( $(left) - 5 )) "$A128_33" "$A512"
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -40
echo "== done in $(( $(date +%s) - START ))s"
