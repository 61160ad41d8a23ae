"""The peers harness's in-process probe: one memory read, the master weights' dtype and the kernels of one profiled
step, the same for every system (Note [One measurement for every peer] in ``benchmarks/peers/common.py``).

``python -m benchmarks.peers`` puts this folder first on every launched process's PYTHONPATH with
``PEERS_PROBE_DIR`` set; Python imports ``sitecustomize`` at start-up, so torchtitan's, TRL's / accelerate's,
DeepSpeed's and ours' ranks all carry it without a line of their code changed. Without ``PEERS_PROBE_DIR`` it does
nothing. It imports nothing heavy itself: once the process has imported ``torch`` (an import hook on the top-level
module), it

* registers ``torch.optim.optimizer.register_optimizer_step_post_hook`` (global: every optimizer of every system)
  and ``register_optimizer_step_pre_hook`` (to see nesting: torchtitan's ``OptimizersContainer`` is itself an
  ``Optimizer`` whose ``step`` calls the inner one's);
* wraps ``torch.autograd.backward`` to count backward passes: a training step is the outermost optimizer steps
  after a backward (DeepSpeed ZeRO-3 calls its inner optimizer once per parameter sub-group within one step);
* after every optimizer step reads ``torch.cuda.max_memory_reserved()`` / ``max_memory_allocated()`` and the
  current ``memory_reserved()`` into its own running maxima, and wraps ``torch.cuda.reset_peak_memory_stats`` to
  read the peaks just before any reset (torchtitan's logger resets them every logged step): a reset cannot erase
  them. Recording only: the wrapped functions are called unchanged;
* at the first training step records the dtype of the first optimizer's first parameter (``master_weights``:
  what the optimizer updates -- fp32 under FSDP2 mixed precision and DeepSpeed bf16, bf16 under "bf16-true");
* with ``PEERS_KERNEL_STEP=k`` (k >= 2), on rank 0, profiles training step k with ``torch.profiler`` (CUDA
  activity only) from the end of step k-1's optimizer step to the end of step k's (for ZeRO-3: its first
  sub-group's) and records the CUDA kernels by total time, the attention kernel they show and whether Triton /
  Liger kernels ran (:func:`summarize`);
* writes ``probe-<rank>-<pid>.json`` into ``PEERS_PROBE_DIR`` after every training step and at exit (a run killed
  at its time limit keeps its last step's reads). Processes that never stepped an optimizer (launchers, compile
  workers) write nothing.

Any other ``sitecustomize`` further along ``sys.path`` (the image's own) is run after this one.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import time

_DIR = os.environ.get("PEERS_PROBE_DIR")
_GB = 1e9

# (label, lower-case substrings of a CUDA kernel's name); the first family that matches names the kernel
ATTENTION_FAMILIES = (
    ("flash-attention 4 (CuTe DSL)", ("flash_attncute", "flashattentionforwardsm", "flashattentionbackwardsm")),
    ("flash-attention 3", ("flash::flashattnfwdsm90", "flash::flashattnbwdsm90", "flashattnfwdsm90", "flashattnbwdsm90")),
    ("torch SDPA flash (flash-attention 2 in torch)", ("pytorch_flash::",)),
    ("flash-attention 2", ("flash_fwd_kernel", "flash_bwd_dq_dk_dv", "flash_bwd_kernel", "flash_fwd_splitkv")),
    ("cuDNN SDPA", ()),  # a cuDNN kernel with an attention-like name (attention_family)
    ("torch SDPA memory-efficient (cutlass fmha)", ("fmha_cutlass", "attentionkernel", "attentionbackwardkernel")),
    ("triton flash attention", ("_attn_fwd", "_attn_bwd")),
)
_ATTENTION_HINTS = ("attn", "attention", "fmha", "sdpa", "flash")
LIGER_KERNELS = ("_rms_norm_forward_kernel", "_rms_norm_backward_kernel", "_swiglu_forward_kernel",
                 "_swiglu_backward_kernel", "_triton_rope", "liger_cross_entropy_kernel", "element_mul_kernel",
                 "_layer_norm_forward_kernel", "_geglu_tanh_forward_kernel", "_block_rms_norm", "_swiglu_fused_gate_up")


def attention_family(name: str) -> str | None:
    """The attention kernel family of one CUDA kernel name, or None (cuDNN counts only for attention-like names)."""
    low = name.lower()
    for label, keys in ATTENTION_FAMILIES:
        if label == "cuDNN SDPA":
            if "cudnn" in low and any(h in low for h in ("sdpa", "fmha", "attn", "flash")):
                return label
            continue
        if any(k in low for k in keys):
            return label
    return None


def summarize(kernels: list[tuple[str, int, float]], top: int = 15) -> dict:
    """``kernels``: (name, calls, total ms) of one profiled step's CUDA kernels. The top ``top`` by time, the attention
    kernel (the family with the most time; every family seen with its ms), and the Triton / Liger kernels' share."""
    kernels = sorted(kernels, key=lambda k: -k[2])
    total = sum(k[2] for k in kernels)
    families: dict[str, float] = {}
    for name, _, ms in kernels:
        fam = attention_family(name)
        if fam:
            families[fam] = families.get(fam, 0.0) + ms
    unnamed = [n for n, _, _ in kernels if attention_family(n) is None and any(h in n.lower() for h in _ATTENTION_HINTS)]
    liger = [(n, c, ms) for n, c, ms in kernels if any(k in n for k in LIGER_KERNELS)]
    triton = [(n, c, ms) for n, c, ms in kernels if n.startswith("triton_")]  # inductor's generated kernels
    attention = max(families, key=families.get) if families else ("unrecognised: " + unnamed[0][:80] if unnamed else "none found")
    return dict(total_kernel_ms=round(total, 1), kernels=len(kernels),
                top=[dict(name=n[:200], calls=c, ms=round(ms, 2)) for n, c, ms in kernels[:top]],
                attention=attention, attention_ms={k: round(v, 1) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
                liger=bool(liger), liger_ms=round(sum(k[2] for k in liger), 1), liger_kernels=sorted({n[:80] for n, _, _ in liger}),
                triton_generated=bool(triton), triton_generated_ms=round(sum(k[2] for k in triton), 1))


class Probe:
    """The running maxima and step count of one process (the hooks call it; tests drive it with a stub ``torch``)."""

    def __init__(self, torch, directory: str | None, kernel_step: int = 0, rank: int = 0) -> None:
        self.torch, self.dir, self.rank = torch, directory, rank
        self.kernel_step = kernel_step if rank == 0 else 0
        self.steps = self.depth = self.backwards = 0
        self._seen_backwards = -1
        self.reserved = self.allocated = self.current_reserved = 0
        self.resets = 0
        self.master_weights = self.optimizer = None
        self.kernels: dict | None = None
        self._prof = None
        self.t0 = time.time()

    # ---- memory ------------------------------------------------------------------------------------------
    def read(self) -> None:
        """The allocator's peaks since the last reset and what it holds now, into the running maxima."""
        cuda = self.torch.cuda
        if not cuda.is_available() or not cuda.is_initialized():
            return
        self.reserved = max(self.reserved, cuda.max_memory_reserved())
        self.allocated = max(self.allocated, cuda.max_memory_allocated())
        self.current_reserved = max(self.current_reserved, cuda.memory_reserved())

    def wrap_reset(self) -> None:
        """Read the peaks before any ``reset_peak_memory_stats`` (the call itself unchanged)."""
        cuda = self.torch.cuda
        original = cuda.reset_peak_memory_stats
        if getattr(original, "_peers_probe", False):
            return

        def reset_peak_memory_stats(*args, **kwargs):
            self.read()
            self.resets += 1
            return original(*args, **kwargs)

        reset_peak_memory_stats._peers_probe = True
        cuda.reset_peak_memory_stats = reset_peak_memory_stats
        memory = getattr(cuda, "memory", None)  # torch.cuda.memory: its reset_max_memory_* call the module's own name
        if memory is not None and hasattr(memory, "reset_peak_memory_stats"):
            memory.reset_peak_memory_stats = reset_peak_memory_stats

    # ---- steps -------------------------------------------------------------------------------------------
    def pre(self, optimizer, args, kwargs) -> None:
        self.depth += 1

    def post(self, optimizer, args, kwargs) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth > 0:  # an inner optimizer of a container: the container's own post hook counts the step
            return
        self.read()
        if self.backwards == self._seen_backwards:  # no backward since the last step: one more sub-group of it
            return
        self._seen_backwards = self.backwards
        self.steps += 1
        if self.master_weights is None:
            self.optimizer, self.master_weights = type(optimizer).__name__, _param_dtype(optimizer)
        try:  # the probe never stops a run: a failure is recorded instead
            if self.kernel_step >= 2 and self.steps == self.kernel_step - 1:
                if not self.torch.cuda.is_available():
                    raise RuntimeError("no CUDA device: no kernels to profile")
                self._start_profile()
            elif self._prof is not None and self.steps == self.kernel_step:
                self._stop_profile()
        except Exception as e:  # noqa: BLE001
            self._prof = None
            self.kernels = dict(step=self.kernel_step, attention=None, why=f"profile failed: {type(e).__name__}: {e}")
        self.write()

    def _start_profile(self) -> None:
        profiler = self.torch.profiler
        self._prof = profiler.profile(activities=[profiler.ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._t_profile = time.perf_counter()

    def _stop_profile(self) -> None:
        self.torch.cuda.synchronize()
        window_s = time.perf_counter() - self._t_profile
        self._prof.__exit__(None, None, None)
        rows = []
        for e in self._prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            us = getattr(e, "self_cuda_time_total", 0) if us is None else us
            if us:
                rows.append((e.key, e.count, us / 1e3))
        self.kernels = dict(summarize(rows), step=self.kernel_step, rank=self.rank,
                            window_s=round(window_s, 4),
                            window="end of optimizer step k-1 to end of optimizer step k, rank 0, CUDA activity only")
        if self.dir:  # the timeline, for the harness's split of the step (benchmarks/profile_summary.py: where_the_step_goes)
            self._prof.export_chrome_trace(os.path.join(self.dir, f"trace-{self.rank}.json"))
        self._prof = None

    # ---- the record --------------------------------------------------------------------------------------
    def state(self) -> dict:
        return dict(rank=self.rank, pid=os.getpid(), steps=self.steps, optimizer=self.optimizer,
                    master_weights=self.master_weights, peak_reserved_gb=self.reserved / _GB,
                    peak_allocated_gb=self.allocated / _GB, max_current_reserved_gb=self.current_reserved / _GB,
                    resets_seen=self.resets, host_maxrss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GB,
                    kernels=self.kernels, seconds=round(time.time() - self.t0, 1))

    def write(self) -> None:
        if not self.dir or not self.steps:
            return
        path = os.path.join(self.dir, f"probe-{self.rank}-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.state(), f)
        os.replace(tmp, path)


def _param_dtype(optimizer) -> str | None:
    """'fp32' / 'bf16' / ...: the dtype of the first parameter the optimizer updates."""
    for group in getattr(optimizer, "param_groups", []):
        for p in group.get("params", []):
            return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(p.dtype), str(p.dtype))
    return None


def install(torch) -> Probe:
    """Hook the imported ``torch`` (the optimizer hooks, the reset wrapper, the backward counter, the exit write)."""
    probe = Probe(torch, _DIR, int(os.environ.get("PEERS_KERNEL_STEP", "0") or 0), int(os.environ.get("RANK", "0")))
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(probe.pre)
    register_optimizer_step_post_hook(probe.post)
    probe.wrap_reset()
    backward = torch.autograd.backward

    def counted_backward(*args, **kwargs):
        probe.backwards += 1
        return backward(*args, **kwargs)

    torch.autograd.backward = counted_backward
    atexit.register(probe.write)
    return probe


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Runs :func:`install` once the top-level ``torch`` module has finished importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            try:
                sys.modules["peers_probe"] = sys.modules[__name__]
                globals()["PROBE"] = install(module)
            except Exception as e:  # noqa: BLE001 - the run goes on unprobed, and says so
                print(f"[peers] probe not installed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_and_install
        return spec


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path (this one shadows it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") == here or not os.path.isfile(candidate):
            continue
        spec = importlib.util.spec_from_file_location("_sitecustomize_next", candidate)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001
            print(f"[peers] {candidate}: {type(e).__name__}: {e}", file=sys.stderr)
        return


PROBE: Probe | None = None
if _DIR and __name__ == "sitecustomize":
    if "torch" in sys.modules:
        PROBE = install(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterTorch())
if __name__ == "sitecustomize":
    _chain()
