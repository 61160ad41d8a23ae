"""What of a transformers model is exact under sequence parallelism, what is refused, and the sweep that checks it.

Public names:

* the refusals, from local metadata (equal on every rank) before any communication:
  :func:`refuse_token_mixers` (:func:`find_token_mixers`) and :func:`refuse_unseen_position_features`, which
  ``apply_hf_attention`` runs at set-up, :func:`check_sharded_layer`, which every sharded or packed forward runs;
  :func:`check_model_supported` — every set-up refusal at once, with a ``ValueError`` naming the architecture, the
  feature and the config field (Note [Silent mismatches the sweep found]).
* :func:`causal_lm_architectures`, :func:`tiny_config`, :func:`build_tiny_model`, :func:`features_of`,
  :data:`FEATURES` — the sweep's inputs: every model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a
  tiny config of it (hidden 32, 2-4 layers, GQA 4/2 heads, every layer kind kept), and the long-context features
  that config can switch on.
* :func:`make_record`, :func:`render_markdown` and ``python -m lightning_seqpar.hf.support --record R.json --write
  docs/hf_support.md`` — the support table, generated from the sweep's JSON record
  (``tests/test_hf_support.py`` writes it with ``SEQPAR_HF_SWEEP=full``).

Note [Exact or refused: position-dependent layers of Hugging Face models]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under the strategy each rank runs the unmodified model on ITS shard of every sequence: every
layer that mixes tokens, or reads where its tokens sit, sees only the shard. Each such thing is
made exact, or refused by name (ValueError naming the layer class and the config field) before
any communication, from local metadata that is equal on every rank:

* attention: the package's ``Attention`` (exact); windows, chunks, soft-capping and sinks are
  read by ``lightning_seqpar.hf.features.attention_features`` and computed by ``Attention`` over
  the GLOBAL positions (Note [Attention variants]);
* rotary embeddings: the positions are the global ones (the strategy shards ``position_ids``);
  rotary variants whose frequencies depend on the sequence length (dynamic NTK, LongRoPE) get the
  global length (Note [Length-dependent rotary embeddings] in ``lightning_seqpar.hf.rope``);
* scalings computed from the LOCAL token index (Llama 4's attention temperature tuning of its
  NoPE layers: ``arange(local length)``) are refused when sharded or packed (:func:`check_sharded_layer`),
  unless the whole sequence is shorter than ``config.floor_scale`` (every factor is then 1);
  exact on one rank with whole sequences;
* token mixers other than attention: those of ``lightning_seqpar.hf.hybrid.HYBRID_MIXERS``
  (gated DeltaNet of Qwen3-Next / Qwen3.5 / OLMo-hybrid, Kimi Linear's KDA, the Mamba2 mixers of
  Bamba, Granite 4, Nemotron-H, Mamba2, Zamba2 and Falcon-H1, the Mamba1 mixers of Mamba,
  Falcon-Mamba, Jamba and Zamba, MiniMax's lightning attention, the short convolutions of LFM2 /
  LFM2-MoE / LFM3, RecurrentGemma's RG-LRU blocks) are replaced by sequence-parallel twins that
  pass their state between ranks (Note [Hybrid models under the strategy]); every other one (causal
  depthwise convolutions, other SSM mixers, other linear attention, recurrent blocks: RWKV, xLSTM,
  ...) would run on its shard alone: :func:`refuse_token_mixers` refuses it at
  set-up (``apply_hf_attention``) by layer class and config field (a block whose class is named
  for the exact mixer it holds, e.g. ``Mamba2Block``, RMS / layer norms, and softmax attention layers
  on attention-typed layers, e.g. ``KimiLinearAttention``, are not token mixers);
* MoE router auxiliary losses: ``lightning_seqpar.hf.moe``.

Note [The Hugging Face support sweep]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For every causal-LM architecture transformers registers, the sweep builds a tiny random model
(fp32, seed 0), once with its defaults ("base": windows longer than the sequence, no scaling) and
once per long-context feature its config has (:data:`FEATURES`), and compares, on a gloo mesh of
2 or 4 ranks and for each attention algorithm, the package's run on the zigzag shards (the
model's attention switched to ``"seqpar"`` by :func:`lightning_seqpar.hf.apply_hf_attention`,
``position_ids`` sharded with the tokens) with the unmodified model on the full sequence: logits,
loss (the model's own loss: cross entropy plus the MoE auxiliary loss where the config asks for
it) and every parameter gradient (summed over the ranks), fp32 at ``atol=1e-5``. Each case ends
in one of:

* ``exact`` — everything matches;
* ``refused`` — a ``ValueError`` raised before any collective (the sweep runs the first step
  under a guard that fails any collective, so a refusal after communication is not counted as one);
* ``MISMATCH`` — a silent wrong answer: a defect;
* ``error`` — another exception (loud, but not an actionable refusal);
* ``not built`` — no tiny model (multimodal-only classes, encoder-decoder models, missing kernels).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_seqpar.hf.features import is_attention_layer, layer_name
from lightning_seqpar.hf.hybrid import HYBRID_MIXERS, decoder_layer_index, is_hybrid_twin

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "FEATURES",
    "Feature",
    "NotBuilt",
    "SEQ_LEN",
    "build_tiny_model",
    "causal_lm_architectures",
    "check_model_supported",
    "check_sharded_layer",
    "features_of",
    "find_token_mixers",
    "make_record",
    "refuse_token_mixers",
    "refuse_unseen_position_features",
    "render_markdown",
    "tiny_config",
]

# ---------------------------------------------------------------------------------------- exact or refused

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
"""``config.layer_types`` values that are softmax attention through the AttentionInterface (windows and
chunks are then checked against the length); any other value is a token mixer :func:`refuse_token_mixers` refuses."""

POSITIONWISE_LAYER_TYPES = frozenset({"mlp", "moe"})
"""``config.layer_types`` values of decoder layers that hold only a feed-forward block (Nemotron-H's
"mlp" / "moe" layers): each token's row depends on that row only, so they need nothing under sharding
(a mixture of experts' router loss is checked on its own: ``lightning_seqpar.hf.moe``)."""

# class names of token mixers that are not attention (matched case-insensitively against every submodule's class)
_MIXER_CLASS_NAMES = re.compile(
    r"mamba|mixer|deltanet|linearattention|linearattn|lightningattention|recurrent|rglru|rwkv|xlstm|mlstm|slstm|"
    r"hyena|retention|shortconv|causalconv",
    re.IGNORECASE,
)
# "SSM" case-sensitively: a case-insensitive "ssm" matches GptOssModel ("GptO-ssM-odel")
_SSM_CLASS_NAMES = re.compile(r"SSM|Ssm")
# normalisations, each token's row alone, whatever the model's name in front ("MambaRMSNorm", "MambaRMSNormGated")
_NORM_CLASS_NAMES = re.compile(r"(RMS|Layer)Norm(Gated)?$")


def _sequence_parallel_mixer(module: nn.Module) -> bool:
    """A token mixer that is exact under sharding: a twin of ``lightning_seqpar.hf.hybrid``, or a
    transformers class that ``apply_hf_hybrid`` replaces by one."""
    return is_hybrid_twin(module) or type(module).__name__ in HYBRID_MIXERS


def find_token_mixers(model: nn.Module) -> list[str]:
    """Descriptions of the token mixers of ``model`` that are not attention and that the package does
    not make sequence-parallel (empty: none), each naming the module path, its class and the config
    field that makes it one. Local metadata only. Mixers of ``HYBRID_MIXERS`` (and their twins) are
    not listed, nor the ``config.layer_types`` entries of the layers that hold them, nor the
    modules holding them (whose class names often say Mamba / linear attention).

    Found structurally: ``config.layer_types`` entries outside :data:`ATTENTION_LAYER_TYPES` and
    :data:`POSITIONWISE_LAYER_TYPES`,
    ``torch.nn.Conv1d`` modules of kernel size > 1 (a causal depthwise convolution over the
    sequence, as in LFM2's short convolutions and every Mamba / DeltaNet block), and modules whose class name says Mamba,
    SSM, mixer, DeltaNet, linear / lightning attention, recurrent, RG-LRU, RWKV, xLSTM, Hyena,
    retention or short / causal convolution.
    """
    found: list[str] = []
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # multimodal models keep the decoder's config there
    exact = [(name, m) for name, m in model.named_modules() if _sequence_parallel_mixer(m)]
    # (RecurrentGemma's recurrent block keeps no layer_idx: its index is in its path, model.layers.<i>.temporal_block)
    exact_layers = {m.layer_idx if getattr(m, "layer_idx", None) is not None else decoder_layer_index(name) for name, m in exact}
    family = _mixer_named_family(model)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        for i, kind in enumerate(layer_types):
            if kind not in ATTENTION_LAYER_TYPES and kind not in POSITIONWISE_LAYER_TYPES and i not in exact_layers:
                found.append(f"decoder layer {i}: config.layer_types[{i}]={kind!r}")
    seen_inside: list[str] = [name for name, _ in exact]  # nothing of an exact mixer is listed
    for name, module in model.named_modules():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in seen_inside):
            continue  # one entry per mixer, not one per submodule of it
        cls = type(module).__name__
        if module is model or cls.endswith(("ForCausalLM", "Model", "LMHeadModel")):
            continue  # the model and its backbone (FalconMambaForCausalLM, MambaModel): name the layers inside
        if _NORM_CLASS_NAMES.search(cls):
            continue  # a norm over each token's features (Mamba2RMSNorm, MambaRMSNormGated): position-wise, whatever its name says
        if any(inner.startswith(name + ".") for inner, _ in exact):
            continue  # a block named for the exact mixer it holds (Mamba2Block, Zamba2MambaDecoderLayer, ...): its own
            # token mixing is that mixer's; any other mixer inside it is listed on its own
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:  # kernel 1 is pointwise: mixes no tokens
            found.append(f"{name!r} ({cls}: a convolution over the sequence, kernel {module.kernel_size[0]})")
            seen_inside.append(name)
        elif _says_mixer(cls.removeprefix(family)) and not _softmax_attention(module, layer_types):
            found.append(f"{name!r} ({cls})")
            seen_inside.append(name)
    return found


def _says_mixer(cls: str) -> bool:
    return bool(_MIXER_CLASS_NAMES.search(cls) or _SSM_CLASS_NAMES.search(cls))


def _mixer_named_family(model: nn.Module) -> str:
    """The model family's class-name prefix when the family's own name reads as a token mixer and the family's
    mixer has a twin (``RecurrentGemma``: its ``RecurrentGemmaMlp``, ``RecurrentGemmaRotaryEmbedding`` and
    ``RecurrentGemmaDecoderLayer`` are no mixers; its recurrent block is exact): the class names are then read
    without it. "" otherwise (RWKV's name reads as a mixer but it has no twin: every ``Rwkv*`` class is matched)."""
    for module in model.modules():
        match = re.fullmatch(r"(\w+?)(ForCausalLM|LMHeadModel|Model)", type(module).__name__)
        if match:
            family = match.group(1)
            return family if _says_mixer(family) and any(name.startswith(family) for name in HYBRID_MIXERS) else ""
    return ""


def _softmax_attention(module: nn.Module, layer_types: Any) -> bool:
    """A softmax attention layer that ``apply_hf_attention`` computes with the package's ``Attention``, whatever its
    class name says (Kimi Linear's ``KimiLinearAttention``): a transformers attention layer (softmax ``scaling``,
    ``is_causal``, the config) on a layer that ``config.layer_types`` says is attention."""
    layer_idx = getattr(module, "layer_idx", None)
    return (is_attention_layer(module) and isinstance(layer_types, (list, tuple)) and isinstance(layer_idx, int)
            and 0 <= layer_idx < len(layer_types) and layer_types[layer_idx] in ATTENTION_LAYER_TYPES)


def refuse_token_mixers(model: nn.Module) -> None:
    """Raise a ValueError naming every token mixer of ``model`` that is not attention (:func:`find_token_mixers`).

    Such a layer (convolution, SSM, linear attention, recurrence) would run on each rank's shard
    alone under sequence parallelism: a silent wrong answer. Local metadata only; called by
    ``apply_hf_attention``, before any communication.
    """
    found = find_token_mixers(model)
    if found:
        shown = "; ".join(found[:6]) + (f"; ... ({len(found)} in all)" if len(found) > 6 else "")
        raise ValueError(
            f"{type(model).__name__} mixes tokens with layers other than attention ({shown}): under sequence parallelism "
            "each would run on its rank's shard of the sequence alone (lightning_seqpar passes the state between ranks "
            f"only for {', '.join(sorted(HYBRID_MIXERS))}), so lightning_seqpar refuses it rather than train it wrongly. "
            "Use a model whose token mixers are attention or one of those, or train without sequence parallelism"
        )


def check_sharded_layer(module: nn.Module, *, seq_len: int, packed: bool = False) -> None:
    """Raise a ValueError for an attention layer that computes values from its LOCAL token indices,
    which are neither the global ones once the sequence is sharded nor the positions inside each
    document once documents are packed. Local metadata only. Call it when the sequence is sharded
    or packed (on one rank with whole sequences the local index is the position).

    Llama 4's NoPE layers with ``config.attn_temperature_tuning`` scale the queries by
    ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`` with ``i = arange(local length)``.
    Over a (global) sequence of ``seq_len < floor_scale`` tokens every factor is 1 whatever ``i``
    is (the floor is 0), so that is exact; from ``floor_scale`` tokens on it is refused.

    Args:
        module: a transformers attention layer.
        seq_len: the length of the whole (global, packed) sequence.
        packed: whether the batch holds packed documents (for the message).
    """
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        floor_scale = getattr(module, "floor_scale", None)
        if isinstance(floor_scale, (int, float)) and not isinstance(floor_scale, bool) and seq_len < floor_scale:
            return  # every scale is log1p(0) * attn_scale + 1 = 1
        layer_idx = getattr(module, "layer_idx", None)
        field = f"config.no_rope_layers[{layer_idx}]=0" if layer_idx is not None else "config.no_rope_layers"
        where = "the packed row (not in each document)" if packed else "the rank's shard (not in the whole sequence)"
        raise ValueError(
            f"{layer_name(module)} scales its queries with attention temperature tuning (config.attn_temperature_tuning="
            f"True on a NoPE layer, {field}, config.floor_scale={floor_scale}), computed from the token index inside "
            f"{where}: not exact at seq_len={seq_len} >= floor_scale with "
            + ("packed documents" if packed else "sequence parallelism")
            + ". Set config.attn_temperature_tuning=False, or train "
            + ("without packing (one document per sample)" if packed else "with sequence_parallel_size=1")
        )


# Note [Silent mismatches the sweep found]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Beyond the attention itself (which "seqpar" computes over the whole sequence), a layer that
# mixes tokens runs on each rank's shard alone and so silently sees a different sequence:
# recurrent / state-space / convolutional token mixers (Mamba, RWKV, xLSTM, short convolutions,
# linear-attention and DeltaNet layers, RG-LRU, Lightning attention). Those of
# ``lightning_seqpar.hf.hybrid.HYBRID_MIXERS`` are made exact (their state passed between ranks);
# :func:`check_model_supported` refuses the others by their module class and config field
# (:func:`refuse_token_mixers`), before any communication. Also refused here, all layers at
# once before any communication: DeepSeek Sparse Attention (an ``*Indexer`` module: top-k key
# selection over the whole sequence, which otherwise fails with a TypeError deep in the model).
# Sliding windows, attention chunks, soft-capping and sinks are not refused: "seqpar" reads them
# from the layer, its config and the call (Note [Reading a layer's attention features] in
# ``lightning_seqpar.hf.features``) and computes them exactly in every algorithm; the sweep checks
# that reading against the unmodified model, architecture by architecture.

def refuse_unseen_position_features(model: nn.Module, *, max_seq_len: int | None = None) -> None:
    """The part of :func:`check_model_supported` that ``apply_hf_attention`` runs besides :func:`refuse_token_mixers`:
    the silent-mismatch classes that the per-call code of ``lightning_seqpar.hf`` cannot see (DeepSeek Sparse Attention
    indexers). Local metadata only. ``max_seq_len``: accepted for the callers' sake; nothing that
    is refused here depends on the length."""
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", type(model).__name__)
    indexers = [(name, type(m).__name__) for name, m in model.named_modules() if type(m).__name__.endswith("Indexer")]
    if indexers:
        name, cls = indexers[0]
        raise ValueError(
            f"{type(model).__name__} (model_type={arch!r}) uses sparse attention with a lightning indexer ({cls} at "
            f"{name!r}: DeepSeek Sparse Attention, config.index_topk={getattr(config, 'index_topk', None)}), which picks "
            "each query's keys by a top-k over the whole sequence and passes them as a mask: the sequence-parallel "
            "attention is dense causal; train it without sequence parallelism"
        )


def check_model_supported(model: nn.Module, *, max_seq_len: int | None = None) -> None:
    """Refuse a transformers model whose sequence-parallel run would silently differ (Note [Silent mismatches the sweep found]).

    Reads only the model's classes and config (equal on every rank): no communication. Call it
    before the first step (``apply_hf_attention`` does).

    Args:
        model: a transformers ``PreTrainedModel``.
        max_seq_len: the longest global sequence to be trained on, if known.

    Raises:
        ValueError: naming the architecture, the layer or config field, and what to do instead.
    """
    refuse_unseen_position_features(model, max_seq_len=max_seq_len)
    refuse_token_mixers(model)  # the hybrid mixers that lightning_seqpar.hf.hybrid makes exact pass


# ---------------------------------------------------------------------------------------- the support sweep

SEQ_LEN = 32
"""The sweep's global sequence length (divisible by 2 x 4: zigzag over 4 ranks)."""

VOCAB = 128
MAX_PARAMS = 3_000_000  # a tiny model is far smaller; more means a size field was missed
WINDOW = 8  # a window / chunk shorter than SEQ_LEN: the feature bites
LONG = 64  # a window longer than SEQ_LEN: base configs
ORIGINAL = 24  # dynamic / LongRoPE original length: between the longest local (zigzag) extent and SEQ_LEN


class NotBuilt(Exception):
    """No tiny model of this architecture can be built generically (the message says why)."""


@dataclass(frozen=True)
class Feature:
    """A long-context feature: its name, what it is, and the config fields that switch it on."""

    name: str
    what: str
    fields: tuple[str, ...]


FEATURES: tuple[Feature, ...] = (
    Feature("sliding_window", f"sliding-window layers, window {WINDOW} < S={SEQ_LEN}",
            ("sliding_window", "use_sliding_window", "attention_window_size")),  # the last: RecurrentGemma's
    Feature("softcap", "attention / final logit soft-capping", ("attn_logit_softcapping", "final_logit_softcapping")),
    Feature("chunked", f"chunked attention, chunk {WINDOW} < S", ("attention_chunk_size",)),
    Feature("rope_dynamic", "dynamic-NTK RoPE, original length 24 < S", ("rope_parameters",)),
    Feature("rope_yarn", "YaRN RoPE, original length 16", ("rope_parameters",)),
    Feature("rope_longrope", "LongRoPE, original length 24 < S", ("rope_parameters",)),
    Feature("moe_aux", "MoE load-balancing loss (output_router_logits=True)", ("output_router_logits",)),
)
_FEATURES = {f.name: f for f in FEATURES}

# ---------------------------------------------------------------------------------------- tiny configs

# (field, value) applied when the architecture's default config has the field
_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32,
    "intermediate_size": 64, "ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "n_inner": 64,
    "ffn_hidden_size": 64, "dense_intermediate_size": 64, "intermediate_size_mlp": 64, "feed_forward_size": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 8, "attention_head_dim": 8, "kv_channels": 8, "dim_head": 8, "d_head": 8, "attention_head_size": 8,
    "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
    "qk_head_dim": 12, "v_head_dim": 8, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 2 * WINDOW,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "rotary_dim": 4, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_target_positions": 128,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_headdim": 8, "mamba_head_dim": 8,
    "mamba_num_heads": 4, "mamba_chunk_size": 8, "ssm_state_size": 8, "state_size": 8, "time_step_rank": 4,
    "mamba_dt_rank": 4, "mamba_d_ssm": 32,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_head_dim": 8, "linear_num_heads": 4, "lru_width": 32, "attention_window_size": LONG,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "initializer_range": 0.1, "router_jitter_noise": 0.0, "router_z_loss_coef": 0.0,
}
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_LAYER_LIST_FIELDS = ("layer_types", "layers_block_type", "mlp_layer_types", "attn_layers", "attention_layers",
                      "no_rope_layers", "layer_rope_theta", "num_attention_heads_per_layer", "activation_sparsity_pattern",
                      "indexer_types", "block_types")
_WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "local_attention_window_len", "window_size")
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "decoder_start_token_id")

# Per-architecture fields after the generic ones: keep every kind of layer in a tiny model
_OVERRIDES: dict[str, dict[str, Any]] = {
    "lfm2": {"full_attn_idxs": [1], "layer_types": None, "num_hidden_layers": 2},
    "lfm2_moe": {"full_attn_idxs": [1], "layer_types": None, "num_hidden_layers": 2, "num_dense_layers": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "num_hidden_layers": 2},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2},
    "bamba": {"mamba_d_head": 16},  # mamba_n_heads * mamba_d_head == mamba_expand * hidden_size
    "granitemoehybrid": {"mamba_d_head": 16, "layer_types": ["linear_attention", "full_attention"],
                         "num_hidden_layers": 2},  # Bamba's rule (its Mamba2 layer is Bamba's); one layer of each kind
    "nemotron_h": {"n_groups": 2},  # the Mamba2 groups must divide mamba_num_heads (4 in the tiny config)
    "dots3_note_text": {"num_key_value_heads": 4},
    # Zamba ties the shared attention block of every hybrid layer to the first one's (a regex over the OTHER hybrid
    # layers in ZambaModel._tied_weights_keys): with one hybrid layer it matches nothing and the model refuses to
    # build, so two hybrid layers (each also holds a Mamba layer) after a plain Mamba one
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # Mamba2: num_heads * head_dim == expand * hidden_size (validated), groups dividing the heads, several chunks
    "mamba2": {"head_dim": 16, "n_groups": 2, "chunk_size": 8},
    "zamba2": {"chunk_size": 8},  # several chunks of the SSD scan in S
    # the lightning attention first (its decay fades with the layer index), blocks shorter than S
    "minimax": {"layer_types": ["linear_attention", "full_attention"], "block_size": 8},
    "kimi_linear": {"num_experts_per_token": 2},  # top-2 of the 4 experts (the default 8 does not fit)
    # the default cycle (recurrent, recurrent, attention) leaves 2 layers without attention: one of each kind
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
}


def causal_lm_architectures() -> list[str]:
    """Every model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _default_config(model_type: str) -> Any:
    import transformers

    try:
        return transformers.AutoConfig.for_model(model_type)
    except Exception as error:  # noqa: BLE001 - any failure is a reason not to build
        raise NotBuilt(f"its default config does not build ({type(error).__name__}: {_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:160]


def _layer_selection(values: list[Any]) -> list[int]:
    """Indices of a short list of layers that keeps every distinct layer kind (in order), at least 2."""
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        seen.setdefault(repr(v), i)
    chosen = sorted(seen.values())
    for i in range(len(values)):
        if len(chosen) >= 2:
            break
        if i not in chosen:
            chosen = sorted({*chosen, i})
    return chosen


def _rope_parameters(config_dict: Mapping[str, Any], kind: str, head_dim: int) -> dict[str, Any]:
    base = dict(config_dict.get("rope_parameters") or {})
    theta = base.get("rope_theta", 10000.0)
    partial = base.get("partial_rotary_factor", config_dict.get("partial_rotary_factor", 1.0)) or 1.0
    params: dict[str, Any] = {"rope_theta": theta, "rope_type": kind.removeprefix("rope_")}
    if "partial_rotary_factor" in base:
        params["partial_rotary_factor"] = partial
    if kind == "rope_linear":
        params["factor"] = 4.0
    elif kind == "rope_dynamic":
        params.update(factor=4.0, original_max_position_embeddings=ORIGINAL)
    elif kind == "rope_yarn":
        params.update(factor=4.0, original_max_position_embeddings=16)
    elif kind == "rope_llama3":
        params.update(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    elif kind == "rope_longrope":
        n = int(head_dim * partial) // 2
        params.update(short_factor=[1.0 + 0.1 * i for i in range(n)], long_factor=[2.0 + 0.5 * i for i in range(n)],
                      original_max_position_embeddings=ORIGINAL, factor=4.0)
    return params


def _head_dim(fields: Mapping[str, Any]) -> int:
    for key in ("qk_rope_head_dim",):
        if fields.get(key):
            return int(fields[key])
    if fields.get("head_dim"):
        return int(fields["head_dim"])
    return int(fields.get("hidden_size", 32)) // int(fields.get("num_attention_heads", 4))


def features_of(model_type: str) -> list[str]:
    """The :data:`FEATURES` that ``model_type``'s config can switch on (by the fields it has)."""
    fields = _default_config(model_type).to_dict()
    out = []
    for feature in FEATURES:
        if feature.name.startswith("rope_"):
            params = fields.get("rope_parameters")
            if isinstance(params, Mapping) and "rope_theta" in params and not _is_per_layer(params):
                out.append(feature.name)
        elif any(f in fields for f in feature.fields):
            out.append(feature.name)
    return out


def _is_per_layer(params: Mapping[str, Any]) -> bool:
    return any(isinstance(v, Mapping) for v in params.values())


def tiny_config(model_type: str, feature: str | None = None) -> Any:
    """A tiny config of ``model_type`` ("base" when ``feature`` is None, else with :data:`FEATURES` ``feature`` on).

    Raises:
        NotBuilt: the architecture has no generic tiny text config (the message says why).
        ValueError: an unknown feature, or one the config has no field for.
    """
    import transformers

    if feature is not None and feature not in _FEATURES:
        raise ValueError(f"feature={feature!r} is not one of {sorted(_FEATURES)}")
    default = _default_config(model_type)
    fields = default.to_dict()
    for sub in ("vision_config", "audio_config", "vq_config", "encoder_config", "audio_encoder", "text_encoder",
                "depth_decoder_config", "audio_encoder_config", "patcher_config"):
        if fields.get(sub):
            raise NotBuilt(f"multimodal / composite config ({sub}); the text-only architecture is swept where transformers registers one")
    if getattr(default, "is_encoder_decoder", False):
        raise NotBuilt("encoder-decoder model (its causal-LM class is the decoder of a seq2seq model)")
    kwargs: dict[str, Any] = {k: v for k, v in _SIZES.items() if k in fields}
    for key, value in fields.items():  # no dropout anywhere: the comparison is deterministic
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
            kwargs[key] = 0.0
    n_default = next((fields[k] for k in _LAYER_COUNT_FIELDS if isinstance(fields.get(k), int)), None)
    chosen: list[int] | None = None
    for key in ("layer_types", "layers_block_type", "attn_layers", "block_types"):
        if isinstance(fields.get(key), list) and len(fields[key]) == n_default:
            chosen = _layer_selection(fields[key])
            break
    n_layers = len(chosen) if chosen else 2
    for key in _LAYER_COUNT_FIELDS:
        if key in fields:
            kwargs[key] = n_layers
    if chosen is not None:
        for key in _LAYER_LIST_FIELDS:
            value = fields.get(key)
            if isinstance(value, list) and len(value) == n_default:
                picked = [value[i] for i in chosen]
                kwargs[key] = None if key == "layer_types" and len(set(map(repr, picked))) == 1 else picked
    for key in _TOKEN_FIELDS:
        value = fields.get(key)
        if isinstance(value, int) and value >= VOCAB:
            kwargs[key] = VOCAB - 1 - _TOKEN_FIELDS.index(key)
        elif isinstance(value, list):
            kwargs[key] = [v if v < VOCAB else VOCAB - 1 for v in value if isinstance(v, int)] or None
    for key in _WINDOW_FIELDS:
        if isinstance(fields.get(key), int):
            kwargs[key] = LONG
    if "attention_chunk_size" in fields:
        kwargs["attention_chunk_size"] = LONG
    if "kv_lora_rank" in fields and "head_dim" in kwargs:  # multi-head latent attention: the rotary part is head_dim
        kwargs["head_dim"] = kwargs.get("qk_rope_head_dim", _SIZES["qk_rope_head_dim"])
    if "kv_lora_rank" in fields and "num_key_value_heads" in kwargs:  # latent K/V are expanded to every query head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    kwargs.update(_OVERRIDES.get(model_type, {}))
    if feature == "sliding_window":
        kwargs["sliding_window"] = WINDOW
        if "attention_window_size" in fields:  # RecurrentGemma's name for it (config.sliding_window maps to it)
            kwargs["attention_window_size"] = WINDOW
        if "use_sliding_window" in fields:
            kwargs["use_sliding_window"] = True
        if "max_window_layers" in fields:
            kwargs["max_window_layers"] = 1  # layer 0 full, the others sliding
    elif feature == "softcap":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key in fields:
                kwargs[key] = 0.5  # small: the cap bites even on a tiny model's logits
    elif feature == "chunked":
        kwargs["attention_chunk_size"] = WINDOW
    elif feature is not None and feature.startswith("rope_"):
        kwargs["rope_parameters"] = _rope_parameters(fields, feature, _head_dim({**fields, **kwargs}))
        if "original_max_position_embeddings" in fields:  # Phi-3 reads the top-level field
            kwargs["original_max_position_embeddings"] = kwargs["rope_parameters"].get("original_max_position_embeddings")
        # dynamic NTK recomputes its frequencies once positions pass max_position_embeddings
        kwargs["max_position_embeddings"] = ORIGINAL if feature == "rope_dynamic" else 64
    elif feature == "moe_aux":
        kwargs["output_router_logits"] = True
        for key in ("router_aux_loss_coef", "aux_loss_alpha", "aux_loss_coef"):
            if key in fields:
                kwargs[key] = 0.5
    if feature is not None and not any(f in fields for f in _FEATURES[feature].fields):
        raise ValueError(f"{model_type} has no config field for feature {feature!r} ({_FEATURES[feature].fields})")
    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as error:  # noqa: BLE001
        raise NotBuilt(f"the tiny config does not build ({type(error).__name__}: {_first_line(error)})") from None


def build_tiny_model(model_type: str, feature: str | None = None, *, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config(...))`` in fp32 from ``seed`` (raises :class:`NotBuilt`)."""
    import torch
    import transformers

    config = tiny_config(model_type, feature)
    try:
        with torch.device("meta"):  # count first: a field the shrinking misses must not allocate gigabytes
            n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).parameters())
        if n > MAX_PARAMS:
            raise NotBuilt(f"the tiny model still has {n / 1e6:.0f}M parameters (a component the generic shrinking misses)")
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except NotBuilt:
        raise
    except Exception as error:  # noqa: BLE001
        raise NotBuilt(f"the tiny model does not build ({type(error).__name__}: {_first_line(error)})") from None


# ---------------------------------------------------------------------------------------- the table


def make_record(results: Mapping[str, Any], *, known: Mapping[str, str],
                packed_lengths: Any = None) -> dict[str, Any]:
    """The sweep's JSON record: versions, settings and ``cases`` (``"arch/feature"`` -> status and runs).

    ``known``: ``"arch/feature"`` -> the known defect (being fixed elsewhere) that explains its mismatches.
    """
    import torch
    import transformers

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "seq_len": SEQ_LEN,
        "atol": 1e-5,
        "archs_walked": len({k.split("/")[0] for k in results}),
        "features": {f.name: f.what for f in FEATURES},
        "cases": {k: dict(v) for k, v in sorted(results.items())},
        "known_defects": dict(sorted(known.items())),
        **({"packed_lengths": [list(r) for r in packed_lengths]} if packed_lengths else {}),
    }


def _short(detail: str, n: int = 110) -> str:
    text = detail.replace("|", "/").replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def is_packed_run(where: str) -> bool:
    """A run on packed documents (``sp2/ring/docs``: document_ids, ``sp2/ring/pos``: restarting position_ids)."""
    return where.endswith(("/docs", "/pos"))


def _cell(case: Mapping[str, Any] | None, known: str | None, packed: bool = False) -> tuple[str, str | None]:
    """(table cell, note) of one (architecture, feature) case across its plain runs (``packed``: its packed ones)."""
    if case is None:
        return "", None
    if case["status"] != "ran":
        return case["status"], case.get("detail")
    runs = {w: r for w, r in case["runs"].items() if is_packed_run(w) == packed}
    if not runs:
        return "", None
    statuses = sorted({r["status"] for r in runs.values()})
    if statuses == ["exact"]:
        rounded = sorted(w for w, r in runs.items() if r.get("detail"))  # fp32 rounding, exact in float64 (tests' Note [Rounding or a defect])
        if rounded:
            return "exact", f"{', '.join(rounded)}: exact in float64 against transformers' SDPA; in fp32 " + runs[rounded[0]]["detail"].split(";")[0].removeprefix("fp32 ")
        return "exact", None
    if statuses == ["refused"]:
        detail = sorted({r["detail"] for r in runs.values()})[0]
        return "refused", detail
    bad = {w: r for w, r in runs.items() if r["status"] != "exact"}
    if "MISMATCH" in statuses:
        label = "MISMATCH (known)" if known else "MISMATCH"
    elif "error" in statuses:
        label = "error"
    else:
        label = "/".join(statuses)
    where = ", ".join(sorted(bad))
    first = bad[sorted(bad)[0]]
    note = f"{where}: " + (f"known defect: {known}" if known and label.startswith("MISMATCH") else first.get("detail", first["status"]))
    return label, note


def _plan(cases: Mapping[str, Any], base: bool, packed: bool = False) -> str:
    """The runs (``sp2/ring``, ...) that the record holds for base configs or for features (plain or packed)."""
    keys = sorted({w for k, c in cases.items() if k.endswith("/base") == base for w in c.get("runs", {})
                   if is_packed_run(w) == packed})
    return ", ".join(keys) if keys else "none"


def render_markdown(record: Mapping[str, Any]) -> str:
    """docs/hf_support.md from a sweep record (deterministic: the CI test compares it with the committed file)."""
    cases = record["cases"]
    known = record.get("known_defects", {})
    archs = sorted({k.split("/")[0] for k in cases})
    features = ["base", *record["features"]]
    order = {"MISMATCH": 0, "MISMATCH (known)": 1, "error": 2, "refused": 3, "not built": 4}

    def table(packed: bool) -> tuple[list[str], dict[str, int], list[str]]:
        counts: dict[str, int] = {}
        notes: dict[tuple[str, str], list[str]] = {}
        rows = []
        for arch in archs:
            cells = []
            for feature in features:
                key = f"{arch}/{feature}"
                case = cases.get(key)
                if packed and case is not None and case.get("status") != "ran":
                    case = None  # not built: said once, in the first table
                cell, note = _cell(case, known.get(key), packed)
                if cell:
                    counts[cell] = counts.get(cell, 0) + 1
                    if note:
                        notes.setdefault((cell, _short(note, 400)), []).append(key)
                cells.append(cell or "·")
            if not packed or any(c != "·" for c in cells):
                rows.append(f"| {arch} | " + " | ".join(cells) + " |")
        lines = [f"- **{cell}** {', '.join(f'`{k}`' for k in keys)}: {note}"
                 for (cell, note), keys in sorted(notes.items(), key=lambda item: (order.get(item[0][0], 9), item[1][0]))]
        head = ["| architecture | " + " | ".join(features) + " |", "|---|" + "---|" * len(features)]
        return head + rows, counts, lines

    plain_rows, counts, plain_notes = table(False)
    packed_rows, packed_counts, packed_notes = table(True)
    built = sum(1 for a in archs if cases.get(f"{a}/base", {}).get("status") == "ran")
    header = [
        "# Hugging Face causal LMs under sequence parallelism: the support table",
        "",
        "<!-- generated by `python -m lightning_seqpar.hf.support --record docs/hf_support.json --write docs/hf_support.md`"
        " from the record of `SEQPAR_HF_SWEEP=full pytest tests/test_hf_support.py`; do not edit by hand -->",
        "",
        f"Every causal-LM architecture registered in transformers {record['transformers']} "
        f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, torch {record['torch']}), as a tiny random fp32 model, its base config "
        f"and each long-context feature its config has, run on a gloo mesh (zigzag layout, S={record['seq_len']}; "
        f"base configs: {_plan(cases, True)}; features: {_plan(cases, False)}; `2d` is 2 x 2) and compared with the "
        f"unmodified model on the full sequence: logits, loss and every gradient at atol {record['atol']:g}. "
        "A cell is `exact` (every run matches), `refused` (a ValueError before any collective, every run), "
        "`MISMATCH` (a silent wrong answer; `(known)`: a defect being fixed), `error` (another exception) or "
        "`not built` (no generic tiny model); `·`: the config has no such feature. Notes below the table give the "
        "reasons. See Note [The Hugging Face support sweep] in `lightning_seqpar/hf/support.py`.",
        "",
        f"Architectures walked: {len(archs)}; built: {built}. Cells: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + "."
        + (" Packed documents: " + ", ".join(f"{k} {v}" for k, v in sorted(packed_counts.items())) + "." if packed_counts else ""),
        "",
        "Features: " + "; ".join(f"`{k}` {v}" for k, v in record["features"].items()) + ".",
        "",
    ]
    out = header + plain_rows + ["", "## Notes (one line per distinct reason)", "", *plain_notes, ""]
    if packed_counts:
        lengths = record.get("packed_lengths")
        out += [
            "## Packed documents",
            "",
            "The same architectures and features with packed documents: each sample holds several documents "
            + (f"(lengths {'; '.join(', '.join(map(str, r)) for r in lengths)}: longer and shorter than the window and "
               "chunk, than the original context of the rotary scalings, two long ones of different lengths, one of "
               "1 token) " if lengths else "")
            + "given as `document_ids` (runs `…/docs`) or as `position_ids` restarting at 0 (`…/pos`), sharded as the "
            f"strategy shards them ({_plan(cases, True, True)} for base configs; {_plan(cases, False, True)} for "
            "features), against EVERY DOCUMENT ALONE through a fresh copy of the unmodified model (positions from 0; "
            "the MoE router loss over all the documents' tokens). Cells as above; a run off by more than the fp32 "
            "tolerance is run again in float64 against transformers' SDPA, and counts as exact where it matches there "
            "(rounding; a wrong mask or position differs at any precision: Note [Rounding or a defect] in "
            "tests/test_hf_support.py), said in the notes.",
            "",
            *packed_rows,
            "",
            "### Notes (packed documents)",
            "",
            *packed_notes,
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_seqpar.hf.support --record R.json --write docs/hf_support.md``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--record", required=True, help="the sweep's JSON record (SEQPAR_HF_SWEEP_RECORD)")
    parser.add_argument("--write", required=True, help="the markdown file to write")
    args = parser.parse_args(argv)
    with open(args.record) as f:
        record = json.load(f)
    with open(args.write, "w") as f:
        f.write(render_markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
