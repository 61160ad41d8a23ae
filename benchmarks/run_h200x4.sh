#!/usr/bin/env bash
# One call on nvidia-h200-x4: attention benchmark vs torch context_parallel, the bf16 GPU
# equivalence suite, and llama3-8b training at 128K (ours vs FSDP2 + torch CP + full AC).
# Usage there: SEQPAR_COMMIT=<sha> bash benchmarks/run_h200x4.sh   (results under $OUT)
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { local t=$1; shift; echo "== $*"; timeout "$t" "$@"; echo "== rc=$?"; }
run 110 torchrun --nproc_per_node=4 benchmarks/attention.py --seqs 131072,524288 --heads 32/8 --iters 3 --warmup 1 \
  --systems seqpar:ring,torch_cp:allgather,torch_cp:alltoall --out "$OUT/attention.json" 2>&1 | grep -v -i warn | tee "$OUT/attention.log"
run 130 torchrun --nproc_per_node=4 -m pytest -s -q -p no:cacheprovider tests/test_attention_gpu.py > "$OUT/gpu_tests.log" 2>&1
grep -cE "\(tol\)|2x1gpu" "$OUT/gpu_tests.log"; grep -E "FAIL|passed|failed" "$OUT/gpu_tests.log" | tail -5
for sys in seqpar torch_cp; do
  run 165 torchrun --nproc_per_node=4 benchmarks/train.py --system $sys --model llama3-8b --seq 131072 --warmup 1 --steps 3 \
    --out "$OUT/train.json" > "$OUT/train_$sys.log" 2>&1
  grep -E "^\[train\]|Error|error" "$OUT/train_$sys.log" | tail -4
done
