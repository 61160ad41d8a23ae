#!/usr/bin/env bash
# Four back-to-back calls on nvidia-h200-x4 (each <= 9.5 min): flash-attn 4 as our local kernel, head
# chunks, op memory, llama3-8b at 128K against torch CP, and the longest context. flash-attn 4's
# wheels are too large for one transfer (../shared/tools/fa4_wheels.sh puts them in .whl/ and .whl2/),
# so stage 1 carries .whl and stage 2 .whl2; stages 3-4 need the machine still warm (/tmp/site).
#
#   STAGE=1 (carry .whl):  copy the first wheels to /tmp/whl; attention at 128K / 512K, heads 32/8,
#           cuDNN kernel: ours (ring, Ulysses, ring with head_chunks 2 / 4) against torch CP, with op
#           memory; torch CP's longest context (llama3-8b, descending 256K, 224K, 192K).
#   STAGE=2 (carry .whl2): install flash-attn 4 into /tmp/site; GPU equivalence tests with fa4 (every
#           algorithm, head chunks) and packed documents (fa4 varlen); attention at 128K / 512K with
#           fa4 beside torch CP and one GPU (cuDNN and fa4).
#   STAGE=3: llama3-8b at 128K: ours (fa4; fa4 + 10 uncheckpointed blocks; cuDNN) and torch CP,
#           bf16 matmul peak.
#   STAGE=4: our longest context: llama3-8b at 512K, full checkpointing, head chunks 4, one step.
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_fa4.sh   (results under $OUT)
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/device_common.sh"
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"

if [ "$STAGE" = 1 ]; then
  copy_fa4_part1
  attention cudnn 200 \
    "seqs=131072;heads=32/8;systems=single,seqpar:ring,seqpar:ulysses,seqpar:ring:chunks2,seqpar:ring:chunks4,seqpar:allgather:chunks4,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=524288;heads=32/8;systems=seqpar:ring,seqpar:ring:chunks4,seqpar:ulysses,torch_cp:allgather,torch_cp:alltoall;iters=2"
  echo "== longest torch_cp ($(left)s left)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 30 $(( $(left) + 10 )) python benchmarks/longest.py \
    --system torch_cp --model llama3-8b --nproc 4 --seqs 262144:140,229376:140,196608:140 --deadline "$DEADLINE" \
    --out "$OUT/longest.json" --log "$OUT/longest.log"
elif [ "$STAGE" = 2 ]; then
  install_fa4_part2
  echo "== GPU tests with fa4 ($(left)s left)"
  timeout -k 10 220 torchrun --nproc_per_node=4 -m pytest -s -q -p no:cacheprovider tests/test_attention_gpu.py -k fa4 > "$OUT/attention_gpu_fa4.log" 2>&1
  echo "== rc=$? ($(( $(date +%s) - START ))s)"; grep -E "FAIL|passed|failed|skipped|Error" "$OUT/attention_gpu_fa4.log" | sort | uniq -c | tail -12
  timeout -k 10 120 torchrun --nproc_per_node=4 -m pytest -s -q -p no:cacheprovider tests/test_documents_gpu.py > "$OUT/documents_gpu_fa4.log" 2>&1
  echo "== rc=$? ($(( $(date +%s) - START ))s)"; grep -E "FAIL|passed|failed|Error" "$OUT/documents_gpu_fa4.log" | sort | uniq -c | tail -8
  attention fa4 $(( $(left) - 5 )) \
    "seqs=131072;heads=32/8;systems=single,single:fa4,seqpar:ring:fa4,seqpar:ulysses:fa4,seqpar:allgather:fa4,seqpar:ring:fa4:chunks4,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=524288;heads=32/8;systems=seqpar:ring:fa4,seqpar:ring:fa4:chunks4,seqpar:allgather:fa4,torch_cp:allgather,torch_cp:alltoall;iters=2"
elif [ "$STAGE" = 3 ]; then
  timeout 60 python benchmarks/matmul_peak.py --sizes 8192 --iters 20 --out "$OUT/train.json" 2>&1 | grep -v -i warn | tee -a "$OUT/train.log"
  PEAK=$(peak_tflops "$OUT/train.json")
  train 150 --system seqpar --backend fa4
  train 150 --system torch_cp
  train 160 --system seqpar --backend fa4 --uncheckpointed-blocks 10 --tag uncheckpointed10
  train 150 --system seqpar --backend cudnn
elif [ "$STAGE" = 4 ]; then
  echo "== longest seqpar ($(left)s left)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 30 $(( $(left) + 10 )) python benchmarks/longest.py \
    --system seqpar --model llama3-8b --nproc 4 --seqs 524288:520 --deadline "$DEADLINE" \
    --out "$OUT/longest.json" --log "$OUT/longest.log" -- --ac full --head-chunks 4 --warmup 0 --steps 1 --backend auto
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -30
echo "== done in $(( $(date +%s) - START ))s"
