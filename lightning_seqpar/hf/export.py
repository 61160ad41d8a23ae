"""Transformers folders from a checkpoint of ``CausalLMModule``, in one process and without a GPU.

Public names:

* :func:`export_hf` — the package's Llama as a transformers ``LlamaForCausalLM`` folder: ``config.json``
  (:func:`hf_config`) and the weights under Hugging Face names (:func:`hf_state_dict`) as ``model.safetensors``
  (:func:`write_safetensors`: no ``safetensors`` package needed) or ``pytorch_model.bin``;
* :func:`export_lora` — a ``CausalLMModule(..., lora=...)`` checkpoint's adapters as a peft adapter folder and,
  on request, the model with the adapters merged as a plain transformers folder (needs ``peft``);
* :func:`tokenizer_source`, :func:`export_tokenizer`, :func:`describe_tokenizer`, :class:`TokenizerSource`,
  :data:`TOKENIZER_FILES` — the run's tokenizer and generation config that both folders carry.

``seqpar export CHECKPOINT OUTPUT --format hf | lora`` (``lightning_seqpar.cli.export``) calls them; the
checkpoint is read by ``lightning_seqpar.parallel.checkpoint_io`` (a folder of shards or one full file).

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

import fnmatch
import json
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_seqpar.hf.config import is_hf_source
from lightning_seqpar.hf.lora import apply_lora
from lightning_seqpar.hf.model import build_hf_causal_lm
from lightning_seqpar.models.llama import LlamaConfig
from lightning_seqpar.parallel.checkpoint_io import atomic_save, check_module_checkpoint, load_meta, load_model_state_dict

__all__ = [
    "MODULE_PREFIX", "TOKENIZER_FILES", "WEIGHT_FILES", "TokenizerSource", "describe_tokenizer", "export_hf", "export_lora", "export_tokenizer",
    "hf_config", "hf_state_dict", "tokenizer_source", "write_safetensors",
]

MODULE_PREFIX = "model."
"""Prefix of the Llama's parameters in ``CausalLMModule``'s state dict (its ``model`` attribute)."""

_LORA_MODULE_PREFIX = "model.hf."
"""Prefix of the peft model's parameters in ``CausalLMModule``'s state dict (CausalLMModule -> HFCausalLM -> PeftModel)."""


# --------------------------------------------------------------------------------------------- the output folder

# Note [Exports that cannot mix]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers loads the weights it finds first: a folder holding an earlier ``model.safetensors``
# beside a new ``pytorch_model.bin`` (or shards of another export) loads the STALE weights. So an
# export never writes into a folder that already holds weight files (:data:`WEIGHT_FILES`): it
# refuses, naming them and ``--overwrite``; with ``overwrite=True`` the export is written into a
# fresh folder beside it (``.NAME.partial``) and only then takes the old folder's place (the old one
# is renamed aside, the new one renamed in, the old one removed): at no moment does the folder hold
# the weights of two exports, and a failed export leaves the old folder as it was.

WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors", "model-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model-*.bin",
    "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin", "tf_model.h5", "flax_model.msgpack",
)
"""The names of the weight files transformers and peft load from a folder (Note [Exports that cannot mix])."""


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The weight files (:data:`WEIGHT_FILES`) in ``folder``, sorted; none when it does not exist."""
    path = Path(folder)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, w) for w in WEIGHT_FILES))


def check_output_folder(folder: str | os.PathLike, *, overwrite: bool, owner: str = "export") -> None:
    """Refuse a ``folder`` that holds weights of another export unless ``overwrite`` (Note [Exports that cannot mix]);
    a file in its place is refused too."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{owner}: the output {str(path)!r} is a file; an export writes a folder")
    found = weight_files(path)
    if found and not overwrite:
        raise ValueError(f"{owner}: the output folder {str(path)!r} already holds weights of another export ({', '.join(found)}); "
                         "transformers would load whichever it finds first. Choose an empty folder, or pass --overwrite "
                         "(overwrite=True) to replace the folder")


@contextmanager
def output_folder(folder: str | os.PathLike, *, overwrite: bool, owner: str = "export") -> Iterator[Path]:
    """The folder to write an export into (Note [Exports that cannot mix]): ``folder`` itself when it holds no weights;
    with ``overwrite`` and weights there, a fresh folder beside it that replaces it once the block has written it."""
    path = Path(folder)
    check_output_folder(path, overwrite=overwrite, owner=owner)
    if not weight_files(path):
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    staging = path.with_name(f".{path.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    aside = path.with_name(f".{path.name}.replaced")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    os.replace(staging, path)
    shutil.rmtree(aside, ignore_errors=True)


# --------------------------------------------------------------------------------------------- the package's Llama


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
    overwrite: bool = False,
) -> Path:
    """Write ``checkpoint``'s model as a Hugging Face ``LlamaForCausalLM`` folder ``output``, with the run's tokenizer
    and generation config where the checkpoint names them (:func:`tokenizer_source`).

    Args:
        weights: "safetensors" (``model.safetensors``) or "bin" (``pytorch_model.bin``).
        dtype: cast the floating-point weights (e.g. ``torch.bfloat16``); None keeps theirs.
        tokenizer: a tokenizer folder or ``tokenizer.json`` file to copy instead of the one the checkpoint names
            (Note [The tokenizer of an export]).
        overwrite: replace an ``output`` folder that holds weights (else refused: Note [Exports that cannot mix]).
    """
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"export_hf: weights={weights!r} is not supported; expected 'safetensors' or 'bin'")
    src, out = Path(checkpoint), Path(output)
    check_output_folder(out, overwrite=overwrite)  # before the checkpoint is read
    meta = load_meta(src)
    check_module_checkpoint(meta, src)
    config = llama_config(meta)
    source = tokenizer_source(meta, tokenizer=tokenizer)  # checked before anything is written
    tensors = hf_state_dict(load_model_state_dict(src), config)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    weight_dtype = next(iter(tensors.values())).dtype
    with output_folder(out, overwrite=overwrite) as folder:  # Note [Exports that cannot mix]
        (folder / "config.json").write_text(json.dumps(hf_config(config, dtype=weight_dtype), indent=2) + "\n")
        if weights == "safetensors":
            write_safetensors(tensors, folder / "model.safetensors")
        else:
            atomic_save({k: v.contiguous() for k, v in tensors.items()}, folder / "pytorch_model.bin")
        if source is not None:
            export_tokenizer(source, folder)
    return out


# --------------------------------------------------------------------------------------------- LoRA


def export_lora(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    merged: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the adapters of a ``CausalLMModule(..., lora=...)`` checkpoint as a peft adapter folder
    ``output`` and, with ``merged``, the model with the adapters merged (``merge_and_unload``) as a
    plain transformers folder. One process, no GPU (the checkpoint's shards are read here).

    The model is rebuilt from the checkpoint's hyper-parameters (``model``: the local base folder,
    or the transformers config; ``config_overrides``; ``lora``: the LoRA fields), then the checkpoint's weights (base and
    adapters) are loaded into it, so the adapter folder and the merged model are those of the
    trained module. The merged folder also gets the run's tokenizer and generation config
    (Note [The tokenizer of an export]).

    Args:
        dtype: cast the merged model's floating-point weights (e.g. ``torch.bfloat16``); None
            keeps the checkpoint's. The adapters keep theirs (fp32).
        tokenizer: with ``merged``, a tokenizer folder or ``tokenizer.json`` file to copy instead of the
            one the checkpoint names.
        overwrite: replace ``output`` / ``merged`` folders that hold weights (else refused: Note [Exports that cannot mix]).
    """
    if tokenizer is not None and merged is None:
        raise ValueError("export_lora: tokenizer= is copied into the merged model's folder; give merged= as well")
    src, out = Path(checkpoint), Path(output)
    for folder in (out, *([] if merged is None else [Path(merged)])):
        check_output_folder(folder, overwrite=overwrite)  # before the checkpoint is read
    meta = load_meta(src)
    check_module_checkpoint(meta, src)
    hparams = meta.get("hyper_parameters") or {}
    spec, source = hparams.get("lora"), hparams.get("model")
    if not spec:
        raise ValueError(f"export: {str(src)!r} is not a LoRA checkpoint (its hyper_parameters have no 'lora'); use --format hf or consolidated")
    if source is None or not is_hf_source(source):
        raise ValueError(f"export: the checkpoint's model {source!r} is not a Hugging Face model (a local folder or a config with 'model_type')")
    tokenizer_from = tokenizer_source(meta, tokenizer=tokenizer) if merged is not None else None  # checked before writing
    state = load_model_state_dict(src)
    peft_state = {k[len(_LORA_MODULE_PREFIX):]: v for k, v in state.items() if k.startswith(_LORA_MODULE_PREFIX)}
    if len(peft_state) != len(state):
        raise ValueError(f"export: unexpected keys outside {_LORA_MODULE_PREFIX!r}: {sorted(set(state))[:5]}")
    base_dtype = next(v.dtype for k, v in peft_state.items() if ".lora_" not in k and v.is_floating_point())  # bf16 after "bf16-true"
    base = build_hf_causal_lm(source, dtype=base_dtype, config_overrides=hparams.get("config_overrides"))  # as trained
    peft_model = apply_lora(base, spec)
    missing, unexpected = peft_model.load_state_dict(peft_state, strict=False)
    if unexpected or [k for k in missing if k in dict(peft_model.named_parameters())]:
        raise ValueError(f"export: the checkpoint does not match the model rebuilt from its hyper-parameters: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    with output_folder(out, overwrite=overwrite) as folder:  # Note [Exports that cannot mix]
        peft_model.save_pretrained(os.fspath(folder))
    if merged is not None:
        model = peft_model.merge_and_unload()
        if dtype is not None:
            model = model.to(dtype)
        with output_folder(merged, overwrite=overwrite) as folder:
            model.save_pretrained(os.fspath(folder))
            if tokenizer_from is not None:
                export_tokenizer(tokenizer_from, folder)
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
