"""The quickstart's control run: the same recipe with attention cut at shard borders.

    python benchmarks/quickstart_cut_attention.py [extra seqpar fit arguments]

Batches are sharded exactly as in ``seqpar fit --config recipes/quickstart.yaml``, but every
``Attention`` module is switched back to local attention after the strategy configured it, so a
rank's tokens attend only within its own shard. In the copy task the second half of a sequence
repeats the first, and under the zigzag layout no rank holds a chunk together with the chunk it
copies: with attention cut, the copy-half validation loss cannot fall below ln(vocab) = ln 64 =
4.159. The quickstart itself (ring attention across shards) drives it near 0.
"""

from __future__ import annotations

import sys

from lightning_seqpar.attention import Attention
from lightning_seqpar.strategy import SequenceParallelStrategy


class CutAttentionStrategy(SequenceParallelStrategy):
    """SequenceParallelStrategy whose attention sees only the local shard (a control, not a product)."""

    def _parallelize(self, module):
        super()._parallelize(module)
        for m in module.modules():
            if isinstance(m, Attention):
                m.configure(mesh=None)


if __name__ == "__main__":
    from lightning_seqpar.cli import main

    if sys.argv[1:2] != ["fit"]:  # Lightning's launcher re-runs this script with the arguments below
        sys.argv = [sys.argv[0], "fit", "--config", "recipes/quickstart.yaml",
                    "--trainer.strategy.class_path", "__main__.CutAttentionStrategy",
                    "--trainer.logger.init_args.save_dir", "outputs/quickstart_cut", *sys.argv[1:]]
    main()
