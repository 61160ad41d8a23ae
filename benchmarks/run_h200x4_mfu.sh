#!/usr/bin/env bash
# MFU work on nvidia-h200-x4 (issue #7): llama3-8b at 128K, where the step's time goes (profile with
# idle-gap causes) and what compile / fused AdamW / more uncheckpointed blocks buy. flash-attn 4's
# wheels come in two carries (../shared/tools/fa4_wheels.sh), as in run_h200x4_fa4.sh.
#
#   STAGE=1 (carry .whl):  copy the first wheels to /tmp/whl; bf16 matmul peak; torch CP baseline;
#           ours with cuDNN (+10 uncheckpointed blocks), eager and compiled, each profiled.
#   STAGE=2 (carry .whl2): install flash-attn 4 into /tmp/site; ours with fa4, eager and compiled.
#   STAGE=3: RUNS="args;args;..." — one train.py run per ;-separated argument list (warm machine;
#           NPROC=2 SEQ=65536 for a 2-GPU machine).
#
# Usage there: SEQPAR_COMMIT=<sha> STAGE=<n> bash benchmarks/run_h200x4_mfu.sh   (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=${STAGE:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
BUDGET_S=${BUDGET_S:-570}
START=$(date +%s); DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
fa4() { python -c "from lightning_seqpar.attention import available_backends as a; import torch; print('fa4' in a('cuda', torch.bfloat16, 128))" 2>/dev/null; }
echo "== STAGE=$STAGE commit=${SEQPAR_COMMIT:-unknown} $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) fa4=$(fa4)"
PEAK=$(python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x.get('bench')=='matmul']; print(round(r[-1]['tflops'],1) if r else '')" /tmp/matmul.json 2>/dev/null)

train() {  # train LIMIT ARGS...: one llama3-8b run at 128K (rank 0 prints the [train] / [profile] lines)
  local limit=$1; shift
  local t=$(( $(left) < limit ? $(left) : limit ))
  if [ "$t" -lt 70 ]; then echo "== skip train $*: ${t}s left" | tee -a "$OUT/train.log"; return; fi
  echo "== train $* (limit ${t}s)" | tee -a "$OUT/train.log"
  timeout -k 20 "$t" torchrun --nproc_per_node=${NPROC:-4} --master_port=$((29500 + RANDOM % 2000)) benchmarks/train.py \
    --model llama3-8b --seq ${SEQ:-131072} --warmup 1 --steps 3 ${PEAK:+--matmul-peak $PEAK} --out "$OUT/train.json" "$@" > "$OUT/run.tmp" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/run.tmp" | grep -E "^\[train\]|Error|error|exitcode" | tail -6 | tee -a "$OUT/train.log"
  echo "== rc=$rc ($(( $(date +%s) - START ))s elapsed)" | tee -a "$OUT/train.log"
  [ "$rc" = 0 ] || grep -v -i warn "$OUT/run.tmp" | tail -30 > "$OUT/failed_$(date +%s).log"
  rm -f "$OUT/run.tmp"
}

if [ "$STAGE" = 1 ]; then
  mkdir -p /tmp/whl && cp .whl/* /tmp/whl/ && echo "== copied .whl to /tmp/whl ($(ls /tmp/whl | wc -l) files)"
  timeout 60 python benchmarks/matmul_peak.py --sizes 8192 --iters 20 --out /tmp/matmul.json 2>&1 | grep -v -i warn | tee -a "$OUT/train.log"
  cp /tmp/matmul.json "$OUT/matmul.json"
  PEAK=$(python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x.get('bench')=='matmul']; print(round(r[-1]['tflops'],1) if r else '')" /tmp/matmul.json 2>/dev/null)
  train 150 --system torch_cp
  train 170 --system seqpar --backend cudnn --uncheckpointed-blocks 10 --profile "$OUT/prof" --tag cudnn-u10
  train 230 --system seqpar --backend cudnn --uncheckpointed-blocks 10 --compile --profile "$OUT/prof" --tag cudnn-u10-compile
elif [ "$STAGE" = 2 ]; then
  cp .whl2/* /tmp/whl/ && cat /tmp/whl/cu13part.* > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
    && rm /tmp/whl/cu13part.* \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/whl/*.whl 2>&1 | tail -2
  echo "== fa4 available: $(fa4) ($(( $(date +%s) - START ))s)"
  train 170 --system seqpar --backend fa4 --uncheckpointed-blocks 10 --profile "$OUT/prof" --tag fa4-u10
  train 200 --system seqpar --backend fa4 --uncheckpointed-blocks 10 --compile --tag fa4-u10-compile
  train 200 --system seqpar --backend fa4 --uncheckpointed-blocks 14 --compile --tag fa4-u14-compile
elif [ "$STAGE" = 3 ]; then
  IFS=';' read -ra runs <<< "${RUNS:-}"
  for r in "${runs[@]}"; do
    # shellcheck disable=SC2086
    train 300 --system seqpar $r
  done
fi
python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -30
echo "== done in $(( $(date +%s) - START ))s"
