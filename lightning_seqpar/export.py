"""Export a checkpoint of ``CausalLMModule``: one consolidated file, or a Hugging Face model folder.

    python -m lightning_seqpar.export CHECKPOINT OUTPUT --format consolidated
    python -m lightning_seqpar.export CHECKPOINT OUTPUT --format hf [--weights safetensors|bin] [--dtype bfloat16]
    python -m lightning_seqpar.export CHECKPOINT OUTPUT --format lora [--merged MERGED_DIR] [--dtype bfloat16]
    seqpar export ...                                    (the same, through the console script)

``CHECKPOINT`` is what the strategy saved: a folder of shards (``save_distributed_checkpoint=True``,
``torch.distributed.checkpoint`` plus Lightning's ``meta.pt``) or one full file. No process
group and no GPU are needed: the shards are read in one process.

* ``consolidated``: one ``torch.save`` file that is a complete Lightning checkpoint: the full
  model state dict, the full optimizer state (keyed by parameter name) and the rest (loops,
  schedulers, random states, hyper-parameters). ``trainer.fit(ckpt_path=...)`` under the
  strategy resumes from it on any mesh layout, and ``CausalLMModule.load_from_checkpoint`` reads it.
* ``hf``: ``config.json`` in ``LlamaForCausalLM`` form and the weights under Hugging Face names
  (``model.embed_tokens.weight``, ``model.layers.N...``, ``model.norm.weight``,
  ``lm_head.weight``) as ``model.safetensors`` (written here, no ``safetensors`` package needed)
  or ``pytorch_model.bin``. ``transformers.LlamaForCausalLM.from_pretrained(OUTPUT)`` loads it and
  computes the same logits: our Llama uses HF's rotate-half RoPE, RMSNorm and SwiGLU, and its
  parameter names are HF's without the ``model.`` prefix.
* ``lora``: a ``CausalLMModule(..., lora=...)`` checkpoint's adapters as a peft adapter folder
  (``PeftModel.save_pretrained``), and with ``--merged`` the model with the adapters merged as a
  plain transformers folder (``lightning_seqpar.lora.export_lora``; needs ``peft``).

The ``hf`` folder and the merged LoRA folder also get the tokenizer and the generation config
(Note [The tokenizer of an export]), so that ``AutoTokenizer.from_pretrained(OUTPUT)`` and a
text-generation pipeline load the folder as it is.

Note [The tokenizer of an export]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint holds no tokenizer, but its hyper-parameters say where the run's came from. The
first of these is copied into the export folder:

  1. ``--tokenizer`` (``tokenizer=``): a tokenizer folder or a ``tokenizer.json`` file;
  2. the model's own folder (``CausalLMModule(model=FOLDER)``, a local transformers folder) when it
     holds a tokenizer (``tokenizer.json`` or ``tokenizer_config.json``);
  3. the datamodule's ``tokenizer_path`` (``HFTextDataModule``, ``ChatDataModule``: Lightning keeps
     a datamodule's hyper-parameters in the checkpoint under ``datamodule_hyper_parameters``).

A folder's tokenizer files (:data:`TOKENIZER_FILES`, the chat templates included) are copied as
they are; a ``tokenizer.json`` file is written as a transformers tokenizer folder. The chat template
the run trained with (the datamodule's ``chat_template``, which replaces the tokenizer's) is written
into the copy. ``generation_config.json`` comes from the model's folder, else from the tokenizer's
folder. The source is loaded before anything is written and the copy after (a ``ValueError``
naming it when it does not load: ``AutoTokenizer`` for a folder). A source the hyper-parameters name that no longer exists is a ``ValueError`` that
names it and ``--tokenizer``; with no source at all nothing is copied and the command says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_seqpar.checkpoint_io import check_files
from lightning_seqpar.models.llama import LlamaConfig

__all__ = [
    "TOKENIZER_FILES", "TokenizerSource", "describe_tokenizer", "export_consolidated", "export_hf", "export_tokenizer", "hf_config",
    "hf_state_dict", "load_model_state_dict", "main", "tokenizer_source", "write_safetensors",
]

MODULE_PREFIX = "model."
"""Prefix of the Llama's parameters in ``CausalLMModule``'s state dict (its ``model`` attribute)."""

_META = "meta.pt"  # Lightning's name for the non-tensor part of a folder checkpoint


# --------------------------------------------------------------------------------------------- reading


def _is_folder_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / _META).is_file()


def _check_checkpoint(path: Path) -> None:
    if path.is_file() or _is_folder_checkpoint(path):
        check_files(path, owner="export")  # every file there and whole (Note [Checking a checkpoint's files])
        return
    if path.is_dir():
        raise ValueError(
            f"export: {str(path)!r} is not a complete distributed checkpoint (needs .metadata and {_META}); was its "
            "save interrupted? Pass another checkpoint"
        )
    raise FileNotFoundError(f"export: no checkpoint at {str(path)!r}")


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The non-tensor part of a checkpoint (hyper-parameters, loops, ...), without the model and optimizer."""
    path = Path(path)
    _check_checkpoint(path)
    if path.is_dir():
        return torch.load(path / _META, map_location="cpu", weights_only=True)
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


def load_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (CausalLMModule names, ``model.`` prefix), on CPU.

    For a folder of shards only the model's tensors are read (not the optimizer's).
    """
    path = Path(path)
    _check_checkpoint(path)
    if path.is_file():
        return dict(torch.load(path, mmap=True, map_location="cpu", weights_only=True)["state_dict"])
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "state_dict."
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    model = {
        key[len(prefix):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"export: {str(path)!r} holds no model tensors under 'state_dict' (keys: {sorted(metadata.state_dict_metadata)[:5]})")
    state = {"state_dict": model}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["state_dict"]


def llama_config(meta: Mapping[str, Any]) -> LlamaConfig:
    """The model's :class:`LlamaConfig` from the checkpoint's hyper-parameters (CausalLMModule's ``model``)."""
    from lightning_seqpar.models import LLAMA_CONFIGS

    hparams = meta.get("hyper_parameters") or {}
    model = hparams.get("model")
    if isinstance(model, str) and model in LLAMA_CONFIGS:
        return LlamaConfig.from_name(model)
    if isinstance(model, Mapping) and not {"glu_dim", "kv_comm"} & set(model):  # TransNormer / GPT fields
        return LlamaConfig(**model)
    raise ValueError(
        f"export: --format hf writes LlamaForCausalLM, but the checkpoint's model is {model!r}, not a Llama "
        "(CausalLMModule's hyper_parameters['model'] names a LlamaConfig or holds its fields); use --format consolidated"
    )


# --------------------------------------------------------------------------------------------- consolidated


def export_consolidated(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write ``checkpoint`` (folder or file) as one complete Lightning checkpoint file ``output``."""
    src, out = Path(checkpoint), Path(output)
    _check_checkpoint(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        full = torch.load(src, mmap=True, map_location="cpu", weights_only=True)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            flat = Path(tmp) / "shards.pt"
            dcp_to_torch_save(str(src), str(flat))  # every tensor of the folder, full size, in one process
            tensors = torch.load(flat, map_location="cpu", weights_only=True)
        full = load_meta(src)
        full["state_dict"] = tensors.pop("state_dict")
        full["optimizer_states"] = [tensors.pop(f"optimizer_{i}") for i in range(len(tensors)) if f"optimizer_{i}" in tensors]
    _atomic_save(full, out)
    return out


def _atomic_save(obj: Any, path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    os.replace(partial, path)


# --------------------------------------------------------------------------------------------- Hugging Face


def hf_config(config: LlamaConfig, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with the same architecture as ``config``."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # transformers 5.x
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "use_cache": True,
        "torch_dtype": dtype_name,  # transformers 4.x
        "dtype": dtype_name,  # transformers 5.x
    }


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename a CausalLMModule (or plain Llama) state dict to ``LlamaForCausalLM``'s names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key.removeprefix(MODULE_PREFIX) if key.startswith(MODULE_PREFIX) else key
        if name == "lm_head.weight":
            if config.tie_embeddings:
                continue  # HF ties it to model.embed_tokens.weight
            out[name] = value
        elif name.startswith(("embed_tokens.", "layers.", "norm.")):
            out["model." + name] = value
        else:
            raise ValueError(f"export: parameter {key!r} has no LlamaForCausalLM counterpart")
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not config.tie_embeddings else set())
    missing = expected - out.keys()
    if missing:
        raise ValueError(f"export: the state dict lacks {sorted(missing)}; is it a Llama checkpoint?")
    return out


_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` in the safetensors format (8-byte header length, JSON header, raw little-endian data).

    The format is small enough to write directly, so exporting needs no extra package.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"write_safetensors: {name!r} has dtype {tensor.dtype}, not one of {sorted(map(str, _SAFETENSORS_DTYPES))}")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
    os.replace(partial, path)


def export_hf(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    weights: Literal["safetensors", "bin"] = "safetensors",
    dtype: torch.dtype | None = None,
    tokenizer: str | os.PathLike | None = None,
) -> Path:
    """Write ``checkpoint``'s model as a Hugging Face ``LlamaForCausalLM`` folder ``output``, with the run's tokenizer
    and generation config where the checkpoint names them (:func:`tokenizer_source`).

    Args:
        weights: "safetensors" (``model.safetensors``) or "bin" (``pytorch_model.bin``).
        dtype: cast the floating-point weights (e.g. ``torch.bfloat16``); None keeps theirs.
        tokenizer: a tokenizer folder or ``tokenizer.json`` file to copy instead of the one the checkpoint names
            (Note [The tokenizer of an export]).
    """
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"export_hf: weights={weights!r} is not supported; expected 'safetensors' or 'bin'")
    src, out = Path(checkpoint), Path(output)
    meta = load_meta(src)
    config = llama_config(meta)
    source = tokenizer_source(meta, tokenizer=tokenizer)  # checked before anything is written
    tensors = hf_state_dict(load_model_state_dict(src), config)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    weight_dtype = next(iter(tensors.values())).dtype
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype=weight_dtype), indent=2) + "\n")
    if weights == "safetensors":
        write_safetensors(tensors, out / "model.safetensors")
    else:
        _atomic_save({k: v.contiguous() for k, v in tensors.items()}, out / "pytorch_model.bin")
    if source is not None:
        export_tokenizer(source, out)
    return out


# --------------------------------------------------------------------------------------------- the tokenizer

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
"""The files of a transformers tokenizer folder that an export copies (with ``additional_chat_templates/``)."""

_GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class TokenizerSource:
    """Where an export's tokenizer comes from (Note [The tokenizer of an export])."""

    path: Path
    """A tokenizer folder or a ``tokenizer.json`` file."""
    origin: str
    """How it was found: "--tokenizer", "the model folder" or "the datamodule's tokenizer_path"."""
    chat_template: str | None = None
    """The chat template the run trained with, where the datamodule replaced the tokenizer's."""
    generation_config: Path | None = None
    """The ``generation_config.json`` to copy (the model folder's, else the tokenizer folder's)."""


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def tokenizer_source(meta: Mapping[str, Any], *, tokenizer: str | os.PathLike | None = None,
                     owner: str = "export") -> TokenizerSource | None:
    """The tokenizer an export of a checkpoint with hyper-parameters ``meta`` copies: ``tokenizer``, else the model's
    folder, else the datamodule's ``tokenizer_path`` (Note [The tokenizer of an export]); None when there is none.
    Raises ``ValueError`` naming a given or recorded source that is not a tokenizer folder or ``tokenizer.json`` file."""
    model = (meta.get("hyper_parameters") or {}).get("model")
    data = meta.get("datamodule_hyper_parameters") or {}
    template = data.get("chat_template") if isinstance(data.get("chat_template"), str) else None
    is_folder = isinstance(model, (str, os.PathLike)) and (Path(model) / "config.json").is_file()  # a transformers folder
    model_folder = Path(model) if is_folder else None
    if tokenizer is not None:
        path, origin, what = Path(tokenizer), "--tokenizer", f"{owner}: --tokenizer {str(tokenizer)!r}"
    elif model_folder is not None and _has_tokenizer(model_folder):
        path, origin, what = model_folder, "the model folder", ""
    elif data.get("tokenizer_path") is not None:
        path, origin = Path(data["tokenizer_path"]), "the datamodule's tokenizer_path"
        what = (f"{owner}: the checkpoint's datamodule trained with tokenizer_path={str(path)!r}, which is gone or changed; "
                "pass --tokenizer DIR (that tokenizer's folder)")
    else:
        return None
    if not ((path.is_dir() and _has_tokenizer(path)) or (path.is_file() and path.suffix == ".json")):
        raise ValueError((what or f"{owner}: {str(path)!r}") + " is neither a tokenizer folder (with tokenizer.json or "
                         "tokenizer_config.json) nor a tokenizer.json file")
    _load_tokenizer(path, why=f"{owner}: the tokenizer at {str(path)!r} ({origin})")  # before anything is written
    generation = next((folder / _GENERATION_CONFIG for folder in (model_folder, path if path.is_dir() else None)
                       if folder is not None and (folder / _GENERATION_CONFIG).is_file()), None)
    return TokenizerSource(path, origin, template, generation)


def export_tokenizer(source: TokenizerSource, output: str | os.PathLike, *, owner: str = "export") -> Path:
    """Copy ``source``'s tokenizer (files and chat template) and generation config into the folder ``output`` and check
    that ``AutoTokenizer`` loads it (Note [The tokenizer of an export])."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if source.path.is_dir():
        for name in TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copyfile(source.path / name, out / name)
        if (source.path / "additional_chat_templates").is_dir():
            shutil.copytree(source.path / "additional_chat_templates", out / "additional_chat_templates", dirs_exist_ok=True)
    if source.generation_config is not None:
        shutil.copyfile(source.generation_config, out / _GENERATION_CONFIG)
    if not source.path.is_dir():
        _load_tokenizer(source.path, why=f"{owner}: {str(source.path)!r}").save_pretrained(os.fspath(out))
    loaded = _load_tokenizer(out, why=f"{owner}: the tokenizer copied from {str(source.path)!r} into {str(out)!r}")
    if source.chat_template is not None and loaded.chat_template != source.chat_template:
        loaded.chat_template = source.chat_template  # the template the run trained with
        loaded.save_pretrained(os.fspath(out))
    return out


def _load_tokenizer(path: Path, *, why: str) -> Any:
    """``AutoTokenizer`` of a folder, ``PreTrainedTokenizerFast`` of a ``tokenizer.json``; a ``ValueError`` starting with
    ``why`` when it does not load."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f"{why}: copying the tokenizer needs transformers: pip install 'lightning-seqpar[hf]'") from error
    try:
        if path.is_dir():
            return transformers.AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
        return transformers.PreTrainedTokenizerFast(tokenizer_file=os.fspath(path))
    except Exception as error:  # transformers' OSError / ValueError, the tokenizers library's plain Exception
        raise ValueError(f"{why} does not load as a tokenizer ({type(error).__name__}: {error}); pass --tokenizer DIR "
                         "(a folder that AutoTokenizer loads)") from error


def describe_tokenizer(source: TokenizerSource | None) -> str:
    """The line ``seqpar export`` prints about the tokenizer."""
    if source is None:
        return ("no tokenizer copied: the checkpoint names neither a model folder with a tokenizer nor a datamodule "
                "tokenizer_path; pass --tokenizer DIR for a folder that AutoTokenizer loads")
    extra = (", the run's chat template" if source.chat_template else "") + (", generation_config.json" if source.generation_config else "")
    return f"tokenizer copied from {str(source.path)!r} ({source.origin}{extra})"


# --------------------------------------------------------------------------------------------- CLI

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(args: Sequence[str] | None = None) -> None:
    """``python -m lightning_seqpar.export`` / ``seqpar export``."""
    parser = argparse.ArgumentParser(prog="seqpar export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a folder of shards or a full checkpoint file written under SequenceParallelStrategy")
    parser.add_argument("output", help="consolidated: the output file; hf: the output folder; lora: the adapter folder")
    parser.add_argument("--format", choices=("consolidated", "hf", "lora"), default="consolidated")
    parser.add_argument("--weights", choices=("safetensors", "bin"), default="safetensors", help="hf only: file format of the weights")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="hf: cast the weights; lora: cast the merged model")
    parser.add_argument("--merged", default=None, help="lora only: also write the model with the adapters merged into this folder")
    parser.add_argument("--tokenizer", default=None, help="hf, lora --merged: copy this tokenizer folder (or tokenizer.json) "
                        "into the export; default: the model's folder, else the datamodule's tokenizer_path")
    ns = parser.parse_args(args)
    if ns.merged is not None and ns.format != "lora":
        parser.error("--merged applies to --format lora only")
    if ns.tokenizer is not None and not (ns.format == "hf" or ns.merged is not None):
        parser.error("--tokenizer applies to --format hf and to --format lora with --merged")
    dtype = _DTYPES[ns.dtype] if ns.dtype else None
    if ns.format == "consolidated":
        if ns.dtype is not None or ns.weights != "safetensors":
            parser.error("--dtype and --weights apply to --format hf only")
        print(f"wrote {export_consolidated(ns.checkpoint, ns.output)}")
        return
    if ns.format == "lora":
        from lightning_seqpar.lora import export_lora

        if ns.weights != "safetensors":
            parser.error("--weights applies to --format hf only")
        if ns.dtype is not None and ns.merged is None:
            parser.error("--dtype with --format lora casts the merged model: add --merged")
        path = export_lora(ns.checkpoint, ns.output, merged=ns.merged, dtype=dtype, tokenizer=ns.tokenizer)
    else:
        path = export_hf(ns.checkpoint, ns.output, weights=ns.weights, dtype=dtype, tokenizer=ns.tokenizer)
    print(f"wrote {path}" + (f" and {ns.merged}" if ns.merged is not None else ""))
    if ns.format == "hf" or ns.merged is not None:
        print(describe_tokenizer(tokenizer_source(load_meta(ns.checkpoint), tokenizer=ns.tokenizer)))


if __name__ == "__main__":  # pragma: no cover
    main()
