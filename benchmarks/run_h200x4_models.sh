#!/usr/bin/env bash
# Three back-to-back calls on nvidia-h200-x4 (each <= 10 min): training throughput of llama-7b (MHA)
# and llama-33h at 128K on 4 GPUs, ours against FSDP2 + torch CP + full checkpointing and
# Megatron-style TP+SP (issue #7 item 2's models other than llama3-8b; TP+SP pads 33 heads to 36,
# Note [Heads that do not divide W] in tp_sp.py). flash-attn 4's wheels come in two parts (.whl,
# .whl2), as in run_h200x4_fa4.sh; stages 2-3 need the machine still warm.
#
#   STAGE=1 (carry .whl): copy the first fa4 wheels; llama-7b: torch_cp, tp_sp.
#   STAGE=2 (carry .whl2): install fa4; ours (fa4, compiled blocks, 10 blocks without checkpointing):
#           llama-7b with Ulysses, llama-33h with the ring (4 does not divide 33 heads).
#   STAGE=3: llama-33h: torch_cp, tp_sp.
#   STAGE=4 / STAGE=5 (fa4 still installed): llama-7b / llama-33h at 256K, one step after the warm-up
#           each: ours (fa4, Selective Checkpoint++, head chunks 4 / 3, auto algorithm), torch_cp, tp_sp.
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_models.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"
OURS="--system seqpar --backend fa4 --compile --uncheckpointed-blocks 10"
if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  train 270 --model llama-7b --system torch_cp
  train $(( $(left) - 5 )) --model llama-7b --system tp_sp
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  train 260 --model llama-7b $OURS --algorithm ulysses
  train $(( $(left) - 5 )) --model llama-33h $OURS --algorithm ring
elif [ "$STAGE" = 3 ]; then
  train 270 --model llama-33h --system torch_cp
  train $(( $(left) - 5 )) --model llama-33h --system tp_sp
elif [ "$STAGE" = 4 ] || [ "$STAGE" = 5 ]; then
  M=llama-7b HC=4; [ "$STAGE" = 5 ] && M=llama-33h HC=3  # head chunks must divide the K/V heads (33)
  export SEQ=262144
  train 190 --model $M --system seqpar --backend fa4 --ac selective++ --head-chunks $HC --steps 1
  train 180 --model $M --system torch_cp --steps 1
  train $(( $(left) - 5 )) --model $M --system tp_sp --steps 1
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -10
echo "== done in $(( $(date +%s) - START ))s"
