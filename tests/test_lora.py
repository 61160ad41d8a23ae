"""LoRA through peft under SequenceParallelStrategy (CPU, gloo, fp32): lightning_seqpar.hf.lora.

* Parity: the loss, the logits and every adapter gradient of a step under the strategy (sp 2 and
  4) equal those of the same peft model on one process (transformers' eager attention, no
  package code); the frozen base gets no gradient and no optimizer state.
* Exact resume: 2 steps, a checkpoint, 2 more steps resumed from it give the losses and the
  adapters of 4 uninterrupted steps.
* Export: the adapter folder (hf_save_dir during training, ``export_lora`` from the checkpoint)
  loads with ``PeftModel.from_pretrained`` onto a fresh base and gives the trained model's
  logits; the merged model (``merge_and_unload``) gives them too, as a plain transformers model.
* "bf16-true": the frozen base in bf16, the adapters and their AdamW state in fp32 (FSDP2 with two
  dtypes in one block).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import BATCH, SEQ_LEN, VOCAB, _List, batch, save_tiny_model, tiny_tokenizer  # noqa: E402

TIMEOUT = 300
ATOL = 1e-5
# init_lora_weights=False: B is random too (peft's default B = 0 would give A no gradient at the first step)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "init_lora_weights": False}
LORA_ALL = {"r": 4, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False}
# the output head adapted too: the chunked loss widens its operands (Note [An adapted output head])
LORA_HEAD = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"], "init_lora_weights": False}


def _data(n_batches: int) -> dict[str, torch.Tensor]:
    pieces = [batch(seed) for seed in range(n_batches)]
    return {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}


def _peft_reference(path: str, lora: dict[str, Any], data: dict[str, torch.Tensor], *, init_seed: int = 0):
    """The same peft model on one process, without the package: logits, mean loss, adapter gradients (peft names)."""
    torch.manual_seed(init_seed)  # CausalLMModule builds the model (and draws the adapters) under torch.manual_seed(init_seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **lora))
    model.train()
    logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return logits.detach(), float(loss), grads


def _fit_lora(rank: int, world_size: int, path: str, lora: dict[str, Any] | None, data: dict[str, torch.Tensor], *,
              steps: int, strategy_kwargs: dict[str, Any] | None = None, precision: str = "32-true",
              ckpt_path: str | None = None, save_to: str | None = None, hf_save_dir: str | None = None,
              peft_model: Any = None, init_seed: int = 0, **module_kwargs: Any) -> dict[str, Any] | None:
    """``steps`` steps of CausalLMModule(path, lora=lora) under the strategy (sp = world size). On rank 0:
    logged losses, the first step's adapter gradients (full, peft names), which parameters had a gradient,
    the optimizer's state size, dtypes, and the final adapters."""
    warnings.filterwarnings("ignore")
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.hf.lora import adapter_state_dict

    def clean(name: str) -> str:
        return name.replace("_checkpoint_wrapped_module.", "").removeprefix("hf.")

    out: dict[str, Any] = {"losses": [], "grads": None}

    class Capture(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            out["dtypes"] = {clean(n): p.dtype for n, p in pl_module.model.named_parameters()}
            out["rotary"] = {clean(n): b.detach().cpu() for n, b in pl_module.model.named_buffers() if "inv_freq" in n}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if out["grads"] is not None:
                return
            params = dict(pl_module.model.named_parameters())
            out["with_grad"] = sorted(clean(n) for n, p in params.items() if p.grad is not None)
            out["grads"] = {clean(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                            for n, p in params.items() if p.grad is not None}
            out["optimized"] = sum(p.numel() for group in optimizer.param_groups for p in group["params"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            out["losses"].append(float(trainer.callback_metrics["train/loss"]))
            if save_to is not None and trainer.global_step == steps:  # where ModelCheckpoint saves
                trainer.save_checkpoint(save_to)

    strategy = SequenceParallelStrategy(**{"sequence_parallel_size": world_size, "attention": "ring", **(strategy_kwargs or {})})
    module = CausalLMModule(peft_model if peft_model is not None else path, lora=lora, lr=1e-2, weight_decay=0.1,
                            warmup_steps=0, max_steps=4, hf_save_dir=hf_save_dir, init_seed=init_seed,
                            **module_kwargs)
    loader = torch.utils.data.DataLoader(_List(data), batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Capture()], precision=precision)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    adapters = adapter_state_dict(module.model)
    optimizer = trainer.optimizers[0]
    state_dtypes = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    if rank != 0:
        return None
    out["adapters"] = {clean(k): v for k, v in adapters.items()}
    out["state_dtypes"] = state_dtypes
    out["state_params"] = len(optimizer.state)
    out["trainable"] = sum(p.requires_grad for p in module.model.parameters())
    return out


def _fit_each(rank: int, world_size: int, runs: list[tuple[tuple, dict]]) -> list[Any] | None:
    """:func:`_fit_lora` for each ``(args, kwargs)`` in turn (one pool call)."""
    results = [_fit_lora(rank, world_size, *args, **kwargs) for args, kwargs in runs]
    return results if rank == 0 else None


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny Llama folder as a user has it: weights, config, a tokenizer with a chat template, a generation config."""
    path = save_tiny_model("llama", str(tmp_path_factory.mktemp("lora-base") / "llama"))
    tiny_tokenizer(["the cat sat on the mat", "a dog ran far away"], path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False, repetition_penalty=1.25).save_pretrained(path)
    return path


def _check_step(result: dict[str, Any], reference: tuple) -> None:
    _, loss, grads = reference
    assert result["losses"][0] == pytest.approx(loss, rel=1e-6)
    assert result["grads"].keys() == grads.keys()  # exactly the adapters have gradients
    assert all(".lora_A." in n or ".lora_B." in n for n in grads)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name  # non-trivial: A and B both random
        torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)
    n_adapter = sum(g.numel() for g in grads.values())
    assert result["optimized"] == n_adapter  # the optimizer holds the adapters only
    assert result["state_params"] == len(grads)  # AdamW state for them only


@pytest.mark.parametrize("world", [2, 4])
def test_lora_matches_the_same_peft_model_on_one_process(world, base):
    data = batch()
    if world == 2:  # all-linear (the MLP too), all-gather and the chunked loss; an adapted head under the chunked loss
        runs = [((base, LORA, data), {"steps": 1}),
                ((base, LORA_ALL, data), {"steps": 1, "strategy_kwargs": {"attention": "allgather"}, "loss_chunk_size": 24}),
                ((base, LORA_HEAD, data), {"steps": 1, "loss_chunk_size": 24})]
    else:  # sp 4; and dp 2 x sp 2: FSDP2 over the data x sequence axes, one sample per replica
        runs = [((base, LORA, data), {"steps": 1}), ((base, LORA, data), {"steps": 1, "strategy_kwargs": {"sequence_parallel_size": 2}})]
    results = run_distributed(_fit_each, world, runs, timeout=TIMEOUT)[0]
    for (args, _), result in zip(runs, results):
        _check_step(result, _peft_reference(base, args[1], data))


def test_a_peft_model_given_as_the_model(base):
    """CausalLMModule(PeftModel) uses its adapters as they are (here: drawn with seed 3, not init_seed)."""
    data = batch()
    reference = _peft_reference(base, LORA, data, init_seed=3)
    torch.manual_seed(3)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    result = run_distributed(_fit_each, 2, [((base, None, data), {"steps": 1, "peft_model": model})], timeout=TIMEOUT)[0][0]
    _check_step(result, reference)


def _load_adapter(base: str, folder: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(model, folder)


def _logits(model, data) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False).logits


def test_resume_is_exact_and_the_adapters_export(base, tmp_path):
    from lightning_seqpar.cli.export import main as export_main

    data = _data(4)
    ckpt = str(tmp_path / "step2.ckpt")
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    runs = [((base, LORA, data), {"steps": 4, "hf_save_dir": straight_dir}),
            ((base, LORA, data), {"steps": 2, "save_to": ckpt}),
            # another init_seed: the adapters after the resume come from the checkpoint
            ((base, LORA, data), {"steps": 4, "ckpt_path": ckpt, "hf_save_dir": resumed_dir, "init_seed": 5})]
    straight, first, resumed = run_distributed(_fit_each, 2, runs, timeout=TIMEOUT)[0]
    assert len(straight["losses"]) == 4 and first["losses"] == straight["losses"][:2]
    assert resumed["losses"] == straight["losses"][2:]  # bit for bit
    for name, value in straight["adapters"].items():
        torch.testing.assert_close(resumed["adapters"][name], value, rtol=0, atol=0, msg=name)

    # the adapter folder written at the end of training: PeftModel.from_pretrained on a fresh base
    trained = _load_adapter(base, straight_dir)
    for name, value in trained.named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(value, straight["adapters"][name], rtol=0, atol=0, msg=name)
    probe = batch(seed=7)
    expected = _logits(trained, probe)

    # from the checkpoint after 2 steps: `seqpar export --format lora` with the merged model
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    export_main([ckpt, str(adapter_dir), "--format", "lora", "--merged", str(merged_dir)])
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()
    after_two = _load_adapter(base, str(adapter_dir))
    for name, value in after_two.named_parameters():
        if ".lora_" in name:
            assert name in first["adapters"], name
            torch.testing.assert_close(value, first["adapters"][name], rtol=0, atol=0, msg=name)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32, attn_implementation="eager")
    assert not any("lora" in n for n, _ in merged.named_parameters())  # a plain transformers model
    torch.testing.assert_close(_logits(merged, probe), _logits(after_two, probe), rtol=0, atol=1e-5)
    assert not torch.allclose(_logits(after_two, probe), expected)  # 2 and 4 steps differ: the comparison means something
    # the merged folder loads everywhere: the base folder's tokenizer (its chat template) and generation config came along
    _generates(merged_dir, base)


def _generates(folder, source) -> None:
    """``folder`` holds the tokenizer and generation config of ``source``: AutoTokenizer and AutoModelForCausalLM load it
    as it is, and the model generates 3 tokens from a chat prompt."""
    from pathlib import Path

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == "[EOS]"
    assert (Path(folder) / "generation_config.json").read_text() == (Path(source) / "generation_config.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    assert model.generation_config.repetition_penalty == 1.25
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=True, return_tensors="pt",
                                           return_dict=True)
    assert prompt["input_ids"][0, -2:].tolist() == tokenizer.convert_tokens_to_ids(["the", "cat"])  # "user:" is unknown
    out = model.generate(**prompt, max_new_tokens=3, min_new_tokens=3)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 3) and torch.equal(out[:, :4], prompt["input_ids"])


def test_adapter_folder_of_a_checkpointed_model(base, tmp_path):
    """One process: the adapter folder of a model whose blocks are wrapped for activation checkpointing
    (parameter names with ``_checkpoint_wrapped_module``) loads with peft and gives the model's logits."""
    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.hf.lora import save_lora_pretrained
    from lightning_seqpar.parallel.parallelize import apply_ac

    module = CausalLMModule(base, lora=LORA_ALL)
    module.configure_model()
    assert apply_ac(module.model, "full") == 2
    assert any("_checkpoint_wrapped_module" in n for n, _ in module.model.named_parameters())
    save_lora_pretrained(module.model, tmp_path / "adapter")
    loaded = _load_adapter(base, str(tmp_path / "adapter"))
    probe = batch(seed=3)
    with torch.no_grad():
        expected = module.model(probe["input_ids"], probe["position_ids"])
    torch.testing.assert_close(_logits(loaded, probe), expected, rtol=0, atol=1e-5)
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].init_lora_weights is False


def test_flops_count_the_frozen_base_without_weight_gradients(base):
    from lightning_seqpar import CausalLMModule

    plain, lora = CausalLMModule(base), CausalLMModule(base, lora=LORA)
    plain.configure_model()
    lora.configure_model()
    hf_plain, hf_lora = plain.model.hf, lora.model.hf
    embedding = hf_plain.get_input_embeddings().weight.numel()  # untied: a lookup, not counted
    n_base = sum(p.numel() for p in hf_plain.parameters()) - embedding
    n_adapters = sum(p.numel() for p in hf_lora.parameters() if p.requires_grad)
    attention = 6 * 2 * SEQ_LEN * 32  # 6 x layers x S x (H x D)
    assert plain.model.flops_per_token(SEQ_LEN) == 6 * n_base + attention
    assert lora.model.flops_per_token(SEQ_LEN) == 4 * n_base + 6 * n_adapters + attention


def test_bf16_true_keeps_the_base_in_bf16_and_the_adapters_in_fp32(base):
    data = batch()
    result = run_distributed(_fit_each, 2, [((base, LORA, data), {"steps": 2, "precision": "bf16-true"})], timeout=TIMEOUT)[0][0]
    adapters = {n for n in result["dtypes"] if ".lora_" in n}
    assert adapters and all(result["dtypes"][n] == torch.float32 for n in adapters)
    assert all(dtype == torch.bfloat16 for n, dtype in result["dtypes"].items() if n not in adapters)
    assert result["state_dtypes"] == {torch.float32}
    assert set(result["with_grad"]) == adapters
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert len(result["losses"]) == 2
    # Note [Rotary frequencies under bf16-true]: the rotary frequencies stay as transformers builds them (fp32)
    import transformers

    built = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).model.rotary_emb.inv_freq
    assert built.dtype == torch.float32
    assert result["rotary"] and all(torch.equal(b, built) for b in result["rotary"].values()), result["rotary"]


def test_lora_config_errors():
    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.hf.lora import lora_config, lora_hparams

    with pytest.raises(ValueError, match="Hugging Face"):
        CausalLMModule("tiny", lora=LORA)
    with pytest.raises(ValueError, match="not fields of peft.LoraConfig"):
        lora_config({"rank": 4, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="only LoRA"):
        lora_config(peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    with pytest.raises(ValueError, match="target_modules"):
        lora_config({"r": 4})
    config = lora_config(LORA)
    assert lora_config(lora_hparams(config)).to_dict() == config.to_dict()
    hparams = lora_hparams(config)
    assert {k: hparams[k] for k in LORA} == {**LORA, "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"]}
    buffer = io.BytesIO()
    torch.save(hparams, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True) == hparams  # what a checkpoint's loader accepts


def test_lora_recipes_parse_into_a_lora_config(monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.setattr(sys, "argv", ["seqpar"])  # LightningCLI reads sys.argv besides its args

    from test_recipes import parse

    from lightning_seqpar.hf.lora import lora_config

    root = Path(__file__).parent.parent / "recipes"
    for name, devices, sp in (("lora_finetune.yaml", 4, 4), ("lora_finetune_1gpu.yaml", 1, 1)):
        config = parse(["fit", "--config", str(root / name)]).fit
        assert (config.trainer.devices, config.trainer.strategy.init_args.sequence_parallel_size) == (devices, sp)
        assert config.trainer.precision == "bf16-true"
        assert config.data.class_path == "lightning_seqpar.data.ChatDataModule"
        lora = lora_config(config.model.lora)
        assert (lora.r, lora.lora_alpha, lora.target_modules) == (16, 32, "all-linear")


def _head_model(base: str, **lora: Any):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **{"r": 4, "lora_alpha": 8, "init_lora_weights": False,
                                                                               "target_modules": ["q_proj", "lm_head"], **lora}))


def test_the_operands_of_an_adapted_head_give_its_logits_and_gradients(base):
    """Note [An adapted output head]: h' @ W'^T is lm_head(h) for a LoRA head with two active adapters (one with a
    rank of its own), and the adapters' gradients through it are peft's; a disabled or merged head is its weight."""
    from lightning_seqpar.hf.lora import PEFT_HEAD
    from lightning_seqpar.loss.head import head_operands as operands

    def head_operands(head, hidden):
        return operands(head, hidden, adapters=(PEFT_HEAD,))

    model = _head_model(base)
    model.add_adapter("second", peft.LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=3, target_modules=["lm_head"],
                                                init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    head = model.get_output_embeddings()
    hidden = torch.randn(2, 5, head.in_features, requires_grad=True)
    h, w = head_operands(head, hidden)
    assert h.shape[-1] == w.shape[-1] == head.in_features + 4 + 2
    params = [p for n, p in head.named_parameters() if ".lora_" in n or n.startswith("lora_")]
    assert len(params) == 4 and all(p.requires_grad for p in params)
    probe = torch.randn(2, 5, head.out_features)
    got = torch.autograd.grad(((h @ w.T) * probe).sum(), [hidden, *params])
    want = torch.autograd.grad((head(hidden) * probe).sum(), [hidden, *params])
    torch.testing.assert_close(h @ w.T, head(hidden), rtol=0, atol=1e-5)
    for g, r in zip(got, want):  # fp32 sums in another order
        assert g.abs().max() > 0
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-5)
    with model.disable_adapter():
        h, w = head_operands(head, hidden)
        assert h is hidden and w is head.get_base_layer().weight
    model.base_model.set_adapter("default")
    expected = head(hidden).detach()
    head.merge()
    h, w = head_operands(head, hidden)
    assert h is hidden and w is head.get_base_layer().weight
    torch.testing.assert_close(h @ w.T, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora, match", [({"use_dora": True}, "LoRA variant"), ({"lora_bias": True}, "lora_bias=True")])
def test_an_adapted_head_the_chunked_loss_cannot_compute_is_refused(base, lora, match):
    from lightning_seqpar.hf import HFCausalLM

    model = HFCausalLM(_head_model(base, **lora))
    probe = batch()
    with pytest.raises(ValueError, match=f"lm_head.*{match}.*loss_chunk_size=None"):
        model(probe["input_ids"], probe["position_ids"], output="hidden")
    assert model(probe["input_ids"], probe["position_ids"]).shape[-1] == VOCAB  # the full logits: the head's own forward
    # CausalLMModule refuses it when it builds the model, before the strategy's first collective
    from lightning_seqpar import CausalLMModule

    module = CausalLMModule(base, lora={"r": 4, "target_modules": ["q_proj", "lm_head"], **lora}, loss_chunk_size=24)
    with pytest.raises(ValueError, match=f"lm_head.*{match}"):
        module.configure_model()


def _fit_bf16_adapters(rank: int, world_size: int, path: str, data: dict[str, torch.Tensor], bf16_adapters: bool):
    """Two bf16-true steps of CausalLMModule(path, lora=LORA_ALL); what the adapters and their inputs were inside the forward."""
    warnings.filterwarnings("ignore")
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    seen: dict[str, Any] = {"losses": [], "inside": set()}

    def probe(module, args):
        seen["inside"].add((module.weight.dtype, args[0].dtype))

    class Capture(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen["masters"] = {p.dtype for n, p in pl_module.model.named_parameters() if p.requires_grad}
            for name, module in pl_module.model.named_modules():
                if name.endswith("lora_A.default"):
                    module.register_forward_pre_hook(probe)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen["losses"].append(float(trainer.callback_metrics["train/loss"]))

    strategy = SequenceParallelStrategy(sequence_parallel_size=world_size, bf16_adapters=bf16_adapters)
    module = CausalLMModule(path, lora=LORA_ALL, lr=1e-2, warmup_steps=0, max_steps=2)
    loader = torch.utils.data.DataLoader(_List(data), batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Capture()], precision="bf16-true")
    trainer.fit(module, train_dataloaders=loader)
    optimizer = trainer.optimizers[0]
    seen["state"] = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    return seen if rank == 0 else None


def test_bf16_adapters_compute_in_bf16_over_fp32_masters(base):
    """Note [Adapters in bf16]: the adapters the forward uses are bf16 (so peft's cast of their input to the adapter's
    dtype keeps the bf16 tensor: no fp32 copy saved), their shards and AdamW state fp32; the losses follow the fp32
    adapters' run within bf16 rounding."""
    data = _data(2)
    plain, lean = run_distributed(_fit_each_bf16, 2, base, data, timeout=TIMEOUT)[0]
    assert plain["inside"] == {(torch.float32, torch.float32)}  # fp32 adapters: peft casts the bf16 input to fp32
    assert lean["inside"] == {(torch.bfloat16, torch.bfloat16)}
    for run in (plain, lean):
        assert run["masters"] == {torch.float32} and run["state"] == {torch.float32}
    assert lean["losses"] == pytest.approx(plain["losses"], rel=2e-2)
    assert lean["losses"] != plain["losses"]  # bf16 adapters round differently: the option did something


def _fit_each_bf16(rank: int, world_size: int, path: str, data: dict[str, torch.Tensor]):
    runs = [_fit_bf16_adapters(rank, world_size, path, data, flag) for flag in (False, True)]
    return runs if rank == 0 else None


def test_bf16_adapters_need_bf16_true_and_adapters(base):
    from lightning_seqpar import SequenceParallelStrategy

    with pytest.raises(ValueError, match="bf16_adapters must be True or False"):
        SequenceParallelStrategy(bf16_adapters="yes")
    result = run_distributed(_refused_bf16_adapters, 2, base, timeout=TIMEOUT)[0]
    assert "bf16_adapters=True gathers fp32 LoRA adapters in bf16" in result and "precision='32-true'" in result


def _refused_bf16_adapters(rank: int, world_size: int, path: str) -> str | None:
    warnings.filterwarnings("ignore")
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision="32-true",
                        strategy=SequenceParallelStrategy(sequence_parallel_size=world_size, bf16_adapters=True))
    loader = torch.utils.data.DataLoader(_List(batch()), batch_size=BATCH)
    try:
        trainer.fit(CausalLMModule(path, lora=LORA), train_dataloaders=loader)
    except ValueError as error:
        return str(error) if rank == 0 else None
    raise AssertionError("bf16_adapters=True under 32-true was not refused")


def test_one_rank_whole_model_gather_holds_the_bf16_base_and_the_fp32_adapters(base):
    """Note [One rank: one gather per step]: the root's one FSDP2 group holds the frozen bf16 base beside the fp32 adapters
    (FSDP2 asks one dtype of the trainable parameters only), and trains as a group per block does."""
    runs = [((base, LORA, batch()), {"steps": 2, "precision": "bf16-true", "strategy_kwargs": {"gather_whole_model": g}})
            for g in (False, True)]
    blocks, whole = run_distributed(_fit_each, 1, runs, timeout=TIMEOUT)[0]
    assert whole["dtypes"] == blocks["dtypes"] and {torch.bfloat16, torch.float32} <= set(whole["dtypes"].values())
    assert whole["losses"] == pytest.approx(blocks["losses"], rel=1e-6) and len(whole["losses"]) == 2
    assert whole["adapters"].keys() == blocks["adapters"].keys()
    for name, value in blocks["adapters"].items():
        torch.testing.assert_close(whole["adapters"][name], value, rtol=0, atol=ATOL, msg=name)
