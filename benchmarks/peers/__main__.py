"""Run the peers and ours one after the other on this machine (Note [One measurement for every peer] in common.py).

    python -m benchmarks.peers --runs torchtitan,seqpar:llama3-8b,trl_cp,deepspeed_alst,seqpar:qwen3-8b \
        --seq 131072 --out $OUT/peers.json [--time-limit 150]
    python -m benchmarks.peers --runs trl_cp --seq 262144,393216,524288 --steps 3 --time-limit 590   # the longest

Each run is its own launcher (torchrun / accelerate launch) under a time limit; a run that fails, runs out of
memory or out of time leaves a record with ``status`` ("oom", "timeout", "error: <last line>") and the tail of its
log in ``$OUT/<run>-<seq>.log``, never a silent omission. The peers' packages come from ``--site`` (wheels carried
to the offline GPU machine and installed there with ``pip install --no-index --no-deps --target``).

Every run is measured from outside its code the same way (Note [One measurement for every peer] in common.py): the
in-process probe ``probe/sitecustomize.py`` on every launched process's PYTHONPATH (the allocator's reserved peak,
reset-proof; the master weights' dtype; the kernels of one profiled warm-up step, ``--kernel-step``), and a poller
here (:class:`MemoryPoller`: the GPUs' used memory through NVML and the host RSS of the launched process tree, every
0.2 s). The harness merges both into the run's record: ``peak_reserved_gb`` (the tables' memory column),
``memory``, ``master_weights``, ``kernels``, ``attention_kernel``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "probe")  # sitecustomize.py: the in-process probe every launched process carries
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


class MemoryPoller(threading.Thread):
    """The GPUs' used memory (NVML through nvidia-ml-py, else ``nvidia-smi -lms``) and the RSS of a process tree (psutil,
    summed over the launcher and every rank), every ``interval`` seconds while the run lives: the peaks over the whole
    run and, once the run's log shows the last warm-up step's ``[peers] step W:`` line, over the timed steps."""

    def __init__(self, pid: int, log: str, warmup: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.log, self.warmup, self.interval = pid, log, warmup, interval
        self._stop_event, self._text, self._offset = threading.Event(), "", 0
        self.timed_from: float | None = None
        self.device_peak: list[int] = []
        self.device_peak_timed: list[int] = []
        self.host_peak = self.host_peak_timed = self.samples = 0
        self.source, self._smi, self._smi_rows, self._nvml = None, None, [], None
        self.baseline = self.device_used()
        self.t0 = time.monotonic()

    def device_used(self) -> list[int]:
        """Bytes in use on each GPU now ([] when neither NVML nor nvidia-smi answers)."""
        if self._nvml is None and self.source is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
                self.source = "nvml (nvidia-ml-py)"
            except Exception:  # noqa: BLE001 - no NVML here: nvidia-smi streams instead
                self._start_smi()
        if self._nvml is not None:
            import pynvml

            return [pynvml.nvmlDeviceGetMemoryInfo(h).used for h in self._nvml]
        return list(self._smi_rows)

    def _start_smi(self) -> None:
        try:
            self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                          f"-lms={int(self.interval * 1000)}"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.source = "none (no NVML, no nvidia-smi)"
            return
        self.source = f"nvidia-smi -lms {int(self.interval * 1000)}"

        def read() -> None:
            for line in self._smi.stdout:
                index, _, used = line.partition(",")
                if index.strip().isdigit() and used.strip().isdigit():
                    i = int(index)
                    self._smi_rows.extend([0] * (i + 1 - len(self._smi_rows)))
                    self._smi_rows[i] = int(used) * 1024 * 1024  # MiB

        threading.Thread(target=read, daemon=True).start()

    def host_rss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _see_timed_steps(self) -> None:
        """Reads the log's new bytes for the last warm-up step's clock line (rank 0's StepClock prints it)."""
        if self.timed_from is not None or not os.path.exists(self.log):
            return
        with open(self.log, errors="replace") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        self._text = (self._text + chunk)[-4096:]
        if re.search(rf"\[peers\] step {self.warmup}: ", self._text):
            self.timed_from = time.monotonic() - self.t0

    def sample(self) -> None:
        self._see_timed_steps()
        used, host = self.device_used(), self.host_rss()
        self.samples += 1
        self.device_peak = [max(a, b) for a, b in zip(self.device_peak + [0] * len(used), used)]
        self.host_peak = max(self.host_peak, host)
        if self.timed_from is not None:
            self.device_peak_timed = [max(a, b) for a, b in zip(self.device_peak_timed + [0] * len(used), used)]
            self.host_peak_timed = max(self.host_peak_timed, host)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a sampling failure is recorded, never the run's
                self.source = f"{self.source}; sampling failed: {type(e).__name__}: {e}"
                return

    def stop(self) -> dict:
        self._stop_event.set()
        self.join(timeout=5)
        if self._smi is not None:
            self._smi.kill()
        gb = lambda xs: [round(x / 1e9, 2) for x in xs]  # noqa: E731
        return dict(
            device=dict(source=self.source, peak_gb=round(max(self.device_peak, default=0) / 1e9, 2) if self.device_peak else None,
                        peak_timed_gb=round(max(self.device_peak_timed) / 1e9, 2) if self.device_peak_timed else None,
                        per_gpu_peak_gb=gb(self.device_peak), baseline_gb=gb(self.baseline),
                        includes="every process's memory on each GPU: CUDA contexts, NCCL buffers, the allocator's reserve"),
            host=dict(peak_rss_gb=round(self.host_peak / 1e9, 2), peak_rss_timed_gb=round(self.host_peak_timed / 1e9, 2) or None,
                      of="RSS summed over the launcher and every process it started (shared pages once per process)"),
            interval_s=self.interval, samples=self.samples,
            timed_from_s=None if self.timed_from is None else round(self.timed_from, 1),
            window=f"the whole run (launch to exit); 'timed': from the log's '[peers] step {self.warmup}:' line on")


def warmup_of(flags: list[str]) -> int:
    """The warm-up steps a run drops (its ``--warmup N`` flag, else the runners' default 2)."""
    for i, f in enumerate(flags):
        if f == "--warmup" and i + 1 < len(flags):
            return int(flags[i + 1])
        if f.startswith("--warmup="):
            return int(f.split("=", 1)[1])
    return 2


def step_split(trace: str, step_s: float | None) -> dict:
    """The profiled step's timeline split by part and idle cause (Note [Where the step goes]), or why not."""
    try:
        from benchmarks.profile_summary import where_the_step_goes
    except ImportError:  # loaded by path (the tests)
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        from benchmarks.profile_summary import where_the_step_goes
    try:
        with open(trace) as f:
            return where_the_step_goes(json.load(f), step_s=step_s)
    except (OSError, ValueError, KeyError) as e:
        return dict(why=f"trace not read: {type(e).__name__}: {e}")


def probe_results(directory: str) -> dict:
    """The in-process probe's per-rank files (probe/sitecustomize.py) as the record's fields: the reserved and
    allocated peaks (max over ranks), the master weights' dtype and the profiled step's kernels (rank 0)."""
    ranks = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("probe-") and name.endswith(".json"):
            try:
                ranks.append(json.load(open(os.path.join(directory, name))))
            except (OSError, ValueError):
                pass
    if not ranks:
        return {}
    first = min(ranks, key=lambda r: r.get("rank", 0))
    kernels = next((r["kernels"] for r in ranks if r.get("kernels")), None)
    trace = os.path.join(directory, f"trace-{(kernels or {}).get('rank', 0)}.json")
    if kernels and os.path.isfile(trace):
        kernels = dict(kernels, where=step_split(trace, kernels.get("window_s")))
    peak = lambda key: round(max(r.get(key) or 0 for r in ranks), 2)  # noqa: E731
    return dict(
        peak_reserved_gb=peak("peak_reserved_gb"), master_weights=first.get("master_weights"), kernels=kernels,
        attention_kernel=kernels.get("attention") if kernels else None,
        probe=dict(peak_reserved_gb=peak("peak_reserved_gb"), peak_allocated_gb=peak("peak_allocated_gb"),
                   max_current_reserved_gb=peak("max_current_reserved_gb"), ranks=len(ranks),
                   resets_seen=[r.get("resets_seen", 0) for r in sorted(ranks, key=lambda r: r.get("rank", 0))],
                   optimizer=first.get("optimizer"), steps=first.get("steps"),
                   host_maxrss_gb_sum=round(sum(r.get("host_maxrss_gb") or 0 for r in ranks), 2),
                   window="each rank's whole run: torch.cuda.max_memory_reserved / max_memory_allocated after every "
                          "optimizer step and before every reset_peak_memory_stats, a running max; the max over ranks"))


def merge_measures(row: dict, probed: dict, polled: dict, flags: list[str]) -> dict:
    """The run's record with the harness's own measures (probe and poller) and its flags; ``peak_mem_gb`` (the
    StepClock's ``max_memory_allocated`` since the first timed step) kept and labelled."""
    row = dict(row, flags=row.get("flags", flags))
    if "peak_mem_gb" in row:
        resets = (probed.get("probe") or {}).get("resets_seen") or []
        row["peak_mem_measure"] = "max_memory_allocated since the first timed step, max over ranks (StepClock; old measure)" + (
            "; reset by the system's own code during the run, so not a peak" if any(n > 1 for n in resets) else "")
    for key in ("peak_reserved_gb", "master_weights", "kernels", "attention_kernel"):
        if probed.get(key) is not None:
            row[key] = probed[key]
    row["memory"] = dict(table="peak_reserved_gb (the probe)", probe=probed.get("probe"), **polled)
    return row


NEEDS: dict[str, tuple[str, ...]] = {
    "torchtitan": ("torchtitan", "torchdata", "tyro", "datasets"),
    "trl_cp": ("trl", "accelerate", "datasets"),
    "deepspeed_alst": ("trl", "accelerate", "datasets", "deepspeed"),
}
"""The modules each peer's runner imports beyond the GPU image's (a run's ``--liger`` adds ``liger_kernel``)."""


def missing_modules(system: str, flags: list[str], env: dict) -> list[str]:
    """The modules ``system`` (with ``flags``) needs that the runner's environment ``env`` cannot import, asked of a
    Python started with it (the carried wheels live on its PYTHONPATH): a run that would fail at its first import is
    refused before its launch, not after a minute of device time (2026-11-28: torchtitan without ``datasets``)."""
    needed = [*NEEDS.get(system, ()), *(("liger_kernel",) if "--liger" in flags else ())]
    if not needed:
        return []
    code = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    found = subprocess.run([sys.executable, "-c", code, *needed], env=env, capture_output=True, text=True, timeout=120)
    return found.stdout.split()


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
        # the YAMLs name 4 GPUs; the degree follows the GPUs of the run (accelerate launch's flags win over its config)
        degree = "--parallelism_config_cp_size" if system == "trl_cp" else "--parallelism_config_sp_size"
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"{HERE}/{cfg}", "--num_processes",
                str(gpus), degree, str(gpus), f"{HERE}/trl_sft.py", "--system", system, *common]
    if system == "seqpar":
        return [*torchrun, f"{HERE}/ours.py", "--model", model or "llama3-8b", *common]
    raise SystemExit(f"--runs: unknown system {system!r} (torchtitan, trl_cp, deepspeed_alst, seqpar:MODEL)")


def parse_run(spec: str) -> tuple[str, list[str]]:
    """'deepspeed_alst+--liger+--attn+flash_attention_4' -> ('deepspeed_alst', ['--liger', '--attn', 'flash_attention_4']):
    the system (and ours' model) and the flags its runner gets."""
    name, *flags = spec.strip().split("+")
    return name, flags


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
    p.add_argument("--kernel-step", default="auto", help="the optimizer step whose CUDA kernels the probe records on "
                   "rank 0 (PEERS_KERNEL_STEP); 'auto': the run's last warm-up step (2 by default: the timed steps are "
                   "not slowed), 0: none")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "peers.json"))
    args = p.parse_args()
    import torch

    gpus = args.gpus or torch.cuda.device_count()
    # flash-attention 4 carried into the site (Note [Carrying flash-attention 4] in benchmarks/driver.py) needs its DSL path
    dsl = os.path.join(args.site, "nvidia_cutlass_dsl", "dsl_packages")
    paths = [PROBE, args.site, *([dsl] if os.path.isdir(dsl) else []), os.getcwd(), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths),
               SEQPAR_COMMIT=os.environ.get("SEQPAR_COMMIT", "unknown"), TOKENIZERS_PARALLELISM="false")
    logs = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(logs, exist_ok=True)
    lengths = [int(x) for x in str(args.seq).split(",")]
    for run in args.runs.split(","):
        name, flags = parse_run(run)
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
    warmup = warmup_of(flags)
    kernel_step = (warmup if warmup >= 2 else 0) if args.kernel_step == "auto" else int(args.kernel_step)
    probe_dir = tempfile.mkdtemp(prefix="peers-probe-")  # not under $OUT: a few files come back from there
    probe_env = dict(PEERS_PROBE_DIR=probe_dir, PEERS_KERNEL_STEP=str(kernel_step))
    missing = missing_modules(system, flags, env)
    if missing:  # refused before the launch: what the environment lacks
        with open(log, "w") as f:
            f.write(f"not launched: ModuleNotFoundError: {', '.join(missing)} cannot be imported with PYTHONPATH="
                    f"{env.get('PYTHONPATH', '')}; carry their wheels into --site\n")
        rc, polled = 1, {}
    else:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**env, **launch, **probe_env},
                                    start_new_session=True)
            poller = MemoryPoller(proc.pid, log, warmup)
            poller.start()
            try:
                rc = proc.wait(timeout=args.time_limit)
            except subprocess.TimeoutExpired:
                rc = "timeout"
                _kill_tree(proc.pid)  # the launcher and every rank it started (torchrun puts ranks in their own sessions)
                proc.wait()
            polled = poller.stop()
    run_s = round(time.monotonic() - start, 1)  # the whole run: launch, load, every step, exit (the 10-minute budget)
    text = open(log, errors="replace").read()
    probed = probe_results(probe_dir)
    if kernel_step and not probed.get("kernels"):
        probed["kernels"] = dict(step=kernel_step, attention=None, why="no profile written (the run ended before the "
                                 "step, or rank 0's profiler failed: see the log)")
    elif not kernel_step:
        probed["kernels"] = dict(step=0, attention=None, why=f"not profiled: --kernel-step 0 or warm-up {warmup} < 2")
    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    if len(rows) > before:
        rows[-1] = merge_measures(rows[-1], probed, polled, flags)
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
    rows[-1] = merge_measures(rows[-1], probed, polled, flags)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"[peers] {name} S={seq}: {status}", flush=True)
    return status

if __name__ == "__main__":
    main()
