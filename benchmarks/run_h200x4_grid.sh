#!/usr/bin/env bash
# Three back-to-back calls on nvidia-h200-x4 (each <= 10 min) that fill the attention grid of issue #7
# item 1 at S = 512K and 1M (32K and 128K are in 20261122-nvidia-h200-x4.json): every algorithm, torch CP
# and one GPU, heads 32/32, 32/8 and 33/33, on 4 and 2 GPUs. One warm-up and one timed iteration per
# point (a 1M point is ~15 s per iteration on 4 GPUs, ~30 s on 2, ~60 s on one). flash-attn 4's wheels
# come in two parts (.whl, .whl2) as in run_h200x4_fa4.sh; stages 2-3 need the machine still warm.
#
#   STAGE=1 (carry .whl): copy the first fa4 wheels; 4 GPUs, S = 1M: MHA and 33 heads with every system
#           (33 heads: no Ulysses / 2D, 4 and 2 do not divide 33), GQA all-gather, 2D and double ring.
#   STAGE=2 (carry .whl2): install fa4; 4 GPUs, S = 512K: what 2026-11-22's runs left out; then two 2-GPU
#           runs side by side on GPUs 0,1 and 2,3 (512K every system and heads; 1M MHA and 33 heads).
#   STAGE=3 (carry nothing): one GPU, the whole sequence, each GPU its own process (1M 32/8, 32/32, 33/33;
#           512K all three); then fa4 on 4 GPUs at 512K (Ulysses, the one fa4 algorithm not measured there).
#   STAGE=4 (a fresh machine): the one-GPU references again (1M 33/33 and 512K, whose files did not come
#           back: at most 8 files per call), and the all-gather with head chunks at 1M on 4 GPUs (stage 1
#           skipped it: the memory estimate did not know head chunks).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_grid.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-570}
ATTN_ITERS=1
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"
M=1048576; K=524288

singles() {  # singles LIMIT "GPU SEQS HEADS"...: one-GPU references, one process per GPU side by side;
  # their records merged into $OUT/attention_single.{json,log} (a call returns at most 8 files: the
  # 2026-11-22 stage 3 ran before this merge and lost two of its four JSON files)
  local limit=$1; shift
  for g in "$@"; do
    set -- $g
    CUDA_VISIBLE_DEVICES=$1 ATTN_NPROC=1 ATTN_ARGS="--single-max-seq $M" attention single-$1 "$limit" "seqs=$2;heads=$3;systems=single" > /dev/null &
  done
  wait
  python - "$OUT" <<'PY'
import glob, json, os, sys
parts = sorted(glob.glob(os.path.join(sys.argv[1], "attention_single-*.json")))
json.dump([r for f in parts for r in json.load(open(f))], open(os.path.join(sys.argv[1], "attention_single.json"), "w"), indent=1)
for f in parts: os.remove(f)
PY
  cat "$OUT"/attention_single-*.log | grep TFLOP >> "$OUT/attention_single.log"; rm -f "$OUT"/attention_single-*.log
  cat "$OUT/attention_single.log"
}

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  attention 1m-w4 $(( $(left) - 10 )) \
    "seqs=$M;heads=32/32;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,seqpar:2d:2x2,seqpar:ring:inner2,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=$M;heads=33/33;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ring:inner2,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=$M;heads=32/8;systems=seqpar:allgather:chunks4,seqpar:2d:2x2,seqpar:ring:inner2"
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  attention 512k-w4 150 \
    "seqs=$K;heads=32/32;systems=seqpar:allgather:chunks4,seqpar:2d:2x2,seqpar:ring:inner2,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=$K;heads=33/33;systems=seqpar:ring:inner2,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=$K;heads=32/8;systems=seqpar:ring:inner2"
  W2="seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,torch_cp:allgather,torch_cp:alltoall"
  T=$(( $(left) - 15 ))
  CUDA_VISIBLE_DEVICES=0,1 ATTN_NPROC=2 attention w2-a $T "seqs=$K;heads=32/32;systems=$W2" "seqs=$K;heads=33/33;systems=${W2//chunks4/chunks3}" \
    "seqs=$K;heads=32/8;systems=seqpar:allgather:chunks4" "seqs=$M;heads=33/33;systems=seqpar:ring:chunks3,torch_cp:allgather" > /dev/null &
  CUDA_VISIBLE_DEVICES=2,3 ATTN_NPROC=2 attention w2-b $T "seqs=$M;heads=32/32;systems=seqpar:ring:chunks4,seqpar:ulysses,torch_cp:allgather" \
    "seqs=$M;heads=32/8;systems=seqpar:allgather:chunks4" > /dev/null &
  wait
  grep -h "^\[attention\]\|TFLOP" "$OUT"/attention_w2-*.log | tail -30
elif [ "$STAGE" = 3 ]; then
  singles $(( $(left) - 100 )) "0 $M 32/8" "1 $M 32/32" "2 $M 33/33" "3 $K 32/8,32/32,33/33"
  attention 1m-w4-33 $(( $(left) - 5 )) "seqs=$M;heads=33/33;systems=seqpar:ring:chunks3,seqpar:allgather:chunks3"
  [ "$(fa4)" = True ] && attention fa4-512k $(( $(left) - 5 )) "seqs=$K;heads=32/8;systems=seqpar:ulysses:fa4"
elif [ "$STAGE" = 4 ]; then
  singles $(( $(left) - 120 )) "0 $M 33/33" "1 $K 32/8" "2 $K 32/32" "3 $K 33/33"
  attention 1m-w4-ag $(( $(left) - 5 )) "seqs=$M;heads=32/32;systems=seqpar:allgather:chunks4" "seqs=$M;heads=33/33;systems=seqpar:allgather:chunks3"
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -40
echo "== done in $(( $(date +%s) - START ))s"
