"""Export of a distributed checkpoint: one consolidated file (resumable under another layout), and
a Hugging Face ``LlamaForCausalLM`` folder (config.json + safetensors / pytorch_model.bin).

The safetensors file is read back here by an independent parser of the format (8-byte header
length, JSON header, raw data); with the ``safetensors`` package installed it is also read by it,
and with ``transformers`` installed ``LlamaForCausalLM.from_pretrained`` must give our logits.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from test_resume import _fit

TIMEOUT = 240
K = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run (dp1 x sp2) that saved a folder of shards after step 2 and captured its full state there."""
    root = tmp_path_factory.mktemp("export")
    results = run_distributed(_fit, 2, sp=2, dirpath=str(root), steps=K + 1, save_at=(K,), capture_at=K, timeout=TIMEOUT)
    checkpoint = root / f"step={K}.ckpt"
    assert (checkpoint / ".metadata").is_file()
    return checkpoint, results[0]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    assert max(i["data_offsets"][1] for i in header.values()) == len(data)  # no trailing bytes
    return out


def test_consolidated_file_holds_the_full_state_and_resumes_under_another_layout(trained, tmp_path):
    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.cli.seqpar import main

    checkpoint, saved = trained
    out = tmp_path / "consolidated.ckpt"
    main(["export", str(checkpoint), str(out), "--format", "consolidated"])  # `seqpar export`
    full = torch.load(out, map_location="cpu", weights_only=True)
    assert full["global_step"] == K and "loops" in full and "lr_schedulers" in full and len(full["rng_states"]) == 2
    state = full["state_dict"]
    assert state.keys() == {f"model.{k}" for k in saved["captured"]["model"]}
    for name, value in saved["captured"]["model"].items():
        assert torch.equal(state[f"model.{name}"], value), name
    for name, fields in saved["captured"]["optim"]["state"].items():
        for field, value in fields.items():
            assert torch.equal(full["optimizer_states"][0]["state"][f"model.{name}"][field], value), (name, field)
    # A plain LightningModule reads it ...
    module = CausalLMModule.load_from_checkpoint(out, map_location="cpu")
    for name, value in saved["captured"]["model"].items():
        assert torch.equal(module.model.state_dict()[name], value), name
    # ... and the strategy resumes from it under another layout (dp2 x sp1): the same state, the next loss.
    resumed = run_distributed(_fit, 2, sp=1, dirpath=str(tmp_path / "r"), steps=K + 1, ckpt_path=str(out),
                              capture_at=-1, init_seed=123, timeout=TIMEOUT)[0]
    for name, value in saved["captured"]["model"].items():
        assert torch.equal(resumed["captured"]["model"][name], value), name
    torch.testing.assert_close(torch.tensor(resumed["losses"][K + 1]), torch.tensor(saved["losses"][K + 1]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_hugging_face_export_has_hf_names_and_config(trained, tmp_path, weights, capsys):
    from lightning_seqpar.cli.export import main
    from lightning_seqpar.models import LlamaConfig

    checkpoint, saved = trained
    out = tmp_path / "hf"
    main([str(checkpoint), str(out), "--format", "hf", "--weights", weights])  # python -m lightning_seqpar.cli.export
    # the run named no tokenizer (a package model, loaders without one): the command says so and how to add one
    printed = capsys.readouterr().out
    assert "no tokenizer copied: " in printed and "pass --tokenizer DIR" in printed and not (out / "tokenizer.json").exists()
    config = json.loads((out / "config.json").read_text())
    tiny = LlamaConfig.from_name("tiny")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["vocab_size"], config["head_dim"]) == (
        tiny.n_embd, tiny.n_layer, tiny.n_head, tiny.n_kv_head, tiny.intermediate_size, tiny.vocab_size, tiny.head_dim)
    assert config["rope_theta"] == tiny.rope_theta and config["rms_norm_eps"] == tiny.norm_eps
    assert config["tie_word_embeddings"] is False
    if weights == "safetensors":
        tensors = _read_safetensors(out / "model.safetensors")
    else:
        tensors = torch.load(out / "pytorch_model.bin", weights_only=True)
    expected = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in saved["captured"]["model"].items()}
    assert tensors.keys() == expected.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "model.layers.1.mlp.down_proj.weight" in tensors
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    if weights == "safetensors" and _importable("safetensors"):  # the reference reader agrees
        from safetensors.torch import load_file

        for name, value in load_file(out / "model.safetensors").items():
            assert torch.equal(value, expected[name]), name


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_export_bf16_and_bad_inputs(trained, tmp_path):
    from lightning_seqpar.parallel.checkpoint_io import load_model_state_dict
    from lightning_seqpar.hf.export import export_hf

    checkpoint, saved = trained
    export_hf(checkpoint, tmp_path / "bf16", dtype=torch.bfloat16)
    tensors = _read_safetensors(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert torch.equal(tensors["lm_head.weight"], saved["captured"]["model"]["lm_head.weight"].bfloat16())
    partial = tmp_path / "partial.ckpt"
    partial.mkdir()
    with pytest.raises(ValueError, match="not a complete distributed checkpoint"):
        load_model_state_dict(partial)


def test_broken_checkpoint_files_are_named_before_loading(trained, tmp_path):
    """Note [Checking a checkpoint's files]: a truncated shard and a missing one are named, with the checkpoint, by the
    strategy's load (before any collective) and by the export; so are a truncated meta.pt / .metadata and a truncated
    one-file checkpoint (a torch.save zip archive, as save_distributed_checkpoint=False writes it)."""
    import shutil

    from lightning_seqpar import SequenceParallelStrategy
    from lightning_seqpar.hf.export import export_hf

    checkpoint, _ = trained
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(checkpoint, broken)
    shards = sorted(p.name for p in broken.glob("*.distcp"))
    assert len(shards) == 2  # one per rank
    with open(broken / shards[0], "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    (broken / shards[1]).unlink()
    strategy = SequenceParallelStrategy(sequence_parallel_size=1)
    expected = (rf"the checkpoint '{broken}' is broken: {shards[0]} has \d+ bytes where its .metadata records \d+ "
                rf"\(truncated\); {shards[1]} is missing \(its .metadata lists it\)\. It cannot be loaded")
    with pytest.raises(ValueError, match="SequenceParallelStrategy: " + expected):
        strategy.load_checkpoint(broken)
    with pytest.raises(ValueError, match="export: " + expected):
        export_hf(broken, tmp_path / "hf")
    shutil.rmtree(broken)
    shutil.copytree(checkpoint, broken)
    with open(broken / "meta.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=rf"'{broken}' is broken: meta.pt is a zip archive without its end"):
        strategy.load_checkpoint(broken)
    (broken / ".metadata").write_bytes((checkpoint / ".metadata").read_bytes()[:50])
    with pytest.raises(ValueError, match=rf"'{broken}' is broken: its .metadata does not load"):
        strategy.load_checkpoint(broken)
    one_file = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(64)}, "global_step": 3}, one_file)
    size = one_file.stat().st_size
    with open(one_file, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ValueError, match=rf"SequenceParallelStrategy: the checkpoint file '{one_file}' is broken: is a zip "
                                         rf"archive without its end .*{size - 10} bytes"):
        strategy.load_checkpoint(one_file)
    one_file.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"'{one_file}' is broken: is empty"):
        strategy.load_checkpoint(one_file)


def test_transformers_loads_the_export_with_the_same_logits(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_seqpar.hf.export import export_hf
    from lightning_seqpar.models import Llama, LlamaConfig

    checkpoint, saved = trained
    export_hf(checkpoint, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    ours = Llama(LlamaConfig.from_name("tiny"))
    ours.load_state_dict(saved["captured"]["model"])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_hf_export_carries_the_datamodules_tokenizer_and_generates(trained, tmp_path, capsys):
    """Note [The tokenizer of an export]: the checkpoint's datamodule hyper-parameters (tokenizer_path, chat_template; what
    Lightning saves for HFTextDataModule / ChatDataModule) bring the tokenizer, the run's chat template and the tokenizer
    folder's generation config into the folder, which AutoTokenizer and AutoModelForCausalLM load and generate from."""
    transformers = pytest.importorskip("transformers")
    import shutil

    from hf_testing import tiny_tokenizer

    from lightning_seqpar.cli.export import main
    from lightning_seqpar.hf.export import export_hf, tokenizer_source

    checkpoint, _ = trained
    tokenizer_dir = tiny_tokenizer(["the cat sat on the mat", "a dog ran far away"], str(tmp_path / "tokenizer"))
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=False, repetition_penalty=1.25).save_pretrained(tokenizer_dir)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with_data = tmp_path / "with_data.ckpt"  # the same checkpoint, as a run with a ChatDataModule would have saved it
    shutil.copytree(checkpoint, with_data)
    meta = torch.load(with_data / "meta.pt", weights_only=True)
    meta["datamodule_hyper_parameters"] = {"tokenizer_path": tokenizer_dir, "chat_template": template, "seq_len": 32}
    torch.save(meta, with_data / "meta.pt")
    out = tmp_path / "hf"
    main([str(with_data), str(out), "--format", "hf"])
    assert f"tokenizer copied from {tokenizer_dir!r} (the datamodule's tokenizer_path, the run's chat template, " \
           "generation_config.json)" in capsys.readouterr().out
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.chat_template == template and tokenizer.eos_token == "[EOS]"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    assert model.generation_config.repetition_penalty == 1.25
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the cat sat"}], tokenize=True, return_tensors="pt",
                                           return_dict=True)
    assert prompt["input_ids"][0].tolist() == tokenizer.convert_tokens_to_ids(["the", "cat", "sat"])
    generated = model.generate(**prompt, max_new_tokens=3, min_new_tokens=3)
    assert generated.shape == (1, 6) and torch.equal(generated[:, :3], prompt["input_ids"])
    # --tokenizer (a tokenizer.json file) replaces the recorded one; a recorded folder that is gone, or a --tokenizer
    # that is no tokenizer, is refused by name before anything is written
    export_hf(checkpoint, tmp_path / "from_file", tokenizer=tmp_path / "tokenizer" / "tokenizer.json")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "from_file").convert_tokens_to_ids("cat") == \
        tokenizer.convert_tokens_to_ids("cat")
    shutil.rmtree(tokenizer_dir)
    with pytest.raises(ValueError, match=rf"export: the checkpoint's datamodule trained with tokenizer_path={tokenizer_dir!r}, "
                                         r"which is gone or changed; pass --tokenizer DIR .* is neither a tokenizer folder"):
        export_hf(with_data, tmp_path / "gone")
    assert not (tmp_path / "gone").exists()
    with pytest.raises(ValueError, match=r"export: --tokenizer '.*empty' is neither a tokenizer folder"):
        tokenizer_source({}, tokenizer=tmp_path / "empty")
    with pytest.raises(ValueError, match=r"export: the tokenizer at '.*config.json' \(--tokenizer\) does not load as a tokenizer"):
        export_hf(checkpoint, tmp_path / "bad", tokenizer=out / "config.json")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit):
        main([str(checkpoint), str(tmp_path / "c.ckpt"), "--tokenizer", str(out)])  # not for --format consolidated
    assert "--tokenizer applies to --format hf, litgpt and to --format lora with --merged" in capsys.readouterr().err
