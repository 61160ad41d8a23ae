"""Longest trainable context: the first sequence length of a descending list that trains 2 steps.

    python benchmarks/longest.py --system seqpar --model llama3-8b --nproc 4 --seqs 524288:420,458752:360 --out l.json --log l.log
    python benchmarks/longest.py --system seqpar --model tnl-1b --nproc 4 --seqs 2097152:200,1048576:200 -- --algorithm lasp --ac full

Each attempt is ``torchrun benchmarks/train.py --warmup 1 --steps 1 --prealloc-optimizer`` (arguments after ``--`` go to
train.py; later flags win; AdamW's state exists before step 1, so what does not fit fails there) in a process session
of its own under its limit (``S:T``, else --timeout): ok, oom (train.py's exit code 3), timeout (the process tree is
stopped), error, or skipped (no time before --deadline; a later success is then a lower bound). One record (bench
"longest"): the first S that trained (null if none), the attempts, that attempt's figures and settings, ``train_args``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import OOM_EXIT, append_records, runner_args  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
KEPT = ("step_time_s", "ac", "backend", "head_chunks", "offload_checkpoints", "offload_params", "optimizer", "host_peak_gb",
        "mlp_chunk_size", "tokens_per_gpu", "lasp_variant", "lasp_kernel", "kv_comm")
"""What a record keeps of the attempt that trained, besides its throughput, memory and MFU."""


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop torchrun (its own process session) and its workers (each in a process session of its own, see
    torch.distributed.elastic's subprocess handler): SIGTERM, then SIGKILL after ``grace`` seconds."""
    groups = [proc.pid, *_children(proc.pid)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not any(_alive(p) for p in groups[1:]):
                return
            time.sleep(0.5)
    proc.wait()


def classify(rc: int | None, output: str, timed_out: bool) -> tuple[str, str]:
    """(status, detail) of one attempt from torchrun's exit code and output."""
    if timed_out:
        return "timeout", ""
    lines = output.splitlines()
    oom = [ln for ln in lines if ln.startswith("[train] OOM") or "out of memory" in ln.lower()]
    if oom or f"exitcode  : {OOM_EXIT} " in output or f"(exitcode: {OOM_EXIT})" in output:
        return "oom", (oom[0] if oom else f"a rank exited with {OOM_EXIT}")[:200]
    if rc == 0:
        return "ok", ""
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return "error", (errors[-1] if errors else f"exit code {rc}")[:200]


def _device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def attempt(cmd: list[str], limit: float) -> tuple[str, str, float, int | None, str, dict | None]:
    """Run one attempt (train.py under torchrun, writing its record to the ``--out`` of ``cmd``) within ``limit``
    seconds: (status, detail, wall seconds, exit code, output, the record when it trained)."""
    rec_path = cmd[cmd.index("--out") + 1]
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            rc = proc.returncode
        log.seek(0)
        output = log.read()
    status, detail = classify(rc, output, timed_out)
    record = None
    if status == "ok":
        try:
            record = json.load(open(rec_path))[-1]
        except (OSError, ValueError, IndexError):
            status, detail = "error", "train.py wrote no record"
    if os.path.exists(rec_path):
        os.unlink(rec_path)
    return status, detail, time.monotonic() - t0, rc, output, record


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = runner_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--system", required=True, choices=["seqpar", "torch_cp", "tp_sp"])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--nproc", type=int, required=True, help="processes (GPUs) per attempt")
    ap.add_argument("--seqs", required=True, help="descending S or S:timeout_s, comma-separated")
    ap.add_argument("--timeout", type=float, default=300.0, help="limit of an attempt without its own")
    ap.add_argument("--deadline", type=float, default=None, help="unix time by which every attempt must have ended")
    ap.add_argument("--log", default=None, help="append every attempt's output to this file")
    args = ap.parse_args(argv)
    attempts, found, skipped = [], None, False
    seqs = [(int(s), float(t) if t else args.timeout) for s, _, t in (item.strip().partition(":") for item in args.seqs.split(","))]
    if [s for s, _ in seqs] != sorted((s for s, _ in seqs), reverse=True):
        ap.error(f"--seqs must be in descending order, got {args.seqs}")
    for seq, limit in seqs:
        if args.deadline is not None and time.time() + limit > args.deadline:
            attempts.append(dict(seq=seq, status="skipped", wall_s=0.0, detail=f"limit {limit:.0f}s does not fit before the deadline"))
            print(f"[longest] {args.system} S={seq}: skipped (limit {limit:.0f}s, {args.deadline - time.time():.0f}s left)", flush=True)
            skipped = True
            continue
        rec_path = os.path.join(tempfile.gettempdir(), f"longest-{os.getpid()}-{seq}.json")  # the attempt's record
        # --standalone: a fresh rendezvous port per attempt (a stopped attempt's port may still be held)
        cmd = ["torchrun", "--standalone", f"--nproc_per_node={args.nproc}", os.path.join(HERE, "train.py"),
               "--system", args.system, "--model", args.model, "--seq", str(seq), "--warmup", "1", "--steps", "1", "--device", args.device,
               "--commit", args.commit, "--out", rec_path, "--tag", "longest", "--prealloc-optimizer", *extra]
        status, detail, wall, rc, output, record = attempt(cmd, limit)
        attempts.append(dict(seq=seq, status=status, wall_s=round(wall, 1), detail=detail))
        print(f"[longest] {args.system} {args.model} S={seq}: {status} ({wall:.0f}s){' ' + detail if detail else ''}", flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(f"===== {' '.join(cmd)}\n===== {status} rc={rc} {wall:.0f}s\n")
                f.write("\n".join(ln for ln in output.splitlines() if "warn" not in ln.lower())[-20000:] + "\n")
        if status == "ok":
            found = record
            break
    got = found or {}
    row = dict(bench="longest", system=args.system,
               algorithm=got.get("algorithm", {"torch_cp": "allgather-cp", "tp_sp": "megatron-tp-sp"}.get(args.system, "ring")),
               model=args.model, gpus=args.nproc, seq=got.get("seq"),
               device=got.get("device") or (_device_name() if args.device == "cuda" else "cpu"), commit=args.commit, attempts=attempts,
               lower_bound=bool(found and skipped), tokens_per_s_per_gpu=got.get("tokens_per_s_per_gpu"), peak_mem_gb=got.get("peak_mem_gb"),
               mfu=got.get("mfu"), alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), train_args=" ".join(extra),
               **{k: got[k] for k in KEPT if k in got})
    if found is None:
        row["error"] = "no sequence length of the list trained" + (" (some were skipped)" if skipped else "")
    print(f"[longest] {args.system} {args.model} GPUs={args.nproc}: longest S = {row['seq']}" + (" (lower bound)" if row["lower_bound"] else "")
          + "; " + ", ".join(f"{a['seq']}:{a['status']}" for a in attempts), flush=True)
    if args.out:
        append_records(args.out, row)
    return row


if __name__ == "__main__":
    main()
