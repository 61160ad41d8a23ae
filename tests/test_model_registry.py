"""The model registry: name or dict -> config and model classes; a model's attention heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_seqpar.models import GPT, GPTConfig, Llama, LlamaConfig, TransNormer, TransNormerConfig
from lightning_seqpar.models.registry import MODEL_FAMILIES, attention_heads, build_model, family_of, is_named_config, resolve_config


@pytest.mark.parametrize("name,cls", [("tiny", LlamaConfig), ("tnl-tiny", TransNormerConfig), ("gpt-tiny", GPTConfig)])
def test_names_and_checkpoint_dicts_resolve_to_their_family(name, cls):
    config = resolve_config(name)
    assert type(config) is cls and is_named_config(name)
    assert resolve_config(dataclasses.asdict(config)) == config  # what a checkpoint stores
    assert resolve_config(config) is config
    assert isinstance(build_model(resolve_config({**dataclasses.asdict(config), "n_layer": 1})),
                      {LlamaConfig: Llama, TransNormerConfig: TransNormer, GPTConfig: GPT}[cls])


def test_a_dict_belongs_to_the_first_family_that_takes_all_its_keys():
    assert type(resolve_config({"n_layer": 2, "n_embd": 32, "n_head": 2})) is LlamaConfig  # shared fields: Llama
    assert type(resolve_config({"n_layer": 2, "n_embd": 32, "n_head": 2, "glu_dim": 64})) is TransNormerConfig
    assert type(resolve_config({"n_layer": 2, "n_embd": 32, "n_head": 2, "kv_comm": "kv"})) is GPTConfig
    with pytest.raises(ValueError, match=r"CausalLMModule: the dict \['glu_dim', 'kv_comm'\] is not the fields of any of"):
        resolve_config({"glu_dim": 64, "kv_comm": "kv"}, owner="CausalLMModule")
    assert not is_named_config("no-such-model")
    assert [f.name for f in MODEL_FAMILIES] == ["llama", "transnormer", "gpt"]


def test_attention_heads_of_the_families_and_of_hugging_face_configs():
    llama = Llama(LlamaConfig(vocab_size=32, n_embd=48, n_layer=1, n_head=6, n_kv_head=2, intermediate_size=32))
    assert attention_heads(llama) == (6, 2, 8)
    tnl = TransNormer(TransNormerConfig(vocab_size=32, n_embd=32, n_layer=1, n_head=4, glu_dim=32))
    assert attention_heads(tnl) == (4, 4, 8) and family_of(tnl.config).linear_attention
    assert attention_heads(torch.nn.Linear(2, 2)) is None
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    holder = torch.nn.Module()
    holder.config = config
    assert attention_heads(holder) == (4, 2, 16)
    gpt2 = torch.nn.Module()
    gpt2.config = transformers.GPT2Config(n_embd=64, n_head=8)  # transformers maps n_head onto num_attention_heads
    assert attention_heads(gpt2) == (8, 8, 8)
