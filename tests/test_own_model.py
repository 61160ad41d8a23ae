"""A user's own model under the strategy (docs/own_model.md): SDPA calls routed, position tables read at global
positions, the split-against-whole check, the user's own loss. Every case against one process running the model whole."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from strategy_testing import _LossRecorder

TIMEOUT = 240
SEQ = 32
STEPS = 3


def _batches(steps: int = STEPS, seq: int = SEQ, batch: int = 2, documents: bool = False, ignore: bool = False) -> list[dict]:
    from own_models import VOCAB

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        b = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        if documents:
            b["document_ids"] = (torch.arange(seq) >= seq // 4 + 3).long().expand(batch, seq).contiguous()
        if ignore:
            b["labels"][:, : seq // 2] = -100
        out.append(b)
    return out


class _Data(torch.utils.data.Dataset):
    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return self.batches[i]


def _loader(batches: list[dict], *, reference: bool = False):
    """Under the strategy Lightning gives the loader ``DistributedSampler(shuffle=True, seed=0)`` over the data-parallel
    ranks (one here): the reference reads the same order."""
    from torch.utils.data import DistributedSampler

    data = _Data(batches)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    return torch.utils.data.DataLoader(data, batch_size=None, shuffle=False, sampler=sampler)


def _fit(module: Any, strategy: Any, devices: int, batches: list[dict], save: str | None = None) -> list[float]:
    reference = strategy == "auto"
    import lightning as L

    losses = _LossRecorder()  # the logged train/loss of every step
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=len(batches), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[losses])
    trainer.fit(module, train_dataloaders=_loader(batches, reference=reference))
    if save is not None:
        trainer.save_checkpoint(save)  # under the strategy: a folder of shards
    return losses.losses


def _state(module: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def reference(kind: str, batches: list[dict], **kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    warnings.filterwarnings("ignore")
    from own_models import make_module

    module = make_module(kind, **kwargs)
    losses = _fit(module, "auto", 1, batches)
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _train(rank: int, world: int, kind: str, strategy_kwargs: dict, batches: list[dict], module_kwargs: dict,
           quiet: bool = True) -> Any:
    if quiet:
        warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from own_models import make_module

    from lightning_seqpar import SequenceParallelStrategy

    if module_kwargs.get("seed") == "rank":  # every rank its own initial weights (no common seed)
        module_kwargs = {**module_kwargs, "seed": rank}
    module = make_module(kind, **module_kwargs)
    try:
        losses = _fit(module, SequenceParallelStrategy(**strategy_kwargs), world, batches)
    except ValueError as e:
        return ("error", str(e))
    state = _state(module)  # collective: every rank
    return losses, state if rank == 0 else None


def _check_parity(results: list, ref: tuple, *, atol: float = 2e-5) -> None:
    ref_losses, ref_state = ref
    assert not isinstance(results[0][0], str), results[0][1]
    losses, state = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=atol, rtol=1e-5,
                               msg=lambda m: f"losses {losses} against one process's {ref_losses}: {m}")
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


CASES = [
    # (model, module kwargs, strategy kwargs, world)
    ("nanogpt", {}, {"attention": "ring"}, 2),
    ("nanogpt", {"on_module": True}, {"attention": "allgather"}, 2),
    ("llama", {}, {"attention": "ring"}, 2),
    ("llama", {"gqa": "repeat"}, {"attention": "ulysses"}, 2),
    ("encoder", {}, {"attention": "ring", "load_balance": "contiguous"}, 2),
    ("llama", {}, {"attention": "2d", "head_parallel_size": 2}, 4),
    ("nanogpt", {}, {"attention": "ring", "inner_ring_size": 2}, 4),
    ("litgpt", {}, {"attention": "ring"}, 2),
    ("litgpt", {"window": 8}, {"attention": "allgather"}, 2),
]


@pytest.mark.parametrize("kind,module_kwargs,strategy_kwargs,world", CASES,
                         ids=[f"{c[0]}-{c[2]['attention']}-{c[3]}{'-' + '-'.join(c[1]) if c[1] else ''}" for c in CASES])
def test_own_model_trains_as_one_process(kind, module_kwargs, strategy_kwargs, world):
    """LitGPT unchanged (its RoPE caches read at global positions, its windowed layers' masks).
    Losses and final weights of 3 SGD steps equal one process training the same model whole (the user's own
    per-rank mean cross entropy: every rank holds the same number of tokens)."""
    if kind == "litgpt":
        pytest.importorskip("litgpt")
    batches = _batches()
    ref = reference(kind, batches, **module_kwargs)
    kwargs = {"sequence_parallel_size": world, "activation_checkpointing": "selective++", **strategy_kwargs}
    _check_parity(run_distributed(_train, world, kind, kwargs, batches, module_kwargs, timeout=TIMEOUT), ref)


REFUSALS = [
    # (module kwargs, what the error names)
    ({"positions": "arange"}, "torch.arange of the shard's length"),
    ({"mask": "causal"}, "explicit attn_mask"),
    ({"mask": "manual"}, "call no F.scaled_dot_product_attention"),
    ({"mask": "latents"}, "attention to a tensor that is not the sequence"),
    ({"dropout": 0.1}, "dropout_p=0.1"),
]


@pytest.mark.parametrize("module_kwargs,named", REFUSALS, ids=[next(iter(r[0].values())) for r in REFUSALS])
def test_a_model_that_would_train_wrong_is_refused_with_its_cause(module_kwargs, named):
    """Each model trains wrong under the split with the check off (its losses differ from one process's), and is refused
    with the cause with it on (the default) — before its first step. Dropout and cross attention are refused at the
    call, check or not."""
    batches = _batches(steps=2)
    kwargs = {"sequence_parallel_size": 2, "attention": "ring"}
    results = run_distributed(_train, 2, "nanogpt", kwargs, batches, module_kwargs, timeout=TIMEOUT)
    assert all(r[0] == "error" and named in r[1] for r in results), results[0]
    if "dropout" in module_kwargs or module_kwargs.get("mask") in ("latents", "causal"):
        return
    ref_losses, _ = reference("nanogpt", batches, **module_kwargs)
    unchecked = run_distributed(_train, 2, "nanogpt", {**kwargs, "check_model": False}, batches, module_kwargs, timeout=TIMEOUT)
    losses = unchecked[0][0]
    assert abs(losses[0] - ref_losses[0]) > 1e-3, (losses, ref_losses)  # what the check prevents: a silently wrong loss


def _train_warned(rank: int, world: int, strategy_kwargs: dict, batches: list[dict], module_kwargs: dict) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(rank, world, "nanogpt", strategy_kwargs, batches, module_kwargs, quiet=False)
    return out, [str(w.message) for w in caught if "global_mean_loss" in str(w.message)]


@pytest.mark.parametrize("own_loss", [True, False], ids=["per-rank-mean", "global_mean_loss"])
def test_a_loss_over_uneven_shards(own_loss):
    """Labels ignored over the first quarter: the zigzag shards of a row hold 8 and 16 trained tokens. A per-rank mean then
    weighs tokens unevenly: warned once with the counts and the fix; global_mean_loss stays exact."""
    batches = _batches(ignore=True)
    for b in batches:
        b["labels"][:, : SEQ // 2] = b["input_ids"][:, 1 : SEQ // 2 + 1]
        b["labels"][:, : SEQ // 4] = -100
    module_kwargs = {"own_loss": own_loss}
    results = run_distributed(_train_warned, 2, {"sequence_parallel_size": 2, "attention": "ring"}, batches, module_kwargs,
                              timeout=TIMEOUT)
    (out, warned) = results[0]
    if own_loss:
        assert len(warned) == 1 and "48 trained tokens" in warned[0] and "this rank's shard 16, not 24" in warned[0] and "weighs tokens unevenly" in warned[0], warned
    else:
        assert warned == []
        _check_parity([out], reference("nanogpt", batches, **module_kwargs))


def test_packed_documents_and_compile():
    """document_ids in the batch: the routed attention masks documents and positions restart per document, as the
    strategy on one process does; with compile=True (aot_eager: the routed block compiles)."""
    batches = _batches(documents=True)
    module_kwargs: dict = {}

    def one(world: int, **extra: Any) -> Any:
        return run_distributed(_train, world, "nanogpt", {"sequence_parallel_size": world, "attention": "ring", **extra},
                               batches, module_kwargs, timeout=TIMEOUT)

    ref = one(1)[0]
    _check_parity(one(2), ref)
    _check_parity(one(2, compile={"backend": "aot_eager"}), ref, atol=5e-5)


LITGPT_OVERRIDES = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_query_groups": 2, "intermediate_size": 128, "block_size": 256,
                    "vocab_size": 64, "padded_vocab_size": 64, "head_size": 16}


def _train_litgpt(rank: int, world: int, batches: list[dict], model: str, out: str | None) -> Any:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from lightning_seqpar import SequenceParallelStrategy
    from lightning_seqpar.training.litgpt import LitGPTModule, save_litgpt

    module = LitGPTModule(model, config_overrides=None if out is None else LITGPT_OVERRIDES, lr=1e-2, max_steps=len(batches))
    losses = _fit(module, SequenceParallelStrategy(sequence_parallel_size=world, attention="ring"), world, batches,
                  save=None if out is None else out + ".ckpt")
    state = _state(module)
    if rank == 0 and out is not None:
        save_litgpt(state, module.litgpt_config, out)
    repeats = {getattr(m, "kv_repeat", None) for m in module.modules() if type(m).__name__ == "Attention"}
    assert repeats == {2}, repeats  # LitGPT repeats K/V for its 2 query heads per group: the routed call takes one copy
    return losses, state if rank == 0 else None


def test_litgpt_module_trains_exact_and_round_trips_its_checkpoint(tmp_path):
    """LitGPTModule (a LitGPT config by name, Llama-3.2-1B's with its RoPE adjustments, shrunk): 2 ranks train as the
    strategy on one process; the weights written as a LitGPT folder load back into LitGPTModule (lit_model.pth +
    model_config.yaml) and train on from there the same way."""
    pytest.importorskip("litgpt")
    from dist_utils import tmpdir_shared

    batches = _batches()
    shared = tmpdir_shared()
    ref = run_distributed(_train_litgpt, 1, batches, "Llama-3.2-1B", os.path.join(shared, "ref"), timeout=TIMEOUT)[0]
    two = run_distributed(_train_litgpt, 2, batches, "Llama-3.2-1B", os.path.join(shared, "sp2"), timeout=TIMEOUT)
    _check_parity(two, ref)
    assert sorted(os.listdir(os.path.join(shared, "sp2"))) == ["lit_model.pth", "model_config.yaml"]
    again = run_distributed(_train_litgpt, 2, batches, os.path.join(shared, "sp2"), None, timeout=TIMEOUT)
    assert again[0][0][0] < two[0][0][0]  # starts from the trained weights: a lower first loss
    _export_and_generate(os.path.join(shared, "sp2"), tmp_path)


def _export_and_generate(trained: str, tmp_path) -> None:
    """``seqpar export CKPT OUT --format litgpt`` of the run's checkpoint (a folder of shards) writes the trained weights
    as save_litgpt does, and ``litgpt generate OUT`` (LitGPT's own command) continues a prompt with them greedily as
    the exported GPT does here."""
    import json
    import subprocess
    import sys

    from litgpt import Config
    from litgpt.model import GPT
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lightning_seqpar.cli.export import main as export

    tokenizer = tmp_path / "tokenizer"  # a word-level tokenizer over the model's 64 ids: t0 ... t63
    tokenizer.mkdir()
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))
    out = tmp_path / "exported"
    export([trained + ".ckpt", str(out), "--format", "litgpt", "--tokenizer", str(tokenizer)])
    assert sorted(os.listdir(out)) == ["lit_model.pth", "model_config.yaml", "tokenizer.json", "tokenizer_config.json"]
    exported, saved = (torch.load(os.path.join(d, "lit_model.pth"), weights_only=True) for d in (out, trained))
    assert exported.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    (out / "prompt_style.yaml").write_text("class_path: litgpt.prompts.Default\n")  # the prompt as typed
    gpt = GPT(Config.from_file(out / "model_config.yaml")).eval()
    gpt.load_state_dict(exported, strict=False)  # its RoPE caches are buffers it builds itself
    ids = [5, 9, 17, 33]
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(gpt(torch.tensor([ids]))[0, -1].argmax()))
    prompt = " ".join(f"t{i}" for i in ids[:4])
    run = subprocess.run([sys.executable, "-m", "litgpt", "generate", str(out), "--prompt", prompt, "--max_new_tokens", "6",
                          "--top_k", "1", "--precision", "32-true"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(prompt)]
    assert lines == [" ".join(f"t{i}" for i in ids)], run.stdout[-2000:]


def test_ranks_that_built_different_weights_start_from_rank_0s():
    """A model built without a common seed: every rank starts from rank 0's weights (as DDP), so the run equals one
    process that built rank 0's model, and the check passes."""
    batches = _batches()
    ref = reference("nanogpt", batches, seed=0)
    _check_parity(run_distributed(_train, 2, "nanogpt", {"sequence_parallel_size": 2}, batches, {"seed": "rank"},
                                  timeout=TIMEOUT), ref)


def test_a_routed_block_compiles_as_one_graph():
    """The block's router (a TorchFunctionMode entered in its forward) and the routed attention trace into one graph."""
    import torch._dynamo
    from own_models import build

    from lightning_seqpar.routing.sdpa import install_sdpa_routing

    model = build("nanogpt")
    install_sdpa_routing(model, list(model.stack), owner="test", blocks_name="stack")
    explained = torch._dynamo.explain(model.stack[0])(torch.randn(2, 16, 32))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _train_mixed(rank: int, world: int) -> Any:
    """A model of the user's own whose blocks use the package's Attention, plus one SDPA call of its own after them."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L
    import torch.nn.functional as F

    from lightning_seqpar import SequenceParallelStrategy
    from lightning_seqpar.attention import Attention
    from lightning_seqpar.loss import global_mean_loss, token_cross_entropy_sum
    from own_models import VOCAB

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.attention = torch.nn.Linear(16, 48), Attention(causal=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.view(*x.shape[:2], 2, 8) for t in self.qkv(x).chunk(3, -1))  # (B, S, H, D)
            return x + self.attention(q, k, v).flatten(2)

    class Mixed(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.layers, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.ModuleList([Block(), Block()]), torch.nn.Linear(16, VOCAB)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids)
            for block in self.layers:
                x = block(x)
            h = x.unsqueeze(1)  # (B, 1, S, 16): a pooling attention over the sequence, outside the blocks
            return self.head(x + F.scaled_dot_product_attention(h, h, h).squeeze(1))

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return global_mean_loss(*token_cross_entropy_sum(self(batch["input_ids"]), batch["labels"]), self.device_mesh)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=SequenceParallelStrategy(sequence_parallel_size=world),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    try:
        trainer.fit(Mixed(), train_dataloaders=_loader(_batches(steps=2)))
    except ValueError as e:
        return "error", str(e)
    return "trained", trainer.global_step


def test_sdpa_outside_the_package_attention_is_refused_under_the_split():
    """Note [SDPA outside the package's attention]: a model with the package's Attention in its blocks and one SDPA call
    of its own elsewhere is refused on its first step over 2 ranks (that call would attend within each shard); on one
    process it trains."""
    two = run_distributed(_train_mixed, 2, timeout=TIMEOUT)
    assert two[0][0] == "error" and "F.scaled_dot_product_attention was called outside the package's attention modules " \
        "(Attention)" in two[0][1] and "over 2 ranks" in two[0][1], two[0]
    assert run_distributed(_train_mixed, 1, timeout=TIMEOUT)[0] == ("trained", 2)


def test_litgpt_module_says_before_it_is_built_whether_cudnn_is_exact():
    """The planner reads ``cudnn_attention_exact`` before configure_model (Note [Choosing attention automatically]): the
    LitGPTModule's answer from its config is the one its built GPT carries (full rotary: cuDNN; partial: not)."""
    pytest.importorskip("litgpt")
    from lightning_seqpar.models.registry import cudnn_attention_exact
    from lightning_seqpar.training.litgpt import LitGPTModule

    for overrides, exact in ((LITGPT_OVERRIDES, True), ({**LITGPT_OVERRIDES, "rotary_percentage": 0.5}, False)):
        module = LitGPTModule("Llama-3.2-1B", config_overrides=overrides)
        assert cudnn_attention_exact(module) is exact and module.gpt is None
        module.configure_model()
        assert module.gpt.cudnn_attention_exact is exact and cudnn_attention_exact(module) is exact
