"""Where a model keeps its transformer blocks: by the containers' names, by structure, or as the user names them.

Note [Finding the blocks of a user's model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Checkpointing, compile, FSDP2 and the routed attention apply per block, so the strategy must know
which modules are "the blocks". The package's models and transformers models keep them in an
``nn.ModuleList`` named ``layers``, ``h`` or ``blocks`` (``BLOCK_CONTAINERS``), found by name.
A user's model may call them anything (``self.transformer.h``, ``self.decoder``, ``self.stack``)
and may keep them on the LightningModule itself; so where no container of those names exists,
the blocks are found by structure: the longest ``nn.ModuleList`` or ``nn.Sequential`` whose
children are all of one class (a tie goes to the first in module order), at least two of them.
A model where that is ambiguous (two stacks of one length: an encoder and a decoder) names its
container with the strategy's ``blocks="decoder.layers"`` option. The container found is marked
(``mark_blocks``), and every ``apply_*`` function then finds the same blocks.
"""

from __future__ import annotations

from torch import nn

__all__ = ["BLOCK_CONTAINERS", "MARK", "block_container_by_name", "is_marked", "mark_blocks", "stacks_by_structure"]

BLOCK_CONTAINERS: tuple[str, ...] = ("layers", "h", "blocks")
"""Names of the ``nn.ModuleList`` attributes whose elements are transformer blocks."""

MARK = "_seqpar_blocks"
"""The attribute set on a container whose children are the model's blocks (``mark_blocks``)."""


def is_marked(module: nn.Module) -> bool:
    return bool(getattr(module, MARK, False))


def mark_blocks(container: nn.Module) -> None:
    """Mark ``container`` (an ``nn.ModuleList`` / ``nn.Sequential``): its children are the blocks."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"blocks: expected an nn.ModuleList or nn.Sequential of transformer blocks, got {type(container).__name__}")
    object.__setattr__(container, MARK, True)


def has_named_container(model: nn.Module) -> bool:
    """Whether ``model`` holds an ``nn.ModuleList`` named one of :data:`BLOCK_CONTAINERS`, or a marked container."""
    return any(is_marked(m) for m in model.modules()) or any(
        name.rsplit(".", 1)[-1] in BLOCK_CONTAINERS and isinstance(m, nn.ModuleList) for name, m in model.named_modules())


def stacks_by_structure(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.ModuleList`` / ``nn.Sequential`` under ``model`` (itself included) whose children, at least two, are
    all of one class, longest first (module order among equals) as ``(dotted name, container)``."""
    stacks = []
    for order, (name, module) in enumerate(model.named_modules()):
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            stacks.append((-len(children), order, name, module))
    return [(name, module) for _, _, name, module in sorted(stacks, key=lambda s: (s[0], s[1]))]


def block_container_by_name(model: nn.Module, path: str, *, owner: str) -> nn.Module:
    """The container at the dotted ``path`` under ``model`` (the strategy's ``blocks`` option), or a ValueError."""
    try:
        container = model.get_submodule(path)
    except AttributeError:
        stacks = [name for name, _ in stacks_by_structure(model)]
        raise ValueError(f"{owner}: blocks={path!r} names no module of {type(model).__name__}; "
                         f"the lists of same-class modules it holds are {stacks or 'none'}") from None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"{owner}: blocks={path!r} is a {type(container).__name__}; name the nn.ModuleList or nn.Sequential "
                         "that holds the transformer blocks")
    return container


def find_block_container(model: nn.Module, *, blocks: str | None, owner: str) -> nn.Module | None:
    """Mark and return the container of ``model``'s blocks where the names of :data:`BLOCK_CONTAINERS` do not find
    them (Note [Finding the blocks of a user's model]): ``blocks`` (a dotted path) if given, else the longest stack of
    same-class modules; None where the named containers already find them, or nothing qualifies."""
    if blocks is not None:
        container = block_container_by_name(model, blocks, owner=owner)
        mark_blocks(container)
        return container
    if has_named_container(model):
        return None
    stacks = stacks_by_structure(model)
    if not stacks:
        return None
    if len(stacks) > 1 and len(list(stacks[1][1].children())) == len(list(stacks[0][1].children())) \
            and not _nested(stacks[0][1], stacks[1][1]):
        raise ValueError(
            f"{owner}: {type(model).__name__} holds several lists of same-class modules of the same length "
            f"({stacks[0][0]!r}, {stacks[1][0]!r}), so which are the transformer blocks is ambiguous; name them "
            f"with SequenceParallelStrategy(blocks={stacks[0][0]!r})")
    mark_blocks(stacks[0][1])
    return stacks[0][1]


def _nested(a: nn.Module, b: nn.Module) -> bool:
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())
