"""``attention_backend="auto"`` per model (Note [Choosing the local kernel]): flash-attention 4 when installed, else
cuDNN for models whose rotary embedding is full (its backward measured exact for them), flash-attention-2 for the
others; one process, CPU (the GPU's kernel list is stood in for)."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_seqpar.attention import local


@pytest.fixture
def hopper(monkeypatch):
    """available_backends as on an H100 without / with flash-attention 4."""
    def set_kernels(fa4: bool):
        kernels = (("fa4",) if fa4 else ()) + ("flash", "cudnn", "efficient", "math")
        monkeypatch.setattr(local, "available_backends", lambda *a, **k: kernels)
    return set_kernels


@pytest.mark.parametrize("fa4,cudnn_exact,expected", [(False, True, "cudnn"), (False, False, "flash"),
                                                       (True, True, "fa4"), (True, False, "fa4")])
def test_auto_takes_cudnn_only_where_the_model_says_it_is_exact(hopper, fa4, cudnn_exact, expected):
    hopper(fa4)
    got = local.resolve_backend("auto", torch.device("cpu"), torch.bfloat16, 128, cudnn_exact=cudnn_exact)
    assert got == expected
    assert local.resolve_backend("flash", torch.device("cpu"), torch.bfloat16, 128, cudnn_exact=True) == "flash"  # named: kept


@pytest.mark.parametrize("seq_len,cudnn_exact,expected", [(4096, True, "cudnn"), (local.FA4_MIN_TOKENS - 1, True, "cudnn"),
                                                           (local.FA4_MIN_TOKENS, True, "fa4"), (32768, True, "fa4"),
                                                           (4096, False, "fa4"), (None, True, "fa4")])
def test_short_calls_take_cudnn_over_flash_attention_4_where_it_is_exact(hopper, seq_len, cudnn_exact, expected):
    """FA4's cost per call is larger than cuDNN's: below FA4_MIN_TOKENS query tokens cuDNN, where exact for the model
    (one H200, Llama-3.2-1B shape, 4K: 0.12 s per step with cuDNN against 0.16 s with FA4; 32K: FA4 ahead)."""
    hopper(True)
    assert local.resolve_backend("auto", torch.device("cpu"), torch.bfloat16, 64, cudnn_exact=cudnn_exact, seq_len=seq_len) == expected
    assert local.resolve_backend("fa4", torch.device("cpu"), torch.bfloat16, 64, cudnn_exact=True, seq_len=4096) == "fa4"  # named: kept


@pytest.fixture
def fa4_loads(monkeypatch):
    """Whether flash-attention 4 loads, as log_auto_backend asks it (fa4_interface); the log's memory emptied."""
    monkeypatch.setattr(local, "_LOGGED", set())

    def set_installed(installed: bool):
        monkeypatch.setattr(local, "fa4_interface", lambda: object() if installed else None)
    return set_installed


def logged(caplog, *calls) -> list[str]:
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.seqpar"):
        for backend, kwargs in calls:
            local.log_auto_backend(backend, **kwargs)
    return [r.getMessage() for r in caplog.records if r.name == "lightning.pytorch.seqpar"]


def test_the_choice_is_logged_once_with_the_install_hint_where_flash_attention_4_is_missing(caplog, fa4_loads):
    fa4_loads(False)
    lines = logged(caplog, *[("cudnn", dict(cudnn_exact=True, seq_len=4096))] * 3, ("flash", dict(cudnn_exact=False)))
    assert len(lines) == 2, lines
    assert "runs cuDNN" in lines[0] and "Install flash-attention 4" in lines[0] and "lightning-seqpar[gpu]" in lines[0]
    assert "runs torch's flash-attention-2" in lines[1] and "not exact" in lines[1] and "lightning-seqpar[gpu]" in lines[1]


def test_with_flash_attention_4_installed_the_log_says_why_another_kernel_runs_and_no_install_hint(caplog, fa4_loads):
    """The `gpu` extra installed, a 4K call: cuDNN by design (cheaper per short call), not "install flash-attention 4"."""
    fa4_loads(True)
    lines = logged(caplog, ("cudnn", dict(cudnn_exact=True, seq_len=4096)), ("fa4", dict(cudnn_exact=True, seq_len=32768)),
                   ("flash", dict(cudnn_exact=False, seq_len=32768)))
    assert len(lines) == 3, lines
    assert all("Install" not in line and "[gpu]" not in line for line in lines), lines
    assert "runs cuDNN" in lines[0] and "flash-attention 4 is installed" in lines[0] and "(as here)" in lines[0]
    assert f"{local.FA4_MIN_TOKENS:,}" in lines[0] and "by design" in lines[0]
    assert "runs flash-attention 4" in lines[1]
    assert "runs torch's flash-attention-2" in lines[2] and "cannot run this call" in lines[2]


def test_models_say_whether_cudnn_is_exact_for_them():
    from lightning_seqpar.models import Llama, LlamaConfig
    from lightning_seqpar.parallel.parallelize import apply_attention

    model = Llama(LlamaConfig.from_name("tiny"))
    apply_attention(model, None, attention="ring")
    assert all(m.cudnn_exact for m in model.modules() if hasattr(m, "cudnn_exact"))
    pytest.importorskip("transformers")
    from lightning_seqpar.hf import support as hf_support
    from lightning_seqpar.hf import HFCausalLM

    full = {"llama": True, "qwen3": True, "mistral": True, "gemma3_text": True,  # RoPE over the whole head
            "qwen3_next": False, "bamba": False, "phi": False, "gpt_neox": False,  # partial rotary (and hybrids)
            "deepseek_v3": False, "llama4_text": False, "gpt2": False}  # latent attention, NoPE layers, learned positions
    tiny = {arch: hf_support.build_tiny_model(arch) for arch in full}
    got = {arch: HFCausalLM(model).cudnn_attention_exact for arch, model in tiny.items()}
    assert got == full
    # the planner reads the same answer from the config alone, before the model is built
    from torch import nn

    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.models.registry import cudnn_attention_exact

    def holding(config):
        holder = nn.Module()
        holder.config = config
        return holder

    assert {arch: cudnn_attention_exact(holding(model.config)) for arch, model in tiny.items()} == full
    assert cudnn_attention_exact(CausalLMModule(model="tiny")) and cudnn_attention_exact(model)
    assert not cudnn_attention_exact(holding(None)) and not cudnn_attention_exact(None)
    hf = HFCausalLM(hf_support.build_tiny_model("qwen3_next"))
    apply_attention(hf, None, attention="ring")
    assert not any(m.cudnn_exact for m in hf.modules() if hasattr(m, "cudnn_exact"))


def test_flash_attention_4_without_its_cuda_13_libraries_is_named_under_a_cuda_13_torch(monkeypatch):
    """flash-attention 4's docs install ``flash-attn-4[cu13]`` on CUDA 13 "for best performance" and the benchmarks ran
    those libraries: under a CUDA 13 build of torch without them the log says so and names the ``gpu-cu13`` extra;
    with them, under CUDA 12, or for another kernel, it does not."""
    msg = lambda **kw: local.auto_backend_message("fa4", cudnn_exact=True, fa4_installed=True, seq_len=32768, **kw)  # noqa: E731
    assert "lightning-seqpar[gpu-cu13]" in msg(torch_cuda="13.0", fa4_cu13=False) and "CUDA 13" in msg(torch_cuda="13.0", fa4_cu13=False)
    for kw in (dict(torch_cuda="13.0", fa4_cu13=True), dict(torch_cuda="12.8", fa4_cu13=False), dict(torch_cuda=None, fa4_cu13=False)):
        assert msg(**kw) == "attention_backend='auto' runs flash-attention 4, the fastest exact kernel here.", kw
    assert "gpu-cu13" not in local.auto_backend_message("cudnn", cudnn_exact=True, fa4_installed=True, seq_len=4096,
                                                        torch_cuda="13.0", fa4_cu13=False)
    from importlib import metadata

    asked = []

    def distribution(name):
        asked.append(name)
        if installed:
            return object()
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", distribution)
    for installed in (True, False):
        assert local.fa4_cuda13_libraries() is installed
    missing = local.auto_backend_message("cudnn", cudnn_exact=True, fa4_installed=False, seq_len=32768, torch_cuda="13.0")
    assert "lightning-seqpar[gpu-cu13]" in missing  # not installed at all: the extra for this torch's CUDA
    assert asked == ["nvidia-cutlass-dsl-libs-cu13"] * 2
