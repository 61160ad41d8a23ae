"""The hybrid models' sequence-parallel twins on one GPU with fla-core's kernels (kernel="fla") against
the unmodified transformers model, and with the package's torch kernels against it: a
Qwen3-Next-shaped and a Bamba-shaped model (a few layers), bf16 autocast, S = 4096; skipped without
CUDA; the fla-core kernels only where fla-core is installed and runs on the GPU (it refuses Hopper
with Triton < 3.7.1, see lightning_seqpar.attention.recurrent.chunked.fla_unusable).

    pytest -s tests/test_hf_hybrid_gpu.py
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _kernels() -> list[str]:
    """The package's torch kernels always; fla-core's where it is installed and usable on this GPU."""
    from lightning_seqpar.attention.recurrent.chunked import fla_unusable

    if importlib.util.find_spec("fla") is None:
        return ["torch"]
    why = fla_unusable(torch.cuda.current_device())
    if why is not None:
        print(f"[hf-hybrid-gpu] fla-core not tested: {why}")
        return ["torch"]
    return ["torch", "fla"]

S, VOCAB = 4096, 1024


def _config(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=S, attention_dropout=0.0)
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, head_dim=64, num_experts=0, linear_num_key_heads=4,
                                            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                            linear_conv_kernel_dim=4,
                                            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    return transformers.BambaConfig(**common, attn_layer_indices=[3], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
                                    mamba_d_state=64, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=64)


def _step(model, ids, wrapped: bool, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        if wrapped:
            logits = model(ids, torch.arange(S, device="cuda")[None])
        else:
            logits = model(input_ids=ids, position_ids=torch.arange(S, device="cuda")[None], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    params = model.hf.named_parameters() if wrapped else model.named_parameters()
    return logits.float(), loss.detach(), {n.removeprefix("base_model.model."): p.grad.float() for n, p in params}


@contextlib.contextmanager
def _recurrence_in_fp32(kind: str):
    """The unmodified model with its gated delta rule kept in fp32 under bf16 autocast: what fla-core's kernels and
    ours do (Note [Recurrences in fp32 under autocast]); transformers' torch path runs its matmuls in bf16 there.
    Bamba's scan is inline in its mixer: unchanged."""
    if kind != "qwen3_next":
        yield
        return
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    original = qwen3_next.torch_chunk_gated_delta_rule

    def fp32(*args, **kwargs):
        up = lambda x: x.float() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
        with torch.autocast("cuda", enabled=False):
            return original(*map(up, args), **{k: up(v) for k, v in kwargs.items()})

    qwen3_next.torch_chunk_gated_delta_rule = fp32
    try:
        yield
    finally:
        qwen3_next.torch_chunk_gated_delta_rule = original


def _bound(e_plain: float, e_plain32: float) -> float:
    """Within 2x (+ 2e-3) of the unmodified model's error under bf16 autocast, its recurrence in bf16 or in fp32: a
    per-head gate gradient (A_log, dt_bias: a sum over every token) has an error of cancellations that lands either
    side of the other run's by chance (Qwen3-Next-shaped, one H100: layer 2's dt_bias 2.6e-2 with our fp32
    recurrence, 2.1e-2 with bf16 matmuls inside it, transformers 1.0e-2; layer 1's 2.7e-2, 3.5e-2, 2.1e-2)."""
    return 2 * max(e_plain, e_plain32) + 2e-3


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


_CUDNN = pytest.param("cudnn", marks=pytest.mark.xfail(strict=False, reason=(
    "cuDNN's attention backward (torch 2.11, one H100): q_norm / q_proj / k_proj gradients of these partial-rotary "
    "models 0.37-0.45 from fp32 where transformers' bf16 run is 0.012-0.024; why 'auto' never picks it "
    "(Note [Choosing the local kernel])")))


@pytest.mark.parametrize("backend", ["auto", _CUDNN])
@pytest.mark.parametrize("kind", ["qwen3_next", "bamba"])
def test_twins_are_as_exact_as_the_unmodified_model_in_bf16(kind, backend):
    """Against the unmodified model in fp32 (no autocast): logits, loss and every gradient of the twins
    (bf16 autocast) within 2x (+ 2e-3) of the unmodified model's own error under bf16 autocast (its recurrence in
    bf16 or in fp32: :func:`_bound`), with the attention kernel "auto" picks (and, expected to fail, cuDNN's)."""
    from lightning_seqpar.attention import Attention
    from lightning_seqpar.attention.recurrent import Recurrence
    from lightning_seqpar.hf import HFCausalLM

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).cuda().train()
    ids = torch.randint(0, VOCAB, (1, S), device="cuda")
    ref = _step(copy.deepcopy(base), ids, wrapped=False, autocast=False)
    plain = _step(copy.deepcopy(base), ids, wrapped=False, autocast=True)
    with _recurrence_in_fp32(kind):
        plain32 = _step(copy.deepcopy(base), ids, wrapped=False, autocast=True)
    failures = []
    for kernel in _kernels():
        model = HFCausalLM(copy.deepcopy(base))
        for m in model.modules():
            if isinstance(m, Recurrence):
                m.configure(mesh=None, kernel=kernel)
            if isinstance(m, Attention):
                m.configure(mesh=None, backend=backend)
        ours = _step(model, ids, wrapped=True, autocast=True)
        pairs = {"logits": (ours[0], plain[0], plain32[0], ref[0]),
                 **{f"d{n}": (ours[2][n], plain[2][n], plain32[2][n], g) for n, g in ref[2].items()}}
        worst = ("", 0.0, 0.0, 0.0)
        for name, (a, b, b32, r) in pairs.items():
            e, e_plain, bound = _rel(a, r), _rel(b, r), _bound(_rel(b, r), _rel(b32, r))
            if e / bound > worst[1] / _bound(worst[2], worst[3]):
                worst = (name, e, e_plain, _rel(b32, r))
            if e > bound:
                failures.append(f"{kind} kernel={kernel} {name}: {e:.2e} > 2 x max({e_plain:.2e}, {_rel(b32, r):.2e}) + 2e-3")
        print(f"[hf-hybrid-gpu] {kind} kernel={kernel}: loss {ours[1].item():.5f} (fp32 {ref[1].item():.5f}, transformers bf16 "
              f"{plain[1].item():.5f}); closest to its bound: {worst[0]} {worst[1]:.2e} (transformers bf16 {worst[2]:.2e}, "
              f"its recurrence in fp32 {worst[3]:.2e})")
        assert abs(ours[1].item() - ref[1].item()) <= 2 * max(abs(plain[1].item() - ref[1].item()),
                                                             abs(plain32[1].item() - ref[1].item())) + 1e-3
    assert not failures, failures


@pytest.mark.parametrize("kind", ["qwen3_next", "bamba"])
def test_twins_with_packed_documents_on_the_gpu(kind):
    """Packed documents on one GPU (the per-document state reset of the torch kernels, Note [Documents in a
    recurrence]), bf16 autocast: the twins' logits, loss and every gradient against every document run alone
    through the unmodified model in fp32, within 2x (+ 2e-3) of that model's own bf16 error (:func:`_bound`)."""
    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents

    lengths = [1000, 1, 2047, 48, 1000]  # S tokens: a one-token document, a document across chunk boundaries
    assert sum(lengths) == S
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).cuda().train()
    ids = torch.randint(0, VOCAB, (1, S), device="cuda")
    labels = torch.cat([torch.cat([part[:, 1:], torch.full((1, 1), -100, device="cuda")], dim=1)
                        for part in ids.split(lengths, dim=1)], dim=1)  # no label across a document boundary

    def alone(model, autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = torch.cat([model(input_ids=part, position_ids=torch.arange(part.shape[1], device="cuda")[None],
                                      use_cache=False).logits for part in ids.split(lengths, dim=1)], dim=1)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        return logits.float(), loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    ref, plain = alone(copy.deepcopy(base), False), alone(copy.deepcopy(base), True)
    with _recurrence_in_fp32(kind):
        plain32 = alone(copy.deepcopy(base), True)
    model = HFCausalLM(copy.deepcopy(base))
    documents = PackedDocuments.from_lengths([lengths])
    model.zero_grad(set_to_none=True)
    with packed_documents(documents), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids, documents.position_ids().cuda())
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n.removeprefix("hf."): p.grad.float() for n, p in model.named_parameters()}
    failures = [f"{kind} d{n}: {_rel(grads[n], g):.2e} > 2 x max({_rel(plain[2][n], g):.2e}, {_rel(plain32[2][n], g):.2e}) + 2e-3"
                for n, g in ref[2].items() if _rel(grads[n], g) > _bound(_rel(plain[2][n], g), _rel(plain32[2][n], g))]
    e, e_plain = _rel(logits.float(), ref[0]), _rel(plain[0], ref[0])
    print(f"[hf-hybrid-gpu] {kind} packed documents: logits {e:.2e} (transformers bf16 {e_plain:.2e}), loss {loss.item():.5f} "
          f"(fp32 {ref[1].item():.5f})")
    assert e <= _bound(e_plain, _rel(plain32[0], ref[0])) and not failures, failures
