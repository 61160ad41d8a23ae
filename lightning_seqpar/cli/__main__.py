"""``python -m lightning_seqpar.cli``: the ``seqpar`` command."""

from lightning_seqpar.cli import main

if __name__ == "__main__":  # pragma: no cover
    main()
