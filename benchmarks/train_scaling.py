"""Training throughput of the product path for any named model (TNL, LSS GPT, Llama): weak scaling,
LASP's two state exchanges, the LSS GPT's fused K/V communication, the longest trainable sequence.

    torchrun --standalone --nproc_per_node=4 benchmarks/train_scaling.py --model tnl-1b --seq 131072 --attention lasp \
        --lasp-variant p2p,allgather --out train_tnl.json
    torchrun --standalone --nproc_per_node=4 benchmarks/train_scaling.py --model lss-gpt-1.5b --seq 65536 \
        --attention allgather --kv-comm input,kv --out train_gpt.json
    python benchmarks/train_scaling.py --find-max-seq 2097152,1048576,524288 --nproc 4 \
        --model tnl-1b --attention lasp --ac full --loss-chunk 4096 --warmup 1 --steps 1 --out train_tnl.json
    torchrun --standalone --nproc_per_node=2 benchmarks/train_scaling.py --device cpu --model tnl-tiny --seq 512   (smoke, gloo)

The path is the one users run: ``lightning.Trainer(strategy=SequenceParallelStrategy(...),
precision="bf16-mixed")`` with ``CausalLMModule`` (FSDP2 over all ranks, which form one
sequence-parallel group; the chunked cross entropy, ``--loss-chunk`` tokens of logits at a time;
activation checkpointing ``--ac``), batch 1 sequence of ``--seq`` tokens of the synthetic copy task
(``LongRangeDataModule``), AdamW. ``--device cpu`` runs the same code with gloo on CPU, also in
bf16-mixed (only the device and the backend differ).

Comma lists in ``--lasp-variant`` (TNL) and ``--kv-comm`` (GPT: "input" all-gathers the layer
input once and projects K/V locally, LSS's fused communication; "kv" hands the local K/V to the
strategy's algorithm, e.g. the all-gather of K and V) run one training after the other in the same
processes (one model build per run, the memory freed in between). ``--lasp-kernel`` sets the
kernel of every ``LinearAttention`` ("auto": fla-core's on CUDA when installed).

Each run appends one record to the JSON list in ``--out`` (rank 0): bench "train", system "seqpar",
model, seq, gpus, device, step_time_s (median of the ``--steps`` timed steps after ``--warmup``,
CUDA-synchronised), tokens_per_s_per_gpu, mfu (tokens/s/GPU x ``flops_per_token(seq)`` /
989e12, H100/H200 dense bf16), peak_mem_gb (max over ranks of torch.cuda.max_memory_allocated
during the timed steps), losses, and what was run (algorithm, lasp_variant, lasp_kernel, kv_comm
as resolved, ac, tokens_per_gpu, loss_chunk, commit). One "[train]" line per run.

``--find-max-seq`` (no torchrun: a driver) tries the lengths in order, each in its own
``torchrun --nproc_per_node=--nproc`` with a timeout, and stops at the first that trains. A rank
that runs out of GPU memory exits at once (``--exit-on-oom``, an out-of-memory observer of the CUDA
allocator; the other ranks would wait in a collective forever), torchrun stops the others, and the attempt is recorded as "oom". One
record, bench "train_max_seq", lists the attempts and the longest length that trained.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from collect import append_records  # benchmarks/ is on sys.path when this file runs as a script
from train import _step_timer  # benchmarks/ is on sys.path when this file runs as a script

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet
OOM_EXIT = 3


# ---------------------------------------------------------------------------------------------- one run


def _model_config(name: str, seq: int, kv_comm: str | None):
    from lightning_seqpar.models import LlamaConfig
    from lightning_seqpar.models.gpt import CONFIGS as GPT_CONFIGS
    from lightning_seqpar.models.gpt import GPTConfig
    from lightning_seqpar.models.transnormer import CONFIGS as TNL_CONFIGS
    from lightning_seqpar.models.transnormer import TransNormerConfig

    if name in GPT_CONFIGS:
        base = GPTConfig.from_name(name)
        # learned positions: the table must have a row for every global position
        return GPTConfig.from_name(name, max_seq_len=max(base.max_seq_len, seq), kv_comm=kv_comm or base.kv_comm)
    if kv_comm is not None:
        raise ValueError(f"--kv-comm is for the GPT models (GPTConfig.kv_comm); model {name!r} is not one")
    if name in TNL_CONFIGS:
        return TransNormerConfig.from_name(name)
    return LlamaConfig.from_name(name)


def _exit_on_oom(seq: int) -> None:
    """Exit this rank at once when the CUDA allocator runs out of memory (before the exception
    reaches code that could wait in a collective for ranks that never come)."""

    def observer(device, alloc, device_alloc, device_free):
        print(f"[train] OOM rank {os.environ.get('RANK')} seq={seq}: allocating {alloc / 2**30:.2f} GiB failed, "
              f"{device_alloc / 2**30:.1f} GiB allocated, {device_free / 2**30:.2f} GiB free", flush=True)
        os._exit(OOM_EXIT)

    try:
        torch._C._cuda_attach_out_of_memory_observer(observer)
    except (AttributeError, RuntimeError) as e:  # a private hook: without it OOMs fall to the driver's timeout
        print(f"[train] no out-of-memory observer ({e})", flush=True)


def run_one(args, seq: int, lasp_variant: str, kv_comm: str | None) -> dict:
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.attention.fused import FusedKVAttention
    from lightning_seqpar.attention.lasp import LinearAttention, _resolve_kernel
    from lightning_seqpar.data import LongRangeDataModule

    cuda = args.device == "cuda"
    world = int(os.environ["WORLD_SIZE"])
    cfg = _model_config(args.model, seq, kv_comm)
    times: list[float] = []
    losses: list[float] = []
    info: dict = {}

    class StepTimer(type(_step_timer(args, times, losses))):  # train.py's timer + what actually runs
        def on_fit_start(self, trainer, pl_module):
            # what actually runs: the LASP kernel, GPT's resolved K/V communication
            for m in pl_module.modules():
                if isinstance(m, LinearAttention):
                    if args.lasp_kernel is not None:
                        m.kernel = args.lasp_kernel  # read at every call
                    info["lasp_kernel"] = _resolve_kernel(m.kernel, pl_module.device)
                if isinstance(m, FusedKVAttention):
                    info["kv_comm"] = m.mode()
            info["attention"] = trainer.strategy.attention
            if cuda:
                info["mem_start_gb"] = torch.cuda.memory_allocated() / 1e9

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if rank == 0 and batch_idx < args.warmup:
                print(f"[train]   warm-up step {batch_idx}: {time.perf_counter() - self.t0:.1f}s", flush=True)

    rank = int(os.environ.get("RANK", "0"))
    strategy = SequenceParallelStrategy(
        sequence_parallel_size=world, attention=args.attention, lasp_variant=lasp_variant,
        activation_checkpointing=None if args.ac == "none" else args.ac,
        timeout=datetime.timedelta(minutes=5),
    )
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
        precision=args.precision, max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[StepTimer()], log_every_n_steps=1,
    )
    module = CausalLMModule(model=cfg, lr=3e-4, warmup_steps=2, weight_decay=0.0, loss_chunk_size=args.loss_chunk)
    data = LongRangeDataModule(vocab_size=cfg.vocab_size, seq_len=seq, batch_size=1,
                               num_samples=(args.warmup + args.steps) * 2, val_samples=0, seed=0)
    trainer.fit(module, datamodule=data)

    peak = torch.tensor(torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0, device="cuda" if cuda else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step = sorted(times)[len(times) // 2] if times else float("nan")
    tps = seq / step / world
    flops = cfg.flops_per_token(seq) if hasattr(cfg, "flops_per_token") else None
    row = dict(
        bench="train", system="seqpar", algorithm=info.get("attention", args.attention), model=args.model, seq=seq, gpus=world,
        device=torch.cuda.get_device_name() if cuda else "cpu", step_time_s=step, tokens_per_s_per_gpu=tps,
        mfu=tps * flops / PEAK_BF16 if flops else None, peak_mem_gb=peak.item() if cuda else None, losses=losses,
        tokens_per_gpu=seq // world, ac=args.ac, loss_chunk=args.loss_chunk, precision=args.precision,
        lasp_variant=lasp_variant if "lasp_kernel" in info else None, lasp_kernel=info.get("lasp_kernel"),
        kv_comm=info.get("kv_comm"), kv_comm_requested=kv_comm, step_times_s=times, mem_start_gb=info.get("mem_start_gb"),
        tag=args.tag, commit=args.commit,
    )
    del trainer, module, data, strategy
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main_worker(args) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        if args.exit_on_oom:
            _exit_on_oom(args.seq)
    variants = args.lasp_variant.split(",")
    kv_comms: list[str | None] = args.kv_comm.split(",") if args.kv_comm else [None]
    if int(os.environ["WORLD_SIZE"]) == 1 and len(kv_comms) > 1:
        kv_comms = kv_comms[:1]  # one GPU: no communication, "input" and "kv" are the same run
    for variant in variants:
        for kv_comm in kv_comms:
            row = run_one(args, args.seq, variant, kv_comm)
            if dist.get_rank() == 0:
                what = " ".join(f"{k}={row[k]}" for k in ("algorithm", "lasp_variant", "lasp_kernel", "kv_comm") if row[k] is not None)
                mfu = f"MFU {row['mfu']:.3f}, " if row["mfu"] is not None else ""
                print(f"[train] {row['model']} S={row['seq']} GPUs={row['gpus']} ({row['tokens_per_gpu']}/GPU) {what} ac={row['ac']}: "
                      f"{row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, {mfu}step {row['step_time_s']:.2f}s, "
                      f"peak {row['peak_mem_gb'] or 0:.1f} GB, losses {[round(x, 3) for x in row['losses']]}", flush=True)
                if args.out:
                    append_records(args.out, row)
            dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver


def _child_argv(args) -> list[str]:
    argv = ["--model", args.model, "--attention", args.attention, "--lasp-variant", args.lasp_variant.split(",")[0],
            "--ac", args.ac, "--loss-chunk", str(args.loss_chunk), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--device", args.device, "--precision", args.precision, "--commit", args.commit, "--tag", args.tag or "max-seq",
            "--exit-on-oom"]
    if args.lasp_kernel:
        argv += ["--lasp-kernel", args.lasp_kernel]
    if args.kv_comm:
        argv += ["--kv-comm", args.kv_comm.split(",")[0]]
    if args.out:
        argv += ["--out", args.out]
    return argv


def _attempt(cmd: list[str], timeout: float) -> tuple[str, float, str]:
    """Run one torchrun; stream its output; (status, seconds, last error line)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []

    def pump():
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[train]") or "Error" in line:
                print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
        status = "ok" if rc == 0 else "error"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        status = "timeout"
    reader.join(timeout=5)
    text = "".join(lines)
    if status != "ok" and ("[train] OOM" in text or "OutOfMemoryError" in text or "CUDA out of memory" in text):
        status = "oom"
    errors = [ln.strip() for ln in lines if ("Error" in ln and "ChildFailedError" not in ln) or "[train] OOM" in ln]
    return status, time.monotonic() - t0, (errors[-1][:300] if errors else "")


def find_max_seq(args) -> None:
    seqs = [int(s) for s in args.find_max_seq.split(",")]
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    attempts, best = [], None
    for seq in seqs:
        left = args.attempt_timeout if deadline is None else min(args.attempt_timeout, deadline - time.monotonic())
        if left < 30:
            attempts.append(dict(seq=seq, status="skipped (no time left)"))
            print(f"[train] max-seq: {seq} skipped, {left:.0f}s left", flush=True)
            break
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", os.path.abspath(__file__),
               *_child_argv(args), "--seq", str(seq)]
        status, secs, err = _attempt(cmd, left)
        attempts.append(dict(seq=seq, status=status, wall_s=round(secs, 1), error=err or None))
        print(f"[train] max-seq attempt S={seq} on {args.nproc} GPUs: {status} after {secs:.0f}s {err}", flush=True)
        if status == "ok":
            best = seq
            break
    row = dict(bench="train_max_seq", system="seqpar", algorithm=args.attention, model=args.model, gpus=args.nproc,
               max_seq=best, tokens_per_gpu=best // args.nproc if best else None, ac=args.ac, loss_chunk=args.loss_chunk,
               attempts=attempts, commit=args.commit)
    print(f"[train] max-seq {args.model} on {args.nproc} GPUs (ac={args.ac}): longest trained {best}", flush=True)
    if args.out:
        append_records(args.out, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tnl-1b", help="a named config CausalLMModule accepts (tnl-*, lss-gpt-*, gpt-tiny, llama names)")
    ap.add_argument("--seq", type=int, default=131072, help="global sequence length (tokens per GPU = seq / GPUs)")
    ap.add_argument("--attention", default="auto", choices=["auto", "lasp", "ring", "allgather", "ulysses"])
    ap.add_argument("--lasp-variant", default="p2p", help="comma list of p2p, allgather (SequenceParallelStrategy(lasp_variant=))")
    ap.add_argument("--lasp-kernel", default=None, choices=["auto", "torch", "fla"], help="LinearAttention.kernel (default: the model's, auto)")
    ap.add_argument("--kv-comm", default=None, help="GPT only: comma list of input, kv, auto (GPTConfig.kv_comm)")
    ap.add_argument("--ac", default="selective++", choices=["selective++", "full", "none"])
    ap.add_argument("--loss-chunk", type=int, default=8192, help="tokens of logits at a time (CausalLMModule(loss_chunk_size=))")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same path on gloo (a smoke test)")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    ap.add_argument("--tag", default=None, help="free text stored in the record")
    ap.add_argument("--exit-on-oom", action="store_true",
                    help="exit the rank at once on a CUDA out-of-memory error (no hang in a collective); set by --find-max-seq")
    ap.add_argument("--find-max-seq", default=None, help="driver mode: comma list of global lengths to try in order")
    ap.add_argument("--nproc", type=int, default=4, help="driver mode: GPUs per attempt")
    ap.add_argument("--attempt-timeout", type=float, default=240.0, help="driver mode: seconds per attempt")
    ap.add_argument("--deadline-s", type=float, default=None, help="driver mode: seconds for all attempts together")
    args = ap.parse_args()
    if args.find_max_seq:
        find_max_seq(args)
    else:
        main_worker(args)


if __name__ == "__main__":
    main()
