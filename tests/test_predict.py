"""``CausalLMModule.predict_step`` and packed documents with and without the strategy (CPU, fp32).

* predict: per-token ``predictions`` (argmax) and ``token_logprobs`` (log p(label)) of the whole
  sequences equal the model on the full sequence on one device, on every rank, for sp = 2 (ring,
  both layouts; Ulysses), 2D (hp 2), dp 2 x sp 2, packed documents (per-document zigzag), the
  chunked head, and without labels.
* packed documents without SequenceParallelStrategy: the loss of a packed batch equals every
  document run alone (positions from 0), as under the strategy.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from dist_utils import run_distributed
from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

SEQ, VOCAB = 32, 256
LENGTHS = ((5, 1, 14, 1, 11), (2, 3, 1, 1, 9, 16))  # each sums to SEQ
TIMEOUT = 300


def _batch(*, documents: bool = False, labels: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    out = {"input_ids": ids}
    if documents:
        doc = torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in LENGTHS])
        out["document_ids"] = doc
    if labels:
        y = torch.full_like(ids, -100)
        y[:, :-1] = ids[:, 1:]
        if documents:  # no label across a document boundary
            y[:, :-1] = torch.where(out["document_ids"][:, 1:] == out["document_ids"][:, :-1], y[:, :-1], -100)
        y[0, 3:7] = -100  # some ignored labels
        out["labels"] = y
    return out


def _module(model: str = "tiny", **kwargs) -> CausalLMModule:
    return CausalLMModule(model, init_seed=0, warmup_steps=0, max_steps=1, **kwargs)


def _reference(batch: dict[str, torch.Tensor], *, documents: bool = False, model: str = "tiny") -> dict[str, torch.Tensor]:
    """The model on the full sequences (each document alone, positions from 0, with documents)."""
    module = _module(model)
    module.configure_model()
    model = module.model
    with torch.no_grad():
        if documents:
            rows = []
            for b, lens in enumerate(LENGTHS):
                start, parts = 0, []
                for n in lens:
                    parts.append(model(batch["input_ids"][b : b + 1, start : start + n], torch.arange(n)[None]))
                    start += n
                rows.append(torch.cat(parts, dim=1))
            logits = torch.cat(rows).float()
        else:
            logits = model(batch["input_ids"], None).float()
    out = {"predictions": logits.argmax(-1)}
    if "labels" in batch:
        y = batch["labels"]
        lp = logits.log_softmax(-1).gather(-1, y.clamp(min=0)[..., None]).squeeze(-1)
        out["token_logprobs"] = torch.where(y != -100, lp, 0.0)
    return out


def _predict(rank: int, world: int, strategy_kwargs: dict | None, batch: dict, module_kwargs: dict) -> list[dict]:
    import lightning as L

    warnings.filterwarnings("ignore")
    if strategy_kwargs is not None:
        os.environ.setdefault("LOCAL_RANK", str(rank))
    strategy = "auto" if strategy_kwargs is None else SequenceParallelStrategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    sp = (strategy_kwargs or {}).get("sequence_parallel_size", world)
    # data parallel: one sample per batch, and Lightning's sampler gives data-parallel rank r sample r
    items = [{k: v[b : b + 1] for k, v in batch.items()} for b in range(2)] if world // sp > 1 else [batch]
    loader = torch.utils.data.DataLoader(items, batch_size=None)
    outputs = trainer.predict(_module(**module_kwargs), dataloaders=loader)
    from lightning_seqpar.sharding.documents import current_documents

    assert current_documents() is None, "the run's packed documents outlived it (Note [Per-call state])"
    return outputs


def _check(outputs: dict, expected: dict) -> None:
    assert outputs.keys() == expected.keys()
    torch.testing.assert_close(outputs["predictions"], expected["predictions"], rtol=0, atol=0)
    if "token_logprobs" in expected:
        torch.testing.assert_close(outputs["token_logprobs"], expected["token_logprobs"], rtol=1e-5, atol=2e-6)


CASES = [
    # (world, strategy kwargs, documents, labels, module kwargs)
    (2, dict(sequence_parallel_size=2, attention="ring"), False, True, {}),
    (2, dict(sequence_parallel_size=2, attention="ring", load_balance=False), False, True, dict(loss_chunk_size=5)),
    (2, dict(sequence_parallel_size=2, attention="ulysses"), False, False, {}),
    (2, dict(sequence_parallel_size=2, head_parallel_size=2, attention="2d"), False, True, {}),
    (2, dict(sequence_parallel_size=2, attention="ring"), True, True, {}),
    (4, dict(sequence_parallel_size=4, head_parallel_size=2, attention="2d"), True, True, dict(loss_chunk_size=7)),
    (4, dict(sequence_parallel_size=2, attention="allgather"), False, True, {}),
    # learned absolute positions (LSS GPT, fused all-gather of the layer input) with packed documents: each document alone
    (2, dict(sequence_parallel_size=2, attention="ring"), True, True, dict(model="gpt-tiny")),
]


@pytest.mark.parametrize("world,strategy_kwargs,documents,labels,module_kwargs", CASES,
                         ids=[f"w{c[0]}-{c[1].get('attention')}-hp{c[1].get('head_parallel_size', 1)}-sp{c[1]['sequence_parallel_size']}"
                              f"{'-docs' if c[2] else ''}{'' if c[3] else '-nolabels'}{'-chunked' if 'loss_chunk_size' in c[4] else ''}"
                              f"{'-' + c[4]['model'] if 'model' in c[4] else ''}" for c in CASES])
def test_predict_under_the_strategy_equals_the_full_sequence(world, strategy_kwargs, documents, labels, module_kwargs):
    batch = _batch(documents=documents, labels=labels)
    expected = _reference(batch, documents=documents, model=module_kwargs.get("model", "tiny"))
    results = run_distributed(_predict, world, strategy_kwargs, batch, module_kwargs, timeout=TIMEOUT)
    sp = strategy_kwargs["sequence_parallel_size"]
    for rank, outputs in enumerate(results):
        assert len(outputs) == 1
        if world // sp > 1:  # data parallel: rank's slice is sample rank // sp
            b = rank // sp
            _check(outputs[0], {k: v[b : b + 1] for k, v in expected.items()})
        else:
            _check(outputs[0], expected)


@pytest.mark.parametrize("documents", [False, True])
def test_predict_without_the_strategy(documents):
    batch = _batch(documents=documents)
    (outputs,) = _predict(0, 1, None, batch, dict(loss_chunk_size=6))
    _check(outputs, _reference(batch, documents=documents))


def test_packed_documents_without_the_strategy_equal_each_document_alone():
    import lightning as L

    warnings.filterwarnings("ignore")
    batch = _batch(documents=True)
    module = _module()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(module, dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    ref = _reference(batch, documents=True)["token_logprobs"]
    expected = -ref.sum() / (batch["labels"] != -100).sum()
    torch.testing.assert_close(torch.tensor(metrics["val/loss"]), expected, rtol=1e-5, atol=1e-6)
    # the same batch through a plain forward (no documents) differs: the check has teeth
    plain = _reference({k: v for k, v in batch.items() if k != "document_ids"})["token_logprobs"]
    assert not torch.allclose(plain, ref, atol=1e-3)


def _fit_warnings(rank: int, world: int, plain_mean: bool) -> list[str]:
    import lightning as L

    from lightning_seqpar.loss import token_cross_entropy_sum

    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))

    class PlainMean(CausalLMModule):
        def training_step(self, batch, batch_idx):
            loss_sum, n = token_cross_entropy_sum(self.model(batch["input_ids"], batch.get("position_ids")), batch["labels"])
            return loss_sum / n  # a per-rank mean: the strategy says that it averages it over the ranks

    module = (PlainMean if plain_mean else CausalLMModule)("tiny", init_seed=0, warmup_steps=0, max_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=SequenceParallelStrategy(sequence_parallel_size=world),
                        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([_batch(), _batch(seed=1)], batch_size=None))
    return [str(w.message) for w in caught if "global_mean_loss" in str(w.message)]


@pytest.mark.parametrize("plain_mean", [True, False])
def test_a_loss_not_from_global_mean_loss_is_warned_about(plain_mean):
    rank0, rank1 = run_distributed(_fit_warnings, 2, plain_mean, timeout=TIMEOUT)
    if plain_mean:  # the batch's ignored labels fall unevenly on the two shards: each rank warns once with its counts
        for warned in (rank0, rank1):
            assert len(warned) == 1 and "averages it over the 2 data- and sequence-parallel ranks, as DDP does" in warned[0]
            assert "weighs tokens unevenly" in warned[0]
    else:
        assert rank0 == rank1 == []


@pytest.mark.parametrize("under_strategy", [False, True])
def test_packed_documents_with_linear_attention_are_refused(under_strategy):
    import lightning as L

    warnings.filterwarnings("ignore")
    batch = _batch(documents=True)
    strategy = SequenceParallelStrategy() if under_strategy else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = CausalLMModule("tnl-tiny", init_seed=0, warmup_steps=0, max_steps=1)
    with pytest.raises(ValueError, match=r"the batch holds packed documents .*linear attention.* does not mask"):
        trainer.validate(module, dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
