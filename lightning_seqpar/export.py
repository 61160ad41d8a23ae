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
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_seqpar.models.llama import LlamaConfig

__all__ = [
    "export_consolidated", "export_hf", "hf_config", "hf_state_dict", "load_model_state_dict", "main", "write_safetensors",
]

MODULE_PREFIX = "model."
"""Prefix of the Llama's parameters in ``CausalLMModule``'s state dict (its ``model`` attribute)."""

_META = "meta.pt"  # Lightning's name for the non-tensor part of a folder checkpoint


# --------------------------------------------------------------------------------------------- reading


def _is_folder_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / _META).is_file()


def _check_checkpoint(path: Path) -> None:
    if path.is_file() or _is_folder_checkpoint(path):
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
) -> Path:
    """Write ``checkpoint``'s model as a Hugging Face ``LlamaForCausalLM`` folder ``output``.

    Args:
        weights: "safetensors" (``model.safetensors``) or "bin" (``pytorch_model.bin``).
        dtype: cast the floating-point weights (e.g. ``torch.bfloat16``); None keeps theirs.
    """
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"export_hf: weights={weights!r} is not supported; expected 'safetensors' or 'bin'")
    src, out = Path(checkpoint), Path(output)
    config = llama_config(load_meta(src))
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
    return out


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
    ns = parser.parse_args(args)
    if ns.merged is not None and ns.format != "lora":
        parser.error("--merged applies to --format lora only")
    if ns.format == "consolidated":
        if ns.dtype is not None or ns.weights != "safetensors":
            parser.error("--dtype and --weights apply to --format hf only")
        path = export_consolidated(ns.checkpoint, ns.output)
    elif ns.format == "lora":
        from lightning_seqpar.lora import export_lora

        if ns.weights != "safetensors":
            parser.error("--weights applies to --format hf only")
        if ns.dtype is not None and ns.merged is None:
            parser.error("--dtype with --format lora casts the merged model: add --merged")
        path = export_lora(ns.checkpoint, ns.output, merged=ns.merged, dtype=_DTYPES[ns.dtype] if ns.dtype else None)
    else:
        path = export_hf(ns.checkpoint, ns.output, weights=ns.weights, dtype=_DTYPES[ns.dtype] if ns.dtype else None)
    print(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    main()
