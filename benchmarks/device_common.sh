# Shared by the device run scripts (benchmarks/run_h200x*.sh); sourced, not run.
# Sets the NCCL / flash-attn 4 / Inductor environment, the call's time budget (BUDGET_S, set before
# sourcing) and these helpers:
#   left               seconds left before the budget's deadline
#   fa4                True when flash-attn 4 loads as our local kernel
#   copy_fa4_part1     stage 1 (carry .whl): the first wheels to /tmp/whl
#   install_fa4_part2  stage 2 (carry .whl2): the rest, joined, installed into /tmp/site
#   attention LABEL LIMIT GRID...  benchmarks/attention.py on ATTN_NPROC (4) GPUs over the grids, ATTN_ITERS (3)
#                      timed iterations after one warm-up, under min(LIMIT, left); $OUT/attention_LABEL.{json,log};
#                      extra attention.py flags in ATTN_ARGS; its own rendezvous port, so runs on disjoint CUDA_VISIBLE_DEVICES can go side by side
#   longest SYSTEM SEQS [-- TRAIN ARGS]  benchmarks/longest.py (descending S, see its docstring) for MODEL (llama3-8b)
#                      on NPROC (4) GPUs, every attempt ended by the call's deadline; $OUT/longest[_LABEL].{json,log}
#                      (a LABEL per run when runs on disjoint CUDA_VISIBLE_DEVICES go side by side)
#   longest_summary    what the longest runs of this call gave (end of the longest-context scripts)
#   train LIMIT ARGS   one benchmarks/train.py process (llama3-8b, SEQ tokens, NPROC GPUs; or its --models / --seqs)
#                      under min(LIMIT, left); skipped below TRAIN_MIN_S seconds left; every [train] line and the
#                      last error lines to $OUT/train.log
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=${STAGE:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
BUDGET_S=${BUDGET_S:-560}
TRAIN_MIN_S=${TRAIN_MIN_S:-60}
START=$(date +%s); DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
fa4() { python -c "from lightning_seqpar.attention import available_backends as a; import torch; print('fa4' in a('cuda', torch.bfloat16, 128))" 2>/dev/null; }

copy_fa4_part1() {
  mkdir -p /tmp/whl && cp .whl/* /tmp/whl/ && echo "== copied .whl to /tmp/whl ($(ls /tmp/whl | wc -l) files)"
}

install_fa4_part2() {
  cp .whl2/* /tmp/whl/ && cat /tmp/whl/cu13part.* > /tmp/whl/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
    && rm /tmp/whl/cu13part.* \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/whl/*.whl 2>&1 | tail -2
  echo "== fa4 available: $(fa4) ($(( $(date +%s) - START ))s)"
}

attention() {  # attention LABEL LIMIT GRID...
  local label=$1 limit=$2; shift 2
  local t=$(( $(left) < limit ? $(left) : limit ))
  echo "== attention $label (limit ${t}s)"
  local grids=(); for g in "$@"; do grids+=(--grid "$g"); done
  timeout -k 10 "$t" torchrun --nproc_per_node="${ATTN_NPROC:-4}" --master_port=$((29500 + RANDOM % 2000)) benchmarks/attention.py --out "$OUT/attention_$label.json" --iters "${ATTN_ITERS:-3}" \
    --warmup 1 --commit "${SEQPAR_COMMIT:-unknown}" ${ATTN_ARGS:-} "${grids[@]}" 2>&1 | grep -v -i warn | tee "$OUT/attention_$label.log"
}

longest() {  # longest SYSTEM SEQS [-- TRAIN ARGS]
  local system=$1 seqs=$2 f="$OUT/longest${LABEL:+_$LABEL}"; shift 2
  echo "== longest $system ${MODEL:-llama3-8b} on ${NPROC:-4} GPUs ${CUDA_VISIBLE_DEVICES:+(GPUs $CUDA_VISIBLE_DEVICES) }($(left)s left)"
  timeout -k 30 $(( $(left) + 10 )) python benchmarks/longest.py --system "$system" --model "${MODEL:-llama3-8b}" --nproc "${NPROC:-4}" \
    --seqs "$seqs" --deadline "$DEADLINE" --out "$f.json" --log "$f.log" "$@" 2>&1 | grep "^\[longest\]"
}

train() {  # train LIMIT ARGS...
  local limit=$1; shift
  local t=$(( $(left) < limit ? $(left) : limit ))
  if [ "$t" -lt "$TRAIN_MIN_S" ]; then echo "== skip train $*: ${t}s left" | tee -a "$OUT/train.log"; return; fi
  echo "== train $* (limit ${t}s)" | tee -a "$OUT/train.log"
  timeout -k 20 "$t" torchrun --nproc_per_node=${NPROC:-4} --master_port=$((29500 + RANDOM % 2000)) benchmarks/train.py \
    --model llama3-8b --seq ${SEQ:-131072} --warmup 1 --steps 3 ${PEAK:+--matmul-peak $PEAK} --out "$OUT/train.json" "$@" > "$OUT/run.tmp" 2>&1
  local rc=$?
  { grep -v -i warn "$OUT/run.tmp" | grep -E "^\[train\]"; grep -v -i warn "$OUT/run.tmp" | grep -v "^\[train\]" | grep -E "Error|error|exitcode" | tail -4; } | tee -a "$OUT/train.log"
  echo "== rc=$rc ($(( $(date +%s) - START ))s elapsed)" | tee -a "$OUT/train.log"
  [ "$rc" = 0 ] || grep -v -i warn "$OUT/run.tmp" | tail -30 > "$OUT/failed_$(date +%s).log"
  rm -f "$OUT/run.tmp"
}

longest_summary() {  # the attempts' outcome lines, the records, the call's time
  grep -h -E "^\[train\] (OOM|[a-z_]+ +llama)" "$OUT"/longest*.log 2>/dev/null | cut -c1-200 | tail -12
  python benchmarks/collect.py --summary "$OUT"/*.json 2>/dev/null | tail -12
  echo "== done in $(( $(date +%s) - START ))s"
}

peak_tflops() {  # peak_tflops FILE: the last bf16 matmul peak recorded in FILE (benchmarks/matmul_peak.py), or ''
  python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x.get('bench')=='matmul']; print(round(r[-1]['tflops'],1) if r else '')" "$1" 2>/dev/null
}
