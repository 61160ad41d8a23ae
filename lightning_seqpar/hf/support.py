"""What of a transformers model is exact under sequence sharding, and the refusals of what is not.

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
* token mixers other than attention: those of ``lightning_seqpar.hf_hybrid.HYBRID_MIXERS``
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
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from lightning_seqpar.hf.features import layer_name
from lightning_seqpar.hf_hybrid import HYBRID_MIXERS, decoder_layer_index, is_hybrid_twin

__all__ = ["ATTENTION_LAYER_TYPES", "check_sharded_layer", "find_token_mixers", "refuse_token_mixers"]

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
    """A token mixer that is exact under sharding: a twin of ``lightning_seqpar.hf_hybrid``, or a
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
    from lightning_seqpar.hf.attention import _is_attention_layer  # here: that module imports this one

    layer_idx = getattr(module, "layer_idx", None)
    return (_is_attention_layer(module) and isinstance(layer_types, (list, tuple)) and isinstance(layer_idx, int)
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
