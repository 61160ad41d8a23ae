"""fla-core's ``chunk_simple_gla`` against the torch kernel, in bf16 on GPUs; skipped without CUDA
and ``fla-core`` (issue #4's GPU acceptance of the fla path of lightning_seqpar/attention/lasp.py).

    pytest -s tests/test_lasp_gpu.py                                   (single-GPU tests)
    torchrun --nproc_per_node=4 -m pytest -s tests/test_lasp_gpu.py    (also LASP over 4 GPUs)

Every case draws bf16 inputs shaped like TNL-1B's token mixer (B=1, H=16, Dv=128; Dk=128, or 256
on the LRPE layer; q, k = silu(randn), as TNL feeds them) and TNL's decays (``tnl_decay_log``: the
fast decays of layer 0, and the nearly-undecayed last layer). Three runs of the same bf16 values:

* reference: the torch kernel in fp32 (the inputs upcast), autograd;
* torch bf16: the torch kernel on the bf16 tensors (it accumulates in fp32, rounds the results);
* fla bf16: ``kernel="fla"`` (fla's Triton kernels, bf16 operands, fp32 accumulation).

Compared: the output, the final state, dq, dk, dv and, with an initial state, its gradient. For
each tensor x against the reference r, printed as "max/rms": max|x - r| / rms(r) and
rms(x - r) / rms(r). A tensor passes when

    (tol)  |x - r| <= 2e-2 rms(r) + 2e-2 |r| everywhere, and rms(x - r) <= 1e-2 rms(r):
           a bf16 tolerance (bf16 rounds to 2^-9 = 2e-3 relative; 1e-2 of RMS error is ~5 of
           those, 2e-2 elementwise ~10), scaled by the reference's RMS because linear attention
           without a denominator has no natural unit (the sums grow with the sequence);
    (2x)   or max and rms are at most 2x the baseline's numbers on the same inputs.

The baseline is the torch bf16 run for the single-GPU cases, and the same kernel on one GPU over
the full sequence for LASP (the distributed result must be as exact as one device in bf16). Each
line says which criterion every tensor met; rank 0 prints one "[lasp-gpu]" line per case.

Under torchrun every rank runs the single-GPU tests on its own GPU (no communication), then all
ranks run LASP (p2p and all-gather variants, both kernels) on contiguous shards of W x 8192 tokens
and compare with the single-GPU fp32 reference on the full sequence. The model test runs a
two-layer TNL with TNL-1B's width and heads under bf16 autocast with each kernel against fp32.

fla compiles and autotunes its kernels on the first call of each shape (minutes; Triton caches
them on disk): ``SEQPAR_FLA_AUTOTUNE=small`` shortens that (Note [fla-core kernel] in lasp.py).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

ATOL, RTOL, RMS_TOL = 2e-2, 2e-2, 1e-2  # x 1 rms(reference), x |reference|, x rms(reference)
H, DV, N_LAYER = 16, 128, 16  # TNL-1B: 16 heads of 128, 16 layers
LOCAL_LEN = 8192  # tokens per rank in the LASP test
MODEL = dict(vocab_size=512, n_embd=2048, n_layer=2, n_head=16, glu_dim=1024)  # TNL-1B's width and heads, two layers
MODEL_LEN = 4096

# (name, T, Dk, layer, with_state): T = 4000 is not a multiple of fla's chunk (64)
SINGLE_CASES = (
    ("layer1", 8192, 128, 1, False),
    ("lrpe-layer0-dk256", 8192, 256, 0, False),
    ("last-layer-state-T4000", 4000, 128, N_LAYER - 1, True),
    ("last-layer-T65536", 65536, 128, N_LAYER - 1, False),
)
LASP_CASES = (("layer1", 128, 1), ("lrpe-layer0-dk256", 256, 0), ("last-layer", 128, N_LAYER - 1))


def _has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


needs_fla = pytest.mark.skipif(not (torch.cuda.is_available() and _has_fla()), reason="needs CUDA and fla-core (pip install fla-core)")


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _device() -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _inputs(T: int, dk: int, layer: int, *, with_state: bool, seed: int, device: torch.device) -> dict:
    from lightning_seqpar.models.transnormer import tnl_decay_log

    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    return dict(
        q=F.silu(randn(1, T, H, dk)).to(torch.bfloat16), k=F.silu(randn(1, T, H, dk)).to(torch.bfloat16),
        v=randn(1, T, H, DV).to(torch.bfloat16), dout=randn(1, T, H, DV).to(torch.bfloat16),
        dfinal=randn(1, H, dk, DV) * 0.1, s0=randn(1, H, dk, DV) * 0.1 if with_state else None,
        decay=tnl_decay_log(H, layer, N_LAYER, device=device),
    )


def _run_local(x: dict, kernel: str, *, fp32: bool = False) -> dict[str, torch.Tensor]:
    """out, final state and gradients of linear_attention_chunked on one GPU (fp32 copies of everything)."""
    from lightning_seqpar.attention.lasp import linear_attention_chunked

    q, k, v = (x[n].detach().float() if fp32 else x[n].detach() for n in ("q", "k", "v"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    s0 = None if x["s0"] is None else x["s0"].detach().clone().requires_grad_()
    out, final = linear_attention_chunked(q, k, v, x["decay"], initial_state=s0, output_final_state=True, kernel=kernel)
    ((out.float() * x["dout"].float()).sum() + (final.float() * x["dfinal"]).sum()).backward()
    got = dict(out=out.detach().float(), final=final.detach().float(), dq=q.grad.float(), dk=k.grad.float(), dv=v.grad.float())
    if s0 is not None:
        got["ds0"] = s0.grad.float()
    return got


def _err(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, bool]:
    """(max|x - ref| / rms(ref), rms(x - ref) / rms(ref), within the elementwise tolerance);
    inf, inf, False when x is not finite."""
    if not bool(torch.isfinite(x).all()):
        return math.inf, math.inf, False
    rms = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    d = (x - ref).abs()
    inside = bool((d <= ATOL * rms + RTOL * ref.abs()).all())
    return (d.max() / rms).item(), (d.pow(2).mean().sqrt() / rms).item(), inside


def _verdict(err: tuple[float, float, bool], base: tuple[float, float, bool]) -> str:
    if err[2] and err[1] <= RMS_TOL:
        return "tol"
    if err[0] <= 2 * base[0] and err[1] <= 2 * base[1]:
        return "2x"
    return "FAIL"


def _compare(got: dict, ref: dict, base: dict, label: str, base_name: str) -> list[str]:
    """Print one line; return the names of the tensors that failed."""
    parts, failed = [], []
    for name, r in ref.items():
        e, b = _err(got[name], r), _err(base[name], r)
        v = _verdict(e, b)
        if v == "FAIL":
            failed.append(name)
        parts.append(f"{name}={e[0]:.1e}/{e[1]:.1e}({base_name} {b[0]:.1e}/{b[1]:.1e},{v})")
    if _rank0():
        print(f"[lasp-gpu] {label}: max/rms {' '.join(parts)} {'FAIL' if failed else 'PASS'}", flush=True)
    return failed


# ---------------------------------------------------------------------------------------------- one GPU


@needs_fla
def test_auto_kernel_is_fla_on_cuda():
    from lightning_seqpar.attention.lasp import resolve_kernel

    assert resolve_kernel("auto", _device()) == "fla"


@needs_fla
@pytest.mark.parametrize("name,T,dk,layer,with_state", SINGLE_CASES, ids=[c[0] for c in SINGLE_CASES])
def test_fla_matches_torch_kernel(name, T, dk, layer, with_state):
    x = _inputs(T, dk, layer, with_state=with_state, seed=T + dk + layer, device=_device())
    ref = _run_local(x, "torch", fp32=True)
    torch_bf16 = _run_local(x, "torch")
    fla = _run_local(x, "fla")
    failed = _compare(fla, ref, torch_bf16, f"fla vs fp32 T={T} Dk={dk} layer={layer} state={with_state} ({name})", "torch-bf16")
    assert not failed, f"{name}: fla differs from the fp32 torch kernel beyond bf16 tolerance in {failed}"


@needs_fla
def test_transnormer_with_fla_matches_fp32():
    """A two-layer TNL (TNL-1B width and heads, LRPE on layer 0) under bf16 autocast: loss and
    gradients with the fla kernel against the fp32 model, next to the torch kernel under autocast."""
    from lightning_seqpar.attention.lasp import LinearAttention
    from lightning_seqpar.models.transnormer import TransNormer, TransNormerConfig

    device = _device()
    torch.manual_seed(0)
    model = TransNormer(TransNormerConfig(**MODEL)).to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (1, MODEL_LEN + 1), device=device, generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def run(kernel: str, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
        for m in model.modules():
            if isinstance(m, LinearAttention):
                m.kernel = kernel
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

    loss_ref, g_ref = run("torch", False)
    loss_t, g_t = run("torch", True)
    loss_f, g_f = run("fla", True)
    worst_t = max(_err(g_t[n], g_ref[n])[1] for n in g_ref)
    worst_f = max(_err(g_f[n], g_ref[n])[1] for n in g_ref)
    ok_loss = abs(loss_f - loss_ref) <= max(2e-2, 2 * abs(loss_t - loss_ref))
    ok_grad = worst_f <= max(2 * RMS_TOL, 2 * worst_t)
    if _rank0():
        print(f"[lasp-gpu] TNL {MODEL} S={MODEL_LEN} bf16 autocast: loss fp32 {loss_ref:.5f} torch-bf16 {loss_t:.5f} "
              f"fla {loss_f:.5f}; worst per-parameter grad rms error torch-bf16 {worst_t:.2e} fla {worst_f:.2e} "
              f"{'PASS' if ok_loss and ok_grad else 'FAIL'}", flush=True)
    assert ok_loss, f"loss with fla {loss_f} vs fp32 {loss_ref} (torch bf16 {loss_t})"
    assert ok_grad, f"worst per-parameter gradient rms error with fla {worst_f:.2e} (torch bf16 {worst_t:.2e})"


# ---------------------------------------------------------------------------------------------- LASP, W GPUs


@pytest.fixture(scope="module")
def lasp_world(nccl_world) -> int:
    """The NCCL world (tests/conftest.py), with fla-core installed."""
    if not _has_fla():
        pytest.skip("needs fla-core")
    return nccl_world


@pytest.mark.parametrize("kernel", ["fla", "torch"])
@pytest.mark.parametrize("variant", ["p2p", "allgather"])
def test_lasp_matches_one_gpu(lasp_world, variant, kernel):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_seqpar.attention.lasp import lasp_attention

    world, rank = lasp_world, dist.get_rank()
    device = _device()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("sp",))
    T = world * LOCAL_LEN
    own = slice(rank * LOCAL_LEN, (rank + 1) * LOCAL_LEN)  # the contiguous layout: rank r holds the r-th chunk
    failures = []
    for name, dk, layer in LASP_CASES:
        x = _inputs(T, dk, layer, with_state=False, seed=1000 + dk + layer, device=device)  # the same on every rank
        x["dfinal"] = torch.zeros_like(x["dfinal"])  # LASP returns no final state: no gradient through it
        ref = _run_local(x, "torch", fp32=True)
        one = _run_local(x, kernel)  # the same kernel on one GPU over the full sequence
        q, k, v = (x[n][:, own].detach().clone().requires_grad_() for n in ("q", "k", "v"))
        out = lasp_attention(q, k, v, x["decay"], mesh=mesh, variant=variant, kernel=kernel)
        out.backward(x["dout"][:, own])
        got = dict(out=out.detach().float(), dq=q.grad.float(), dk=k.grad.float(), dv=v.grad.float())
        mine = {n: ref[n][:, own] for n in got}
        base = {n: one[n][:, own] for n in got}
        label = f"LASP W={world} variant={variant} kernel={kernel} T={T} Dk={dk} layer={layer} ({name}) vs 1-GPU fp32"
        failed = _compare(got, mine, base, label, "1gpu")
        if failed:
            failures.append(f"rank {rank} {label}: {failed}")
    assert not failures, "\n".join(failures)
