"""Deprecated path: the support table and the refusals are :mod:`lightning_seqpar.hf.support`.

This module only re-exports that module's public names, for one release, with a ``DeprecationWarning``;
``python -m lightning_seqpar.hf_support`` still writes the table (``python -m lightning_seqpar.hf.support``).
"""

import sys
import warnings

from lightning_seqpar.hf.support import (
    FEATURES,
    LONG,
    MAX_PARAMS,
    ORIGINAL,
    SEQ_LEN,
    VOCAB,
    WINDOW,
    Feature,
    NotBuilt,
    build_tiny_model,
    causal_lm_architectures,
    check_model_supported,
    features_of,
    is_packed_run,
    main,
    make_record,
    refuse_unseen_position_features,
    render_markdown,
    tiny_config,
)

__all__ = ["FEATURES", "LONG", "MAX_PARAMS", "ORIGINAL", "SEQ_LEN", "VOCAB", "WINDOW", "Feature", "NotBuilt", "build_tiny_model",
           "causal_lm_architectures", "check_model_supported", "features_of", "is_packed_run", "main", "make_record",
           "refuse_unseen_position_features", "render_markdown", "tiny_config"]

warnings.warn("lightning_seqpar.hf_support is deprecated: import from lightning_seqpar.hf.support instead "
              "(the old path will be removed in the next release)", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(main())
