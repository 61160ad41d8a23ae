"""Deprecated path: the recurrent mixers' sequence-parallel twins are :mod:`lightning_seqpar.hf.hybrid`.

This module only re-exports that module's public names, for one release, with a ``DeprecationWarning``.
"""

import warnings

from lightning_seqpar.hf.hybrid import (
    HYBRID_MIXERS,
    SeqparFalconH1Mixer,
    SeqparGatedDeltaNet,
    SeqparKimiDeltaAttention,
    SeqparLightningAttention,
    SeqparMamba2Mixer,
    SeqparMambaMixer,
    SeqparOlmoHybridGatedDeltaNet,
    SeqparRecurrentGemmaRecurrentBlock,
    SeqparShortConv,
    SeqparZambaMambaMixer,
    apply_hf_hybrid,
    configure_recurrence,
    decoder_layer_index,
    is_hybrid_twin,
)

__all__ = ["HYBRID_MIXERS", "SeqparFalconH1Mixer", "SeqparGatedDeltaNet", "SeqparKimiDeltaAttention", "SeqparLightningAttention",
           "SeqparMamba2Mixer", "SeqparMambaMixer", "SeqparOlmoHybridGatedDeltaNet", "SeqparRecurrentGemmaRecurrentBlock",
           "SeqparShortConv", "SeqparZambaMambaMixer",
           "apply_hf_hybrid", "configure_recurrence", "decoder_layer_index", "is_hybrid_twin"]

warnings.warn("lightning_seqpar.hf_hybrid is deprecated: import from lightning_seqpar.hf.hybrid instead "
              "(the old path will be removed in the next release)", DeprecationWarning, stacklevel=2)
