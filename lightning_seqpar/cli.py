"""The ``seqpar`` command: LightningCLI over :class:`~lightning_seqpar.CausalLMModule`.

    seqpar fit --config recipes/quickstart.yaml
    seqpar fit --config recipes/llama_gqa.yaml --trainer.max_steps 100
    seqpar validate --config recipes/quickstart.yaml --ckpt_path ...

Any LightningDataModule can be given as ``data.class_path`` (subclass mode), e.g.
``lightning_seqpar.data.LongRangeDataModule`` or ``lightning_seqpar.data.TokenFileDataModule``;
the strategy as ``trainer.strategy.class_path: lightning_seqpar.SequenceParallelStrategy``
(or a registered name such as ``trainer.strategy: seqpar_ring``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_seqpar.strategy  # noqa: F401 - registers the "seqpar*" strategy names
from lightning_seqpar.module import CausalLMModule

SUBCOMMANDS: tuple[str, ...] = ("fit", "validate", "test")


class SeqparCLI(LightningCLI):
    """LightningCLI limited to fit / validate / test."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: spec for name, spec in LightningCLI.subcommands().items() if name in SUBCOMMANDS}


def make_cli(args: Sequence[str] | None = None, **kwargs: Any) -> SeqparCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]``; ``kwargs`` go to LightningCLI."""
    return SeqparCLI(
        CausalLMModule,
        datamodule_class=None,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        **kwargs,
    )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``seqpar`` console script."""
    make_cli(args)


if __name__ == "__main__":  # pragma: no cover
    main()
