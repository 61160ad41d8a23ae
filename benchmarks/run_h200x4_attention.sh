#!/usr/bin/env bash
# One call on nvidia-h200-x4 (~5 minutes): the attention grid of issue #7 (items 1 and 4).
# Every algorithm of ours (ring, all-gather, Ulysses, 2D 2x2, double ring), torch context_parallel
# and the one-GPU cuDNN reference, forward + backward, heads 32/8, 32/32, 33/33; S = 32K, 128K on
# 4 and 2 GPUs, 512K on 4 GPUs for the main algorithms. One torchrun per GPU count. Each record
# carries the cost model's prediction and auto choice; the summary says, per (GPUs, S, heads), the
# measured best of ours, the auto choice, and whether it is within 5% of the best.
# Usage there: SEQPAR_COMMIT=<sha> bash benchmarks/run_h200x4_attention.sh   (results under $OUT)
#
# Wall time (4xH200: ~520 TFLOP/s/GPU, so one fwd+bwd at 32 heads takes 15 ms at 32K, 0.24 s at
# 128K and 3.8 s at 512K on 4 GPUs, twice that on 2; ~1 s per measurement for cuDNN plans and
# allocation; ~15 s per torchrun start): 4 GPUs ~190 s (32K ~25 s, 128K ~55 s, 512K ~100 s),
# 2 GPUs ~90 s, summary ~1 s.  The timeouts (240 + 120 s) bound it at 6 minutes; the JSON files are
# rewritten after every measurement, so a run stopped by `timeout` keeps what it measured.
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ALL="seqs=32768,131072;heads=32/8,32/32,33/33;systems=all"

echo "== 4 GPUs"
timeout 240 torchrun --nproc_per_node=4 benchmarks/attention.py --out "$OUT/attention_4gpu.json" --iters 3 --warmup 1 \
  --grid "$ALL" \
  --grid "seqs=524288;heads=32/8;systems=seqpar:ring,seqpar:allgather,seqpar:ulysses,seqpar:2d:2x2;iters=2" \
  --grid "seqs=524288;heads=32/32;systems=seqpar:ring,seqpar:ulysses;iters=2" \
  --grid "seqs=524288;heads=33/33;systems=seqpar:ring,seqpar:allgather;iters=2" \
  2>&1 | grep -v -i warn | tee "$OUT/attention_4gpu.log"
echo "== rc=${PIPESTATUS[0]}"

echo "== 2 GPUs"
timeout 120 torchrun --nproc_per_node=2 benchmarks/attention.py --out "$OUT/attention_2gpu.json" --iters 3 --warmup 1 \
  --grid "$ALL" 2>&1 | grep -v -i warn | tee "$OUT/attention_2gpu.log"
echo "== rc=${PIPESTATUS[0]}"

python3 benchmarks/attention.py --summarize "$OUT"/attention_*gpu.json | tee "$OUT/summary.txt"
