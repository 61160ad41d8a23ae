#!/usr/bin/env bash
# Longest trainable context of llama-7b (MHA, vocab 32K) and llama-33h on 4 GPUs, and of llama-33h on
# 2 GPUs, ours against FSDP2 + torch CP + full AC and Megatron-style TP+SP (issue #7 item 3: per model
# and GPU count, against each baseline; llama3-8b on 2 and 4 GPUs and llama-7b on 2 GPUs are measured).
# Each attempt is a benchmarks/longest.py process (AdamW state allocated first, then ONE step here,
# --warmup 0 --steps 1); descending S, the first that trains is the record. Ours runs the settings of
# the llama3-8b 1M record (fa4 ring, Selective Checkpoint++, offloaded block inputs, 32K MLP slices,
# head chunks; 1M is the first and only attempt, so a success is a lower bound), plus
# --offload-params (FSDP2 keeps the fp32 parameter shards, gradients and AdamW state on the host:
# ~27 GB per GPU for 7B on 4 GPUs), which llama-7b at 1M needed (its attempt without it stopped in
# cuBLAS's handle creation; the strategy now also creates the backward's handles at set-up). Calls
# of <= 10 min on nvidia-h200-x4, three per session of ~28 device minutes; fa4's wheels come in two
# parts (.whl, .whl2), so a call that runs ours with fa4 needs both previous calls on the same warm
# machine. A 2-GPU pair goes side by side (GPUs 0,1 | 2,3); an attempt whose limit no longer fits
# in its call is skipped (benchmarks/longest.py).
#
# Ran 2026-11-22 (commit cda1d4e, docs/benchmarks.md "Latest"):
#   STAGE=1 (carry .whl):  copy the first fa4 wheels; llama-7b torch CP on 4 GPUs; then 2 GPUs side
#                          by side, cuDNN: llama-33h torch CP | TP+SP (34 heads).
#   STAGE=2 (carry .whl2): install fa4; ours llama-7b at 1M on 4 GPUs (OOM; OURS_1M had no --offload-params then).
#   STAGE=3:               llama-7b TP+SP on 4 GPUs; then 2 GPUs side by side: ours llama-33h | llama-7b.
# Ran 2026-11-22 (commit 8c2ff05, docs/benchmarks.md "Latest"):
#   STAGE=4 (carry .whl):  copy; GPU tests of offload_params / the handle warm-up, a 4-GPU offload_params
#                          run at 64K; llama-33h torch CP on 4 GPUs (544K, 480K, 416K): 544K trained.
#   STAGE=5 (carry .whl2): install fa4; llama-33h TP+SP (36 heads) on 4 GPUs (512K, 448K, 384K): 512K trained.
#   STAGE=6 LONG_S=917504: ours llama-33h on 4 GPUs (head chunks 3), the whole call: trained (549 s of 588).
# Not run (a 1M step of these MHA models, ~555-570 s, plus ~100 s of start-up, does not fit a 10-minute call):
#   STAGE=7:               ours llama-7b at 1M on 4 GPUs (fa4 installed: after 5 or 6 on a warm machine).
#   STAGE=8:               2 GPUs side by side, cuDNN: ours llama-33h at 384K | llama-7b at 448K (the 2-GPU
#                          settings of run_h200x2_longest.sh; stage 3 had no time left for them).
#
# Stages 6-7: give them BUDGET_S=590 (and the call timeout_s 600): a 1M step of these MHA models is
# estimated at 480-540 s (llama-7b at 768K: 298.9 s; llama3-8b at 1M: 475 s), start-up ~50 s, which
# may not fit one call: LONG_S=<S> sets the attempt's length (default 1048576).
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
  # offload_params and the handle warm-up have not run on a GPU before: their GPU tests (one GPU), and a
  # 4-GPU run of the 1M settings at 64K (cuDNN), before any long attempt relies on them
  timeout -k 10 120 python -m pytest -q -p no:cacheprovider tests/test_warmup.py \
    tests/test_checkpointing_gpu.py -k "offload_params or keeps_no_memory" 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
  SEQ=65536 train 150 --system seqpar --model llama-7b --ac selective++ --offload --offload-params --mlp-chunk 32768 \
    --head-chunks 4 --backend cudnn --warmup 1 --steps 1 --tag offload-params-smoke
  MODEL=llama-33h longest torch_cp $L33_CP_4GPU -- $ONE
elif [ "$STAGE" = 5 ]; then
  install_fa4_part2
  MODEL=llama-33h longest tp_sp $L33_TPSP_4GPU -- $ONE
elif [ "$STAGE" = 6 ]; then
  MODEL=llama-33h longest seqpar ${LONG_S:-1048576}:$(( $(left) - 5 )) -- $OURS_1M --head-chunks 3
elif [ "$STAGE" = 7 ]; then
  MODEL=llama-7b longest seqpar ${LONG_S:-1048576}:$(( $(left) - 5 )) -- $OURS_1M --head-chunks 4
elif [ "$STAGE" = 8 ]; then
  ours_2gpu
fi
longest_summary
