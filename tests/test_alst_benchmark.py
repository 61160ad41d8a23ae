"""benchmarks/alst.py: ALST's one-GPU recipe as DeepSpeed ships it (issue #22). Skipped without deepspeed (CI has none).

The tiled MLP, the tiled fused logits+loss and reentrant checkpointing under DeepSpeed's checkpoint-offload context
must train the same model as the plain transformers model: loss and every gradient (fp32, CPU), the tied embedding
included (Note [ALST on one GPU] in benchmarks/alst.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import alst

S = 200  # 4 MLP tiles of 50 (hidden 64); 7 uneven loss tiles


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, S), generator=g)  # (1, S)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    labels[:, 30:90] = -100  # an unlabelled span: the loss tiles hold different labelled counts
    return ids, labels


def _reference(model: torch.nn.Module, lora: bool) -> torch.nn.Module:
    """The same weights in a plain transformers model (no tiling, no checkpointing)."""
    spec = dict(alst.TINY)
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if lora:
        import peft

        ref = peft.get_peft_model(ref, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=alst.LORA_TARGETS))
    state = {k.replace("mlp.mlp.", "mlp."): v for k, v in model.state_dict().items()}
    ref.load_state_dict(state, strict=True)
    return ref.train()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_alst_recipe_matches_plain_model(lora):
    if lora:
        pytest.importorskip("peft")
    model = alst.build_model(alst.TINY, lora=lora, device="cpu", dtype=torch.float32)
    if lora:  # peft initialises lora_B to zero: make the adapters' gradients non-trivial
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    ref = _reference(model, lora)
    ids, labels = _batch(alst.TINY["vocab_size"])

    shards = 7
    offload = alst.offload_context()
    with offload:
        loss = alst.alst_loss(model, ids, labels, shards=shards)
        loss.backward()
    logits = alst.causal_lm(ref)(input_ids=ids, use_cache=False).logits  # (1, S, V)
    ref_loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1), ignore_index=-100)
    ref_loss.backward()

    torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    ref_params = dict(ref.named_parameters())
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    if lora:  # the base is frozen: only adapters train
        assert all("lora_" in n for n, _ in trained)
    for name, p in trained:
        q = ref_params[name.replace("mlp.mlp.", "mlp.")]
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if not lora:  # the tied embedding gets its lm_head part from the loss tiles and its lookup part from backward
        assert alst.causal_lm(model).lm_head.weight is alst.causal_lm(model).model.embed_tokens.weight
    # DeepSpeed's pack hook saw every checkpointed layer input (on the CPU it keeps them: no accelerator to copy from)
    layers = alst.TINY["num_hidden_layers"]
    assert offload.stats.marked_tensors == layers
    assert offload.stats.skipped_marked_tensors == layers and offload.stats.offloaded_tensors == 0


def test_loss_shards_follow_one_gib_of_fp32_logits():
    assert alst.loss_shards(2048, 131072, 1.0) == 1  # exactly 1 GiB
    assert alst.loss_shards(2049, 131072, 1.0) == 2
    assert alst.loss_shards(131072, 128256, 1.0) == 63  # 131072 * 128256 * 4 B = 62.6 GiB
    assert alst.loss_shards(16, 256, 1.0) == 1


def test_tiny_run_writes_records(tmp_path):
    out = tmp_path / "alst.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(BENCH), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "alst.py"), "--tiny", "--model", "llama-1b",
                           "--seqs", "48,96", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["seq"] for r in rows] == [48, 96]
    for r in rows:
        assert r["bench"] == "alst" and r["system"] == "alst" and r["model"] == "hf-llama-3.2-1b-shaped-tiny"
        assert "error" not in r, r.get("error")
        assert len(r["losses"]) == 2 and all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["step_time_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["seq"] / r["step_time_s"])
        assert r["offload"]["marked"] == alst.TINY["num_hidden_layers"]


def test_offload_recipe_trains_the_plain_models_loss():
    """--recipe offload (ZeRO-3, parameters and optimizer on the host, CPU Adam): its first loss is the plain
    transformers model's on the same initial weights and tokens (bf16), and both steps' losses are finite."""
    import deepspeed

    spec = dict(alst.TINY, tie_word_embeddings=False)
    seq, first = 200, {}

    def weights(engine):
        params = dict(engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            first.update({n.replace("mlp.mlp.", "mlp."): p.detach().clone() for n, p in params.items()})

    row: dict = {}
    alst.run_offload(spec, seq=seq, steps=2, shard_gb=1.0, device="cpu", attn="sdpa", row=row, inspect=weights)
    assert row["optimizer"] == "DeepSpeedCPUAdam" or row["cpu_adam_error"], row
    assert row["zero"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}

    config = transformers.AutoConfig.for_model(**{k: v for k, v in spec.items()})
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    assert first and first.keys() == dict(ref.named_parameters()).keys()
    ref.load_state_dict(first, strict=True)
    g = torch.Generator().manual_seed(0)  # run_offload's tokens of step 1
    ids = torch.randint(0, spec["vocab_size"], (seq,), generator=g)[None]
    with torch.no_grad():
        logits = ref(input_ids=ids, use_cache=False).logits.float()  # (1, S, V)
    ref_loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert row["losses"][0] == pytest.approx(float(ref_loss), rel=2e-2)
    assert all(torch.isfinite(torch.tensor(row["losses"])))
