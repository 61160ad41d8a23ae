#!/usr/bin/env bash
# One call (<= 9 min wall) on nvidia-h200-x4: llama3-8b training, ours against both baselines.
#
#   PART=compare (default, ~7.5 min): bf16 matmul peak; llama3-8b at 128K: seqpar, tp_sp (Megatron
#       TP+SP), torch_cp (warmup 1, steps 3, with MFU against the measured peak); then the longest
#       context of torch_cp on 4 GPUs.
#   PART=longest (~7-9 min): the longest context of seqpar on 4 GPUs, then of tp_sp if time is left.
#   PART=hf (~9 min): the packed-document GPU test (tests/test_documents_gpu.py), a Hugging Face
#       Llama (llama3-8b shape) fine-tuned at 128K with packed documents (benchmarks/hf_finetune.py),
#       then llama3-8b at 128K: torch_cp, tp_sp, seqpar, and the bf16 matmul peak.
#
# Usage there: SEQPAR_COMMIT=<sha> [PART=longest] bash benchmarks/run_h200x4_train.sh   (results under $OUT)
# Every step runs under `timeout` and within one deadline (BUDGET_S seconds from the start): a step
# whose limit does not fit is skipped and says so. Files in $OUT: train.json, train.log,
# longest.json, longest.log, summary.txt. Merge here with:
#   python benchmarks/collect.py --kind nvidia-h200-x4 --date <yyyymmdd> <files_at>/train.json <files_at>/longest.json
set -u
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-compare}
BUDGET_S=${BUDGET_S:-530}
START=$(date +%s); DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
# overridable for a CPU dry run of this script: DEVICE=cpu NPROC=2 MODEL=tiny SEQ=256 SEQPAR_SEQS=... bash ...
MODEL=${MODEL:-llama3-8b}; NPROC=${NPROC:-4}; DEVICE=${DEVICE:-cuda}; SEQ=${SEQ:-131072}
SEQPAR_SEQS=${SEQPAR_SEQS:-524288:390,458752:330}
TORCH_CP_SEQS=${TORCH_CP_SEQS:-262144:150,196608:150}
TP_SP_SEQS=${TP_SP_SEQS:-262144:160,196608:160}
echo "== PART=$PART commit=${SEQPAR_COMMIT:-unknown} budget=${BUDGET_S}s $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"

# train SYSTEM SEQ LIMIT: one throughput run, at most LIMIT seconds (less if the deadline is nearer)
train() {
  local sys=$1 seq=$2 limit=$3 t; t=$(( $(left) < limit ? $(left) : limit ))
  if [ "$t" -lt 60 ]; then echo "== skip $sys S=$seq: ${t}s left" | tee -a "$OUT/train.log"; return; fi
  echo "== train $sys S=$seq (limit ${t}s)" | tee -a "$OUT/train.log"
  timeout -k 20 "$t" torchrun --nproc_per_node=$NPROC --master_port=$((29500 + RANDOM % 2000)) benchmarks/train.py \
    --system "$sys" --model $MODEL --seq "$seq" --warmup 1 --steps 3 --device $DEVICE ${PEAK:+--matmul-peak $PEAK} \
    --out "$OUT/train.json" > "$OUT/run.tmp" 2>&1
  local rc=$?
  grep -v -i warn "$OUT/run.tmp" | grep -E "^\[train\]|Error|error|exitcode" | tail -6 | tee -a "$OUT/train.log"
  echo "== rc=$rc ($sys S=$seq, $(( $(date +%s) - START ))s elapsed)" | tee -a "$OUT/train.log"
  rm -f "$OUT/run.tmp"
}

# longest SYSTEM SEQ:LIMIT,...: descending search, 2 steps per attempt (benchmarks/longest.py)
longest() {
  local sys=$1 seqs=$2
  if [ "$(left)" -lt 60 ]; then echo "== skip longest $sys: $(left)s left"; return; fi
  echo "== longest $sys $seqs ($(left)s left)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 30 $(( $(left) + 20 )) python benchmarks/longest.py \
    --system "$sys" --model $MODEL --nproc $NPROC --device $DEVICE --seqs "$seqs" --deadline "$DEADLINE" \
    --out "$OUT/longest.json" --log "$OUT/longest.log"
}

if [ "$PART" = compare ]; then
  # 1. bf16 matmul peak of GPU 0 (~20 s)
  [ "$DEVICE" = cuda ] && timeout 90 python benchmarks/matmul_peak.py --sizes 8192,16384 --iters 30 --out "$OUT/train.json" 2>&1 | grep -v -i warn | tee -a "$OUT/train.log"
  PEAK=$(python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x.get('bench')=='matmul']; print(round(r[-1]['tflops'],1) if r else '')" "$OUT/train.json" 2>/dev/null)
  echo "== matmul peak: ${PEAK:-none} TFLOP/s"
  # 2. llama3-8b at 128K, the three systems (~100 s, ~110 s, ~90 s expected)
  train seqpar "$SEQ" 170
  train tp_sp "$SEQ" 200
  [ "$DEVICE" = cuda ] && train torch_cp "$SEQ" 150
  # 3. torch_cp's longest context (estimate: ~200K fits; 256K OOMs at the fp32 logits early in step 1),
  #    then tp_sp's (same estimate) if time is left
  [ "$DEVICE" = cuda ] && longest torch_cp "$TORCH_CP_SEQS"
  longest tp_sp "$TP_SP_SEQS"
elif [ "$PART" = hf ]; then
  echo "== documents GPU test" | tee -a "$OUT/train.log"
  timeout -k 10 150 torchrun --nproc_per_node=$NPROC -m pytest -s -q -p no:cacheprovider tests/test_documents_gpu.py > "$OUT/documents_gpu.log" 2>&1
  echo "== rc=$? ($(( $(date +%s) - START ))s elapsed)" | tee -a "$OUT/train.log"
  grep -E "\[documents-gpu\]|passed|failed|Error" "$OUT/documents_gpu.log" | sort -u | tail -14 | tee -a "$OUT/train.log"
  t=$(( $(left) < 170 ? $(left) : 170 ))
  echo "== hf_finetune documents S=$SEQ (limit ${t}s)" | tee -a "$OUT/train.log"
  timeout -k 20 "$t" torchrun --nproc_per_node=$NPROC benchmarks/hf_finetune.py --seq "$SEQ" --documents --mean-doc 16384 \
    --warmup 1 --steps 3 --device $DEVICE --out "$OUT/train.json" > "$OUT/run.tmp" 2>&1
  echo "== rc=$? ($(( $(date +%s) - START ))s elapsed)" | tee -a "$OUT/train.log"
  grep -v -i warn "$OUT/run.tmp" | grep -E "^\[train\]|Error|error" | tail -6 | tee -a "$OUT/train.log"
  train torch_cp "$SEQ" 150
  train tp_sp "$SEQ" 200
  train seqpar "$SEQ" 170
  [ "$(left)" -gt 40 ] && timeout 40 python benchmarks/matmul_peak.py --sizes 8192 --iters 20 --out "$OUT/train.json" 2>&1 | grep -v -i warn | tee -a "$OUT/train.log"
elif [ "$PART" = longest ]; then
  # seqpar: peak ~ 43 GB + 0.18 GB per 1K tokens (from 65.6 GB at 128K) -> 512K borderline, 448K ~ 125 GB.
  # 2 steps at 512K ~ 5 min, at 448K ~ 4.5 min; an attempt that does not fit ends in step 1.
  longest seqpar "$SEQPAR_SEQS"
  longest tp_sp "$TP_SP_SEQS"
else
  echo "unknown PART=$PART (compare | longest)"; exit 2
fi

python benchmarks/collect.py --summary "$OUT/train.json" "$OUT/longest.json" | tee "$OUT/summary.txt"
echo "== done in $(( $(date +%s) - START ))s"
