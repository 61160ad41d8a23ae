#!/usr/bin/env bash
# One call on nvidia-h200-x4 (carry .site: jsonargparse for the CLI, unpacked in .site/site):
# llama-7b-gqa training at 128K and 32K, ours vs FSDP2 + torch CP + full AC, then the quickstart
# recipe on 2 GPUs.  Usage there: SEQPAR_COMMIT=<sha> bash benchmarks/run_h200x4_gqa.sh
set -u
export PYTHONPATH=$PWD:$PWD/.site/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for seq in 131072 32768; do
  for sys in seqpar torch_cp; do
    timeout 130 torchrun --nproc_per_node=4 benchmarks/train.py --system $sys --model llama-7b-gqa --seq $seq --warmup 1 --steps 3 \
      --out "$OUT/train.json" > "$OUT/train_${sys}_$seq.log" 2>&1; echo "rc=$?"
    grep -E "^\[train\]|Error" "$OUT/train_${sys}_$seq.log" | tail -3
  done
done
timeout 100 python3 -m lightning_seqpar.cli fit --config recipes/quickstart.yaml --trainer.accelerator gpu \
  --trainer.logger.init_args.save_dir "$OUT/quickstart" > "$OUT/quickstart.log" 2>&1; echo "quickstart rc=$?"
find "$OUT/quickstart" -name metrics.csv -exec cp {} "$OUT/quickstart_metrics.csv" \;
grep -E "Trainer.fit|Error" "$OUT/quickstart.log" | tail -3
python3 - "$OUT/quickstart_metrics.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("val/loss")]
print("quickstart val/loss by step:", [(r["step"], round(float(r["val/loss"]), 4)) for r in rows])
PY
