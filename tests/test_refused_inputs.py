"""Inputs that used to train a broken model with exit code 0, refused by name (issue: non-finite options, mismatched
data, stale export files, per-rank batches that disagree); and schedules and evaluation that say what they do.

Each test failed on the code before these checks. The options of every config type are fuzzed in
tests/test_fuzz_options.py; these are the paths an option check does not reach: RoPE parameters at the lengths they
run, token files against their dtype and the model's vocabulary, export folders, batches across ranks.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_distributed

TIMEOUT = 180


# --------------------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("kwargs, match", [
    ({"weight_decay": math.nan}, "weight_decay must be finite"),
    ({"lr": math.inf}, "lr must be finite"),
    ({"betas": (0.9, math.nan)}, "betas must be finite"),
    ({"bits_per_character": "no"}, "bits_per_character must be True or False"),
])
def test_non_finite_options_and_strings_for_bools_are_refused(kwargs, match):
    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.models import LlamaConfig

    with pytest.raises(ValueError, match=f"CausalLMModule: {match}"):
        CausalLMModule("tiny", **kwargs)
    with pytest.raises(ValueError, match="LlamaConfig: tie_embeddings must be True or False, got 'no'"):
        LlamaConfig.from_name("tiny", tie_embeddings="no")


def test_a_recipe_given_a_nan_option_ends_before_training(tmp_path, monkeypatch):
    """``seqpar fit --config recipes/quickstart.yaml --model.weight_decay .nan`` trained NaN parameters with exit code 0."""
    import sys

    from lightning_seqpar.cli.seqpar import main

    recipe = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["seqpar"])
    with pytest.raises(ValueError, match="CausalLMModule: weight_decay must be finite, got nan"):
        main(["fit", "--config", str(recipe), "--model.weight_decay", ".nan", "--trainer.devices=1",
              "--trainer.strategy.init_args.sequence_parallel_size=1", "--trainer.max_steps=1"])


@pytest.mark.parametrize("fields, match", [
    ({"rope_type": "longrope", "long_factor": [2.0, 0.0, 3.0, 3.5]}, r"every entry of rope_parameters\['long_factor'\] must be a finite number > 0.*\[1\]"),
    ({"rope_type": "longrope", "long_factor": [2.0, -2.5, 3.0, 3.5]}, r"rope_parameters\['long_factor'\].*entries \[1\] are \[-2.5\]"),
    ({"rope_type": "yarn", "attention_factor": 0.0}, r"rope_parameters\['attention_factor'\] must be > 0"),
    ({"rope_type": "linear", "factor": math.inf}, r"rope_parameters\['factor'\] must be a finite number"),
])
def test_rope_parameters_are_checked_at_the_lengths_they_run(fields, match):
    pytest.importorskip("transformers")
    from hf_testing import tiny_config

    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.hf import rope_extension

    base = tiny_config("llama", max_position_embeddings=16)  # head_dim 8: 4 rotary frequencies
    with pytest.raises(ValueError, match=match):
        rope_extension(base, 64, **fields)
    rope = {"rope_theta": 10000.0, "factor": 4.0, **fields}
    if fields["rope_type"] in ("longrope", "yarn"):
        rope["original_max_position_embeddings"] = 16
    if fields["rope_type"] == "longrope":
        rope["short_factor"] = [1.0] * 4
    with pytest.raises(ValueError, match=r"config_overrides\['rope_parameters'\]: .*" + match):
        CausalLMModule(base, config_overrides={"rope_parameters": rope, "max_position_embeddings": 64})


def test_rope_frequencies_at_the_long_length_must_be_finite():
    """The check of the frequencies themselves, for what the parameter checks let through: LongRoPE's long factors are
    only read past original_max_position_embeddings, where they are computed now."""
    pytest.importorskip("transformers")
    from hf_testing import tiny_config

    from lightning_seqpar.hf.config import _rope_lengths

    config = tiny_config("llama", max_position_embeddings=64)
    params = {"rope_type": "longrope", "original_max_position_embeddings": 16}
    assert _rope_lengths(config, params, "longrope") == [None, 17]
    assert _rope_lengths(config, {"rope_type": "dynamic"}, "dynamic") == [None, 128]
    assert _rope_lengths(config, {"rope_type": "yarn"}, "yarn") == [None]


# --------------------------------------------------------------------------------------------- data against the model


def test_a_token_file_read_with_another_dtype_is_refused(tmp_path):
    from lightning_seqpar.data import TokenFileDataModule

    rng = np.random.default_rng(0)
    rng.integers(0, 100_000, 4096).astype(np.uint32).tofile(tmp_path / "wide.bin")  # ids above 65535
    rng.integers(0, 30_000, 4096).astype(np.uint32).tofile(tmp_path / "narrow_ids.bin")  # every high half 0
    rng.integers(0, 30_000, 4096).astype(np.uint16).tofile(tmp_path / "u16.bin")
    rng.integers(0, 256, 4096).astype(np.uint16).tofile(tmp_path / "bytes.bin")  # a byte-level corpus: not refused

    def setup(name, dtype, **kwargs):
        TokenFileDataModule(train_path=str(tmp_path / name), dtype=dtype, seq_len=16, batch_size=2, **kwargs).setup("fit")

    for name in ("wide.bin", "narrow_ids.bin"):
        with pytest.raises(ValueError, match=rf"{name}' read as dtype='uint16' looks like a uint32 file"):
            setup(name, "uint16")
    with pytest.raises(ValueError, match=r"u16.bin' read as dtype='uint32' holds id \d+ .* looks like a uint16 file"):
        setup("u16.bin", "uint32")
    with pytest.raises(ValueError, match=r"wide.bin' \(read as dtype='uint32'\) holds id 99\d\d\d .* but vocab_size=50000"):
        setup("wide.bin", "uint32", vocab_size=50_000)
    setup("u16.bin", "uint16", vocab_size=30_000)
    setup("bytes.bin", "uint16")
    setup("wide.bin", "uint32", vocab_size=100_000)


def _batch_with(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids.roll(-1, dims=1)}


def test_the_first_batch_is_checked_against_the_vocabulary():
    """Out-of-vocabulary ids end in an error naming the datamodule, the largest id and the vocabulary, not in
    ``IndexError: index out of range in self`` deep in the embedding (the package's models and transformers')."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule

    ids = torch.arange(16).view(2, 8)
    ids[1, 3] = 300  # "tiny": 256 ids
    module = CausalLMModule("tiny", warmup_steps=0)
    with pytest.raises(ValueError, match=r"input_ids id 300 \(largest 300\), but the model's vocabulary has 256 ids"):
        module.on_after_batch_transfer(_batch_with(ids), 0)
    module.on_after_batch_transfer(_batch_with(ids % 256), 0)
    labels = {"input_ids": ids % 256, "labels": torch.full_like(ids, -100)}
    labels["labels"][0, 0] = 256
    with pytest.raises(ValueError, match=r"labels id 256"):
        CausalLMModule("tiny").on_after_batch_transfer(labels, 0)

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader([{"input_ids": ids[1], "labels": ids[1].roll(-1)}] * 2, batch_size=2)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"CausalLMModule: the first batch from Data holds input_ids id 300 .* 256 ids"):
        trainer.fit(module, datamodule=Data())
    if not _has_transformers():
        return
    from hf_testing import tiny_config

    hf_module = CausalLMModule(tiny_config("llama"))
    vocab = hf_module._vocabulary_size()
    with pytest.raises(ValueError, match=rf"input_ids id {vocab} \(largest {vocab}\), but the model's vocabulary has {vocab} ids"):
        hf_module.on_after_batch_transfer(_batch_with(torch.tensor([[1, 2, vocab, 3]])), 0)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_wrong_length_of_document_ids_is_named():
    from lightning_seqpar.sharding.batches import check_batch
    from lightning_seqpar.sharding.documents import batch_documents

    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "document_ids": torch.zeros(2, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"batch\['document_ids'\] has shape \(2, 6\); expected \(2, 8\)"):
        check_batch(batch, owner="SequenceParallelStrategy")
    with pytest.raises(ValueError, match=r"batch\['document_ids'\] has shape \(2, 6\); expected \(2, 8\)"):
        batch_documents(batch, world=1)  # CausalLMModule's path without the strategy


# --------------------------------------------------------------------------------------------- export


def _checkpoint(path: Path) -> Path:
    from lightning_seqpar import CausalLMModule

    module = CausalLMModule("tiny")
    module.configure_model()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": "2.6.0", "global_step": 1}, path)
    return path


def test_an_export_into_a_used_folder_is_refused_or_replaced_whole(tmp_path):
    from lightning_seqpar.cli.export import main
    from lightning_seqpar.hf.export import export_hf

    checkpoint = _checkpoint(tmp_path / "run.ckpt")
    out = tmp_path / "hf"
    export_hf(checkpoint, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match=r"already holds weights of another export \(model.safetensors\).*--overwrite"):
        main([str(checkpoint), str(out), "--format", "hf", "--weights", "bin"])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # untouched
    main([str(checkpoint), str(out), "--format", "hf", "--weights", "bin", "--overwrite"])
    assert sorted(os.listdir(out)) == ["config.json", "pytorch_model.bin"]  # never the weights of two exports
    assert sorted(os.listdir(tmp_path)) == ["hf", "run.ckpt"]  # no staging folder left
    (tmp_path / "empty").mkdir()
    export_hf(checkpoint, tmp_path / "empty", weights="bin")  # a folder without weights is used as it is


def test_a_checkpoint_that_is_not_ours_is_refused(tmp_path):
    from lightning_seqpar.cli.export import export_consolidated
    from lightning_seqpar.hf.export import export_hf

    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(4)}, "global_step": 3}, foreign)
    match = r"'.*foreign.ckpt' is not a checkpoint of CausalLMModule: its hyper_parameters have no 'model'"
    with pytest.raises(ValueError, match=match):
        export_consolidated(foreign, tmp_path / "out.ckpt")
    with pytest.raises(ValueError, match=match):
        export_hf(foreign, tmp_path / "hf")
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / "hf").exists()
    export_consolidated(_checkpoint(tmp_path / "run.ckpt"), tmp_path / "out.ckpt")  # ours is exported


# --------------------------------------------------------------------------------------------- ranks that disagree


def _different_documents(rank: int, world_size: int) -> str:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from test_validation import _batch, _ready_strategy

    strategy = _ready_strategy(world_size, sequence_parallel_size=2, attention="ring")
    batch = _batch()  # the same ids and labels on both ranks
    batch["document_ids"] = torch.zeros_like(batch["input_ids"])
    if rank == 1:
        batch["document_ids"][:, 16:] = 1  # two documents where rank 0 sees one
    with pytest.raises(ValueError) as info:
        strategy.shard_batch(batch)
    return str(info.value)


def test_ranks_with_the_same_tokens_but_other_document_ids_are_named():
    messages = run_distributed(_different_documents, 2, timeout=TIMEOUT)
    assert len(set(messages)) == 1, messages  # every rank raises the same error: none is left waiting
    assert "ranks [1] hold batches with different document_ids than rank 0" in messages[0], messages[0]
    assert "document_ids differ" in messages[0]


def test_the_summary_covers_every_per_token_tensor():
    from lightning_seqpar.sharding.batches import batch_summary

    ids = torch.arange(16).view(2, 8)
    base = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(8).expand(2, 8)}
    summary = batch_summary(base)
    for key, value in (("position_ids", torch.arange(8).flip(0).expand(2, 8)), ("attention_mask", torch.ones(2, 8)),
                       ("loss_mask", torch.ones(2, 8)), ("document_position_ids", torch.zeros(2, 8, dtype=torch.long))):
        assert not torch.equal(batch_summary({**base, key: value}), summary), key
    mask = torch.ones(2, 8)
    assert not torch.equal(batch_summary({**base, "loss_mask": mask}), batch_summary({**base, "loss_mask": mask.roll(1, 1) * 0.5}))
    assert torch.equal(batch_summary({**base, "not_per_token": torch.ones(2, 3)}), summary)  # other tensors are not shared


# --------------------------------------------------------------------------------------------- schedules and evaluation


def test_long_warmup_warns_and_untrained_validation_logs_zero():
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule

    ids = torch.arange(8) % 200
    train = [{"input_ids": ids, "labels": ids.roll(-1)}] * 4
    untrained = [{"input_ids": ids, "labels": torch.full((8,), -100)}] * 2
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(CausalLMModule("tiny", warmup_steps=10, max_steps=2), DataLoader(train, batch_size=2),
                    DataLoader(untrained, batch_size=2))
    warned = [str(w.message) for w in caught if "warmup_steps=10 is longer than the run (2 optimizer steps)" in str(w.message)]
    assert len(warned) == 1, [str(w.message) for w in caught]
    assert float(trainer.callback_metrics["val/loss"]) == 0.0 and float(trainer.callback_metrics["val/ppl"]) == 1.0
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


# --------------------------------------------------------------------------------------------- smaller ones


@pytest.mark.parametrize("argv, match", [
    (["--seq", "3", "--gpus", "4"], r"--seq 3: every length is shorter than the GPU counts 4"),
    (["--seq", "1K", "--gpus", "3"], r"--gpus 3: the sequence of --seq 1024 is split over all 3 GPUs and must be a multiple of 3"),
    (["--seq", "1K", "--gpus", "4", "--precision", "bogus"], r"--precision: 'bogus' is not one of"),
    (["--seq", "1K", "--gpus", "4", "--host-memory", "nan"], r"--host-memory: expected a size > 0 \(250GB, 240GiB; a bare number is GB\), got 'nan'"),
])
def test_seqpar_plan_refuses_what_it_cannot_plan(argv, match, capsys):
    from lightning_seqpar.cli.plan import plan_main

    with pytest.raises(SystemExit):
        plan_main(["--model", "llama3-8b", *argv])
    err = capsys.readouterr().err
    assert __import__("re").search(match, err), err
    assert "Traceback" not in err


def test_an_empty_jsonl_and_a_capitalised_role_are_named(tmp_path):
    from lightning_seqpar.data.chat import read_conversations
    from lightning_seqpar.data.hf_text import _files

    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl'\] holds no document"):
        _files(str(tmp_path / "empty.jsonl"))
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "Assistant", "content": "hello"},
                          {"role": "assistant", "content": "bye"}]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=r"chat.jsonl:1: a role 'Assistant' that is not 'assistant' \(roles are case-sensitive\)"):
        read_conversations(str(tmp_path / "chat.jsonl"), None, seq_len=32, on_invalid="error")
    conversations, bad = read_conversations(str(tmp_path / "chat.jsonl"), None, seq_len=32)
    assert conversations == [] and bad == {"a role 'Assistant' that is not 'assistant' (roles are case-sensitive)": 1}
