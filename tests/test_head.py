"""The head interface (lightning_seqpar.loss.head): a plain head's operands, refusals by name, and a library's adapter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_seqpar.loss.head import USE_FULL_LOGITS, head_operands, is_plain, is_plain_linear, logits_head


def test_a_plain_head_gives_its_own_weight():
    head = nn.Linear(8, 16, bias=False)
    hidden = torch.randn(2, 3, 8)
    h, w = head_operands(head, hidden)
    assert h is hidden and w is head.weight
    assert logits_head(head, "M") is head


class _Hooked(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # computes with more than its weight
        return super().forward(x) + 1


@pytest.mark.parametrize("head, what", [(nn.Linear(8, 16), "Linear with a bias"), (_Hooked(8, 16, bias=False), "_Hooked"),
                                        (nn.Embedding(16, 8), "Embedding")])
def test_a_head_the_chunked_loss_would_get_wrong_is_refused_by_name(head, what):
    with pytest.raises(ValueError, match=f"^Owner: lm_head is a {what}, not a plain nn.Linear") as error:
        head_operands(head, torch.randn(2, 8), "Owner")
    assert USE_FULL_LOGITS in str(error.value)
    assert not is_plain_linear(head)


def test_is_plain_reads_the_class_forward():
    assert is_plain(nn.Conv1d(2, 2, 3), nn.Conv1d) and not is_plain(_Hooked(2, 2), nn.Linear)


class _Widened(nn.Module):
    """A wrapper that adds a rank-1 term: h W^T + (h a) b^T = [h | h a] @ [W | b]^T."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 16, bias=False)
        self.a = nn.Parameter(torch.randn(8, 1))
        self.b = nn.Parameter(torch.randn(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a) @ self.b.T


class _Adapter:
    def resolve(self, head, owner):
        return head if isinstance(head, _Widened) else None

    def operands(self, layer, hidden):
        return torch.cat([hidden, hidden @ layer.a], dim=-1), torch.cat([layer.base.weight, layer.b], dim=-1)


def test_an_adapter_writes_its_wrapper_as_one_product_and_leaves_plain_heads_alone():
    head, hidden = _Widened(), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="lm_head is a _Widened"):
        head_operands(head, hidden)  # no adapter: refused
    h, w = head_operands(head, hidden, adapters=(_Adapter(),))
    torch.testing.assert_close(h @ w.T, head(hidden))
    assert logits_head(head, "M", adapters=(_Adapter(),)) is head
    plain = nn.Linear(8, 16, bias=False)
    h, w = head_operands(plain, hidden, adapters=(_Adapter(),))
    assert h is hidden and w is plain.weight


def test_the_loss_chunk_by_default():
    """loss_chunk_size="auto" (the default, Note [The loss chunk by default]): LOSS_CHUNK_AUTO wherever the chunked loss
    computes the model's own logits, the full logits where a model changes them after its head (or the head is not a
    linear layer: checked when the model is built); a user's int or None is kept; the hyper-parameters keep "auto"."""
    import logging

    import pytest
    from transformers import AutoModelForCausalLM, CohereConfig, LlamaConfig

    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.training.module import LOSS_CHUNK_AUTO

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert CausalLMModule("tiny").loss_chunk_size == LOSS_CHUNK_AUTO == 8192
    assert CausalLMModule("tiny").hparams["loss_chunk_size"] == "auto"
    assert CausalLMModule(LlamaConfig(**tiny)).loss_chunk_size == LOSS_CHUNK_AUTO
    assert CausalLMModule(CohereConfig(**tiny, logit_scale=0.5)).loss_chunk_size is None  # scales its logits after lm_head
    assert CausalLMModule("tiny", loss_chunk_size=None).loss_chunk_size is None
    assert CausalLMModule("tiny", loss_chunk_size=7).loss_chunk_size == 7
    with pytest.raises(ValueError, match="transforms its logits"):  # a chunk the user asked for is refused by name
        CausalLMModule(AutoModelForCausalLM.from_config(CohereConfig(**tiny, logit_scale=0.5)), loss_chunk_size=8)
    for bad in (0, "yes", 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk_size must be"):
            CausalLMModule("tiny", loss_chunk_size=bad)
    built = AutoModelForCausalLM.from_config(LlamaConfig(**tiny))
    class Doubled(nn.Linear):  # a head whose logits are not hidden @ W^T: "auto" falls back to the full logits
        def forward(self, x):
            return 2 * super().forward(x)

    head = Doubled(32, 64, bias=False)
    head.weight = built.lm_head.weight
    built.lm_head = head
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        module = CausalLMModule(built)
    finally:
        logger.removeHandler(handler)
    assert module.loss_chunk_size is None
    assert any("loss_chunk_size='auto' computes the full logits" in m for m in seen), seen


KINDS_FOR_CHUNKING = ["llama", "qwen2", "mistral", "qwen3", "gemma", "gemma3", "gemma2", "gpt_oss", "mixtral", "qwen2_moe", "olmoe",
                      "qwen3_moe", "lfm2", "bamba", "qwen3_next", "qwen3_5", "jamba", "phi3-longrope"]


def test_every_model_type_auto_chunks_gives_the_full_logits_loss_and_gradients():
    """hf.CHUNKED_LOSS_MODEL_TYPES, where loss_chunk_size="auto" chunks: for each, one tiny model's loss and every gradient
    through the chunked cross entropy (chunks of 5 tokens) equal those through the model's own full logits."""
    import copy
    import warnings

    from transformers import AutoModelForCausalLM

    from hf_testing import tiny_config
    from lightning_seqpar import CausalLMModule, hf

    warnings.filterwarnings("ignore")
    seen = set()
    for kind in KINDS_FOR_CHUNKING:
        config = tiny_config(kind)
        seen.add(config.model_type)
        assert hf.chunked_loss_serves(config), kind
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config).float()
        ids = torch.randint(0, config.vocab_size, (2, 24))
        labels = torch.randint(0, config.vocab_size, (2, 24))
        labels[:, :3] = -100
        batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(24)[None].expand(2, 24)}
        out = {}
        for chunk in (None, 5):
            module = CausalLMModule(copy.deepcopy(base), loss_chunk_size=chunk)
            total, count = module.loss_sum(batch)
            total.backward()
            out[chunk] = (total.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        torch.testing.assert_close(out[5][0], out[None][0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind} loss: {m}")
        assert out[5][1].keys() == out[None][1].keys(), kind
        for name, grad in out[None][1].items():
            torch.testing.assert_close(out[5][1][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{kind} {name}: {m}")
    assert seen == set(hf.CHUNKED_LOSS_MODEL_TYPES)


def test_a_logit_multiplier_is_refused_for_chunking():
    """Falcon-H1 multiplies its logits by lm_head_multiplier after lm_head: the chunked loss would silently drop it."""
    import pytest
    from transformers import FalconH1Config

    from lightning_seqpar import hf

    config = FalconH1Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=64, lm_head_multiplier=0.5)
    assert hf.logit_transform(config) == "lm_head_multiplier=0.5" and not hf.chunked_loss_serves(config)
    with pytest.raises(ValueError, match="lm_head_multiplier"):
        from lightning_seqpar import CausalLMModule
        from transformers import AutoModelForCausalLM

        CausalLMModule(AutoModelForCausalLM.from_config(config), loss_chunk_size=8)
