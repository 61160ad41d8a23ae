"""The benchmark driver: runs a suite of benchmarks/suites.py on a GPU machine within a time budget.

    python -m benchmarks list                                    # the suites, their runs and GPU counts
    python -m benchmarks run SUITE --gpus N [--only GLOB,...] [--budget-s 560] [--dry-run] [--out DIR]
    python -m benchmarks fa4                                     # flash-attention 4, step 1 of 2 (below)
    python -m benchmarks collect --kind nvidia-h200-x4 DIR/*.json     # here: merge into benchmarks/results/
    python -m benchmarks tables [--check]                        # here: regenerate docs/benchmarks.md's tables
    python -m benchmarks auto [--worst N]                        # here: attention="auto" replayed on the records
    python -m benchmarks plot                                    # here: docs/img/*.png

What a run needs that the runners (train.py, longest.py, attention.py, hf.py) do not do lives here: the environment
(NCCL without NVLink multicast, caches on /tmp, the carried wheels on PYTHONPATH), torchrun's start, the time budget
(every run under ``timeout`` with min(its limit, what is left); a run that does not fit is skipped and says so), the
records (stamped with ``suite``, ``run``, ``commit`` into ``DIR/<suite>.json``; one line per run and its result lines in
``DIR/<suite>.log``, full logs in ``DIR/logs/``). Then what the runners share: device and process group, timing,
records, out-of-memory exits, the Trainer.

Note [Carrying flash-attention 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The GPU machine has no internet; flash-attention 4 and its CuTe DSL wheels (``pip download flash-attn-4`` on a machine
with internet) come as two folders, ``.whl/`` and ``.whl2/`` (the largest wheel split in two), each under the 64 MiB one
command may carry to the machine. So it takes two commands on one warm machine:

    command 1, carry [".whl"]:   python -m benchmarks fa4            # copies .whl/* to /tmp/whl
    command 2, carry [".whl2"]:  python -m benchmarks run SUITE ...  # joins the split wheel, installs into /tmp/site

``run`` does whatever of this the carried folders allow and puts /tmp/site on PYTHONPATH; runs marked ``fa4`` are
skipped, by name, when flash-attention 4 does not load. A machine that went cold has lost /tmp: start at command 1.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from suites import MODES, SUITES, Run, Suite

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHL, SITE = "/tmp/whl", "/tmp/site"
CU13 = "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl"
ENV = {
    # NVLink multicast is off on these machines (KINDS.md); the caches survive between runs on a warm machine
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/tmp/fa4cache",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor_cache",
}
PY = "python"  # the interpreter of the runners: the image's python, on PATH (as torchrun is)
MIN_S = 60  # a run is skipped when less than this many seconds (or its limit, if smaller) are left
RESULT_PREFIXES = ("[train]", "[longest]", "[attention]", "[hf]", "[lasp-gpu]", "[documents-gpu]")
SCRIPTS = {"train": "train.py", "longest": "longest.py", "attention": "attention.py", "hf": "hf.py"}
ONE_PROCESS = {("longest", None), ("attention", "local"), ("attention", "rates"), ("attention", "matmul"), ("train", "host-adamw")}
"""Runs started with plain ``python`` (one process; longest.py starts its own torchrun per attempt)."""


def commit_of(explicit: str | None) -> str:
    if explicit or os.environ.get("SEQPAR_COMMIT"):
        return explicit or os.environ["SEQPAR_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        return out.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command(run: Run, *, out: str, commit: str, deadline: float, peak: float | None = None) -> list[str]:
    """The command line of one run; its records go to ``out`` (a JSON file of its own)."""
    if run.kind == "pytest":
        base = ["torchrun", "--standalone", f"--nproc_per_node={run.gpus}", "-m"] if run.gpus > 1 else [PY, "-m"]
        return base + ["pytest", "-s", "-q", "-p", "no:cacheprovider", *run.args]
    if (run.kind, run.mode) in ONE_PROCESS:
        cmd = [PY]
    else:  # --standalone: a rendezvous on a free local port (a fixed or random port can meet another job's store)
        cmd = ["torchrun", "--standalone", f"--nproc_per_node={run.gpus}"]
    cmd += [os.path.join("benchmarks", SCRIPTS[run.kind]), *([run.mode] if run.mode else [])]
    if run.system is not None and run.kind in ("train", "longest") and run.mode is None:
        cmd += ["--system", run.system]
    if run.model and "--models" not in run.args:
        cmd += ["--model", run.model]
    if run.seq is not None:
        cmd += ["--seq", str(run.seq)]
    cmd += [x for g in run.grids for x in ("--grid", g)]
    if run.kind == "longest":
        cmd += ["--nproc", str(run.gpus), "--seqs", ",".join(f"{s}:{t}" for s, t in run.seqs), "--deadline", f"{deadline:.0f}",
                "--log", out[:-5] + ".attempts.log"]
    elif (run.kind, run.mode) in (("train", None), ("attention", "grid")):
        cmd += ["--warmup", "1", *(("--steps", "3") if run.kind == "train" else ("--iters", "3"))]
    cmd += [] if run.kind == "longest" else list(run.args)  # later flags win: args may set --warmup / --steps
    if peak is not None and (run.kind, run.mode) == ("train", None):
        cmd += ["--matmul-peak", f"{peak:.1f}"]
    cmd += ["--out", out, "--commit", commit]
    return cmd + (["--", *run.args] if run.kind == "longest" and run.args else [])


def install_fa4(log: Callable[[str], None] = print) -> None:
    """Note [Carrying flash-attention 4]: copy .whl (command 1) or join .whl2 and install (command 2), as carried."""
    if os.path.isdir(os.path.join(ROOT, ".whl")):
        os.makedirs(WHL, exist_ok=True)
        for f in glob.glob(os.path.join(ROOT, ".whl", "*")):
            shutil.copy(f, WHL)
        log(f"== fa4: copied .whl to {WHL} ({len(os.listdir(WHL))} files); carry .whl2 in the next command")
    if os.path.isdir(os.path.join(ROOT, ".whl2")):
        if not glob.glob(os.path.join(WHL, "cu13part.*")) and not os.path.exists(os.path.join(WHL, CU13)):
            log(f"== fa4: .whl2 is here but {WHL} has no first part: this machine went cold; carry .whl again (command 1)")
            return
        for f in glob.glob(os.path.join(ROOT, ".whl2", "*")):
            shutil.copy(f, WHL)
        parts = sorted(glob.glob(os.path.join(WHL, "cu13part.*")))
        if parts:
            with open(os.path.join(WHL, CU13), "wb") as dst:
                for p in parts:
                    with open(p, "rb") as src:
                        shutil.copyfileobj(src, dst)
                    os.remove(p)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                            "--target", SITE, *sorted(glob.glob(os.path.join(WHL, "*.whl")))], capture_output=True, text=True)
        log(f"== fa4: installed into {SITE} (rc {r.returncode}) {r.stderr.strip()[-300:]}")


def environment() -> dict[str, str]:
    env = dict(os.environ, **ENV)
    # /tmp/site: the carried wheels; cutlass lives one level down (--target skips .pth files)
    paths = [ROOT, SITE, os.path.join(SITE, "nvidia_cutlass_dsl", "dsl_packages"), os.path.join(ROOT, ".site", "site")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def fa4_available(env: dict[str, str]) -> bool:
    probe = "import torch; from lightning_seqpar.attention import available_backends as a; print('fa4' in a('cuda', torch.bfloat16, 128))"
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    return r.stdout.strip().endswith("True")


def _stamp(path: str, suite: str, run: str, commit: str) -> list[dict]:
    """The records a run wrote, with suite / run / commit filled in."""
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        return []
    return [{**row, "suite": suite, "run": run, "commit": commit if row.get("commit") in (None, "", "unknown") else row["commit"]}
            for row in (data if isinstance(data, list) else [data]) if isinstance(row, dict)]


def run_suite(suite: Suite, *, gpus: int, only: tuple[str, ...] = (), budget_s: float = 560, out_dir: str = "/tmp/out",
              commit: str | None = None, dry_run: bool = False, log: Callable[[str], None] = print) -> list[dict]:
    """Run (or, dry, print) the selected runs of ``suite`` in order within ``budget_s``; the records they wrote."""
    runs = suite.select(gpus, only)
    commit = commit_of(commit)
    start = time.time()
    deadline = start + budget_s
    records: list[dict] = []
    run_dir = os.path.join(out_dir, "runs")
    env = environment()
    if dry_run:
        log(f"# suite {suite.name}, {gpus} GPUs, {len(runs)} runs, budget {budget_s:.0f}s, commit {commit} (dry run)")
        for run in runs:
            cmd = command(run, out=os.path.join(run_dir, f"{run.name}.json"), commit=commit, deadline=deadline)
            envs = " ".join(f"{k}={v}" for k, v in run.env)
            log(f"# {run.name}: {run.kind}{' ' + run.mode if run.mode else ''}, {run.gpus} GPUs, limit {run.limit_s}s"
                + (", needs fa4" if run.fa4 else "") + (f", peers {', '.join(run.peers)}" if run.peers else ""))
            log(f"{envs + ' ' if envs else ''}timeout -k 20 {run.limit_s} {shlex.join(cmd)}")
        return records
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    os.makedirs(run_dir, exist_ok=True)
    suite_log = open(os.path.join(out_dir, f"{suite.name}.log"), "a")

    def say(line: str) -> None:
        log(line)
        suite_log.write(line + "\n")
        suite_log.flush()

    if commit == "unknown":
        say("== WARNING: the commit is unknown (no --commit, $SEQPAR_COMMIT or git here): records will say 'unknown'")
    install_fa4(say)
    have_fa4 = any(r.fa4 for r in runs) and fa4_available(env)
    say(f"== suite {suite.name}, {gpus} GPUs, runs {', '.join(r.name for r in runs)}; budget {budget_s:.0f}s; commit {commit}; "
        f"fa4 {'yes' if have_fa4 else 'no'}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}")
    peak = None
    for run in runs:
        left = deadline - time.time()
        limit = min(run.limit_s, left)
        if limit < min(MIN_S, run.limit_s):
            say(f"== {run.name}: SKIPPED ({left:.0f}s of the budget left, limit {run.limit_s}s)")
            continue
        if run.fa4 and not have_fa4:
            say(f"== {run.name}: SKIPPED (needs flash-attention 4; Note [Carrying flash-attention 4] in benchmarks/driver.py)")
            continue
        out = os.path.join(run_dir, f"{run.name}.json")
        if os.path.exists(out):
            os.remove(out)
        cmd = command(run, out=out, commit=commit, deadline=deadline, peak=peak)
        say(f"== {run.name} (limit {limit:.0f}s): {shlex.join(cmd)}")
        logfile = os.path.join(out_dir, "logs", f"{suite.name}-{run.name}.log")
        t0 = time.time()
        with open(logfile, "w") as f:
            # its own process session, so that `timeout` ends torchrun's workers too
            rc = subprocess.run(["timeout", "-k", "20", f"{limit:.0f}", *cmd], cwd=ROOT, env={**env, **dict(run.env)},
                                stdout=f, stderr=subprocess.STDOUT).returncode
        text = open(logfile, errors="replace").read().splitlines()
        for line in text:
            if line.startswith(RESULT_PREFIXES) or " passed" in line or " failed" in line:
                say("   " + line[:300])
        if rc != 0:
            say("   -- end of the log:\n" + "\n".join("   " + x[:300] for x in [t for t in text if "warn" not in t.lower()][-8:]))
        rows = _stamp(out, suite.name, run.name, commit)
        if rows and rows[-1].get("bench") == "matmul" and rows[-1].get("tflops"):
            peak = float(rows[-1]["tflops"])  # the measured bf16 peak: train runs after it record mfu_measured_peak
        records += rows
        if rows:
            append_records(os.path.join(out_dir, f"{suite.name}.json"), rows)
        say(f"== {run.name}: rc={rc}{' TIMEOUT' if rc in (124, 137, -9) else ''}, {time.time() - t0:.0f}s, {len(rows)} records "
            f"({time.time() - start:.0f}s of {budget_s:.0f}s used)")
    say(f"== done in {time.time() - start:.0f}s; merge here with: python -m benchmarks collect --kind <machine kind> "
        f"<files_at>/{suite.name}.json")
    suite_log.close()
    return records


def describe(suite: Suite) -> str:
    return "\n".join([f"{suite.name}: {suite.question}"] + [f"  --gpus {gpus}: " + ", ".join(
        f"{r.name} ({r.limit_s}s{', fa4' if r.fa4 else ''})" for r in runs) for gpus, runs in sorted(suite.runs.items())])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the suites and their runs")
    r = sub.add_parser("run", help="run a suite (or --only a slice of it) on this machine's GPUs")
    r.add_argument("suite", choices=sorted(SUITES))
    r.add_argument("--gpus", type=int, required=True, help="GPUs of this machine (selects the suite's runs for it)")
    r.add_argument("--only", default="", help="comma list of run names or fnmatch patterns (e.g. 'llama3-8b-*')")
    r.add_argument("--budget-s", type=float, default=560, help="seconds for all runs together (a run on our GPU machines is limited to 600)")
    r.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="folder of the records and logs (default: $OUT)")
    r.add_argument("--commit", default=None, help="the commit measured (default: $SEQPAR_COMMIT, else git)")
    r.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    sub.add_parser("fa4", help="copy / install the carried flash-attention 4 wheels (Note [Carrying flash-attention 4])")
    sub.add_parser("collect", help="merge records into benchmarks/results/ (benchmarks/report.py)", add_help=False)
    sub.add_parser("tables", help="regenerate docs/benchmarks.md's tables (benchmarks/report.py)", add_help=False)
    sub.add_parser("plot", help="redraw docs/img/*.png (benchmarks/plot.py)", add_help=False)
    sub.add_parser("auto", help='replay attention="auto" over every measured attention point (benchmarks/report.py)', add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd in ("collect", "tables", "plot", "auto"):
        import plot
        import report

        result = {"collect": report.collect_main, "tables": report.main, "plot": plot.main, "auto": report.auto_main}[args.cmd](rest)
        return result if isinstance(result, int) else 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "list":
        print("\n\n".join(describe(s) for s in SUITES.values()))
        return 0
    if args.cmd == "fa4":
        install_fa4()
        return 0
    only = tuple(p for p in args.only.split(",") if p)
    try:
        run_suite(SUITES[args.suite], gpus=args.gpus, only=only, budget_s=args.budget_s, out_dir=args.out, commit=args.commit,
                  dry_run=args.dry_run)
    except ValueError as e:
        ap.error(str(e))
    return 0


# ==== what the runners share ===============================================================================

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16 (datasheet): the denominator of every MFU
OOM_EXIT = 3  # the exit code of a rank that ran out of GPU memory (longest.py tells it from other failures)
HOST_OOM_EXIT = 4  # the exit code of a run the host-memory watchdog ended (Note [The host-memory watchdog])


def runner_args(ap: argparse.ArgumentParser, *, device: bool = True) -> argparse.ArgumentParser:
    """The options every runner has: --out (records appended to this JSON list), --commit and --device."""
    ap.add_argument("--out", default=None, help="append the records to this JSON list (merge with python -m benchmarks collect)")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    if device:
        ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (gloo, small shapes)")
    return ap


def mode_of(argv: list[str] | None, kind: str) -> tuple[str | None, list[str]]:
    """(mode, the other arguments) of a runner with several modes (its first argument; the first mode when absent)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MODES[kind]:
        return argv[0], argv[1:]
    return MODES[kind][0], argv


def setup(device_type: str, *, group: bool = False, axis: str = "sp", timeout_min: float = 5.0) -> tuple[Any, Any, int, int]:
    """(device, 1-D mesh named ``axis`` or None, rank, world) of this process: a plain launch (world 1) or torchrun.
    The process group (NCCL on CUDA, gloo on the CPU) is initialised when WORLD_SIZE > 1 or ``group``."""
    world, rank, mesh = int(os.environ.get("WORLD_SIZE", "1")), 0, None
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if world > 1 or group:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_min),
                                device_id=device if cuda else None)
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=(axis,))
    return device, mesh, rank, world


def device_name(device: Any) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def max_over_ranks(*values: float, device: Any = "cpu") -> list[float]:
    """``values``, each the largest over the ranks of the default process group (as they are without one)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(step: Callable[[], Any], iters: int, warmup: int, device: Any, *, best: bool = False) -> tuple[float, float, float]:
    """Time ``step`` (forward + backward of an op, say): ``warmup`` untimed calls, then ``iters`` timed ones (CUDA
    events on a GPU). (seconds: the median, or with ``best`` the fastest; peak GB: torch.cuda.max_memory_allocated
    over the timed calls; op GB: that peak minus what was allocated before them). Under a process group the
    slowest rank's time and the largest memory."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    base = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    t = min(times) if best else sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    t, peak_gb, op_gb = max_over_ranks(t, peak / 1e9, (peak - base) / 1e9, device=device)
    return t, peak_gb, op_gb


def append_records(path: str, rows: dict | list[dict]) -> None:
    """Append one record or a list of records to the JSON list in ``path`` (created if missing)."""
    old = json.load(open(path)) if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(old + (rows if isinstance(rows, list) else [rows]), f, indent=1)


def error_text(error: BaseException, limit: int = 300) -> str:
    """A failed run's error for its record: the type and the first line of the message."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:limit] if str(error).strip() else ''}"


def record_and_release(path: str | None, row: dict, *, end_group: bool = True) -> None:
    """After one measurement: append ``row`` to ``path`` (when given), then free what the run left (collected
    objects, the CUDA cache and, with ``end_group``, a default process group) before the next one."""
    if path:
        append_records(path, row)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if end_group and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def held_gb(cuda: bool) -> float:
    """Before the next run of one process: free what the previous run left (its trainer, model and optimizer are
    unreachable once it returned) and return what is still allocated, GB, max over ranks (a record's
    ``held_before_gb``: a leak shows there rather than as a peak that silently includes it)."""
    gc.collect()
    if not cuda or not dist.is_initialized():
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return max_over_ranks(torch.cuda.memory_allocated() / 1e9, device="cuda")[0]


def is_oom(exc: BaseException | None) -> bool:
    """torch.OutOfMemoryError, or an allocation failure that a kernel library reports as a RuntimeError."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or (
                isinstance(exc, RuntimeError) and ("out of memory" in str(exc).lower() or "ALLOC_FAILED" in str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def oom_state(exc: BaseException) -> str:
    """Where an out-of-memory error happened (the innermost frames of ours, of torch if none) and the memory then:
    what PyTorch's allocator held, had reserved and peaked at, and what the driver had free (a library's own
    allocation, e.g. cuBLAS's handle, fails when the allocator has reserved the card)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    ours = [f for f in frames if "lightning_seqpar" in f.filename or "benchmarks" in f.filename] or frames
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-3:])) or "?"
    memory = "no CUDA"
    if torch.cuda.is_available():
        gb = 1e9
        try:
            free, total = torch.cuda.mem_get_info()
            driver = f", driver free {free / gb:.1f} of {total / gb:.1f} GB"
        except RuntimeError:
            driver = ""
        memory = (f"allocated {torch.cuda.memory_allocated() / gb:.1f} GB, reserved {torch.cuda.memory_reserved() / gb:.1f} GB, "
                  f"peak {torch.cuda.max_memory_allocated() / gb:.1f} GB{driver}")
    return f"{memory}; at {where}"


def exit_oom(rank: Any, exc: BaseException) -> None:
    """End this rank at once with OOM_EXIT (the other ranks would wait in a collective; torchrun stops them)."""
    print(f"[train] OOM rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}", flush=True)
    print(f"[train] oom-state rank {rank}: {oom_state(exc)}", flush=True)
    sys.stderr.flush()
    os._exit(OOM_EXIT)



# Note [The host-memory watchdog]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A run that exhausts the host's memory (pinned offloaded checkpoints, ZeRO-3's host states) is ended by the kernel's
# OOM killer with SIGKILL: no Python runs, the length leaves no record, and a table cannot tell "did not fit in the
# host" from a crash. So the one-GPU runners (alst.py, hf.py memory) run each length under ``HostMemoryWatchdog``: a
# daemon thread that reads /proc/meminfo every ``interval_s`` (0.15 s) and, once MemAvailable falls below the floor
# (min(8 GB, 3% of MemTotal) by default), calls ``on_low`` once with the line "host out of memory: MemAvailable X GB
# of Y GB at process RSS Z GB (peak RSS W GB)". The runners' ``on_low`` (:func:`host_oom_exit`) makes the run's row
# an error row (``error`` that line, ``host_oom`` true, the GPU peaks so far), appends it to the records as
# ``record_and_release`` would, prints it, and ends the process with ``os._exit(HOST_OOM_EXIT)`` (4): the run cannot
# go on safely, and an exception raised into the main thread would need memory to unwind. The floor is a margin, not
# a guarantee: memory taken faster than the floor per interval can still meet the OOM killer first. MemAvailable is
# the machine's (a cgroup limit below it is not watched); where /proc/meminfo is absent the watchdog does nothing.


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, float] | None:
    """MemTotal and MemAvailable of ``path``, bytes; None where it is absent or lacks them (not Linux)."""
    try:
        with open(path) as fh:
            info = {k: float(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in fh)
                    if k in ("MemTotal", "MemAvailable")}
    except (OSError, ValueError, IndexError):
        return None
    return info if len(info) == 2 else None


def process_rss_bytes() -> tuple[float, float]:
    """(RSS, peak RSS) of this process, bytes: VmRSS / VmHWM of /proc/self/status, else ru_maxrss for both."""
    try:
        with open("/proc/self/status") as fh:
            status = {k: float(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in fh) if k in ("VmRSS", "VmHWM")}
        return status["VmRSS"], status["VmHWM"]
    except (OSError, ValueError, IndexError, KeyError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
        return peak, peak


class HostMemoryWatchdog:
    """``with HostMemoryWatchdog(on_low):`` around a run: ``on_low(line)`` once MemAvailable falls below the floor
    (Note [The host-memory watchdog]). ``read``: the /proc/meminfo reader (tests pass their own); ``fired``: the line,
    once it fired."""

    def __init__(self, on_low: Callable[[str], None], *, floor_gb: float = 8.0, floor_fraction: float = 0.03,
                 interval_s: float = 0.15, read: Callable[[], dict[str, float] | None] = read_meminfo) -> None:
        if floor_gb < 0 or not 0 <= floor_fraction < 1 or interval_s <= 0:
            raise ValueError(f"HostMemoryWatchdog: floor_gb >= 0, 0 <= floor_fraction < 1 and interval_s > 0, got {floor_gb}, "
                             f"{floor_fraction}, {interval_s}")
        self.on_low, self.floor_gb, self.floor_fraction, self.interval_s, self.read = on_low, floor_gb, floor_fraction, interval_s, read
        self.fired: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> str | None:
        """One reading: the host-out-of-memory line when MemAvailable is below the floor, else None (also without
        /proc/meminfo)."""
        info = self.read()
        if info is None:
            return None
        total, available = info["MemTotal"], info["MemAvailable"]
        if available >= min(self.floor_gb * 1e9, self.floor_fraction * total):
            return None
        rss, peak = process_rss_bytes()
        return (f"host out of memory: MemAvailable {available / 1e9:.1f} GB of {total / 1e9:.1f} GB at process RSS "
                f"{rss / 1e9:.1f} GB (peak RSS {peak / 1e9:.1f} GB)")

    def _watch(self) -> None:
        while not self._stop.is_set():
            line = self.check()
            if line is not None:
                self.fired = line
                self.on_low(line)
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HostMemoryWatchdog:
        if self.read() is not None:  # no /proc/meminfo: nothing to watch
            self._thread = threading.Thread(target=self._watch, name="host-memory-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # an on_low that is writing the record ends the process before this returns


def gpu_peaks() -> dict[str, float]:
    """``peak_mem_gb`` / ``peak_reserved_gb`` of the current CUDA device (allocator peaks), {} where CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9, "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}


def host_oom_exit(row: dict, path: str | None, *, say: Callable[[dict], None], code: int = HOST_OOM_EXIT,
                  end: Callable[[int], Any] = os._exit) -> Callable[[str], None]:
    """A runner's ``on_low`` for :class:`HostMemoryWatchdog`: ``row`` becomes the run's error row (``error`` the line,
    ``host_oom``, the GPU peaks so far, the host peak RSS), appended to ``path`` (when given), shown with ``say``; then
    the process ends with ``code`` (``end``: tests pass their own)."""
    def on_low(line: str) -> None:
        row.update(error=line, host_oom=True, oom=False, host_maxrss_gb=process_rss_bytes()[1] / 1e9, **gpu_peaks())
        if path:
            append_records(path, row)
        say(row)
        sys.stdout.flush()
        sys.stderr.flush()
        end(code)

    return on_low

def trainer(strategy: Any, *, steps: int, precision: str, callbacks: list, cuda: bool) -> Any:
    """A benchmark's Lightning Trainer: ``steps`` optimizer steps on the devices of this node (torchrun's
    LOCAL_WORLD_SIZE; 1 without torchrun), nothing logged, validated or saved."""
    import lightning as L

    return L.Trainer(accelerator="gpu" if cuda else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                     strategy=strategy, precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                     callbacks=callbacks, log_every_n_steps=1)


def step_timer(times: list, losses: list, *, warmup: int, cuda: bool) -> Any:
    """A callback timing each optimizer step after the first ``warmup`` (synchronised wall clock) into ``times`` and
    collecting ``train/loss`` into ``losses``; the peak memory statistics are reset when the timed steps start
    (``warmup=-1``: every step timed, no reset)."""
    import lightning as L

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
                if batch_idx == warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            if batch_idx >= warmup:
                times.append(time.perf_counter() - self.t0)
            loss = trainer.callback_metrics.get("train/loss")
            losses.append(float(loss) if loss is not None else float("nan"))

    return StepTimer()
