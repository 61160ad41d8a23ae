"""``seqpar plan`` and ``seqpar memory``: what fits, from the command line, without a GPU.

    seqpar plan --model llama3-8b --seq 1M --gpus 4 --gpu-memory H200
    seqpar plan --model /path/to/hf-model --seq 128K,512K --gpus 1,8 --gpu-memory 80GB
    seqpar memory --model llama3-8b --seq 512K,1M --device-memory 150.1 --sp 4

``seqpar plan`` prints, per model, length and GPU count, what ``attention="auto"`` picks across
nodes, the step around it, and what ``memory="auto"`` sets for it with its estimate per GPU, or
the longest length that fits (Note [Planning a step across nodes] in ``lightning_seqpar.planner.step_plan``).
``seqpar memory`` prints the memory planner's choice alone, for a given sequence-parallel size.
Both run the planner the strategy runs (Note [Planning memory] in ``lightning_seqpar.planner.memory``).

A model (``--model``) is one of the package's (:data:`lightning_seqpar.planner.step_plan.MODELS`, or a
config name of ``lightning_seqpar.models``), a local Hugging Face model folder (its
``config.json`` is read; nothing is downloaded) or a ``config.json`` file. A GPU
(``--gpu-memory``) is a size (``80GB``: 10^9 bytes; ``75GiB``: 2^30) or a card:
``H100`` (80 GB marketed; torch reports 85.0 GB) or ``H200`` (141 GB marketed; torch reports
150.1 GB), the memory ``memory="auto"`` plans for on that card.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from lightning_seqpar.attention.cost import DeviceProfile
from lightning_seqpar.planner.memory import PARAM_BYTES, TransformerShape, plan_memory
from lightning_seqpar.planner.step_plan import GPU_MEMORY, MODELS, MemorySetting, ModelShape, all_linear_lora, table

__all__ = ["memory_main", "parse_gpu_memory", "parse_lengths", "parse_size", "plan_main", "resolve_model"]


def parse_lengths(text: str) -> list[int]:
    """``"128K,1M,8"`` -> [131072, 1048576, 8]; a ValueError for anything else."""
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = 1048576 if part.endswith("M") else 1024 if part.endswith("K") else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"expected positive integers with an optional K or M suffix, comma-separated (e.g. 128K,1M), got {text!r}")
        out.append(int(digits) * scale)
    return out


def parse_gpu_memory(text: str) -> tuple[float, str]:
    """A GPU's memory in bytes and the name of its cost-model profile ("H100" or "H200"): ``H100`` / ``H200`` (what
    torch reports for the card, :data:`~lightning_seqpar.planner.step_plan.GPU_MEMORY`), or a size ``80GB`` / ``80`` (10^9
    bytes) / ``75GiB`` (2^30 bytes), timed as an H200. A ValueError for anything else."""
    name = text.strip().upper()
    if name in GPU_MEMORY:
        return GPU_MEMORY[name], name
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GB|GIB)?", name)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"expected a size (80GB, 141GB, 75GiB; a bare number is GB) or a GPU name ({', '.join(GPU_MEMORY)}), "
                         f"got {text!r}")
    return float(match.group(1)) * (2**30 if match.group(2) == "GIB" else 1e9), "H200"


def parse_size(text: str) -> float:
    """A memory size in bytes: ``250GB`` / ``250`` (10^9 bytes) or ``240GiB`` (2^30 bytes), > 0 and finite. A ValueError
    naming the forms for anything else."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GB|GIB)?", str(text).strip().upper())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"expected a size > 0 (250GB, 240GiB; a bare number is GB), got {text!r}")
    return float(match.group(1)) * (2**30 if match.group(2) == "GIB" else 1e9)


def resolve_model(text: str) -> ModelShape:
    """The decoder ``--model`` names: one of :data:`~lightning_seqpar.planner.step_plan.MODELS`, a config name of the package,
    a local Hugging Face model folder or a ``config.json`` file. A ValueError naming what was expected, and for a model
    the memory estimate does not model (linear attention, experts, recurrent layers)."""
    if text in MODELS:
        return MODELS[text]
    from lightning_seqpar.models.registry import is_named_config, resolve_config

    config: Any
    if is_named_config(text):
        config = resolve_config(text, owner="--model")
    elif os.path.isfile(os.path.join(text, "config.json")) or (os.path.isfile(text) and text.endswith(".json")):
        from transformers import AutoConfig

        if os.path.isdir(text):
            config = AutoConfig.from_pretrained(text, local_files_only=True)
        else:
            with open(text) as f:
                fields = json.load(f)
            if "model_type" not in fields:
                raise ValueError(f"{text!r} has no 'model_type': it is not a transformers config.json")
            config = AutoConfig.for_model(**fields)
    else:
        raise ValueError(f"{text!r} is neither one of the package's models ({', '.join(sorted(MODELS))}, or a config name of "
                         "lightning_seqpar.models), a local Hugging Face model folder (with config.json) nor a config.json file")
    name = text
    if os.path.exists(text):  # a folder's name; a config.json's folder
        path = os.path.normpath(os.path.abspath(text))
        name = os.path.basename(os.path.dirname(path) if os.path.basename(path) == "config.json" else path)
    return ModelShape.from_transformer_shape(name, TransformerShape.from_config(config))


def _memory_setting(ap: argparse.ArgumentParser, args: argparse.Namespace, gpu_memory: float) -> MemorySetting:
    host_memory = None
    if args.host_memory is not None:
        try:
            host_memory = parse_size(args.host_memory)
        except ValueError as error:
            ap.error(f"--host-memory: {error}")
    if args.precision not in PARAM_BYTES:
        ap.error(f"--precision: {args.precision!r} is not one of the Trainer precisions the planner models: "
                 f"{', '.join(sorted(PARAM_BYTES))}")
    for flag, value in (("--loss-chunk", args.loss_chunk), ("--lora-r", args.lora_r)):
        if value < 0:
            ap.error(f"{flag}: expected an int >= 0, got {value}")
    return MemorySetting(gpu_memory=gpu_memory, host_memory=host_memory,
                         precision=args.precision, loss_chunk_size=args.loss_chunk or None, lora_r=args.lora_r)


def _common_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host-memory", default=None, help="host memory available per GPU: 250GB, 240GiB or a bare number of GB "
                    "(default: unchecked)")
    ap.add_argument("--precision", default="bf16-mixed", help="the Trainer's precision (bf16-mixed, bf16-true, 32-true)")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="CausalLMModule's loss_chunk_size (0: the full logits)")
    ap.add_argument("--lora-r", type=int, default=0, help="LoRA rank on every linear layer (0: full training)")


def _check_lengths_and_gpus(ap: argparse.ArgumentParser, seqs: Sequence[int], gpus: Sequence[int]) -> None:
    """Every GPU count splits every length it is planned for (one sequence over all the GPUs: a multiple of the count);
    a length shorter than a GPU count is left out of the table, and nothing left is an error, not an empty table."""
    for w in gpus:
        for s in seqs:
            if s >= w and s % w:
                ap.error(f"--gpus {w}: the sequence of --seq {s} is split over all {w} GPUs and must be a multiple of {w} "
                         f"(choose a length such as {s - s % w if s - s % w >= w else w} or another GPU count)")
    if not any(s >= w for s in seqs for w in gpus):
        ap.error(f"--seq {','.join(map(str, seqs))}: every length is shorter than the GPU counts {','.join(map(str, gpus))}: "
                 "a GPU holds at least one token of the sequence; nothing to plan")


def plan_main(argv: Sequence[str] | None = None) -> None:
    """``seqpar plan``: what fits across GPUs (module docstring)."""
    ap = argparse.ArgumentParser(prog="seqpar plan", description="What attention='auto' picks across nodes, the step around it, "
                                 "and what memory='auto' sets for it (Note [Planning a step across nodes] in "
                                 "lightning_seqpar.planner.step_plan).")
    ap.add_argument("--model", default="llama3-8b,llama-70b,llama-33h",
                    help=f"comma-separated: of {sorted(MODELS)}, a config name of the package, a local Hugging Face model "
                         "folder or a config.json file")
    ap.add_argument("--seq", default="128K,512K,1M,4M", help="sequence lengths, e.g. 128K,1M")
    ap.add_argument("--gpus", default="8,64,256,1024", help="GPU counts (one sequence over all of them)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-memory", default="H200", help="H100, H200 (what torch reports for the card) or a size: 80GB, 75GiB")
    _common_arguments(ap)
    args = ap.parse_args(argv)
    models = []
    for name in args.model.split(","):
        try:
            models.append(resolve_model(name))
        except ValueError as error:
            ap.error(f"--model: {error}")
    lengths = {}
    for flag, text in (("--seq", args.seq), ("--gpus", args.gpus)):
        try:
            lengths[flag] = parse_lengths(text)
        except ValueError as error:
            ap.error(f"{flag}: {error}")
    if args.gpus_per_node < 1:
        ap.error(f"--gpus-per-node: expected a positive integer, got {args.gpus_per_node}")
    try:
        gpu_memory, card = parse_gpu_memory(args.gpu_memory)
    except ValueError as error:
        ap.error(f"--gpu-memory: {error}")
    memory = _memory_setting(ap, args, gpu_memory)
    _check_lengths_and_gpus(ap, lengths["--seq"], lengths["--gpus"])
    profile = (DeviceProfile.h100 if card == "H100" else DeviceProfile.h200)(gpus_per_node=args.gpus_per_node)
    print("\n".join(table(models, lengths["--seq"], lengths["--gpus"], gpus_per_node=args.gpus_per_node, memory=memory,
                          profile=profile)))


def memory_main(argv: Sequence[str] | None = None) -> None:
    """``seqpar memory``: what ``memory="auto"`` would choose (or why it refuses) for a model, lengths and a device,
    without a GPU: the same estimate and planner the strategy runs at set-up."""
    ap = argparse.ArgumentParser(prog="seqpar memory", description=(memory_main.__doc__ or "").split(":", 1)[0] +
                                 " (Note [Planning memory] in lightning_seqpar.planner.memory).")
    ap.add_argument("--model", required=True, help="a model of the package (llama3-8b, llama-7b, ...), a local Hugging Face "
                                                    "model folder (its config.json is read) or a config.json file")
    ap.add_argument("--seq", required=True, help="sequence lengths, e.g. 128K,512K,1M")
    ap.add_argument("--device-memory", required=True,
                    help="GB per GPU as torch reports total_memory (an H200: 150.1, an H100 80GB: 85.0), or H100 / H200")
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks")
    ap.add_argument("--dp-shard", type=int, default=1, help="data-parallel ranks FSDP2 shards over besides them")
    _common_arguments(ap)
    ap.set_defaults(precision="bf16-true")
    args = ap.parse_args(argv)
    try:
        seqs = parse_lengths(args.seq)
    except ValueError as error:
        ap.error(f"--seq: {error}")
    try:
        shape = resolve_model(args.model).transformer_shape
    except ValueError as error:
        ap.error(f"--model: {error}")
    try:
        device_memory, _ = parse_gpu_memory(args.device_memory)
    except ValueError as error:
        ap.error(f"--device-memory: {error}")
    for flag, value in (("--sp", args.sp), ("--dp-shard", args.dp_shard)):
        if value < 1:
            ap.error(f"{flag}: expected a positive integer, got {value}")
    memory = _memory_setting(ap, args, device_memory)
    trainable, targets = all_linear_lora(shape, memory.lora_r)
    for seq in seqs:
        try:
            plan = plan_memory(model_shape=shape, seq_len=seq, device_memory=device_memory, sp=args.sp, dp_shard=args.dp_shard,
                               precision=memory.precision, loss_chunk_size=memory.loss_chunk_size, trainable_params=trainable,
                               lora_targets=targets, host_memory=memory.host_memory, owner="seqpar memory")
            print(plan.describe())
        except ValueError as error:
            print(f"seq_len={seq}: {error}")
