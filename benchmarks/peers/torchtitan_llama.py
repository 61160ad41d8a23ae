"""torchtitan's own trainer and its published Llama-3-8B config, with context parallel over every GPU.

    torchrun --nproc_per_node 4 benchmarks/peers/torchtitan_llama.py --seq 131072 --steps 5 --out $OUT/peers.json

The config is ``torchtitan.models.llama3.config_registry.llama3_8b()`` as released (0.3.0: FlexAttention, selective
activation checkpointing, chunked cross entropy in 8 chunks, FSDP2 with bf16 parameters and fp32 reductions, AdamW
lr 3e-4, no compile), run through ``torchtitan.trainer.Trainer`` and its ``train()`` loop. Changed, each for the
comparison only (listed in every record): ``context_parallel_degree`` = GPUs (FSDP over the same GPUs, torchtitan's
default dp_shard = -1), ``training.seq_len`` = --seq, ``training.steps``; random tokens from an in-memory
dataloader instead of c4 and a stub tokenizer instead of Llama-3.1-8B's files (nothing can be downloaded; the
model's vocabulary is unchanged); random init (no checkpoint); checkpointing, validation, the profiler and
TensorBoard off; RoPE's max_seq_len raised to --seq above 131072; ``--compile`` turns on its published compile
option (``compile.enable``) for the compiled variant. Note [One measurement for every peer] in common.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import StepClock, write_record  # noqa: E402


def _walk_set(obj, cls_name: str, field: str, value, seen=None) -> int:
    """Set ``field`` on every dataclass of type ``cls_name`` inside ``obj``; the count set."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    n = 0
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if type(obj).__qualname__.endswith(cls_name) and getattr(obj, field) < value:
            object.__setattr__(obj, field, value)
            n += 1
        for f in dataclasses.fields(obj):
            n += _walk_set(getattr(obj, f.name), cls_name, field, value, seen)
    elif isinstance(obj, (list, tuple)):
        n += sum(_walk_set(x, cls_name, field, value, seen) for x in obj)
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--flavor", default="8B", help="debugmodel for a CPU smoke run")
    p.add_argument("--out", default="peers.json")
    args = p.parse_args()

    import torchtitan
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models.llama3 import config_registry
    from torchtitan.trainer import Trainer

    class RandomTokens(BaseDataLoader):
        """Random token rows of seq_len + 1 (input, shifted labels): the dataloader contract of torchtitan."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 128256

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **_):
            self.vocab, self.seq_len, self.batch = config.vocab_size, seq_len, local_batch_size
            self.gen = torch.Generator().manual_seed(dp_rank)

        def __iter__(self):
            while True:
                row = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=self.gen)
                yield {"input": row[:, :-1]}, row[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    class StubTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 128256

        def __init__(self, config, *, tokenizer_path=None, **_):
            super().__init__()
            self.vocab_size, self.eos_id, self.bos_id = config.vocab_size, 1, 0

        def encode(self, *a, **k):
            return []

        def decode(self, *a, **k):
            return ""

        def get_vocab_size(self):
            return self.vocab_size

    config = config_registry.llama3_8b() if args.flavor == "8B" else config_registry.llama3_debugmodel()
    vocab = config.model_spec.model.vocab_size
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config.training.seq_len = args.seq
    config.training.steps = args.steps
    config.parallelism.context_parallel_degree = world
    config.dataloader = RandomTokens.Config(vocab_size=vocab)
    config.tokenizer = StubTokenizer.Config(vocab_size=vocab)
    config.checkpoint.enable = False
    config.validator.enable = False
    config.profiler.enable_profiling = False
    config.metrics.enable_tensorboard = False
    config.metrics.log_freq = 1
    config.dump_folder = os.environ.get("OUT", "/tmp") + "/torchtitan"
    if args.compile:
        config.compile.enable = True
    raised = _walk_set(config.model_spec.model, "RoPE.Config", "max_seq_len", args.seq)
    if not torch.cuda.is_available():
        config.comm.init_timeout_seconds = 60
        config.training.mixed_precision_param = "float32"

    clock = StepClock(args.warmup)
    original = Trainer.train_step

    def timed(self, data_iterator):
        clock.begin()
        out = original(self, data_iterator)
        clock.end()
        return out

    Trainer.train_step = timed
    trainer = config.build()
    trainer.train()
    changes = [f"context_parallel_degree={world} (FSDP over the same GPUs)", f"training.seq_len={args.seq}",
               f"training.steps={args.steps}", "random tokens, stub tokenizer (no download), random init",
               "checkpoint / validation / profiler / tensorboard off"]
    if raised:
        changes.append(f"RoPE max_seq_len raised to {args.seq}")
    settings = dict(attn_backend="flex (published default)", activation_checkpoint=type(config.activation_checkpoint).__qualname__,
                    compile=config.compile.enable, loss=type(config.loss).__qualname__, dtype=config.training.dtype,
                    mixed_precision_param=config.training.mixed_precision_param)
    write_record(args.out, system="torchtitan", model="llama3-8b", seq=args.seq, clock=clock, peak_gb=clock.peak_gb(),
                 settings=settings, changes=changes, version=f"torchtitan {torchtitan.__version__}")
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
