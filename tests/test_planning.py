"""``seqpar plan`` and ``lightning_seqpar.planner.step_plan`` (Note [Planning a step across nodes]): the model
shapes, the terms of a planned step, auto against Megatron-style CP, the CLI, and the table in
docs/scaling.md reproduced from the code (no hand-edited numbers)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from dataclasses import replace

import pytest

from lightning_seqpar.cli import seqpar as cli
from lightning_seqpar.attention.cost import DeviceProfile
from lightning_seqpar.cli.plan import parse_gpu_memory, parse_lengths
from lightning_seqpar.planner.step_plan import GPU_MEMORY, MODELS, PEAK_BF16, MemorySetting, ModelShape, megatron_cp, plan_step, table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "scaling.md"


@pytest.mark.parametrize("name, params", [("llama3-8b", 8.03e9), ("llama-70b", 70.55e9), ("llama-7b", 6.74e9)])
def test_model_shapes_have_the_published_parameter_counts(name, params):
    # Llama 3 8B: 8.03B, Llama 3 70B: 70.55B, Llama 2 7B: 6.74B (untied input embedding and head)
    assert MODELS[name].params == pytest.approx(params, rel=0.005)


def test_flops_per_token_is_six_n_plus_attention():
    m = ModelShape(name="t", n_layer=2, d_model=8, n_head=2, n_kv_head=1, head_dim=4, ffn=16, vocab=10)
    matmul = 2 * (8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16) + 10 * 8
    assert m.matmul_params == matmul
    assert m.params == matmul + 10 * 8
    assert m.flops_per_token(32) == 6 * matmul + 6 * 2 * 32 * 2 * 4


@pytest.mark.parametrize("gpus", [8, 16, 64, 256])
def test_step_is_the_sum_of_its_terms_and_mfu_follows_from_it(gpus):
    model, s = MODELS["llama3-8b"], 1 << 20
    p = plan_step(model, seq_len=s, gpus=gpus)
    assert p.step_s == pytest.approx(p.attention_s + p.linear_s + p.fsdp_exposed_s)
    assert p.fsdp_exposed_s >= 0 and p.attention_comm_s >= 0 and p.attention_overhead_s >= 0
    assert p.linear_s == pytest.approx(8 * model.matmul_params * s / gpus / 650e12)
    assert p.mfu == pytest.approx(model.flops_per_token(s) * s / gpus / p.step_s / PEAK_BF16)
    assert 0 < p.mfu < 1
    # the memory planner of memory="auto" on an H200: its options fit 90% of the card, or it names the longest length that does
    assert p.fits == (p.memory is not None) and (p.longest_seq_len is None) == p.fits
    assert p.memory_gb * 1e9 <= 0.9 * GPU_MEMORY["H200"] if p.fits else 0 <= p.longest_seq_len < s
    assert re.fullmatch(r"(attn comm|attn per-step|FSDP) \d+%", p.dominant)


def test_more_gpus_shorten_the_step_and_need_fewer_memory_savings():
    model, s = MODELS["llama-70b"], 4 << 20
    plans = [plan_step(model, seq_len=s, gpus=w) for w in (16, 64, 256, 1024)]
    assert all(p.fits for p in plans[1:])
    for a, b in zip(plans, plans[1:]):
        assert b.step_s < a.step_s
        assert b.linear_s == pytest.approx(a.linear_s / 4)
        if a.fits:  # memory="auto" sets no more of the options that trade time for memory on more GPUs
            assert _savings(b) <= _savings(a)
    # nothing traded for memory at 1024 GPUs (what is left goes to blocks without checkpointing: speed, not savings)
    assert replace(plans[-1].memory.options, uncheckpointed_blocks=0).changes() == "defaults"


def _savings(p) -> int:
    from dataclasses import fields

    from lightning_seqpar.planner.memory import MemoryOptions

    return sum(getattr(p.memory.options, f.name) != getattr(MemoryOptions(), f.name) for f in fields(MemoryOptions)
               if f.name != "uncheckpointed_blocks")  # a speed choice, not a saving


def test_auto_is_never_slower_than_megatron_cp_and_megatron_cp_is_one_plain_ring():
    for name in ("llama3-8b", "llama-33h"):
        for s, w in [(128 << 10, 16), (1 << 20, 64), (1 << 20, 1024)]:
            auto = plan_step(MODELS[name], seq_len=s, gpus=w)
            ring = megatron_cp(MODELS[name], seq_len=s, gpus=w)
            assert ring.plan.label == "ring" and ring.plan.inner_ring_size in (None, w)
            assert auto.attention_s <= ring.attention_s * (1 + 1e-9)
            assert auto.step_s <= ring.step_s * (1 + 1e-9)


def test_across_nodes_the_head_group_of_2d_stays_inside_a_node():
    # LoongTrain's finding at 1M on 64 GPUs: hp = 8 x cp = 8, head-first (the all-to-all inside a node)
    p = plan_step(MODELS["llama3-8b"], seq_len=1 << 20, gpus=64)
    assert (p.plan.algorithm, p.plan.hp, p.plan.cp, p.plan.placement) == ("2d", 8, 8, "head-first")
    # 33 heads cannot be split: the double ring keeps its inner ring inside an 8-GPU node
    q = plan_step(MODELS["llama-33h"], seq_len=1 << 20, gpus=64)
    assert q.plan.algorithm == "ring" and q.plan.inner_ring_size == 8


def test_slower_network_makes_the_plan_no_faster():
    model, s, w = MODELS["llama3-8b"], 1 << 20, 256
    fast = plan_step(model, seq_len=s, gpus=w)
    slow = plan_step(model, seq_len=s, gpus=w, profile=DeviceProfile.h200(inter_node_bandwidth=5e9))
    assert slow.step_s >= fast.step_s


def test_table_skips_fewer_tokens_than_gpus_and_has_twelve_columns():
    rows = table(["llama3-8b"], [8, 128 << 10], [16, 8])
    assert rows[0].count("|") == rows[1].count("|") == 13
    assert len(rows) == 2 + 3  # S=8 on 16 GPUs is skipped, S=8 on 8 GPUs and 128K on both are planned
    assert all(r.count("|") == 13 for r in rows)


def test_seqpar_plan_cli_prints_the_table(capsys):
    cli.main(["plan", "--model", "llama3-8b", "--seq", "128K,1M", "--gpus", "8,64"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out == table(["llama3-8b"], [128 << 10, 1 << 20], [8, 64])
    assert len(out) == 2 + 4


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-5"], "--model: 'gpt-5' is neither one of the package's models (llama-33h, llama-70b, llama-7b, llama3-8b"),
    (["--model", "tnl-385m"], "--model: TransNormerConfig is a linear-attention model: its memory is not modelled"),
    (["--seq", "128Q"], "--seq"),
    (["--gpus", "0"], "--gpus"),
    (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--gpu-memory", "80TB"], "--gpu-memory: expected a size (80GB, 141GB, 75GiB; a bare number is GB) or a GPU name (H100, H200)"),
    (["--host-memory", "0"], "--host-memory: expected a size > 0 (250GB, 240GiB; a bare number is GB), got '0'"),
    (["--host-memory", "1TB"], "--host-memory: expected a size > 0"),
])
def test_seqpar_plan_rejects_bad_arguments_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_table_in_docs_scaling_is_what_the_code_prints():
    text = DOCS.read_text()
    command = re.search(r"`seqpar plan (--seq \S+ --gpus \S+)`", text)
    assert command, "docs/scaling.md names the command that made its planning table"
    seq, gpus = command.group(1).split()[1], command.group(1).split()[3]
    expected = table(["llama3-8b", "llama-70b", "llama-33h"], parse_lengths(seq), parse_lengths(gpus))
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model | S | GPUs | auto picks"))
    documented = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        documented.append(line)
    assert documented == expected, "regenerate the planning table in docs/scaling.md with the command above it"
    assert not math.isnan(float(expected[2].split("|")[5]))


def test_llama3_8b_at_1m_on_4_h200s_is_planned_as_it_trained():
    """The measured run (benchmarks/results/20261122-nvidia-h200-x4-1m-train.log, recipes/llama3_8b_1m.yaml: bf16-mixed,
    loss chunks of 8192, offloaded checkpoints, head_chunks=4, MLP tiles of 32K; 138.2 GB max_memory_allocated): the
    planner of memory="auto" sets the same kinds of options and its estimate of the allocated peak is within 10%."""
    p = plan_step(MODELS["llama3-8b"], seq_len=1 << 20, gpus=4, memory=MemorySetting(gpu_memory=GPU_MEMORY["H200"]))
    assert p.plan.algorithm == "ring" and p.fits
    options = p.memory.options
    assert (options.activation_checkpointing, options.offload_checkpoints, options.head_chunks, options.offload_params) == \
        ("selective++", True, 4, False)
    assert options.mlp_chunk_size is not None  # tiled (the planner's tile is 8192 tokens, the run's 32768)
    assert p.memory.estimate.allocated / 1e9 == pytest.approx(138.2, rel=0.10)
    # before, `seqpar plan` printed "361 (> HBM)" for this run
    row = table(["llama3-8b"], [1 << 20], [4])[2]
    assert "| offload_checkpoints, head_chunks=4, mlp_chunk_size=8192 | 133 |" in row
    # the host holds the offloaded block inputs: 32 layers x 256K tokens x 4096 x 2 B per GPU, pinned in the first step
    host = p.memory.estimate.host
    assert host == pytest.approx(32 * (1 << 18) * 4096 * 2, rel=0.05) and f"| 133 | {host / 1e9:.0f} |" in row


def test_seqpar_plan_takes_a_transformers_folder_or_config_and_a_gpu(tmp_path, capsys):
    """--model: a Hugging Face folder or its config.json (no download); --gpu-memory: a card or a size; a length that does
    not fit names the longest that does."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "llama-1b"
    transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True).save_pretrained(folder)
    cli.main(["plan", "--model", f"{folder},{folder / 'config.json'}", "--seq", "512K,4M", "--gpus", "1", "--gpu-memory", "h200",
              "--precision", "bf16-true"])
    rows = capsys.readouterr().out.strip().splitlines()
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| llama-1b"] * 4
    assert rows[2].split(" | ")[6] == "offload_checkpoints"  # the one-H200 run's choice at 512K (docs/benchmarks.md)
    assert rows[3].split(" | ")[6].startswith("does not fit (longest ") and rows[4:] == rows[2:4]
    assert parse_gpu_memory("H100") == (GPU_MEMORY["H100"], "H100") and parse_gpu_memory("80GB") == (80e9, "H200")
    assert parse_gpu_memory("75GiB")[0] == 75 * 2**30 and parse_gpu_memory("141")[0] == 141e9
    cli.main(["plan", "--model", "llama3-8b", "--seq", "1M", "--gpus", "4", "--gpu-memory", "H100"])
    (row,) = capsys.readouterr().out.strip().splitlines()[2:]
    assert row.split(" | ")[6].startswith("activation_checkpointing=full, offload_checkpoints")  # 4 x 85.0 GB: more savings


def test_compile_auto_is_on_for_the_package_models_and_measured_transformers_families_on_cuda_only():
    """Note [Compile by default]: "auto" compiles the package's own blocks and the transformers families of
    COMPILED_TRANSFORMERS (without LoRA) on a CUDA device; other transformers models, a user's own model and any CPU run
    stay eager; True / False / a dict pass through as given."""
    import sys

    import torch

    from lightning_seqpar.parallel.config import StrategyConfig
    from lightning_seqpar.planner.planning import RunSite, resolve_compile
    from lightning_seqpar.training.module import CausalLMModule

    sys.path.insert(0, str(Path(__file__).parent))
    from own_models import build

    package = CausalLMModule(model="tiny")
    package.configure_model()
    own = build("llama")
    cuda, cpu = RunSite(device=torch.device("cuda", 0)), RunSite(device=torch.device("cpu"))
    auto = StrategyConfig()
    assert auto.compile == "auto" and auto.compile_kwargs is None  # nothing compiles before it is resolved
    assert resolve_compile([package], config=auto, site=cuda).compile_kwargs == {}
    assert resolve_compile([package], config=auto, site=cpu).compile_kwargs is None
    assert resolve_compile([own], config=auto, site=cuda).compile_kwargs is None
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    assert resolve_compile([hf], config=auto, site=cuda).compile_kwargs == {}  # a family "auto" compiles (COMPILED_TRANSFORMERS)
    assert resolve_compile([hf], config=auto, site=cpu).compile_kwargs is None
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**small))
    assert resolve_compile([mistral], config=auto, site=cuda).compile_kwargs is None  # not measured compiled: eager
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert resolve_compile([lora], config=auto, site=cuda).compile_kwargs is None  # peft's layers in the block: eager
    for given, kwargs in ((False, None), (True, {}), ({"mode": "max-autotune"}, {"mode": "max-autotune"})):
        assert resolve_compile([own], config=StrategyConfig(compile=given), site=cpu).compile_kwargs == kwargs
    with pytest.raises(ValueError, match='compile must be True, False, "auto"'):
        StrategyConfig(compile="yes")


def test_host_memory_takes_the_sizes_gpu_memory_takes():
    from lightning_seqpar.cli.plan import parse_size

    assert parse_size("250GB") == parse_size("250") == 250e9 and parse_size("240GiB") == 240 * 2**30
    assert parse_size(" 1.5 gb ") == 1.5e9
