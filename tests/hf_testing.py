"""Shared by the Hugging Face tests: tiny random-weight transformers models and runs under the strategy."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch

SEQ_LEN = 32  # divisible by 2 * 4 (zigzag over 4 ranks)
BATCH = 2
VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)


def tiny_config(kind: str, **overrides: Any):
    """A tiny GQA config (4 query heads, 2 KV heads) of a transformers architecture."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(**{**COMMON, **overrides})
    if kind == "qwen2":  # tied embeddings, q/k/v biases; use_sliding_window=False (the default)
        return transformers.Qwen2Config(**{**COMMON, "tie_word_embeddings": True, **overrides})
    if kind == "mistral":  # window == SEQ_LEN: HF builds its sliding-window mask, which covers everything
        return transformers.MistralConfig(**{**COMMON, "sliding_window": SEQ_LEN, **overrides})
    # one-process tests only
    if kind == "qwen3":  # q/k norms
        return transformers.Qwen3Config(**{**COMMON, "head_dim": 8, **overrides})
    if kind == "gemma":
        return transformers.GemmaConfig(**{**COMMON, "head_dim": 8, **overrides})
    if kind == "gemma3":  # local layers with a 4096-token window (> SEQ_LEN: exact), global layers
        return transformers.Gemma3TextConfig(**{**COMMON, "head_dim": 8, **overrides})
    if kind == "gemma2":  # attention and final logit soft-capping, sliding layers (window 4096 unless overridden)
        return transformers.Gemma2Config(**{**COMMON, "head_dim": 8, **overrides})
    if kind == "gpt_oss":  # attention sinks, alternating sliding / full layers, top-2 of 4 experts
        return transformers.GptOssConfig(**{**COMMON, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                            "intermediate_size": 32, **overrides})
    # Note [Exact or refused: position-dependent layers of Hugging Face models] (tests/test_hf_exact.py).
    # Lengths are chosen so that the zigzag / contiguous shards of SEQ_LEN over 2 and 4 ranks disagree
    # on which side of the threshold their own max(position_ids) + 1 falls.
    if kind == "llama-dynamic":  # dynamic NTK: inv_freq recomputed once seq_len > max_position_embeddings = 24
        return transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 24,
                                           "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                           **overrides})
    if kind == "phi3-longrope":  # LongRoPE: the long factors once seq_len > original_max_position_embeddings = 24
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
                "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.5, 3.0, 3.5]}
        return transformers.Phi3Config(**{**COMMON, "original_max_position_embeddings": 24, "rope_parameters": rope,
                                          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides})
    moe = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
    if kind == "mixtral":
        return transformers.MixtralConfig(**{**COMMON, **moe, "num_local_experts": 4, **overrides})
    if kind == "qwen2_moe":  # shared expert; sliding window only with use_sliding_window=True
        return transformers.Qwen2MoeConfig(**{**COMMON, **moe, "num_experts": 4, "moe_intermediate_size": 16,
                                              "shared_expert_intermediate_size": 32, **overrides})
    if kind == "olmoe":
        return transformers.OlmoeConfig(**{**COMMON, **moe, "num_experts": 4, "pad_token_id": 0, "bos_token_id": 1,
                                           "eos_token_id": 2, **overrides})
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**COMMON, **moe, "num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8,
                                              **overrides})
    if kind == "llama4":  # layer 0: RoPE + chunked attention, layer 1: NoPE (temperature tuning when enabled), MoE
        return transformers.Llama4TextConfig(**{**COMMON, "num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 8,
                                                "intermediate_size_mlp": 64, "interleave_moe_layer_step": 1,
                                                "no_rope_layers": [1, 0], "attention_chunk_size": SEQ_LEN,
                                                "attn_temperature_tuning": False, "pad_token_id": 0, "bos_token_id": 1,
                                                "eos_token_id": 2, **overrides})
    # token mixers other than attention: made exact (lightning_seqpar.hf.hybrid) or refused
    if kind == "lfm2":  # short causal convolutions
        return transformers.Lfm2Config(**{**COMMON, "layer_types": ["conv", "full_attention"], **overrides})
    if kind == "bamba":  # Mamba2 mixers
        return transformers.BambaConfig(**{**COMMON, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
                                           "mamba_d_state": 8, "attn_layer_indices": [1], **overrides})
    if kind == "qwen3_next":  # gated DeltaNet (with its convolution)
        return transformers.Qwen3NextConfig(**{**COMMON, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                                               "layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 2,
                                               "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                               **overrides})
    if kind == "qwen3_5":  # Qwen3.5: gated DeltaNet with separate q|k|v, z, b, a projections; dense MLP
        return transformers.Qwen3_5TextConfig(**{**COMMON, "head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
                                                 "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                                                 "linear_value_head_dim": 8, **overrides})
    if kind in _SWEPT_HYBRIDS:  # the support sweep's tiny config, with the fields that make the test bite
        from lightning_seqpar.hf import support as hf_support

        config = hf_support.tiny_config(kind)
        for key, value in {**_SWEPT_HYBRIDS[kind], **overrides}.items():
            setattr(config, key, value)
        return config
    if kind == "jamba":  # Mamba (v1) mixers and attention (the twin: SeqparMambaMixer)
        return transformers.JambaConfig(**{**COMMON, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                                           "num_experts": 1, "mamba_d_state": 4, "mamba_d_conv": 4, "mamba_expand": 2,
                                           **overrides})
    raise ValueError(kind)


# more Mamba2 / linear-attention hybrids (lightning_seqpar.hf.hybrid): fields set on the sweep's tiny config
_SWEPT_HYBRIDS: dict[str, dict[str, Any]] = {
    "mamba2": {},
    "zamba2": {},
    # muP multipliers (on the mixer's input and per block of its in-projection) and the gated RMS norm on
    "falcon_h1": {"ssm_multipliers": [0.5, 1.5, 0.7, 1.3, 0.9], "ssm_in_multiplier": 0.8, "mamba_rms_norm": True},
    "olmo_hybrid": {"linear_allow_neg_eigval": True},  # beta in (0, 2)
    "minimax": {"block_size": 8, "num_local_experts": 2},  # transformers' blocks shorter than S
    "kimi_linear": {},  # KDA: a decay per key dimension
}


def save_tiny_model(kind: str, path: str, seed: int = 0, **overrides: Any) -> str:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    model.save_pretrained(path)
    return path


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens; labels are the next tokens of the full sequence, -100 at the end (and on a few tokens)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, 5] = -100
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels,
            "position_ids": torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN).contiguous()}


def reference(path: str, data: dict[str, torch.Tensor], config: Any = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The unmodified transformers model (eager attention, one device, fp32): logits, mean loss (plus
    ``router_aux_loss_coef * aux_loss`` with ``output_router_logits``, as transformers adds it), gradients.
    ``config``: load the folder's weights into the model of this config (an overridden one) instead of its own."""
    import transformers

    kwargs = {} if config is None else {"config": config}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, **kwargs)
    model.train()
    out = model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    if getattr(model.config, "output_router_logits", False):  # MoE: transformers' own auxiliary loss of the whole batch
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


class _List(torch.utils.data.Dataset):
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def _capture_callback():
    import lightning as L
    from torch.distributed.tensor import DTensor

    class Capture(L.Callback):
        """Full logits, logged loss and full gradients of the first step (every rank takes part in the gathers)."""

        def __init__(self) -> None:
            self.logits: list[torch.Tensor] = []
            self.losses: list[float] = []
            self.grads: dict[str, torch.Tensor] | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            pl_module.model.register_forward_hook(lambda m, args, out: self.logits.append(out.detach()))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if self.grads is not None:
                return
            self.grads = {}
            for name, p in pl_module.model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                self.grads[name.replace("_checkpoint_wrapped_module.", "").removeprefix("hf.")] = g.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
            # the full sequences (layout or per-document zigzag, 1-D or 2-D mesh) on every rank
            self.logits[-1] = trainer.strategy.gather_sequence(self.logits[-1].contiguous())

    return Capture()


def train_under_strategy(rank: int, world_size: int, model: Any, data: dict[str, torch.Tensor], *, steps: int = 1,
                         strategy_kwargs: dict[str, Any] | None = None, full_state: bool = False,
                         **module_kwargs: Any) -> dict[str, Any] | None:
    """Run on every pooled rank: ``steps`` steps of CausalLMModule(model) under SequenceParallelStrategy
    (sp = world size). Returns, on rank 0: full logits of the first step, logged losses, full
    gradients of the first step and, with ``full_state``, the final full state dict (HF names; gathering it
    was a sixth of a one-step fit, for the one test that reads it)."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    strategy = SequenceParallelStrategy(**{"sequence_parallel_size": world_size, **(strategy_kwargs or {})})
    # the captured logits are the model's output: the full-logit path unless a test asks for the chunked loss
    module_kwargs = {"loss_chunk_size": None, **module_kwargs}
    module = CausalLMModule(copy.deepcopy(model), lr=1e-3, weight_decay=0.0, warmup_steps=0, max_steps=steps, **module_kwargs)
    capture = _capture_callback()
    loader = torch.utils.data.DataLoader(_List(data), batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[capture])
    trainer.fit(module, train_dataloaders=loader)
    state = None
    if full_state:  # a collective: every rank takes part
        state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    out = {"logits": capture.logits[0], "losses": capture.losses, "grads": capture.grads}
    if state is not None:
        out["state"] = {k.removeprefix("hf."): v for k, v in state.items()}
    return out


def train_each(rank: int, world_size: int, models: list[Any], data: dict[str, torch.Tensor], **kwargs: Any) -> list[Any] | None:
    """:func:`train_under_strategy` for each of ``models`` in turn (one pool call: process start-up is paid once)."""
    results = [train_under_strategy(rank, world_size, model, data, **kwargs) for model in models]
    return results if rank == 0 else None


def tiny_tokenizer(texts: list[str], path: str) -> str:
    """A word-level tokenizer trained on ``texts`` (with [UNK], [BOS], [EOS]), saved as a transformers folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]", "[EOS]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")
    fast.save_pretrained(path)
    return path


def fit_on_text(rank: int, world_size: int, model: Any, datamodule_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """One step of CausalLMModule(model) on HFTextDataModule(**datamodule_kwargs) under the strategy
    (sp = world size, ring). Returns, on rank 0, the logged loss and the first batch, put back together."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import HFTextDataModule
    from lightning_seqpar.sharding import unshard_sequence
    from lightning_seqpar.sharding.documents import current_documents

    def unshard(v, s):
        documents = current_documents()  # packed documents: sharded with the per-document zigzag
        if documents is None:
            return unshard_sequence(v, s.sp_mesh, dim=1, layout=s.layout)
        shards = [torch.empty_like(v) for _ in range(world_size)]
        torch.distributed.all_gather(shards, v.contiguous(), group=s.sp_mesh.get_group())
        return documents.unshard(shards)

    class FirstBatch(L.Callback):
        batch: dict[str, torch.Tensor] | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.batch is None:
                self.batch = {k: unshard(v, trainer.strategy) for k, v in batch.items()}

    first, capture = FirstBatch(), _capture_callback()
    strategy = SequenceParallelStrategy(sequence_parallel_size=world_size, attention="ring")
    module = CausalLMModule(model, lr=1e-3, warmup_steps=0, max_steps=1, loss_chunk_size=None)  # the captured logits: the full path
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[first, capture])
    trainer.fit(module, datamodule=HFTextDataModule(**datamodule_kwargs))
    return {"losses": capture.losses, "batch": first.batch} if rank == 0 else None


# --------------------------------------------------------------------------------------------- hybrid models


def run_unmodified(model, ids, labels, lengths=None):
    """The unmodified transformers model on the whole sequence (or on every packed document alone, ``lengths``
    per sample): (logits, summed loss, every parameter's gradient)."""
    batch, seq = ids.shape
    if lengths is None:
        logits = model(input_ids=ids, position_ids=torch.arange(seq).expand(batch, seq), use_cache=False).logits
    else:
        logits = torch.cat([torch.cat([model(input_ids=part, position_ids=torch.arange(part.shape[1])[None],
                                             use_cache=False).logits for part in ids[b:b + 1].split(list(lens), dim=1)], dim=1)
                            for b, lens in enumerate(lengths)])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def with_twins(model, mesh, layout: str):
    """A copy of ``model`` as HFCausalLM and the strategy leave it: apply_hf_attention installs the recurrent twins,
    apply_attention points them (and the attention) at ``mesh`` with ``layout``."""
    from lightning_seqpar.attention.recurrent import Recurrence
    from lightning_seqpar.hf import apply_hf_attention
    from lightning_seqpar.parallel.parallelize import apply_attention

    model = copy.deepcopy(model)
    apply_hf_attention(model)
    apply_attention(model, mesh, attention="ring", layout=layout)
    recurrent = [m for m in model.modules() if isinstance(m, Recurrence)]
    assert recurrent and all(m.mesh is mesh and m.layout == layout for m in recurrent)
    return model


def shard_case(ids, labels, *, lengths, layout: str, world: int, rank: int):
    """What one rank holds of a batch, as the strategy shards it: (shard, position_ids, labels, documents). With
    ``lengths`` (packed documents per sample) the per-document zigzag and no label across a document boundary."""
    from seqpar_testing import expected_index, take

    from lightning_seqpar.sharding.documents import PackedDocuments

    batch, seq = ids.shape
    if lengths is None:
        index = expected_index(seq, layout, world, rank)
        return (lambda x: take(x, index)), torch.arange(seq).expand(batch, seq), labels, None
    docs = PackedDocuments.from_lengths(lengths, world=world)
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in lengths])
    labels = torch.where(doc_ids.diff(dim=1, append=torch.full((batch, 1), -1)) == 0, labels, -100)
    return (lambda x: docs.shard(x, rank)), docs.position_ids(), labels, docs


def sharded_failures(model, reference, ids, labels, positions, shard, documents=None, *, tag: str, atol: float = 1e-5):
    """Run ``model`` (its twins and attention configured) on this rank's shard, sum the loss and every gradient over
    the ranks and compare them and the logits with ``reference`` = (logits, summed loss, gradients) of the
    unmodified model: the failures, one line each."""
    import torch.distributed as dist

    from lightning_seqpar.sharding.documents import packed_documents

    ref_logits, ref_loss, ref_grads = reference
    with packed_documents(documents):
        logits = model(input_ids=shard(ids), position_ids=shard(positions), use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard(labels).flatten(), reduction="sum")
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    checks = [("logits", logits.detach(), shard(ref_logits)), ("loss", total, ref_loss)]
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        checks.append((f"d{n}", g, ref_grads[n]))
    failures = []
    for name, got, want in checks:
        try:
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
        except AssertionError as err:
            failures.append(f"{tag} {name}: {err}")
    return failures


def assert_trained_like(kinds, results, references, *, atol: float = 1e-5, same_keys: bool = True) -> None:
    """Each kind's one-step result of :func:`train_each` (logits, logged loss, gradients) against its reference
    (logits, loss, gradients) of the unmodified model; ``same_keys``: also the same gradient names."""
    import pytest

    for kind, result in zip(kinds, results):
        logits, loss, grads = references[kind][-3:]
        torch.testing.assert_close(result["logits"], logits, rtol=0, atol=atol, msg=lambda m, k=kind: f"{k} logits: {m}")
        assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6), kind
        if same_keys:
            assert result["grads"].keys() == grads.keys(), kind
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=atol, msg=lambda m, k=kind, n=name: f"{k} {n}: {m}")


def build_eager(config, seed: int = 0):
    """A transformers causal LM from ``config`` (eager attention, fp32, random init from ``seed``) whose zero-initialised
    norms and biases get some weight (a stronger test), in train mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.train()


def each_document_alone(model, input_ids, lengths, *, attn: str = "eager", router_logits: bool = False):
    """Every packed document ALONE through a fresh copy of the unmodified ``model`` (positions from 0; no state of
    another document: dynamic NTK caches the longest length it saw), ``lengths`` per sample. Returns (full logits,
    the copies, to sum their gradients after a backward, the router logits of each document when asked)."""
    model = copy.deepcopy(model)
    model.set_attn_implementation(attn)
    model.train()
    rows, copies, routers = [], [], []
    for b, lens in enumerate(lengths):
        parts = []
        for part in input_ids[b:b + 1].split(list(lens), dim=1):
            alone = copy.deepcopy(model)
            out = alone(input_ids=part, position_ids=torch.arange(part.shape[1], device=part.device)[None], use_cache=False,
                        **({"output_router_logits": True} if router_logits else {}))
            parts.append(out.logits)
            routers.append(out.router_logits if router_logits else None)
            copies.append(alone)
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows), copies, routers


def summed_grads(model, copies) -> dict:
    """Each parameter's gradient summed over ``copies`` of ``model`` (None where no copy has one)."""
    out = {}
    for name, _ in model.named_parameters():
        got = [g for g in (dict(c.named_parameters())[name].grad for c in copies) if g is not None]
        out[name] = sum(got[1:], got[0].clone()) if got else None
    return out
