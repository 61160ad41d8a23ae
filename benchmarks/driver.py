"""The benchmark driver: runs a suite of benchmarks/suites.py on a GPU machine within one call's budget.

    python -m benchmarks list                                    # the suites, their runs and GPU counts
    python -m benchmarks run SUITE --gpus N [--only GLOB,...] [--budget-s 560] [--dry-run] [--out DIR]
    python -m benchmarks fa4                                     # flash-attention 4, stage 1 of 2 (below)
    python -m benchmarks collect --kind nvidia-h200-x4 DIR/*.json     # here: merge into benchmarks/results/
    python -m benchmarks tables [--check]                        # here: regenerate docs/benchmarks.md's tables
    python -m benchmarks plot                                    # here: docs/img/*.png

Everything a benchmark run on a GPU machine needs that the per-run scripts do not do lives here, once: the environment
(NCCL without NVLink multicast, caches on /tmp, PYTHONPATH with the carried wheels), torchrun's start
(``--standalone``: a free rendezvous port per run), the time budget (every run under ``timeout`` with
min(its limit, what is left); a run whose limit does not fit is skipped and says so; longest-context
searches get the call's deadline), flash-attention 4 from carried wheels, and the records: each run
writes its own JSON file; the driver stamps every record with ``suite``, ``run``, ``commit`` (from
--commit, $SEQPAR_COMMIT or git) and appends it to ``DIR/<suite>.json``, and writes one log line
per run plus the run's result lines to ``DIR/<suite>.log`` (full logs in ``DIR/logs/``).

Note [Carrying flash-attention 4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The GPU machine has no internet; flash-attention 4 and its CuTe DSL wheels (``pip download
flash-attn-4`` on a machine with internet) come as two folders, ``.whl/`` and ``.whl2/`` (the largest
wheel split in two), each under the 64 MiB a call may carry. So it takes two calls on one warm machine:

    call 1, carry [".whl"]:   python -m benchmarks fa4            # copies .whl/* to /tmp/whl
    call 2, carry [".whl2"]:  python -m benchmarks run SUITE ...  # joins the split wheel, installs into /tmp/site

``run`` always does whatever of this the carried folders allow (nothing when neither is there), and
puts /tmp/site on PYTHONPATH for its runs; runs marked ``fa4`` are skipped, by name, when flash-attention
4 does not load. A machine that went cold has lost /tmp: start again at call 1.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Callable

from collect import append_records
from suites import SUITES, Run, Suite

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WHL, SITE = "/tmp/whl", "/tmp/site"
CU13 = "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl"
ENV = {
    # NVLink multicast is off on these machines (KINDS.md); the caches survive between calls of a warm machine
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "/tmp/fa4cache",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor_cache",
}
PY = "python"
"""The interpreter of the per-run scripts: the image's python, on PATH (as torchrun is)."""
MIN_S = 60
"""A run is skipped when less than this many seconds (or its limit, if smaller) are left."""
RESULT_PREFIXES = ("[train]", "[longest]", "[attention]", "[lasp]", "[lasp-gpu]", "[documents-gpu]", "[matmul]", "[local]")


def commit_of(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("SEQPAR_COMMIT"):
        return os.environ["SEQPAR_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _torchrun(nproc: int) -> list[str]:
    # --standalone: a rendezvous on a free local port (a fixed or random port can meet another job's store)
    return ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]


def _script(name: str) -> str:
    return os.path.join("benchmarks", name)


def command(run: Run, *, out: str, commit: str, deadline: float, peak: float | None = None) -> list[str]:
    """The command line of one run; its records go to ``out`` (a JSON file of its own)."""
    c = ["--commit", commit]
    if run.kind == "train":
        cmd = _torchrun(run.gpus) + [_script("train.py"), "--system", str(run.system)]
        if run.model and "--models" not in run.args:
            cmd += ["--model", run.model]
        if run.seq is not None:
            cmd += ["--seq", str(run.seq)]
        cmd += ["--warmup", "1", "--steps", "3", *run.args]  # later flags win: args may set --warmup / --steps
        if peak is not None:
            cmd += ["--matmul-peak", f"{peak:.1f}"]
        return cmd + ["--out", out, *c]
    if run.kind == "longest":
        seqs = ",".join(f"{s}:{t}" for s, t in run.seqs)
        return [PY, _script("longest.py"), "--system", str(run.system), "--model", str(run.model), "--nproc",
                str(run.gpus), "--seqs", seqs, "--deadline", f"{deadline:.0f}", "--out", out, "--log", out[:-5] + ".attempts.log",
                *c, *(("--", *run.args) if run.args else ())]
    if run.kind == "attention":
        grids = [x for g in run.grids for x in ("--grid", g)]
        return _torchrun(run.gpus) + [_script("attention.py"), *grids, "--iters", "3", "--warmup", "1", *run.args,
                                      "--out", out, *c]
    if run.kind == "scaling":
        return (_torchrun(run.gpus) + [_script("train_scaling.py"), "--model", str(run.model),
                 "--seq", str(run.seq), "--warmup", "1", "--steps", "3", *run.args, "--out", out, *c])
    if run.kind == "max_seq":
        seqs = ",".join(str(s) for s, _ in run.seqs)
        per = max(t for _, t in run.seqs)
        return [PY, _script("train_scaling.py"), "--find-max-seq", seqs, "--nproc", str(run.gpus), "--model",
                str(run.model), *run.args, "--attempt-timeout", str(per), "--deadline-s", f"{max(deadline - time.time() - 10, 0):.0f}",
                "--out", out, *c]
    if run.kind == "lasp_op":
        return _torchrun(run.gpus) + [_script("lasp.py"), *run.args, "--out", out, *c]
    if run.kind == "hf_finetune":
        return _torchrun(run.gpus) + [_script("hf_finetune.py"), "--seq", str(run.seq), *run.args, "--out", out, *c]
    if run.kind == "hf_families":
        return _torchrun(run.gpus) + [_script("hf_families.py"), "--seq", str(run.seq), *run.args, "--out", out, *c]
    if run.kind == "matmul":
        return [PY, _script("matmul_peak.py"), *run.args, "--out", out, *c]
    if run.kind == "local_attention":
        return [PY, _script("local_attention.py"), *run.args, "--out", out]
    if run.kind == "kernel_rates":
        return [PY, _script("kernel_rates.py"), *run.args, "--out", out, *c]
    if run.kind == "offload_optimizer":
        return [PY, _script("offload_optimizer.py"), "--model", str(run.model), *run.args, "--out", out, *c]
    if run.kind == "pytest":
        base = _torchrun(run.gpus) + ["-m"] if run.gpus > 1 else [PY, "-m"]
        return base + ["pytest", "-s", "-q", "-p", "no:cacheprovider", *run.args]
    raise ValueError(f"run {run.name!r}: unknown kind {run.kind!r}")


def install_fa4(log: Callable[[str], None] = print) -> None:
    """Note [Carrying flash-attention 4]: copy .whl (call 1) or join .whl2 and install (call 2), as carried."""
    if os.path.isdir(os.path.join(ROOT, ".whl")):
        os.makedirs(WHL, exist_ok=True)
        for f in glob.glob(os.path.join(ROOT, ".whl", "*")):
            shutil.copy(f, WHL)
        log(f"== fa4: copied .whl to {WHL} ({len(os.listdir(WHL))} files); carry .whl2 in the next call")
    if os.path.isdir(os.path.join(ROOT, ".whl2")):
        if not glob.glob(os.path.join(WHL, "cu13part.*")) and not os.path.exists(os.path.join(WHL, CU13)):
            log(f"== fa4: .whl2 is here but {WHL} has no first part: this machine went cold; carry .whl again (call 1)")
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
    if not os.path.exists(path):
        return []
    try:
        data = json.load(open(path))
    except ValueError:
        return []
    rows = []
    for row in data if isinstance(data, list) else [data]:
        if isinstance(row, dict):
            row = {**row, "suite": suite, "run": run}
            if row.get("commit") in (None, "", "unknown"):
                row["commit"] = commit
            rows.append(row)
    return rows


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
            log(f"# {run.name}: {run.kind}, {run.gpus} GPUs, limit {run.limit_s}s" + (", needs fa4" if run.fa4 else "")
                + (f", peers {', '.join(run.peers)}" if run.peers else ""))
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
            # its own session, so that `timeout` ends torchrun's workers too
            rc = subprocess.run(["timeout", "-k", "20", f"{limit:.0f}", *cmd], cwd=ROOT, env={**env, **dict(run.env)},
                                stdout=f, stderr=subprocess.STDOUT).returncode
        text = open(logfile, errors="replace").read().splitlines()
        for line in text:
            if line.startswith(RESULT_PREFIXES) or " passed" in line or " failed" in line:
                say("   " + line[:300])
        if rc != 0:
            say("   -- end of the log:\n" + "\n".join("   " + x[:300] for x in [t for t in text if "warn" not in t.lower()][-8:]))
        rows = _stamp(out, suite.name, run.name, commit)
        if run.kind == "matmul" and rows and rows[-1].get("tflops"):
            peak = float(rows[-1]["tflops"])
        records += rows
        if rows:
            append_records(os.path.join(out_dir, f"{suite.name}.json"), rows)
        say(f"== {run.name}: rc={rc}{' TIMEOUT' if rc in (124, 137, -9) else ''}, {time.time() - t0:.0f}s, {len(rows)} records "
            f"({time.time() - start:.0f}s of {budget_s:.0f}s used)")
    if records:
        from collect import summary

        say(summary(records))
    say(f"== done in {time.time() - start:.0f}s; merge here with: python -m benchmarks collect --kind <machine kind> "
        f"<files_at>/{suite.name}.json")
    suite_log.close()
    return records


def describe(suite: Suite) -> str:
    lines = [f"{suite.name}: {suite.question}"]
    for gpus, runs in sorted(suite.runs.items()):
        lines.append(f"  --gpus {gpus}: " + ", ".join(f"{r.name} ({r.limit_s}s{', fa4' if r.fa4 else ''})" for r in runs))
    return "\n".join(lines)


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
    sub.add_parser("collect", help="merge records into benchmarks/results/ (benchmarks/collect.py)", add_help=False)
    sub.add_parser("tables", help="regenerate docs/benchmarks.md's tables (benchmarks/report.py)", add_help=False)
    sub.add_parser("plot", help="redraw docs/img/*.png (benchmarks/plot.py)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd in ("collect", "tables", "plot"):
        import importlib

        mod = importlib.import_module({"collect": "collect", "tables": "report", "plot": "plot"}[args.cmd])
        result = mod.main(rest)
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
