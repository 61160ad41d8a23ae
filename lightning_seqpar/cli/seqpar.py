"""The ``seqpar`` command: LightningCLI over :class:`~lightning_seqpar.CausalLMModule`.

    seqpar fit --config quickstart                        (a recipe shipped in the package, by name; a path works too)
    seqpar fit --config recipes/llama_gqa.yaml --trainer.max_steps 100
    seqpar recipes                                        (the shipped recipes, one line each)
    seqpar recipes cp llama_gqa [DEST]                    (a copy to edit: ./llama_gqa.yaml by default)
    seqpar validate --config recipes/quickstart.yaml --ckpt_path ...
    seqpar export CHECKPOINT OUTPUT --format hf           (lightning_seqpar.cli.export; not a Trainer command)
    seqpar plan --model llama3-8b --seq 128K,1M --gpus 4,64 --gpu-memory H200   (what fits: lightning_seqpar.cli.plan)
    seqpar memory --model llama3-8b --seq 512K,1M --device-memory 150.1   (memory="auto"'s choice; no GPU needed)

Any LightningDataModule can be given as ``data.class_path`` (subclass mode), e.g.
``lightning_seqpar.data.LongRangeDataModule`` or ``lightning_seqpar.data.TokenFileDataModule``;
the strategy as ``trainer.strategy.class_path: lightning_seqpar.SequenceParallelStrategy``
(or a registered name such as ``trainer.strategy: seqpar_ring``).
"""

from __future__ import annotations

import difflib
import inspect
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import lightning
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_seqpar.strategy  # noqa: F401 - registers the "seqpar*" strategy names
from lightning_seqpar.training.module import CausalLMModule

SUBCOMMANDS: tuple[str, ...] = ("fit", "validate", "test")


def _accepted_names() -> set[str]:
    """Argument names of the classes a recipe configures (for "did you mean" hints)."""
    import dataclasses

    from lightning.pytorch import LightningDataModule, Trainer

    import lightning_seqpar.data as data
    import lightning_seqpar.models as models
    from lightning_seqpar.strategy import SequenceParallelStrategy
    from lightning_seqpar.training.preemption import PreemptionCheckpoint

    names: set[str] = set()
    for obj in vars(models).values():
        if dataclasses.is_dataclass(obj) and isinstance(obj, type):
            names |= {f.name for f in dataclasses.fields(obj)}
    datamodules = [obj for obj in vars(data).values() if isinstance(obj, type) and issubclass(obj, LightningDataModule)]
    for cls in (Trainer, CausalLMModule, SequenceParallelStrategy, PreemptionCheckpoint, *datamodules):
        names |= set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
    return names


_UNKNOWN = (re.compile(r"Option '([^']+)' is not accepted"), re.compile(r"unrecognized arguments: (.*)"))


def unknown_key_hints(message: str, accepted: Iterable[str] | None = None) -> list[str]:
    """For each unknown key named in a jsonargparse error, a hint with the closest accepted names."""
    accepted = sorted(_accepted_names() if accepted is None else accepted)
    keys: list[str] = []
    for pattern in _UNKNOWN:
        for match in pattern.finditer(message):
            for token in match.group(1).split():
                key = token.lstrip("-").split("=", 1)[0].rsplit(".", 1)[-1]
                if key and key not in keys:
                    keys.append(key)
    hints = []
    for key in keys:
        close = difflib.get_close_matches(key, accepted, n=3, cutoff=0.5)
        fix = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "remove it or check the spelling"
        hints.append(f"unknown key {key!r}: {fix} (`seqpar fit --help` lists every accepted key)")
    return hints


class SeqparArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors about unknown keys also suggest the closest accepted keys."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        hints = unknown_key_hints(message)
        if hints:
            message = message.rstrip() + "\n" + "\n".join(f"hint: {h}" for h in hints)
        super().error(message, ex)


# Note [The progress bar under max_steps]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every recipe trains for max_steps and leaves max_epochs unset, which Lightning turns into
# max_epochs=-1 ("no limit"). Its default bar where `rich` is installed, RichProgressBar, then
# titles the bar "Epoch 1/-2" (max_epochs - 1; Lightning-AI/pytorch-lightning#21925, fixed there
# after 2.6). So `seqpar` adds TQDMProgressBar, which titles it "Epoch 1" and counts the steps
# left, when the config trains by steps, names no progress bar and leaves enable_progress_bar on:
# before the classes are built (a callback in the recipes would clash with
# --trainer.enable_progress_bar=false, which Lightning refuses next to a progress bar callback).

TQDM_PROGRESS_BAR = "lightning.pytorch.callbacks.TQDMProgressBar"


def step_progress_bar(trainer: Any) -> bool:
    """Add :data:`TQDM_PROGRESS_BAR` to a parsed ``trainer`` config (a jsonargparse Namespace) that trains by
    ``max_steps`` without ``max_epochs``, names no progress bar and leaves the bar on (Note [The progress bar
    under max_steps]). Returns whether it added it."""
    import pydoc

    from jsonargparse import Namespace
    from lightning.pytorch.callbacks import ProgressBar

    steps, epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    if trainer.get("enable_progress_bar") is False or steps in (None, -1) or epochs not in (None, -1):
        return False
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]

    def is_bar(callback: Any) -> bool:
        cls = pydoc.locate(callback.get("class_path", "")) if isinstance(callback, Namespace) else type(callback)
        return isinstance(cls, type) and issubclass(cls, ProgressBar)

    if any(map(is_bar, callbacks)):
        return False
    trainer.callbacks = [*callbacks, Namespace(class_path=TQDM_PROGRESS_BAR)]
    return True


class SeqparCLI(LightningCLI):
    """LightningCLI limited to fit / validate / test; a run by steps gets a progress bar that reads "Epoch N"
    (Note [The progress bar under max_steps])."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: spec for name, spec in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("trainer") is not None:
            step_progress_bar(config.trainer)


def make_cli(args: Sequence[str] | None = None, **kwargs: Any) -> SeqparCLI:
    """Build (and by default run) the CLI; ``args`` replaces ``sys.argv[1:]``; ``kwargs`` go to LightningCLI."""
    kwargs.setdefault("parser_class", SeqparArgumentParser)
    own = names_a_module_class(sys.argv[1:] if args is None else args)
    return SeqparCLI(
        lightning.LightningModule if own else CausalLMModule,  # Note [A recipe of your own LightningModule]
        subclass_mode_model=own,
        datamodule_class=None,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        **kwargs,
    )


# Note [A recipe of your own LightningModule]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A recipe's ``model:`` is CausalLMModule's arguments. A recipe whose ``model:`` has a ``class_path`` names another
# LightningModule instead (``lightning_seqpar.training.litgpt.LitGPTModule``, or a module of the user's own whose blocks call
# ``F.scaled_dot_product_attention``: docs/own_model.md), with its ``init_args``; the CLI then takes the model in
# LightningCLI's subclass mode, and everything else of the recipe (trainer, strategy, data) reads as before.


def names_a_module_class(argv: Sequence[str]) -> bool:
    """Whether a ``--config`` file of ``argv`` gives ``model.class_path`` (Note [A recipe of your own LightningModule])."""
    import yaml

    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if value is None or not Path(value).is_file():
            continue
        try:
            config = yaml.safe_load(Path(value).read_text())
        except (OSError, yaml.YAMLError):
            continue
        model = config.get("model") if isinstance(config, dict) else None
        if isinstance(model, dict) and "class_path" in model:
            return True
    return any(a.startswith("--model.class_path") or a.startswith("--model=") for a in argv)


# Note [Shipped recipes]
# ~~~~~~~~~~~~~~~~~~~~~~
# The recipes are package data (lightning_seqpar/recipes/, the repository's recipes/ links to it), so
# an installed wheel has them: `--config NAME` (or `--config recipes/NAME.yaml`, as the docs write it)
# that names no file is read from the shipped recipe NAME, before LightningCLI parses the arguments; a
# file that exists always wins. `seqpar recipes` lists them, each with the first line of its comment
# (a one-line summary), and `seqpar recipes cp NAME [DEST]` copies one out for editing, as torchtune's
# `tune ls` / `tune cp`.

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def recipe_names() -> list[str]:
    """The shipped recipes by name: their path under :data:`RECIPES_DIR` without ``.yaml`` (``slurm/...`` included)."""
    return sorted(p.relative_to(RECIPES_DIR).with_suffix("").as_posix() for p in RECIPES_DIR.rglob("*.yaml"))


def recipe_summary(path: Path) -> str:
    """A recipe's one-line summary: the first line of its leading comment."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip()
            if text:
                return text
        elif line.strip():
            break
    return ""


def recipe_path(value: str) -> Path | None:
    """The shipped recipe ``value`` names (``NAME``, ``NAME.yaml`` or ``recipes/NAME.yaml``), or None."""
    name = value.replace("\\", "/").removesuffix(".yaml").removesuffix(".yml")
    name = name.removeprefix("./").removeprefix("recipes/")
    return RECIPES_DIR / f"{name}.yaml" if name in recipe_names() else None


def _looks_like_a_name(value: str) -> bool:
    return re.fullmatch(r"[\w./\\-]+", value) is not None  # not inline YAML ("trainer: {...}")


def resolve_recipe_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--config`` / ``-c`` value that names no file but a shipped recipe replaced by its path
    (Note [Shipped recipes]); a value that is neither raises a ValueError listing the closest recipe names."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            j, value, prefix = i + 1, out[i + 1], ""
        elif arg.startswith("--config="):
            j, value, prefix = i, arg.split("=", 1)[1], "--config="
        else:
            continue
        if not value or Path(value).exists() or not _looks_like_a_name(value):
            continue
        shipped = recipe_path(value)
        if shipped is None:
            close = difflib.get_close_matches(Path(value).stem, recipe_names(), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"--config {value}: no such file and no shipped recipe of that name{hint} "
                             "(`seqpar recipes` lists the shipped recipes)")
        out[j] = prefix + str(shipped)
    return out


def recipes_main(argv: Sequence[str]) -> None:
    """``seqpar recipes``: list the shipped recipes; ``seqpar recipes cp NAME [DEST]``: copy one out to edit."""
    import argparse

    ap = argparse.ArgumentParser(prog="seqpar recipes", description="The recipes shipped in the package "
                                 "(run one with `seqpar fit --config NAME`).")
    sub = ap.add_subparsers(dest="command")
    cp = sub.add_parser("cp", help="copy a recipe out for editing")
    cp.add_argument("name", help="a recipe name, as `seqpar recipes` lists them")
    cp.add_argument("dest", nargs="?", default=None, help="file or existing folder (default: ./NAME.yaml)")
    cp.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    args = ap.parse_args(list(argv))
    if args.command is None:
        names = recipe_names()
        width = max(map(len, names))
        for name in names:
            print(f"{name:<{width}}  {recipe_summary(RECIPES_DIR / f'{name}.yaml')}")
        return
    source = recipe_path(args.name)
    if source is None:
        close = difflib.get_close_matches(args.name, recipe_names(), n=3, cutoff=0.5)
        ap.exit(2, f"seqpar recipes cp: no recipe named {args.name!r}"
                   f"{'; did you mean ' + ' or '.join(close) + '?' if close else ''} (`seqpar recipes` lists them)\n")
    dest = Path(args.dest) if args.dest is not None else Path(source.name)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        ap.exit(2, f"seqpar recipes cp: {dest} exists (--force overwrites it)\n")
    shutil.copyfile(source, dest)
    print(f"{dest}  (run it: seqpar fit --config {dest})")


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``seqpar`` console script; ``seqpar export ...`` runs ``lightning_seqpar.cli.export``."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["export"]:
        from lightning_seqpar.cli.export import main as export_main

        export_main(argv[1:])
        return
    if argv[:1] == ["plan"]:
        from lightning_seqpar.cli.plan import plan_main

        plan_main(argv[1:])
        return
    if argv[:1] == ["memory"]:
        from lightning_seqpar.cli.plan import memory_main

        memory_main(argv[1:])
        return
    if argv[:1] == ["recipes"]:
        recipes_main(argv[1:])
        return
    try:
        argv = resolve_recipe_args(argv)
    except ValueError as err:
        sys.exit(f"seqpar: {err}")
    make_cli(argv)


if __name__ == "__main__":  # pragma: no cover
    main()
