"""Hugging Face ``transformers`` causal LMs under the package's attention (and so under the strategy).

Public names:

* :data:`ATTN_IMPLEMENTATION` (``"seqpar"``), :func:`register_attention` — the name and the
  registration of :func:`seqpar_attention_forward` / :func:`seqpar_attention_mask` with
  transformers' own ``AttentionInterface`` / ``AttentionMaskInterface``.
* :func:`apply_hf_attention` — switch a ``PreTrainedModel`` to ``"seqpar"`` and give each of its
  attention layers a parameter-free :class:`lightning_seqpar.attention.Attention` child.
* :class:`HFCausalLM` — a transformers causal LM behind the interface of the package's models
  (``forward(input_ids, position_ids, output=...)``, ``lm_head``, ``flops_per_token``).
* :func:`is_hf_source`, :func:`load_hf_config`, :func:`build_hf_causal_lm` — a model from a local
  folder, a ``PretrainedConfig`` or a dict with ``"model_type"``, with ``config_overrides``
  (:func:`apply_config_overrides`: fields changed before the model is built, checked).
* :func:`rope_extension` — the ``config_overrides`` that stretch a model's RoPE to a target length
  (linear, dynamic, YaRN, Llama 3, LongRoPE).
* :func:`save_hf_pretrained` — a consolidated ``save_pretrained`` folder of an FSDP2-sharded model.

Submodules, one concern each, in the order of their imports (each imports only those before it; the
order is drawn in docs/architecture.md):

* ``config`` (reading a config, overriding it, extending its RoPE), ``features`` (a layer's window /
  soft-capping / sinks / chunk size, read from the call, the layer and the config: ``attention_features``,
  ``attention_kwargs``), ``lora`` (LoRA through peft: applying, saving the adapters, peft's output head);
* ``rope`` (length-dependent rotary embeddings made global), ``moe`` (the router auxiliary loss across
  ranks), ``hybrid`` (the recurrent mixers of hybrid models replaced by sequence-parallel twins);
* ``support`` (what is exact and what is refused: ``refuse_token_mixers``, ``check_sharded_layer``,
  ``check_model_supported``; the support sweep's tiny models and the support table);
* ``attention`` (the ``AttentionInterface`` entry, :func:`apply_hf_attention`), ``fused`` (the fused RMSNorm / SwiGLU
  forward of Llama, Mistral, Qwen2 and Qwen3 layers: ``apply_hf_fused_kernels``);
* ``model`` (:class:`HFCausalLM`, building, saving);
* ``export`` (a package Llama as a transformers folder, a LoRA checkpoint's adapters and merged model, the
  run's tokenizer: what ``seqpar export --format hf | lora`` writes).

Note [Hugging Face models under the strategy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every attention layer of a modern transformers model (Llama, Mistral, Qwen2/3, Gemma, ...) calls

    ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)(
        self, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)

with ``query`` ``[B, H_q, S, D]`` and ``key``/``value`` ``[B, H_kv, S, D]`` (after RoPE). Nothing
of the model class is patched. :func:`apply_hf_attention`

1. registers ``"seqpar"`` with ``AttentionInterface`` (-> :func:`seqpar_attention_forward`) and
   with ``AttentionMaskInterface`` (-> :func:`seqpar_attention_mask`, which returns None: the
   attention is causal by construction, so no 4-D mask is ever materialised, whatever the length);
2. sets ``"seqpar"`` with the model's public ``set_attn_implementation``;
3. gives every attention layer a child ``seqpar_attention = Attention(causal=True, scale=layer.scaling)``.

The strategy's ``apply_attention`` finds those ``Attention`` children like the ones of the
package's own models and configures them with the sequence-parallel mesh (no global state: the
mesh lives on the module). :func:`seqpar_attention_forward` transposes to ``[B, S, H, D]`` and
calls ``layer.seqpar_attention(q, k, v)``: K/V keep their H_kv heads (GQA/MQA are never repeated,
neither in memory nor in communication).

Positions: the strategy's batch hook shards ``position_ids`` (the GLOBAL positions) with the
batch; :class:`HFCausalLM` passes them to the model, whose rotary embedding then sees each token's
position in the whole sequence. Without them a shard would get positions ``0..S_local-1``, so
:class:`HFCausalLM` refuses to run sequence-parallel without ``position_ids``.

Everything a layer does that depends on where its tokens sit is made exact under sharding and
with packed documents, or refused with a ``ValueError`` naming the layer and the config field,
before any communication (Note [Exact or refused: position-dependent layers of Hugging Face
models] in ``lightning_seqpar.hf.support``): windows, chunks, soft-capping and sinks are read from
the layer (Note [Reading a layer's attention features] in ``lightning_seqpar.hf.features``) and
computed by the package's attention (with packed documents, counted inside each document);
length-dependent rotary embeddings get the global length, or each document's own with packed
documents (``lightning_seqpar.hf.rope``); the MoE router loss is reduced over every rank; Llama 4
temperature tuning is exact below ``config.floor_scale`` and refused from there when sharded or
packed; token mixers other than attention are exact where the package has a sequence-parallel twin
and refused otherwise. Also refused: attention dropout > 0 in training
(``config.attention_dropout``), non-causal layers, padding or custom masks (a 2-D
``attention_mask`` with zeros, any 4-D mask), packed-sequence kwargs (``cu_seq_lens_*``: put
``document_ids`` in the batch instead), and a query length different from the key length
(KV-cache decoding: generate with ``model.set_attn_implementation("sdpa")``).

Right padding is exact without a mask (a causal token never attends to later ones): pad on the
right and set the labels of the padding to -100, as ``SequenceParallelStrategy`` checks.
"""

from lightning_seqpar.hf.attention import (
    ATTN_IMPLEMENTATION,
    MIN_TRANSFORMERS_VERSION,
    apply_hf_attention,
    register_attention,
    seqpar_attention_forward,
    seqpar_attention_mask,
)
from lightning_seqpar.hf.config import EXTENSIBLE_ROPE_TYPES, HFConfigSpec, apply_config_overrides, is_hf_source, load_hf_config, rope_extension
from lightning_seqpar.hf.model import CHUNKED_LOSS_MODEL_TYPES, HFCausalLM, build_hf_causal_lm, chunked_loss_serves, logit_transform, save_hf_pretrained

__all__ = [
    "HFConfigSpec",
    "ATTN_IMPLEMENTATION",
    "EXTENSIBLE_ROPE_TYPES",
    "CHUNKED_LOSS_MODEL_TYPES",
    "HFCausalLM",
    "MIN_TRANSFORMERS_VERSION",
    "apply_config_overrides",
    "apply_hf_attention",
    "build_hf_causal_lm",
    "chunked_loss_serves",
    "is_hf_source",
    "load_hf_config",
    "logit_transform",
    "register_attention",
    "rope_extension",
    "save_hf_pretrained",
    "seqpar_attention_forward",
    "seqpar_attention_mask",
]
