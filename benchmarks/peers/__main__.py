"""Run the peers and ours one after the other on this machine (Note [One measurement for every peer] in common.py).

    python -m benchmarks.peers --runs torchtitan,seqpar:llama3-8b,trl_cp,deepspeed_alst,seqpar:qwen3-8b \
        --seq 131072 --out $OUT/peers.json [--time-limit 150]
    python -m benchmarks.peers --runs trl_cp --seq 262144,393216,524288 --steps 3 --time-limit 590   # the longest

Each run is its own launcher (torchrun / accelerate launch) under a time limit; a run that fails, runs out of
memory or out of time leaves a record with ``status`` ("oom", "timeout", "error: <last line>") and the tail of its
log in ``$OUT/<run>-<seq>.log``, never a silent omission. The peers' packages come from ``--site`` (wheels carried
to the offline GPU machine and installed there with ``pip install --no-index --no-deps --target``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = {"torchtitan": "llama3-8b", "trl_cp": "qwen3-8b", "deepspeed_alst": "qwen3-8b"}
LAUNCH_ENV = {  # what each peer's own published launch puts in the environment (Note [One measurement for every peer])
    "torchtitan": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},  # torchtitan's run_train.sh
    "trl_cp": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},  # TRL's long-context guide ("still fails without it")
    "deepspeed_alst": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},  # the ALST paper's fragmentation advice
}


def _cause(lines: list[str], tail: list[str]) -> str:
    """The last exception line of a failed run that is not the launcher's own ChildFailedError."""
    for line in reversed(lines):
        if "Error" in line and ":" in line and "ChildFailedError" not in line and "error_file" not in line:
            return line.strip()
    return tail[-1] if tail else "?"


def steps_done(text: str) -> list[float]:
    """The seconds of each step a run finished before it failed or ran out of time (StepClock prints them)."""
    return [float(m) for m in re.findall(r"\[peers\] step \d+: ([0-9.]+) s", text)]


def _kill_tree(pid: int) -> None:
    import psutil

    root = psutil.Process(pid)
    for p in [*root.children(recursive=True), root]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def launch_env(system: str, environ) -> dict[str, str]:
    """What the peer's own launch adds to the environment (``LAUNCH_ENV``), unless the caller set an allocator
    configuration (theirs wins); ours sets its allocator in the strategy (Note [Expandable segments by default])."""
    if any(environ.get(var) for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return {}
    return dict(LAUNCH_ENV.get(system, {}))


def command(run: str, seq: int, gpus: int, steps: int, out: str, extra: list[str]) -> list[str]:
    system, _, model = run.partition(":")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)]
    common = ["--seq", str(seq), "--steps", str(steps), "--out", out, *extra]
    if system == "torchtitan":
        return [*torchrun, f"{HERE}/torchtitan_llama.py", *common]
    if system in ("trl_cp", "deepspeed_alst"):
        cfg = "accelerate_cp.yaml" if system == "trl_cp" else "accelerate_alst.yaml"
        if system == "trl_cp" and "--ckpt-offload" in extra:  # TRL's long-context example: checkpoints offloaded to the host
            cfg = "accelerate_cp_long.yaml"
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"{HERE}/{cfg}", "--num_processes",
                str(gpus), f"{HERE}/trl_sft.py", "--system", system, *common]
    if system == "seqpar":
        return [*torchrun, f"{HERE}/ours.py", "--model", model or "llama3-8b", *common]
    raise SystemExit(f"--runs: unknown system {system!r} (torchtitan, trl_cp, deepspeed_alst, seqpar:MODEL)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help="comma-separated: torchtitan, trl_cp, deepspeed_alst, seqpar:llama3-8b, "
                   "seqpar:qwen3-8b; a run may carry its own flags after '+', e.g. 'trl_cp+--offload'")
    p.add_argument("--seq", default="131072", help="a length, or ascending lengths (comma-separated): each run goes up "
                   "until its first failure, so its last 'ok' record is the longest that trains")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--time-limit", type=int, default=300, help="seconds per run")
    p.add_argument("--site", default="/tmp/site")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "peers.json"))
    args = p.parse_args()
    import torch

    gpus = args.gpus or torch.cuda.device_count()
    # flash-attention 4 carried into the site (Note [Carrying flash-attention 4] in benchmarks/driver.py) needs its DSL path
    dsl = os.path.join(args.site, "nvidia_cutlass_dsl", "dsl_packages")
    paths = [args.site, *([dsl] if os.path.isdir(dsl) else []), os.getcwd(), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths),
               SEQPAR_COMMIT=os.environ.get("SEQPAR_COMMIT", "unknown"), TOKENIZERS_PARALLELISM="false")
    logs = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(logs, exist_ok=True)
    lengths = [int(x) for x in str(args.seq).split(",")]
    for run in args.runs.split(","):
        name, *flags = run.split("+")
        for seq in lengths:  # ascending: the longest that trains is the last "ok" before the first failure
            if _run_one(name, flags, seq, args=args, gpus=gpus, env=env, logs=logs) != "ok":
                break


def _run_one(name: str, flags: list[str], seq: int, *, args, gpus: int, env: dict, logs: str) -> str:
    """One system at one length under the time limit; its record's status ("ok", "oom", "timeout", "error: ...")."""
    import torch

    cmd = command(name, seq, gpus, args.steps, args.out, flags)
    tag = "".join(f.strip("-").replace("=", "-") for f in flags if f.startswith("--"))  # a run's own flags name its log too
    log = os.path.join(logs, f"{name.replace(':', '-')}{'-' + tag if tag else ''}-{seq}.log")
    print(f"[peers] {name} S={seq}: {' '.join(cmd)}", flush=True)
    before = len(json.load(open(args.out))) if os.path.exists(args.out) else 0
    start = time.monotonic()
    system = name.partition(":")[0]
    launch = launch_env(system, os.environ)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**env, **launch}, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.time_limit)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            _kill_tree(proc.pid)  # the launcher and every rank it started (torchrun puts ranks in their own sessions)
            proc.wait()
    run_s = round(time.monotonic() - start, 1)  # the whole run: launch, load, every step, exit (the 10-minute budget)
    text = open(log, errors="replace").read()
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    if len(rows) > before:
        rows[-1]["run_s"] = run_s
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"[peers] {name} S={seq}: {rows[-1].get('status', 'ok')} in {run_s} s", flush=True)
        return rows[-1].get("status", "ok")
    tail = [line for line in text.splitlines() if line.strip()][-40:]
    status = ("timeout" if rc == "timeout" else "oom" if "OutOfMemoryError" in text or "CUDA out of memory" in text
              else "error: " + _cause(text.splitlines(), tail)[:300])
    model = name.partition(":")[2]
    rows.append(dict(bench="peers", system=system, model=model or MODEL.get(system, "llama3-8b"), seq=seq, gpus=gpus,
                     gpu=("H200" if "H200" in torch.cuda.get_device_name() else "H100") if torch.cuda.is_available() else "cpu",
                     commit=env["SEQPAR_COMMIT"], status=status, flags=flags, alloc_conf=launch, time_limit_s=args.time_limit, run_s=run_s,
                     steps_done_s=steps_done(text),  # a run out of time: how far it got
                     log_tail=tail[-15:]))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"[peers] {name} S={seq}: {status}", flush=True)
    return status

if __name__ == "__main__":
    main()
