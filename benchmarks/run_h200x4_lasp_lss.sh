#!/usr/bin/env bash
# One call on nvidia-h200-x4 (about 9 minutes): the GPU acceptance of LASP / TransNormerLLM (issue #4)
# and of the LSS GPT (issue #5). Usage there, with .site carried (fla-core and jsonargparse unpacked
# in .site/site):
#     SEQPAR_COMMIT=<sha> bash benchmarks/run_h200x4_lasp_lss.sh
# Steps, by priority; each under `timeout`, all within BUDGET_S seconds (default 530; a step that
# would start with < 30 s left is skipped); STEPS="1 2 3 4 5" picks which run (e.g. STEPS=5 later):
#   1. tests/test_lasp_gpu.py on 4 GPUs: fla == torch kernel in bf16, locally and through LASP;
#      this also compiles + autotunes fla's Triton kernels for TNL-1B's shapes (cached on disk
#      for every later step; SEQPAR_FLA_AUTOTUNE=small, Note [fla-core kernel])
#   2. TNL-1B, 32K tokens/GPU on 1, 2, 4 GPUs (LASP p2p; on 4 GPUs also the all-gather variant)
#   3. lss-gpt-1.5b, 16K tokens/GPU on 1, 2, 4 GPUs, kv_comm "input" (fused) and "kv" (attention allgather)
#   4. the LASP op, p2p vs all-gather, 8K / 32K / 256K tokens/GPU on 4 GPUs (fla kernel)
#   5. the longest TNL-1B sequence on 4 GPUs (full AC, 4K-token loss chunks): 2M, else 1M, else 512K;
#      each attempt its own torchrun (an OOM rank exits at once). Estimated peak at 2M (512K tokens/GPU):
#      ~5 GB model states + 34 GB checkpointed block inputs (16 x 512K x 2048 bf16) + ~11 GB final norm
#      and loss + ~60-80 GB for one block's recompute and backward (fla keeps fp32 chunk states h, dh
#      in backward: 17 GB, 34 GB on the LRPE layer) = ~110-125 GB of 141: plausible, not certain.
# Files in $OUT (5): run.log (all result lines, failures' tails, the summary tables at the end),
# lasp_gpu_tests.log, train_tnl.json, train_gpt.json, lasp.json. Full logs of the other steps stay in $LOGS.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PWD/.site/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} SEQPAR_FLA_AUTOTUNE=${SEQPAR_FLA_AUTOTUNE:-small}
OUT=${OUT:-/tmp/out}; LOGS=${LOGS:-/tmp/seqpar_logs}; mkdir -p "$OUT" "$LOGS"
BUDGET=${BUDGET_S:-530}
STEPS=${STEPS-1 2 3 4 5}
PY=${PY:-python3}
TRAIN="benchmarks/train_scaling.py --warmup 1 --steps 3"
# SMOKE=1: a CPU dry run of this very script (gloo, tiny models, 1-2 processes; the same commands otherwise)
if [ "${SMOKE:-0}" = 1 ]; then
  TNL=tnl-tiny GPT=gpt-tiny TNL_TOK=256 GPT_TOK=256 GPUS="1 2" NMAX=2 OP_SEQS=256,1024 MAX_SEQS=1001,2048,1024 DEV="--device cpu"
else
  TNL=tnl-1b GPT=lss-gpt-1.5b TNL_TOK=32768 GPT_TOK=16384 GPUS="1 2 4" NMAX=4 OP_SEQS=8192,32768,262144 MAX_SEQS=2097152,1048576,524288 DEV=""
fi

# step NAME MAX_SECONDS LOG CMD...: run CMD under timeout (at most what is left of the budget),
# then print its rc, its time and its result lines (and the end of its log when it failed)
step() {
  local name=$1 max=$2 log=$3; shift 3
  local left=$((BUDGET - SECONDS)); local t=$((max < left ? max : left))
  if ((t < 30)); then echo "== $name: SKIPPED (${left}s of the budget left)"; return 0; fi
  echo "== $name (timeout ${t}s, at ${SECONDS}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$t" "$@" > "$log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s$([ $rc -eq 124 ] && echo ' TIMEOUT')"
  grep -E '^\[(train|lasp|lasp-gpu)\]|[0-9]+ (passed|failed|skipped)|^(FAILED|ERROR) ' "$log" | tail -40
  if [ $rc -ne 0 ]; then echo "-- end of $log:"; grep -v -i warn "$log" | tail -12; fi
}
want() { [[ " $STEPS " == *" $1 "* ]]; }

main() {
  echo "== commit ${SEQPAR_COMMIT:-unknown}, budget ${BUDGET}s, steps: $STEPS, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1 | head -4
  if want 1; then
    step "1 fla==torch GPU tests ($NMAX GPUs)" 200 "$OUT/lasp_gpu_tests.log" \
      torchrun --standalone --nproc_per_node=$NMAX -m pytest -s -q -p no:cacheprovider tests/test_lasp_gpu.py
  fi
  if want 2; then
    for n in $GPUS; do
      variants=p2p; [ $n -eq $NMAX ] && variants=p2p,allgather
      step "2 $TNL x$n GPUs, $TNL_TOK/GPU" $((n == NMAX ? 150 : 120)) "$LOGS/tnl_x$n.log" \
        torchrun --standalone --nproc_per_node=$n $TRAIN $DEV --model $TNL --seq $((TNL_TOK * n)) --attention lasp \
        --lasp-variant $variants --out "$OUT/train_tnl.json"
    done
  fi
  if want 3; then
    for n in $GPUS; do
      step "3 $GPT x$n GPUs, $GPT_TOK/GPU" $((n == 1 ? 90 : 130)) "$LOGS/gpt_x$n.log" \
        torchrun --standalone --nproc_per_node=$n $TRAIN $DEV --model $GPT --seq $((GPT_TOK * n)) --attention allgather \
        --kv-comm input,kv --out "$OUT/train_gpt.json"
    done
  fi
  if want 4; then
    step "4 LASP op p2p vs allgather ($NMAX GPUs)" 100 "$LOGS/lasp_op.log" \
      torchrun --standalone --nproc_per_node=$NMAX benchmarks/lasp.py $DEV --local-seqs $OP_SEQS --iters 5 --warmup 2 \
      --out "$OUT/lasp.json"
  fi
  if want 5; then
    local left=$((BUDGET - SECONDS - 5))
    step "5 longest $TNL sequence ($NMAX GPUs)" $left "$LOGS/max_seq.log" \
      $PY benchmarks/train_scaling.py $DEV --find-max-seq $MAX_SEQS --nproc $NMAX --model $TNL --attention lasp \
      --ac full --loss-chunk 4096 --warmup 1 --steps 1 --attempt-timeout 200 --deadline-s $((left - 5)) --out "$OUT/train_tnl.json"
  fi
  echo "== done at ${SECONDS}s"
  summary
}

summary() {
  $PY - "$OUT" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def rows(name):
    p = os.path.join(out, name)
    try:
        return json.load(open(p)) if os.path.exists(p) else []
    except ValueError as e:
        print(f"{name}: unreadable ({e})"); return []
def f(x, fmt):
    return "-" if x is None else format(x, fmt)

print("\n==================== summary ====================")
log = os.path.join(out, "lasp_gpu_tests.log")
if os.path.exists(log):
    text = open(log).read()
    print("(a) fla == torch:", "; ".join(re.findall(r"\d+ (?:passed|failed|skipped)[^\n]*", text)[-4:]) or "no pytest summary",
          f"| [lasp-gpu] lines PASS {text.count(' PASS')} FAIL {text.count(' FAIL')}")

def scaling(title, rs, key, note):
    if not rs:
        return
    print(f"\n{title}")
    print(f"{'GPUs':>4} {'seq':>8} {'tok/GPU':>8} {key:>16} {'tokens/s/GPU':>12} {'eff':>6} {'MFU':>6} {'peak GB':>8} {'step s':>7}  losses")
    base = {}
    for r in rs:
        if r["gpus"] == 1:
            base.setdefault("one", r["tokens_per_s_per_gpu"])
    for r in sorted(rs, key=lambda r: (r["gpus"], str(r.get(key)))):
        eff = r["tokens_per_s_per_gpu"] / base["one"] if "one" in base else None
        print(f"{r['gpus']:>4} {r['seq']:>8} {r['tokens_per_gpu']:>8} {str(r.get(key)):>16} {r['tokens_per_s_per_gpu']:>12.0f} "
              f"{f(eff, '.3f'):>6} {f(r.get('mfu'), '.3f'):>6} {f(r.get('peak_mem_gb'), '.1f'):>8} {r['step_time_s']:>7.2f}  "
              f"{[round(x, 3) for x in r['losses']]}")
    print(note)

tnl = [r for r in rows("train_tnl.json") if r.get("bench") == "train" and r.get("tag") != "max-seq"]
scaling("(b) TNL-1B weak scaling, LASP (eff = tokens/s/GPU / 1-GPU tokens/s/GPU; goal >= 0.90 at 4 GPUs)", tnl, "lasp_variant",
        "    kernel: " + ", ".join(sorted({str(r.get("lasp_kernel")) for r in tnl})))
for r in tnl:
    if r["gpus"] == max(x["gpus"] for x in tnl) > 1 and r.get("lasp_variant") == "p2p":
        one = [x for x in tnl if x["gpus"] == 1]
        if one:
            e = r["tokens_per_s_per_gpu"] / one[0]["tokens_per_s_per_gpu"]
            print(f"    {r['gpus']}-GPU efficiency (p2p): {e:.3f} -> {'PASS' if e >= 0.9 else 'FAIL'} (>= 0.90)")
v4 = {r.get("lasp_variant"): r for r in tnl if tnl and r["gpus"] == max(x["gpus"] for x in tnl)}
if "p2p" in v4 and "allgather" in v4:
    a, b = v4["p2p"]["step_time_s"], v4["allgather"]["step_time_s"]
    print(f"(d) TNL-1B step on {v4['p2p']['gpus']} GPUs: p2p {a:.3f}s, allgather {b:.3f}s -> faster: {'p2p' if a <= b else 'allgather'} ({abs(a - b) / max(a, b) * 100:.1f}%)")

gpt = [r for r in rows("train_gpt.json") if r.get("bench") == "train"]
scaling("Issue #5: lss-gpt-1.5b weak scaling (LSS Table 3 style; eff vs 1 GPU; kv_comm input = fused all-gather of x, kv = all-gather of K/V)",
        gpt, "kv_comm", "")
by = {(r["gpus"], r.get("kv_comm")): r for r in gpt}
for n in (2, 4):
    if (n, "input") in by and (n, "kv") in by:
        a, b = by[(n, "input")], by[(n, "kv")]
        print(f"    {n} GPUs: fused (input) {a['step_time_s']:.3f}s / {f(a['peak_mem_gb'], '.1f')} GB vs unfused (kv) "
              f"{b['step_time_s']:.3f}s / {f(b['peak_mem_gb'], '.1f')} GB -> fused runs at {b['step_time_s'] / a['step_time_s']:.3f}x the speed of unfused")

op = [r for r in rows("lasp.json") if r.get("bench") == "attention"]
if op:
    print(f"\n(d) LASP op, forward+backward (fwd) ms, slowest rank, {op[0]['gpus']} GPUs")
    for c in sorted({r["tokens_per_gpu"] for r in op}):
        rs = {r["algorithm"]: r for r in op if r["tokens_per_gpu"] == c}
        cells = "  ".join(f"{a} {rs[a]['time_ms']:.2f} ({rs[a]['fwd_ms']:.2f})" + (f" [{rs[a]['error']}]" if rs[a].get("error") else "")
                          for a in ("local", "lasp-p2p", "lasp-allgather") if a in rs)
        fast = ""
        if "lasp-p2p" in rs and "lasp-allgather" in rs:
            fast = " -> faster: " + ("p2p" if rs["lasp-p2p"]["time_ms"] <= rs["lasp-allgather"]["time_ms"] else "allgather")
        print(f"  {c:>7}/GPU ({next(iter(rs.values()))['kernel']}): {cells}{fast}")

for r in rows("train_tnl.json"):
    if r.get("bench") == "train_max_seq":
        print(f"\n(c) longest TNL-1B sequence on {r['gpus']} GPUs (ac={r['ac']}): {r['max_seq']} tokens "
              f"({r['tokens_per_gpu']}/GPU); attempts: " + ", ".join(f"{a['seq']}:{a['status']}" for a in r["attempts"]))
for r in rows("train_tnl.json"):
    if r.get("tag") == "max-seq":
        print(f"    at {r['seq']}: {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, step {r['step_time_s']:.1f}s, peak {f(r.get('peak_mem_gb'), '.1f')} GB")
EOF
}

main 2>&1 | tee -a "$OUT/run.log"
