"""The ``seqpar`` command (``main``): ``seqpar.py`` (``seqpar fit`` / ``validate`` / ``test`` through LightningCLI, the
shipped recipes, the subcommands' dispatch), ``plan.py`` (``seqpar plan`` / ``seqpar memory``), ``export.py``
(``seqpar export``)."""

from __future__ import annotations

from lightning_seqpar.cli.seqpar import main

__all__ = ["main"]
