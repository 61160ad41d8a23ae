"""Models the way users write them (no import of the package): nanoGPT-style, a Llama with a ``freqs_cis`` table and GQA,
a bidirectional encoder; and the LightningModule around them, with its own loss. Used by tests/test_own_model.py."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one qkv projection, SDPA with is_causal (or a bidirectional encoder's, causal=False)."""

    def __init__(self, dim: int, heads: int, *, causal: bool = True, mask: str | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.causal, self.mask, self.dropout = heads, causal, mask, dropout
        self.latents = nn.Parameter(torch.randn(1, heads, 4, dim // heads)) if mask == "latents" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))  # (B, H, T, D)
        if self.mask == "causal":  # an explicit mask built from the local length
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.mask == "manual":  # attention written out
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = att.softmax(-1) @ v
        elif self.mask == "latents":  # cross attention to a tensor that is not the sequence
            lat = self.latents.expand(B, -1, -1, -1)
            y = F.scaled_dot_product_attention(q, lat, lat)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, **attn: Any) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, **attn)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """Token + learned position embeddings; ``positions="batch"`` reads ``position_ids``, "arange" computes them in forward."""

    def __init__(self, *, dim: int = 32, heads: int = 4, layers: int = 2, block_size: int = 256, positions: str = "batch",
                 **attn: Any) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(block_size, dim)
        self.stack = nn.ModuleList(Block(dim, heads, **attn) for _ in range(layers))  # not named layers / h / blocks
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        self.positions = positions

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.positions == "arange" or position_ids is None:
            position_ids = torch.arange(0, idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(position_ids)
        for block in self.stack:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))  # (end, dim/2) complex


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D), freqs_cis (T, D/2) as Meta's reference Llama."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, gqa: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.gqa = heads, kv_heads, dim // heads, gqa
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rotary_emb(self.wq(x).view(B, T, self.heads, self.head_dim), freqs_cis)
        k = apply_rotary_emb(self.wk(x).view(B, T, self.kv_heads, self.head_dim), freqs_cis)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.gqa == "repeat":
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, gqa: str) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = LlamaAttention(dim, heads, kv_heads, gqa)
        self.w1, self.w2, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    """Meta's reference Llama shape: ``self.freqs_cis[start_pos : start_pos + seqlen]`` sliced in forward (a tensor
    attribute, not a buffer, as in the reference code), GQA by ``enable_gqa`` or by repeated K/V."""

    def __init__(self, *, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2, max_seq_len: int = 512,
                 gqa: str = "enable_gqa") -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, gqa) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        self.freqs_cis = precompute_freqs_cis(dim // heads, max_seq_len)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


class Encoder(nn.Module):
    """A bidirectional encoder (masked-LM style): SDPA with is_causal=False, positions from the batch."""

    def __init__(self, *, dim: int = 32, heads: int = 4, layers: int = 2, block_size: int = 256) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(block_size, dim)
        self.encoder = nn.ModuleList(Block(dim, heads, causal=False) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:  # one process without position_ids in its batch (the strategy always gives them)
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(position_ids)
        for layer in self.encoder:
            x = layer(x)
        return self.head(x)


def litgpt_gpt(*, window: int | None = None) -> nn.Module:
    """LitGPT's ``GPT`` as LitGPT builds it (a tiny Llama-3-style config: RoPE caches ``cos`` / ``sin`` sliced by the
    input's length, GQA by repeated K/V; ``window``: a sliding window on the first layer, as Gemma / Mistral configs)."""
    from litgpt import Config
    from litgpt.model import GPT

    config = Config(name="tiny-llama", n_layer=2, n_head=4, n_embd=32, block_size=128, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                    mlp_class_name="LLaMAMLP", intermediate_size=64,
                    **({"sliding_window_size": window, "sliding_window_indices": [1, 0]} if window else {}))
    return GPT(config)


def build(kind: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    return {"nanogpt": NanoGPT, "llama": Llama, "encoder": Encoder, "litgpt": litgpt_gpt}[kind](**kwargs)


def make_module(kind: str, *, lr: float = 1e-2, own_loss: bool = True, on_module: bool = False, **kwargs: Any):
    """A LightningModule as a user writes it: ``self.model(...)`` in training_step and its own ``F.cross_entropy`` (a mean
    over its rank's tokens); ``on_module``: the blocks live on the LightningModule itself (nanoGPT pasted in)."""
    import lightning as L

    class UserModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            model = build(kind, **kwargs)
            if on_module:
                for name, child in model.named_children():
                    self.add_module(name, child)
                self.positions = getattr(model, "positions", "batch")
            else:
                self.model = model

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
            if on_module:
                return NanoGPT.forward(self, input_ids, position_ids)  # type: ignore[arg-type]
            if kind in ("llama", "litgpt"):
                return self.model(input_ids)
            return self.model(input_ids, position_ids)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            logits = self(batch["input_ids"], batch.get("position_ids"))
            if own_loss:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
            else:
                from lightning_seqpar.loss import global_mean_loss, token_cross_entropy_sum

                loss = global_mean_loss(*token_cross_entropy_sum(logits, batch["labels"]), self.device_mesh)
            # a per-rank mean: the mean over ranks; global_mean_loss: this rank's share, summed
            self.log("train/loss", loss.detach(), sync_dist=True, reduce_fx="mean" if own_loss else "sum")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return UserModule()
