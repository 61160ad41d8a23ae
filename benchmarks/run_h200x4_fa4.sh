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
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=${STAGE:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s); DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
fa4() { python -c "from lightning_seqpar.attention import available_backends as a; import torch; print('fa4' in a('cuda', torch.bfloat16, 128))" 2>/dev/null; }
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"

attention() {  # attention LABEL LIMIT GRID...
  local label=$1 limit=$2; shift 2
  local t=$(( $(left) < limit ? $(left) : limit ))
  echo "== attention $label (limit ${t}s)"
  local grids=(); for g in "$@"; do grids+=(--grid "$g"); done
  timeout -k 10 "$t" torchrun --nproc_per_node=4 benchmarks/attention.py --out "$OUT/attention_$label.json" --iters 3 --warmup 1 \
    "${grids[@]}" 2>&1 | grep -v -i warn | tee "$OUT/attention_$label.log"
}

train() {  # train LIMIT ARGS...: one llama3-8b run at 128K
  local limit=$1; shift
  local t=$(( $(left) < limit ? $(left) : limit ))
  if [ "$t" -lt 60 ]; then echo "== skip train $*: ${t}s left" | tee -a "$OUT/train.log"; return; fi
  echo "== train $* (limit ${t}s)" | tee -a "$OUT/train.log"
  timeout -k 20 "$t" torchrun --nproc_per_node=4 --master_port=$((29500 + RANDOM % 2000)) benchmarks/train.py \
    --model llama3-8b --seq 131072 --warmup 1 --steps 3 ${PEAK:+--matmul-peak $PEAK} --out "$OUT/train.json" "$@" > "$OUT/run.tmp" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/run.tmp" | grep -E "^\[train\]|Error|error|exitcode" | tail -6 | tee -a "$OUT/train.log"
  echo "== rc=$rc ($(( $(date +%s) - START ))s elapsed)" | tee -a "$OUT/train.log"
  rm -f "$OUT/run.tmp"
}

if [ "$STAGE" = 1 ]; then
  mkdir -p /tmp/whl && cp .whl/* /tmp/whl/ && echo "== copied .whl to /tmp/whl ($(ls /tmp/whl | wc -l) files)"
  attention cudnn 200 \
    "seqs=131072;heads=32/8;systems=single,seqpar:ring,seqpar:ulysses,seqpar:ring:chunks2,seqpar:ring:chunks4,seqpar:allgather:chunks4,torch_cp:allgather,torch_cp:alltoall" \
    "seqs=524288;heads=32/8;systems=seqpar:ring,seqpar:ring:chunks4,seqpar:ulysses,torch_cp:allgather,torch_cp:alltoall;iters=2"
  echo "== longest torch_cp ($(left)s left)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 30 $(( $(left) + 10 )) python benchmarks/longest.py \
    --system torch_cp --model llama3-8b --nproc 4 --seqs 262144:140,229376:140,196608:140 --deadline "$DEADLINE" \
    --out "$OUT/longest.json" --log "$OUT/longest.log"
elif [ "$STAGE" = 2 ]; then
  cp .whl2/* /tmp/whl/ && cat /tmp/whl/cu13part.* > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
    && rm /tmp/whl/cu13part.* \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/whl/*.whl 2>&1 | tail -2
  echo "== fa4 available: $(fa4) ($(( $(date +%s) - START ))s)"
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
  PEAK=$(python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x.get('bench')=='matmul']; print(round(r[-1]['tflops'],1) if r else '')" "$OUT/train.json" 2>/dev/null)
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
