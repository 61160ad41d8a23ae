"""Export a checkpoint of ``CausalLMModule``: one consolidated file, or a Hugging Face model folder.

    python -m lightning_seqpar.cli.export CHECKPOINT OUTPUT --format consolidated
    python -m lightning_seqpar.cli.export CHECKPOINT OUTPUT --format hf [--weights safetensors|bin] [--dtype bfloat16] [--overwrite]
    python -m lightning_seqpar.cli.export CHECKPOINT OUTPUT --format lora [--merged MERGED_DIR] [--dtype bfloat16]
    python -m lightning_seqpar.cli.export CHECKPOINT OUTPUT --format litgpt [--tokenizer DIR] [--dtype bfloat16]
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
  plain transformers folder (``lightning_seqpar.hf.export.export_lora``; needs ``peft``).
* ``litgpt``: a ``LitGPTModule`` checkpoint as a LitGPT folder (``lit_model.pth``, ``model_config.yaml``, the
  tokenizer files of ``--tokenizer`` or of the LitGPT folder training started from) that ``litgpt generate``
  and ``litgpt finetune`` read (``lightning_seqpar.training.litgpt.export_litgpt``; needs ``litgpt``).

The ``hf`` folder and the merged LoRA folder also get the tokenizer and the generation config
(Note [The tokenizer of an export] in ``lightning_seqpar.hf.export``, which writes both folders), so
that ``AutoTokenizer.from_pretrained(OUTPUT)`` and a text-generation pipeline load the folder as it is.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_seqpar.hf import export as hf_export
from lightning_seqpar.parallel import checkpoint_io

__all__ = ["export_consolidated", "main"]

# --------------------------------------------------------------------------------------------- consolidated


def export_consolidated(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write ``checkpoint`` (folder or file) as one complete Lightning checkpoint file ``output``."""
    src, out = Path(checkpoint), Path(output)
    checkpoint_io.check_checkpoint(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        full = torch.load(src, mmap=True, map_location="cpu", weights_only=True)
        meta = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")} if isinstance(full, dict) else full
        state = full.get("state_dict") if isinstance(full, dict) else None
        checkpoint_io.check_module_checkpoint(meta, src, state_keys=list(state) if isinstance(state, dict) else None)
    else:
        checkpoint_io.check_module_checkpoint(checkpoint_io.load_meta(src), src)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            flat = Path(tmp) / "shards.pt"
            dcp_to_torch_save(str(src), str(flat))  # every tensor of the folder, full size, in one process
            tensors = torch.load(flat, map_location="cpu", weights_only=True)
        full = checkpoint_io.load_meta(src)
        full["state_dict"] = tensors.pop("state_dict")
        full["optimizer_states"] = [tensors.pop(f"optimizer_{i}") for i in range(len(tensors)) if f"optimizer_{i}" in tensors]
    checkpoint_io.atomic_save(full, out)
    return out


# --------------------------------------------------------------------------------------------- CLI

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(args: Sequence[str] | None = None) -> None:
    """``python -m lightning_seqpar.cli.export`` / ``seqpar export``."""
    parser = argparse.ArgumentParser(prog="seqpar export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a folder of shards or a full checkpoint file written under SequenceParallelStrategy")
    parser.add_argument("output", help="consolidated: the output file; hf, litgpt: the output folder; lora: the adapter folder")
    parser.add_argument("--format", choices=("consolidated", "hf", "lora", "litgpt"), default="consolidated")
    parser.add_argument("--weights", choices=("safetensors", "bin"), default="safetensors", help="hf only: file format of the weights")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="hf, litgpt: cast the weights; lora: cast the merged model")
    parser.add_argument("--merged", default=None, help="lora only: also write the model with the adapters merged into this folder")
    parser.add_argument("--overwrite", action="store_true", help="hf, lora: replace an output folder that holds weights of "
                        "another export (refused without it: two exports' weights in one folder would mix)")
    parser.add_argument("--tokenizer", default=None, help="hf, lora --merged, litgpt: copy this tokenizer folder (or tokenizer.json) "
                        "into the export; default: the model's folder, else the datamodule's tokenizer_path")
    ns = parser.parse_args(args)
    if ns.merged is not None and ns.format != "lora":
        parser.error("--merged applies to --format lora only")
    if ns.tokenizer is not None and not (ns.format in ("hf", "litgpt") or ns.merged is not None):
        parser.error("--tokenizer applies to --format hf, litgpt and to --format lora with --merged")
    dtype = _DTYPES[ns.dtype] if ns.dtype else None
    if ns.format == "consolidated":
        if ns.dtype is not None or ns.weights != "safetensors":
            parser.error("--dtype and --weights apply to --format hf only")
        print(f"wrote {export_consolidated(ns.checkpoint, ns.output)}")
        return
    if ns.format == "litgpt":
        if ns.weights != "safetensors" or ns.overwrite:
            parser.error("--weights and --overwrite apply to --format hf and lora only (litgpt refuses a folder that holds weights)")
        from lightning_seqpar.training.litgpt import TOKENIZER_FILES, export_litgpt

        path = export_litgpt(ns.checkpoint, ns.output, tokenizer=ns.tokenizer, dtype=dtype)
        missing = not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
        print(f"wrote {path}" + (f" without tokenizer files: `litgpt generate` needs {TOKENIZER_FILES[:3]} "
                                 "(pass --tokenizer DIR)" if missing else ""))
        return
    if ns.format == "lora":
        if ns.weights != "safetensors":
            parser.error("--weights applies to --format hf only")
        if ns.dtype is not None and ns.merged is None:
            parser.error("--dtype with --format lora casts the merged model: add --merged")
        path = hf_export.export_lora(ns.checkpoint, ns.output, merged=ns.merged, dtype=dtype, tokenizer=ns.tokenizer,
                                     overwrite=ns.overwrite)
    else:
        path = hf_export.export_hf(ns.checkpoint, ns.output, weights=ns.weights, dtype=dtype, tokenizer=ns.tokenizer,
                                   overwrite=ns.overwrite)
    print(f"wrote {path}" + (f" and {ns.merged}" if ns.merged is not None else ""))
    if ns.format == "hf" or ns.merged is not None:
        print(hf_export.describe_tokenizer(hf_export.tokenizer_source(checkpoint_io.load_meta(ns.checkpoint), tokenizer=ns.tokenizer)))


if __name__ == "__main__":  # pragma: no cover
    main()
