"""torchtitan's own trainer with its published Llama-3-8B preset, context parallel over every GPU.

    torchrun --nproc_per_node 4 benchmarks/peers/torchtitan_llama.py --seq 131072 --steps 5 --out $OUT/peers.json

torchtitan 0.2.2, the release that runs on torch 2.11 (0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims``,
which torch 2.11 lacks: seen on the GPU image). Its ``torchtitan.train.Trainer`` and ``train()`` loop run the preset
``torchtitan_llama3_8b.toml`` (v0.2.2's ``llama3_8b.toml`` as published: SDPA attention, op-level selective activation
checkpointing, no compile, FSDP2 with bf16 parameters and fp32 reductions, AdamW lr 3e-4), changed for the
comparison only (each change is listed in the record): ``context_parallel_degree`` = GPUs (torch's context parallel;
FSDP over the same GPUs, the preset's dp_shard = -1), ``training.seq_len`` = --seq (RoPE follows, torchtitan's
``update_from_config``), ``training.steps``, ``lr_scheduler.warmup_steps`` = 1, ``metrics.log_freq`` = 1, profiling
and TensorBoard off; random tokens from an in-memory dataloader instead of c4 and a stub tokenizer instead of
Llama-3.1-8B's files (nothing can be downloaded; the vocabulary is unchanged); random init. ``--compile`` sets the
preset's ``compile.enable``; ``--ac full`` sets ``activation_checkpoint.mode = "full"``, what torchtitan's docs offer
when the preset's op-level selective checkpointing runs out of memory (it does at 128K on 4 x H200: the fp32 logits
of 32K tokens on top of 117.5 GiB); each is listed among the record's changes. Note [One measurement for every peer] in common.py.

torchtitan at its best (issue #56): ``--compile --ac full``, the settings of torchtitan 0.2.2's own long-context
runs: ``benchmarks/llama3_h100_202412_torchtitan.md`` in the v0.2.2 tree, Table 2, "FSDP + CP + torch.compile +
Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1. Full activation checkpointing" (``SOURCES``). Float8 is
left out: it changes the matmuls' precision, and every system here trains in bf16. ``compile.enable`` compiles
the preset's ``components = ["model", "loss"]`` (v0.2.2's ``torchtitan/config/job_config.py``, ``Compile``);
``activation_checkpoint.mode`` is one of selective / full / memory_budget / none (the same file). A run with
neither flag is the as-published row (``settings["variant"]``). Master weights: the preset's FSDP2 mixed
precision (``training.mixed_precision_param = "bfloat16"``, reductions in fp32) keeps fp32 parameters, which the
probe reads off the optimizer. Its logger resets the allocator's peak every logged step
(``DeviceMemoryMonitor.reset_peak_stats`` in ``torchtitan/components/metrics.py``), so the StepClock's
``peak_mem_gb`` is no peak here; the harness's probe reads it before every reset.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import tomllib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import StepClock, write_record  # noqa: E402

PRESET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchtitan_llama3_8b.toml")
SOURCES = {
    "preset": "https://github.com/pytorch/torchtitan/blob/v0.2.2/torchtitan/models/llama3/train_configs/llama3_8b.toml",
    "compile + full AC for long context": "https://github.com/pytorch/torchtitan/blob/v0.2.2/benchmarks/"
                                          "llama3_h100_202412_torchtitan.md (Table 2: FSDP + CP + torch.compile, full AC)",
    "compile / activation_checkpoint options": "https://github.com/pytorch/torchtitan/blob/v0.2.2/torchtitan/config/job_config.py",
    "expandable segments": "https://github.com/pytorch/torchtitan/blob/v0.2.2/run_train.sh",
}


def _toml(d: dict, prefix: str = "") -> str:
    """A flat TOML writer for the preset's tables of scalars and lists."""
    lines = []
    for table, fields in d.items():
        lines.append(f"[{table}]")
        for k, v in fields.items():
            lines.append(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v).replace(chr(39), chr(34))}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", choices=("preset", "full", "none"), default="preset",
                   help="activation_checkpoint.mode: the preset's (selective, op level) unless set")
    p.add_argument("--flavor", default="8B", help="debugmodel for a smoke run")
    p.add_argument("--out", default="peers.json")
    args = p.parse_args()

    import torchtitan
    import torchtitan.train as tt_train
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import ConfigManager
    from torchtitan.protocols import train_spec as train_spec_module

    world = int(os.environ.get("WORLD_SIZE", "1"))
    preset = tomllib.load(open(PRESET, "rb"))
    changes = {("parallelism", "context_parallel_degree"): world, ("training", "seq_len"): args.seq,
               ("training", "steps"): args.steps, ("lr_scheduler", "warmup_steps"): 1, ("metrics", "log_freq"): 1,
               ("metrics", "enable_tensorboard"): False, ("profiling", "enable_profiling"): False,
               ("job", "dump_folder"): os.environ.get("OUT", "/tmp") + "/torchtitan"}
    if args.flavor != "8B":
        changes[("model", "flavor")] = args.flavor
    if args.compile:
        changes[("compile", "enable")] = True
    if args.ac != "preset":
        changes[("activation_checkpoint", "mode")] = args.ac
    for (table, key), value in changes.items():
        preset[table][key] = value
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(_toml(preset))

    class StubTokenizer(BaseTokenizer):
        def __init__(self, vocab: int):
            super().__init__()
            self.vocab, self.eos_id, self.bos_id = vocab, 1, 0

        def encode(self, *a, **k):
            return []

        def decode(self, *a, **k):
            return ""

        def get_vocab_size(self):
            return self.vocab

    class RandomTokens(BaseDataLoader):
        """Random rows of seq_len + 1 tokens as (input, shifted labels): torchtitan's dataloader contract."""

        def __init__(self, vocab: int, seq_len: int, batch: int, rank: int):
            self.vocab, self.seq_len, self.batch = vocab, seq_len, batch
            self.gen = torch.Generator().manual_seed(rank)

        def __iter__(self):
            while True:
                row = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=self.gen)
                yield {"input": row[:, :-1]}, row[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    original_get = train_spec_module.get_train_spec

    def get_train_spec(name):
        spec = original_get(name)
        vocab = spec.model_args[args.flavor].vocab_size
        return dataclasses.replace(
            spec, build_tokenizer_fn=lambda job_config: StubTokenizer(vocab),
            build_dataloader_fn=lambda *, dp_world_size, dp_rank, tokenizer, job_config, **_: RandomTokens(
                vocab, job_config.training.seq_len, job_config.training.local_batch_size, dp_rank))

    train_spec_module.get_train_spec = get_train_spec
    clock = StepClock(args.warmup)
    original_step = tt_train.Trainer.train_step

    def timed(self, *a, **k):
        clock.begin()
        out = original_step(self, *a, **k)
        clock.end()
        return out

    tt_train.Trainer.train_step = timed
    config = ConfigManager().parse_args(["--job.config_file", f.name])
    tt_train.init_logger()
    trainer = tt_train.Trainer(config)
    trainer.train()
    listed = [f"{t}.{k}={v}" for (t, k), v in changes.items() if k != "dump_folder"]
    listed += ["random tokens and a stub tokenizer instead of c4 / Llama-3.1-8B's files (no download); random init"]
    settings = dict(preset=os.path.basename(PRESET), attention="sdpa (preset)", activation_checkpoint=preset["activation_checkpoint"],
                    compile=preset["compile"]["enable"], fsdp_mixed_precision="bf16 params, fp32 reduce (torchtitan default)",
                    variant=", ".join((["compile"] if args.compile else []) + ([f"{args.ac} AC"] if args.ac != "preset" else []))
                    or "as published", sources=SOURCES)
    write_record(args.out, system="torchtitan", model="llama3-8b", seq=args.seq, clock=clock, peak_gb=clock.peak_gb(),
                 settings=settings, changes=listed, version=f"torchtitan {torchtitan.__version__}")
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
