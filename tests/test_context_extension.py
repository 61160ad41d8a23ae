"""Context extension (issue 40): config overrides and rope_extension, long documents, LossByPosition and
PasskeyAccuracy, the LongContextEval callback, the recipe.

One process: the overrides (merged, checked, refused by key before any process group), rope_extension for
every extensible type (the frequencies equal those of a config transformers builds itself), document
selection, the metrics under simulated sharding (zigzag, per-document zigzag) against one device, the
passkey prompts. Under the strategy (CPU, gloo, fp32; ONE pool call per world size): models built from
overridden configs (every rope type, every algorithm, sp 2 and 4) against the same overridden model on
one process (logits, logged loss, every gradient); LongContextEval's numbers at sp 2, 4 and 2 x dp 2
against one device; the tiny recipe trained and evaluated at sp 2.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import SEQ_LEN, batch, reference, save_tiny_model, tiny_config, train_under_strategy  # noqa: E402
from seqpar_testing import expected_index, take  # noqa: E402

from lightning_seqpar import CausalLMModule  # noqa: E402
from lightning_seqpar.data import HFTextDataModule, passkey_prompts, select_documents  # noqa: E402
from lightning_seqpar.data.passkey import FILLER, INTRO, NEEDLE, QUESTION  # noqa: E402
from lightning_seqpar.hf import apply_config_overrides, rope_extension  # noqa: E402
from lightning_seqpar.sharding.documents import PackedDocuments  # noqa: E402
from lightning_seqpar.training.metrics import LossByPosition, PasskeyAccuracy  # noqa: E402

ORIGINAL, TARGET = 16, 64  # the tiny models' "pretrained" length (SEQ_LEN = 32 is beyond it) and the extended one
ATOL = 1e-5
TIMEOUT = 300
LONGROPE = {"long_factor": [2.0, 2.5, 3.0, 3.5]}  # head_dim 8: 4 rotary frequencies
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        "max_position_embeddings": TARGET}
WORDS = "the cat sat on a mat while dog ran far away from home and then came back to sleep".split()


def _base(**overrides):
    return tiny_config("llama", max_position_embeddings=ORIGINAL, **overrides)


def _extension(rope_type: str) -> dict:
    return rope_extension(_base(), TARGET, rope_type=rope_type, **(LONGROPE if rope_type == "longrope" else {}))


# --------------------------------------------------------------------------------------------- config overrides


def test_rope_extension_gives_transformers_own_frequencies():
    """For each type: the factor from the original length, and a model built from base + overrides rotates
    exactly as a config transformers builds with the same rope_parameters."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected = {"linear": {"factor": 4.0}, "dynamic": {"factor": 4.0},
                "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL},
                "llama3": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                "longrope": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL, "short_factor": [1.0] * 4, **LONGROPE}}
    for rope_type, fields in expected.items():
        overrides = _extension(rope_type)
        assert overrides["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": rope_type, **fields}, rope_type
        assert overrides["max_position_embeddings"] == (ORIGINAL if rope_type == "dynamic" else TARGET), rope_type
        config = apply_config_overrides(_base(), overrides)
        native = tiny_config("llama", max_position_embeddings=overrides["max_position_embeddings"],
                             rope_parameters=copy.deepcopy(overrides["rope_parameters"]))
        got, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=SEQ_LEN)
        want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](native, "cpu", seq_len=SEQ_LEN)
        assert torch.equal(got, want) and scale == want_scale, rope_type
        plain = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # default RoPE, head_dim 8
        assert got.shape == plain.shape and not torch.allclose(got, plain), rope_type  # the extension changes the frequencies
    assert _base().rope_parameters["rope_type"] == "default"  # the base config is never changed


@pytest.mark.parametrize("config, kwargs, match", [
    (lambda: _base(), {"rope_type": "longrope"}, r"rope_type='longrope' needs long_factor"),
    (lambda: _base(), {"rope_type": "default"}, r"rope_type='default' cannot extend"),
    (lambda: _base(), {"target_length": ORIGINAL}, r"target_length=16 is not longer than the model's original length 16"),
    (lambda: transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4), {}, r"GPT2Config.*has no rope_parameters"),
    (lambda: tiny_config("gemma3"), {}, r"rope_parameters per layer type"),
    (lambda: tiny_config("phi3-longrope"), {"rope_type": "yarn"}, r"rope_extension\(rope_type='yarn'\)\['rope_parameters'\].*type field"),
])
def test_rope_extension_refuses_what_it_cannot_extend(config, kwargs, match):
    kwargs = {"target_length": TARGET, **kwargs}
    with pytest.raises(ValueError, match=match):
        rope_extension(config(), kwargs.pop("target_length"), **kwargs)


@pytest.mark.parametrize("overrides, match", [
    ({"max_position_embedding": 64}, r"config_overrides\['max_position_embedding'\]: LlamaConfig .* no field.*'max_position_embeddings'"),
    ({"max_position_embeddings": "long"}, r"config_overrides\['max_position_embeddings'\]='long' is refused.*expected int"),
    ({"rope_scaling": {"type": "yarn"}}, r"config_overrides\['rope_scaling'\]: .*'rope_parameters'"),
    ({"model_type": "mistral"}, r"config_overrides\['model_type'\]: the model type cannot change"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5}}, r"config_overrides\['rope_parameters'\]: .*factor field must be"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "betta_fast": 8}}, r"config_overrides\['rope_parameters'\]: .*'betta_fast'"),
    ({"rope_parameters": {"rope_type": "ntk", "factor": 4.0}}, r"config_overrides\['rope_parameters'\]: .*'ntk'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0}}, r"config_overrides\['rope_parameters'\]: .*low_freq_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [2.0]}},
     r"config_overrides\['rope_parameters'\]: .*short_factor field must have length 4"),
    ({"num_attention_heads": 5}, r"config_overrides \['num_attention_heads'\]: LlamaConfig refuses.*not a multiple"),
    ([("max_position_embeddings", 64)], r"config_overrides must be a dict"),
])
def test_bad_overrides_are_refused_by_key_before_any_process_group(overrides, match):
    import torch.distributed as dist
    from seqpar_testing import no_collectives

    before = dist.is_initialized()  # an earlier test of this worker process may have left a default group
    with no_collectives(), pytest.raises(ValueError, match=match):  # refused in __init__: no group made, no collective
        CausalLMModule(_base(), config_overrides=overrides)
    assert dist.is_initialized() == before


def test_overrides_are_merged_built_and_kept(tmp_path):
    """A folder: its weights in the model of the overridden config; the hyper-parameters keep the source and the
    overrides apart; a changed rope_type keeps rope_theta and drops the old type's fields; a model already built,
    or the package's own model, refuses them."""
    folder = save_tiny_model("llama", str(tmp_path / "llama"), max_position_embeddings=ORIGINAL,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 2.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    module = CausalLMModule(folder, config_overrides=YARN)
    assert module.hparams["model"] == folder and module.hparams["config_overrides"] == YARN
    module.configure_model()
    config = module.model.hf.config
    assert config.rope_parameters == {"rope_theta": 500.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    assert config.max_position_embeddings == TARGET
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in module.model.hf.state_dict().items() if k in saved)
    rotary = module.model.hf.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling == pytest.approx(0.1 * np.log(4.0) + 1.0)
    as_dict = CausalLMModule({"model_type": "llama", **_base().to_dict()}, config_overrides=YARN)
    assert as_dict.hparams["model"]["rope_parameters"]["rope_type"] == "default"  # the source, before the overrides
    assert as_dict.config.rope_parameters["rope_type"] == "yarn"
    built = transformers.AutoModelForCausalLM.from_config(_base())
    with pytest.raises(ValueError, match=r"config_overrides cannot change a model that is already built \(LlamaForCausalLM\)"):
        CausalLMModule(built, config_overrides=YARN)
    with pytest.raises(ValueError, match=r"config_overrides is for Hugging Face models"):
        CausalLMModule("tiny", config_overrides=YARN)
    CausalLMModule(built, config_overrides={})  # nothing to apply


# --------------------------------------------------------------------------------------------- long documents


def test_select_documents_mixes_by_tokens_deterministically():
    lengths = np.array([50, 3, 40, 2, 60, 5, 4, 30, 6, 1, 45, 2])  # long (>= 30): 50, 40, 60, 30, 45 = 225 tokens
    only, counts = select_documents(lengths, min_doc_tokens=30)
    assert only.tolist() == [0, 2, 4, 7, 10] and counts["long_token_ratio"] == 1.0 and counts["short_tokens"] == 23
    # 0.95: every long document, short ones until 225 * 0.05 / 0.95 = 11.8 tokens
    mixed, counts = select_documents(lengths, min_doc_tokens=30, long_doc_ratio=0.95, seed=3)
    short = [i for i in mixed if lengths[i] < 30]
    assert counts["kept_long_documents"] == 5 and 11.8 <= lengths[short].sum() < 11.8 + lengths[short].max()
    assert sorted(mixed.tolist()) == sorted(set(mixed.tolist()))  # no document twice
    assert np.array_equal(mixed, select_documents(lengths, min_doc_tokens=30, long_doc_ratio=0.95, seed=3)[0])
    assert not np.array_equal(mixed, select_documents(lengths, min_doc_tokens=30, long_doc_ratio=0.95, seed=4)[0])
    assert mixed.tolist() != sorted(mixed.tolist())  # long and short shuffled together
    # 0.5: the 23 short tokens run out first: every short document, long ones until 23 tokens
    mixed, counts = select_documents(lengths, min_doc_tokens=30, long_doc_ratio=0.5)
    assert counts["kept_short_documents"] == 7 and counts["kept_long_documents"] == 1  # one long document reaches 23
    assert counts["long_token_ratio"] == pytest.approx(counts["kept_long_tokens"] / (counts["kept_long_tokens"] + 23))


def _passkey_tokenizer(path) -> str:
    """A word-level tokenizer that splits numbers into digits (the passkey prompts' words, the corpus' words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    texts = [INTRO, FILLER, NEEDLE, QUESTION, " ".join(WORDS), "0 1 2 3 4 5 6 7 8 9"]
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="[BOS]",
                            eos_token="[EOS]").save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer with digits, and documents of 1 to 60 words (train and validation files)."""
    root = tmp_path_factory.mktemp("context")
    tokenizer = _passkey_tokenizer(root / "tokenizer")
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("val", 16)):
        docs = [" ".join(rng.choice(WORDS, size=k)) for k in rng.integers(1, 60, size=n)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return root, tokenizer


def test_long_documents_are_selected_counted_and_logged(corpus, caplog):
    root, tokenizer = corpus
    kwargs = dict(train_files=str(root / "train.jsonl"), val_files=str(root / "val.jsonl"), tokenizer_path=tokenizer, seq_len=16,
                  batch_size=2, cache_dir=str(root / "cache"))
    with caplog.at_level(logging.INFO):
        dm = HFTextDataModule(**kwargs, min_doc_tokens=24, long_doc_ratio=0.7)
        dm.setup("fit")
    train, val = dm.document_counts["train"], dm.document_counts["val"]
    assert train["kept_short_documents"] > 0 and 0.7 <= train["long_token_ratio"] < 0.8
    assert val["kept_short_documents"] == 0 and val["long_token_ratio"] == 1.0  # validation: long documents only
    assert "HFTextDataModule (train): documents of >= 24 tokens" in caplog.text and "long_doc_ratio=0.7" in caplog.text
    lengths = np.asarray(dm.tokenized(str(root / "train.jsonl"))["length"])
    assert dm.train_dataset.num_tokens == train["kept_long_tokens"] + train["kept_short_tokens"]
    assert train["long_tokens"] == lengths[lengths >= 24].sum()
    again = HFTextDataModule(**kwargs, min_doc_tokens=24, long_doc_ratio=0.7)
    again.setup("fit")
    assert torch.equal(again.train_dataset[1]["input_ids"], dm.train_dataset[1]["input_ids"])  # the same on every rank
    with pytest.raises(ValueError, match=r"long_doc_ratio=0.5 needs min_doc_tokens"):
        HFTextDataModule(**kwargs, long_doc_ratio=0.5)
    with pytest.raises(ValueError, match=r"long_doc_ratio must be a fraction in \(0, 1\]"):
        HFTextDataModule(**kwargs, min_doc_tokens=8, long_doc_ratio=0.0)
    with pytest.raises(ValueError, match=r"min_doc_tokens must be a positive integer"):
        HFTextDataModule(**kwargs, min_doc_tokens=0)
    with pytest.raises(ValueError, match=r"no document has min_doc_tokens=10000 tokens or more"):
        HFTextDataModule(**kwargs, min_doc_tokens=10_000).setup("fit")


# --------------------------------------------------------------------------------------------- the metrics


def _sharded(world: int, lengths=None):
    """``[(rank's piece of a (B, S) tensor, as a function)]``: the zigzag layout, or the per-document zigzag."""
    if lengths is None:
        return [lambda x, r=r: take(x, expected_index(SEQ_LEN, "zigzag", world, r)) for r in range(world)]
    docs = PackedDocuments.from_lengths(lengths, world=world)
    return [lambda x, r=r: docs.shard(x, r) for r in range(world)]


def _summed(metric_type, kwargs, pieces):
    """The metric whose state is the sum of one metric per rank (what torchmetrics' reduction computes)."""
    total = metric_type(**kwargs)
    for args in pieces:
        part = metric_type(**kwargs)
        part.update(*args)
        total.merge_state(part)  # sum states: dist_reduce_fx="sum"
    return total


@pytest.mark.filterwarnings("ignore:The ``compute`` method")  # _summed's total is merged into, not updated
def test_loss_by_position_is_the_one_device_value_under_sharding():
    """Positions come from the sharded position_ids; packed documents are bucketed by the position inside the document."""
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(2, SEQ_LEN, generator=g, dtype=torch.float32) * 5
    labels = torch.randint(0, 97, (2, SEQ_LEN), generator=g)
    labels[0, :3] = labels[1, -5:] = -100
    positions = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
    kwargs = {"max_length": SEQ_LEN, "num_buckets": 8}
    one = LossByPosition(**kwargs)
    one.update(losses, positions, labels)
    want = torch.stack([losses[:, 4 * b : 4 * b + 4][labels[:, 4 * b : 4 * b + 4] != -100].double().mean() for b in range(8)]).float()
    torch.testing.assert_close(one.compute(), want, rtol=1e-6, atol=0)
    for world in (2, 4):
        shards = _sharded(world)
        got = _summed(LossByPosition, kwargs, [(s(losses), s(positions), s(labels)) for s in shards]).compute()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # packed documents: the strategy's position_ids restart at every document
    lengths = [[10, 22], [32]]
    docs = PackedDocuments.from_lengths(lengths, world=1)
    in_doc = docs.position_ids(torch.device("cpu")).expand(2, SEQ_LEN)
    assert in_doc[0, 10] == 0 and in_doc[0, 31] == 21
    packed = LossByPosition(**kwargs)
    packed.update(losses, in_doc, labels)
    by_doc = torch.zeros(8, dtype=torch.float64)
    count = torch.zeros(8)
    for b, t in np.ndindex(2, SEQ_LEN):  # by hand
        if labels[b, t] != -100:
            by_doc[int(in_doc[b, t]) // 4] += float(losses[b, t])
            count[int(in_doc[b, t]) // 4] += 1
    torch.testing.assert_close(packed.compute(), (by_doc / count).float(), rtol=1e-6, atol=0, equal_nan=True)
    assert packed.compute()[7].isnan() and count[7] == 0  # no valid token at document positions 28-31: NaN
    assert not torch.allclose(packed.compute()[:7], want[:7])
    for world in (2, 4):
        shards = _sharded(world, lengths)
        got = _summed(LossByPosition, kwargs, [(s(losses), s(in_doc), s(labels)) for s in shards]).compute()
        torch.testing.assert_close(got, packed.compute(), rtol=1e-6, atol=0, equal_nan=True)
    assert torch.equal(LossByPosition(max_length=10, num_buckets=3).bucket_starts(), torch.tensor([0, 4, 7]))
    with pytest.raises(ValueError, match=r"position 40 .*outside max_length=32"):
        one.update(losses, positions + 9, labels)


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_passkey_accuracy_counts_every_prompt_across_shards():
    """A prompt is retrieved when all its answer tokens, wherever they sit, are predicted."""
    metric_kwargs = {"depths": [0.0, 1.0], "lengths": [SEQ_LEN], "samples": 2}
    labels = torch.full((4, SEQ_LEN), -100)
    labels[:, 26:31] = torch.arange(5) + 10  # the answer's positions (span the zigzag's last chunks)
    predictions = labels.clamp(min=0).clone()
    predictions[1, 27] = 3  # prompt 1 misses one token of five
    predictions[3, 26:31] = 0  # prompt 3 misses all
    prompt_ids = torch.tensor([0, 1, 2, 3])  # depth 0: samples 0, 1; depth 1: samples 0, 1
    want = {"accuracy": torch.tensor([[0.5], [0.5]]), "token_accuracy": torch.tensor([[0.9], [0.5]])}
    for world in (1, 2, 4):
        shards = _sharded(world)
        result = _summed(PasskeyAccuracy, metric_kwargs, [(s(predictions), s(labels), prompt_ids) for s in shards]).compute()
        for key, value in want.items():
            torch.testing.assert_close(result[key], value, msg=f"{key}, {world} ranks")
        assert result["misses"].flatten().tolist() == [0, 1, 0, 5] and (result["answer_tokens"] == 5).all()
    logits = torch.nn.functional.one_hot(predictions, 97).float()  # logits are reduced to their argmax
    one = PasskeyAccuracy(**metric_kwargs)
    one.update(logits, labels, prompt_ids)
    torch.testing.assert_close(one.compute()["accuracy"], want["accuracy"])
    empty = PasskeyAccuracy(**metric_kwargs).compute()["accuracy"]
    assert empty.isnan().all()  # no prompt evaluated
    with pytest.raises(ValueError, match=r"prompt_ids must be in \[0, 4\)"):
        one.update(predictions, labels, torch.tensor([0, 1, 2, 4]))
    with pytest.raises(ValueError, match=r"depths must be fractions in \[0, 1\]"):
        PasskeyAccuracy(depths=[1.5], lengths=[8])


def test_passkey_prompts(corpus):
    root, tokenizer_path = corpus
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    prompts = passkey_prompts(tokenizer, lengths=[96, 128], depths=[0.0, 1.0], samples=2, seed=1)
    assert [int(p["prompt_id"]) for p in prompts] == list(range(8))
    keys = []
    for p in prompts:
        n = len(p["input_ids"])
        assert n == [96, 128][(int(p["prompt_id"]) // 2) % 2] and torch.equal(p["position_ids"], torch.arange(n))
        answer = p["labels"][p["labels"] != -100]
        assert torch.equal(answer, p["input_ids"][-len(answer):]) and (p["labels"][-len(answer) - 1 : -1] == answer).all()
        key = tokenizer.decode(answer).replace(" ", "")
        assert len(key) == 5 and key.isdigit()
        text = tokenizer.decode(p["input_ids"])
        assert text.startswith("There is an important info")
        assert text.endswith("What is the pass key ? The pass key is " + tokenizer.decode(answer))
        keys.append(key)
    assert len(set(keys)) > 4  # random passkeys
    depth0 = tokenizer.decode(prompts[0]["input_ids"])
    depth1 = tokenizer.decode(prompts[4]["input_ids"])
    assert depth0.index("pass key is") < depth0.index("grass") and depth1.index("pass key is") > depth1.rindex("grass")
    again = passkey_prompts(tokenizer, lengths=[96, 128], depths=[0.0, 1.0], samples=2, seed=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(prompts, again))
    with pytest.raises(ValueError, match=r"lengths holds 40 tokens, fewer than the prompt's fixed parts"):
        passkey_prompts(tokenizer, lengths=[40], depths=[0.5])
    with pytest.raises(ValueError, match=r"cannot spell the passkey"):
        passkey_prompts(_Words(tokenizer), lengths=[96], depths=[0.5])
    short = passkey_prompts(tokenizer, lengths=[40], depths=[0.5], digits=3, intro="")  # the tiny recipe's prompts
    assert len(short[0]["input_ids"]) == 40 and (short[0]["labels"] != -100).sum() == 3


class _Words:
    """A tokenizer that knows no digit (every number is its unknown token)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.unk_token_id = tokenizer, tokenizer.unk_token_id

    def __call__(self, text, add_special_tokens=False):
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        digits = set(self.tokenizer.convert_tokens_to_ids(list("0123456789")))
        return {"input_ids": [self.unk_token_id if i in digits else i for i in ids]}


# --------------------------------------------------------------------------------------------- under the strategy

EXACT = {  # world -> (rope type, attention, layout): every type and every algorithm at each world size
    2: [("yarn", "ring", "zigzag"), ("dynamic", "ring", "contiguous"), ("linear", "allgather", "zigzag"),
        ("longrope", "allgather", "zigzag"), ("llama3", "ulysses", "contiguous"), ("yarn", "ulysses", "zigzag")],
    4: [("llama3", "ring", "zigzag"), ("longrope", "ring", "contiguous"), ("yarn", "allgather", "contiguous"),
        ("dynamic", "allgather", "zigzag"), ("linear", "ulysses", "zigzag")],
}
EVAL = dict(lengths=[40, 64], depths=[0.0, 0.5, 1.0], samples=2, batch_size=2, num_buckets=8, digits=3, intro=False, plots=False)


def _context_cases(rank: int, world_size: int, folder: str, exact: list, data: dict, validate: list, recipe: dict | None) -> dict | None:
    """Every case of one world size in one pool call: the exactness fits, LongContextEval under the strategy
    (``validate``: strategy kwargs of each run), and (``recipe``) the tiny recipe's fit."""
    warnings.filterwarnings("ignore")
    out: dict = {"exact": [train_under_strategy(rank, world_size, folder, data, config_overrides=_extension(rope_type),
                                                strategy_kwargs={"attention": attention, "load_balance": layout})
                           for rope_type, attention, layout in exact]}
    out["validate"] = [_validate(rank, world_size, folder, strategy_kwargs=kwargs, **validate_kwargs)
                       for kwargs, validate_kwargs in validate]
    if recipe is not None:
        out["recipe"] = _fit_recipe(rank, world_size, **recipe)
    return out if rank == 0 else None


def _validate(rank: int, world_size: int, folder: str, *, strategy_kwargs: dict | None, data: dict, output_dir: str) -> dict:
    """``trainer.validate`` of the YaRN-extended model with LongContextEval (one device when ``strategy_kwargs`` is None)."""
    import lightning as L

    from lightning_seqpar import SequenceParallelStrategy
    from lightning_seqpar.training.callbacks import LongContextEval

    callback = LongContextEval(tokenizer_path=data["tokenizer_path"], output_dir=output_dir, **EVAL)
    strategy = "auto" if strategy_kwargs is None else SequenceParallelStrategy(**{"sequence_parallel_size": world_size, **strategy_kwargs})
    trainer = L.Trainer(accelerator="cpu", devices=1 if strategy_kwargs is None else world_size, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.validate(CausalLMModule(folder, config_overrides=YARN), datamodule=HFTextDataModule(**data), verbose=False)
    return callback.results[-1]


def _fit_recipe(rank: int, world_size: int, *, model: dict, data: dict, callback: dict, strategy: dict, root: str) -> dict | None:
    """recipes/extend_context_tiny.yaml's module, data, callback and strategy: two steps, a validation."""
    import lightning as L

    from lightning_seqpar import SequenceParallelStrategy
    from lightning_seqpar.training.callbacks import LongContextEval

    eval_callback = LongContextEval(**callback)
    module = CausalLMModule(**model)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=SequenceParallelStrategy(**strategy), max_steps=2,
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[eval_callback],
                        logger=L.pytorch.loggers.CSVLogger(root, name="recipe"))
    trainer.fit(module, datamodule=HFTextDataModule(**data))
    result = eval_callback.results[-1]
    return {**result, "rope": dict(module.model.hf.config.rope_parameters), "loss": float(trainer.callback_metrics["train/loss"]),
            "files": {f: os.path.getsize(f) for f in result.get("files", [])}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus):
    """The folder of the tiny Llama (pretrained length 16), its references under each extension, the data of the
    evaluation and its one-device result."""
    root, tokenizer = corpus
    folder = save_tiny_model("llama", str(tmp_path_factory.mktemp("extension") / "llama"), max_position_embeddings=ORIGINAL)
    data = batch()
    references = {t: reference(folder, data, config=apply_config_overrides(_base(), _extension(t)))
                  for t in ("linear", "dynamic", "yarn", "llama3", "longrope")}
    eval_data = dict(train_files=str(root / "train.jsonl"), val_files=str(root / "val.jsonl"), tokenizer_path=tokenizer,
                     seq_len=SEQ_LEN, batch_size=2, min_doc_tokens=12, val_samples=4, cache_dir=str(root / "cache"))
    one_device = _validate(0, 1, folder, strategy_kwargs=None, data=eval_data, output_dir=str(root / "one"))
    return folder, data, references, eval_data, one_device, root


def _recipe(root, tokenizer) -> dict:
    """recipes/extend_context_tiny.yaml, parsed by the seqpar CLI, with this test's files."""
    from test_recipes import RECIPES, parse

    config = parse(["fit", "--config", str(RECIPES[0].parent / "extend_context_tiny.yaml")]).fit.as_dict()
    spec = config["model"].pop("model")
    callback = config["trainer"]["callbacks"][0]["init_args"]
    assert config["trainer"]["callbacks"][0]["class_path"] == "lightning_seqpar.training.callbacks.LongContextEval"
    data = {**config["data"]["init_args"], "train_files": str(root / "train.jsonl"), "val_files": str(root / "val.jsonl"),
            "tokenizer_path": tokenizer, "cache_dir": str(root / "cache")}
    return {"model": {**config["model"], "model": {"model_type": spec["model_type"], **spec["config"]}}, "data": data,
            "callback": {**callback, "tokenizer_path": tokenizer}, "strategy": config["trainer"]["strategy"]["init_args"],
            "root": str(root / "logs")}


def _assert_same_evaluation(got: dict, want: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got["loss_by_position"]["loss"]), torch.tensor(want["loss_by_position"]["loss"]),
                               rtol=1e-5, atol=2e-6, msg=lambda m: f"{what} loss by position: {m}")
    for key in ("accuracy", "token_accuracy", "misses", "answer_tokens"):
        assert got["passkey"][key] == want["passkey"][key], (what, key)


@pytest.mark.parametrize("world", [2, 4])
def test_extension_under_the_strategy(world, setup, corpus):
    """sp 2 and 4: the overridden configs (every rope type, every algorithm) against the same overridden model on one
    process; LongContextEval's numbers at sp = world (and sp 2 x dp 2) against one device; at 2, the tiny recipe."""
    folder, data, references, eval_data, one_device, root = setup
    validate = [({"attention": "ring"}, {"data": eval_data, "output_dir": str(root / f"sp{world}")})]
    if world == 4:
        validate.append(({"attention": "ulysses", "sequence_parallel_size": 2}, {"data": eval_data, "output_dir": str(root / "dp2")}))
    recipe = _recipe(root, corpus[1]) if world == 2 else None
    out = run_distributed(_context_cases, world, folder, EXACT[world], data, validate, recipe, timeout=TIMEOUT)[0]
    for (rope_type, attention, layout), result in zip(EXACT[world], out["exact"]):
        what = f"{rope_type} {attention} {layout} sp={world}"
        logits, loss, grads = references[rope_type]
        torch.testing.assert_close(result["logits"], logits, rtol=0, atol=ATOL, msg=lambda m: f"{what} logits: {m}")
        assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6), what
        assert result["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")
    # one device: every prompt was evaluated, every bucket has tokens; the same numbers under the strategy
    assert all(n > 0 for row in one_device["passkey"]["answer_tokens"] for cell in row for n in cell)
    assert all(loss is not None for loss in one_device["loss_by_position"]["loss"])
    for (kwargs, _), result in zip(validate, out["validate"]):
        _assert_same_evaluation(result, one_device, f"sp={kwargs.get('sequence_parallel_size', world)} {kwargs['attention']}")
        assert sorted(os.listdir(os.path.dirname(result["files"][0]))) == ["long_context_step0.json"]
    if recipe is not None:
        result = out["recipe"]
        assert result["rope"] == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
        assert np.isfinite(result["loss"]) and result["step"] == 2
        assert sorted(os.path.basename(f) for f in result["files"]) == [
            "long_context_step2.json", "loss_by_position_step2.png", "passkey_step2.png"]
        assert all(size > 1000 for f, size in result["files"].items() if f.endswith(".png"))
        assert result["loss_by_position"]["loss"][0] is not None  # (far buckets may be empty: one batch of 2 windows)
        assert len(result["passkey"]["accuracy"]) == 3 and all(n == 3 for row in result["passkey"]["answer_tokens"]
                                                              for cell in row for n in cell)


def test_lora_export_rebuilds_the_overridden_model(tmp_path):
    """export_lora rebuilds the base from the checkpoint's hyper-parameters, config_overrides included."""
    pytest.importorskip("peft")
    from lightning_seqpar.hf.export import export_lora

    folder = save_tiny_model("llama", str(tmp_path / "llama"), max_position_embeddings=ORIGINAL)
    module = CausalLMModule(folder, config_overrides=YARN, lora={"r": 2, "target_modules": ["q_proj"]})
    module.configure_model()
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict()}, checkpoint)
    export_lora(checkpoint, tmp_path / "adapter", merged=tmp_path / "merged")
    merged = transformers.AutoConfig.from_pretrained(tmp_path / "merged")
    assert merged.rope_parameters["rope_type"] == "yarn" and merged.max_position_embeddings == TARGET


def test_validation_returns_the_token_losses_chunked_or_not():
    """validation_step's ``token_losses`` (what LossByPosition reads): the same with loss_chunk_size, and they sum to
    the loss the module trains with."""
    data = batch()
    full = CausalLMModule(_base(), config_overrides=YARN)
    chunked = CausalLMModule(_base(), config_overrides=YARN, loss_chunk_size=7)
    with torch.no_grad():
        losses = full.validation_step(data, 0)["token_losses"]
        torch.testing.assert_close(chunked.validation_step(data, 0)["token_losses"], losses, rtol=1e-6, atol=1e-6)
        loss_sum, n_valid = full.loss_sum(data)
    assert losses.shape == (2, SEQ_LEN) and losses[0, 5] == 0 and (losses[data["labels"] != -100] > 0).all()
    torch.testing.assert_close(losses.sum(), loss_sum, rtol=1e-6, atol=0)
    assert int(n_valid) == int((data["labels"] != -100).sum())
    torch.testing.assert_close(full.val_loss.compute(), loss_sum / n_valid, rtol=1e-6, atol=0)


def test_a_config_dict_builds_the_shape_it_names_or_is_refused_by_key():
    """A dict model: the recipe's nested form {model_type, config: {...}} builds that shape (it was silently the class's
    default: transformers keeps an unknown keyword such as 'config' as an attribute), and a field the class does not
    know is refused by name, with the close names (it built the default size)."""
    from lightning_seqpar.hf.config import load_hf_config

    nested = load_hf_config({"model_type": "qwen3", "config": {"hidden_size": 64, "num_hidden_layers": 2}})
    flat = load_hf_config({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2})
    assert (nested.hidden_size, nested.num_hidden_layers) == (flat.hidden_size, flat.num_hidden_layers) == (64, 2)
    with pytest.raises(ValueError, match=r"model\['hiden_size'\].*did you mean 'hidden_size'"):
        load_hf_config({"model_type": "llama", "hiden_size": 64})
    with pytest.raises(ValueError, match="either inside 'config' or beside 'model_type'"):
        load_hf_config({"model_type": "llama", "config": {"hidden_size": 64}, "vocab_size": 32})
    with pytest.raises(ValueError, match=r"model\['hiden_size'\]"):
        CausalLMModule(model={"model_type": "llama", "config": {"hiden_size": 64}})
    # what transformers converts or keeps from an older config.json passes
    assert load_hf_config({"model_type": "llama", "rope_theta": 5e5}).rope_parameters["rope_theta"] == 5e5
    assert load_hf_config({"model_type": "llama", "is_decoder": True, "tokenizer_class": None}).model_type == "llama"


def test_a_one_cell_evaluation_keeps_its_shapes(setup):
    """One depth, one length, one bucket: torchmetrics squeezes one-element results to scalars; the callback's
    results keep the (depths x lengths) grid and the list of buckets."""
    import lightning as L

    from lightning_seqpar.training.callbacks import LongContextEval

    folder, _, _, eval_data, _, root = setup
    callback = LongContextEval(tokenizer_path=eval_data["tokenizer_path"], lengths=[EVAL["lengths"][-1]], depths=[0.5], samples=1,
                               num_buckets=1, max_length=64, digits=3, intro=False, plots=False,
                               output_dir=str(root / "one-cell"))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.validate(CausalLMModule(folder, config_overrides=YARN), datamodule=HFTextDataModule(**eval_data), verbose=False)
    result = callback.results[-1]
    assert len(result["passkey"]["accuracy"]) == 1 and len(result["passkey"]["accuracy"][0]) == 1
    assert result["passkey"]["answer_tokens"][0][0][0] > 0  # the prompt was evaluated
    assert len(result["loss_by_position"]["loss"]) == 1 and result["loss_by_position"]["bucket_starts"] == [0]
