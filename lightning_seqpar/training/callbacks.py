"""``LongContextEval``: loss by position and passkey retrieval during validation, under the strategy, with plots.

Note [Long-context evaluation during validation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Evaluating at 128K-1M tokens needs the sequence parallelism of training, so the evaluation runs
inside the run, on its mesh, with nothing gathered:

* every validation batch: ``CausalLMModule.validation_step`` returns the per-token losses of this
  rank's shard (``token_losses``) and the batch holds the shard's ``position_ids``; they update
  :class:`~lightning_seqpar.training.metrics.LossByPosition` (Note [Loss by position under sequence
  parallelism]). No extra forward pass.
* at the end of the validation epoch: the passkey prompts (:func:`~lightning_seqpar.data.passkey_prompts`,
  built once at ``setup`` with the run's tokenizer) go through the strategy's own batch hook
  (``strategy.batch_to_device``: checked, sharded like any batch) and one forward pass each
  (``CausalLMModule.logit_pieces``: with ``loss_chunk_size`` at most that many tokens' logits at a
  time); the argmax of this rank's logits updates :class:`~lightning_seqpar.training.metrics.PasskeyAccuracy`
  (Note [Passkey retrieval]). Batches of prompts (one length each) are dealt round-robin over the
  data-parallel replicas; every replica runs the same number of forward passes (FSDP gathers
  parameters over all ranks), a replica left without a batch in the last round repeats one
  without counting it.

Then both metrics are reduced over every rank (torchmetrics ``compute``), logged
(``val/passkey_acc``, ``val/passkey_token_acc``, ``val/passkey_acc_len<L>``, ``val/loss_pos_<first
position of the bucket>``) and, on rank 0, written to ``<log dir>/long_context/``: a JSON file of
the numbers, a loss-by-position curve and a depth x length accuracy heatmap (PNG, matplotlib's Agg
canvas, no pyplot state), one of each per validation, named by the global step. The sanity-check
validation is skipped. ``seqpar validate --config ... --ckpt_path ...`` runs it on a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_seqpar.data.hf_text import load_tokenizer
from lightning_seqpar.data.passkey import PasskeyPrompts, passkey_prompts
from lightning_seqpar.sharding.layouts import required_multiple
from lightning_seqpar.strategy import SequenceParallelStrategy
from lightning_seqpar.training.metrics import LossByPosition, PasskeyAccuracy

__all__ = ["LongContextEval"]


class LongContextEval(L.Callback):
    """Loss by position and passkey retrieval at the trained length during validation (Note [Long-context
    evaluation during validation]); needs a :class:`~lightning_seqpar.CausalLMModule`.

    Args:
        tokenizer_path: the run's tokenizer (a local folder or a ``tokenizer.json``): the passkey prompts are built with it.
        lengths: passkey prompt lengths in tokens (up to the trained length; under the strategy multiples of
            2 x sequence_parallel_size for the zigzag layout, unless ``pad_to_multiple``).
        depths: where the passkey sits in the filler, fractions in [0, 1].
        samples: prompts (passkeys) per (depth, length) cell.
        batch_size: prompts per forward pass.
        num_buckets: position buckets of the loss curve.
        max_length: positions bucketed by the loss curve; None: the datamodule's ``seq_len``.
        seed: seed of the passkeys.
        digits: digits of a passkey.
        intro: begin each prompt with Mohtashami & Jaggi's introduction (False: shorter prompts, for tiny models).
        plots: write the PNG figures (the JSON file is always written).
        output_dir: where to write; None: ``<trainer.log_dir>/long_context``.
    """

    def __init__(
        self,
        *,
        tokenizer_path: str,
        lengths: Sequence[int],
        depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        samples: int = 2,
        batch_size: int = 1,
        num_buckets: int = 32,
        max_length: int | None = None,
        seed: int = 0,
        digits: int = 5,
        intro: bool = True,
        plots: bool = True,
        output_dir: str | None = None,
    ) -> None:
        name = type(self).__name__
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{name}: batch_size must be a positive integer, got {batch_size!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"{name}: max_length must be a positive integer or None (the datamodule's seq_len), got {max_length!r}")
        self.passkey = PasskeyAccuracy(depths=depths, lengths=lengths, samples=samples)  # checks depths, lengths, samples
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
            raise ValueError(f"{name}: num_buckets must be a positive integer, got {num_buckets!r}")
        self.tokenizer_path, self.batch_size, self.num_buckets, self.max_length = tokenizer_path, batch_size, num_buckets, max_length
        self.seed, self.digits, self.intro, self.plots, self.output_dir = seed, digits, intro, plots, output_dir
        self.loss_by_position: LossByPosition | None = None
        self._prompts: PasskeyPrompts | None = None
        self._batches: list[list[int]] = []
        self.results: list[dict[str, Any]] = []
        """One entry per validation: ``step``, ``loss_by_position`` (bucket starts and losses), ``passkey``
        (depths, lengths, accuracy and token accuracy grids, every prompt's counts of mispredicted and of
        answer tokens) and, on rank 0, the written ``files``."""

    # ----------------------------------------------------------------------------------------- set-up

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        name = type(self).__name__
        if not all(callable(getattr(pl_module, m, None)) for m in ("token_losses", "logit_pieces")):
            raise ValueError(f"{name} needs a lightning_seqpar.CausalLMModule (token_losses, logit_pieces), got {type(pl_module).__name__}")
        max_length = self.max_length
        if max_length is None and trainer.datamodule is not None:
            max_length = getattr(trainer.datamodule, "seq_len", None)
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"{name}: max_length=None reads the datamodule's seq_len, and there is none; set max_length "
                             "to the validation sequence length")
        seq_len = getattr(trainer.datamodule, "seq_len", None) if trainer.datamodule is not None else None
        if isinstance(seq_len, int) and seq_len > max_length:  # here, not mid-validation: every rank raises alike
            raise ValueError(f"{name}: max_length={max_length} is shorter than the datamodule's seq_len={seq_len}: the loss "
                             "curve would have no bucket for the last positions; set max_length >= seq_len (or None)")
        self.loss_by_position = LossByPosition(max_length=max_length, num_buckets=min(self.num_buckets, max_length))
        lengths = self.passkey.lengths
        strategy = trainer.strategy
        if isinstance(strategy, SequenceParallelStrategy) and strategy.parallel_dims.sp > 1 and not strategy.pad_to_multiple:
            multiple = required_multiple(strategy.sp_mesh, strategy.layout)
            bad = [n for n in lengths if n % multiple]
            if bad:
                raise ValueError(f"{name}: lengths {bad} are not multiples of {multiple} (sequence_parallel_size="
                                 f"{strategy.parallel_dims.sp}, load_balance={strategy.layout!r}); choose multiples of {multiple} "
                                 "or SequenceParallelStrategy(pad_to_multiple=True)")
        tokenizer = load_tokenizer(self.tokenizer_path)
        self._prompts = passkey_prompts(tokenizer, lengths=lengths, depths=self.passkey.depths, samples=self.passkey.samples,
                                        seed=self.seed, digits=self.digits, **({} if self.intro else {"intro": ""}))
        vocab = getattr(getattr(pl_module, "config", None), "vocab_size", None)
        top = self._prompts.max_token_id
        if isinstance(vocab, int) and top >= vocab:
            raise ValueError(f"{name}: the tokenizer at {self.tokenizer_path!r} gives token {top}, outside the model's "
                             f"vocab_size={vocab}; use the model's own tokenizer")
        by_length: dict[int, list[int]] = {}
        for i in range(len(self._prompts)):
            by_length.setdefault(self._prompts.length(i), []).append(i)
        self._batches = [ids[i : i + self.batch_size] for ids in by_length.values() for i in range(0, len(ids), self.batch_size)]

    # ----------------------------------------------------------------------------------------- validation

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.loss_by_position is not None, "setup ran"
        self.loss_by_position.to(pl_module.device)
        self.passkey.to(pl_module.device)

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking:
            return
        if not isinstance(outputs, Mapping) or "token_losses" not in outputs:
            raise ValueError(f"{type(self).__name__}: validation_step must return {{'token_losses': (B, S)}} "
                             "(CausalLMModule.validation_step does)")
        labels = batch["labels"]
        positions = batch.get("position_ids")
        if positions is None:  # one device without position ids: the positions of the full sequence
            positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
        assert self.loss_by_position is not None
        self.loss_by_position.update(outputs["token_losses"], positions, labels)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.loss_by_position is not None
        if trainer.sanity_checking:
            self.loss_by_position.reset()
            return
        self._run_passkeys(trainer, pl_module)
        # collectives: every rank. torchmetrics squeezes a one-element result to a scalar (one bucket, a 1 x 1 grid):
        # the shapes are put back
        losses = self.loss_by_position.compute().cpu().reshape(-1)
        grid = (len(self.passkey.depths), len(self.passkey.lengths))
        passkey = {k: v.cpu().reshape(*grid, -1) if k in ("misses", "answer_tokens") else v.cpu().reshape(grid)
                   for k, v in self.passkey.compute().items()}
        starts = self.loss_by_position.bucket_starts()
        self.loss_by_position.reset()
        self.passkey.reset()
        logged: dict[str, float] = {}
        accuracy, tokens = passkey["accuracy"], passkey["token_accuracy"]
        if bool(accuracy.isfinite().any()):
            logged["val/passkey_acc"] = float(accuracy[accuracy.isfinite()].mean())
            logged["val/passkey_token_acc"] = float(tokens[tokens.isfinite()].mean())
        for j, n in enumerate(self.passkey.lengths):
            column = accuracy[:, j]
            if bool(column.isfinite().any()):
                logged[f"val/passkey_acc_len{n}"] = float(column[column.isfinite()].mean())
        for start, loss in zip(starts.tolist(), losses.tolist()):
            if math.isfinite(loss):
                logged[f"val/loss_pos_{start}"] = loss
        if logged:  # the values are global already: sync_dist averages equal numbers
            pl_module.log_dict(logged, sync_dist=True)
        result = {"step": trainer.global_step,
                  "loss_by_position": {"bucket_starts": starts.tolist(), "max_length": self.loss_by_position.max_length,
                                       "loss": [_number(x) for x in losses.tolist()]},
                  "passkey": {"depths": self.passkey.depths, "lengths": self.passkey.lengths, "samples": self.passkey.samples,
                              "accuracy": [[_number(x) for x in row] for row in accuracy.tolist()],
                              "token_accuracy": [[_number(x) for x in row] for row in tokens.tolist()],
                              "misses": passkey["misses"].tolist(), "answer_tokens": passkey["answer_tokens"].tolist()}}
        folder = self.output_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "long_context")  # log_dir: a broadcast
        if trainer.is_global_zero:
            result["files"] = _write(folder, result, plots=self.plots)
        self.results.append(result)

    def _run_passkeys(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert self._prompts is not None, "setup ran"
        sampler = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        replicas, replica = int(sampler.get("num_replicas", 1)), int(sampler.get("rank", 0))
        for start in range(0, len(self._batches), replicas):
            index = start + replica
            counted = index < len(self._batches)
            prompts = [self._prompts[i] for i in self._batches[index if counted else 0]]
            batch = {key: torch.stack([p[key] for p in prompts]) for key in prompts[0]}
            batch = strategy.batch_to_device(batch)  # checked and sharded as any batch (the prompt ids are not per token)
            with trainer.precision_plugin.val_step_context():
                predictions = torch.cat([logits.argmax(-1) for logits in pl_module.logit_pieces(batch)], dim=1)  # (B, S_local)
            if counted:
                self.passkey.update(predictions, batch["labels"], batch["prompt_id"])


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _write(folder: str, result: dict[str, Any], *, plots: bool) -> list[str]:
    """The JSON file and (``plots``) the two figures of one validation; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    step = result["step"]
    files = [os.path.join(folder, f"long_context_step{step}.json")]
    with open(files[0], "w") as f:
        json.dump(result, f, indent=1)
    if not plots:
        return files
    from matplotlib.figure import Figure  # the Agg canvas of a bare Figure: no pyplot, no global backend

    curve = result["loss_by_position"]
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    xs = [s for s, loss in zip(curve["bucket_starts"], curve["loss"]) if loss is not None]
    ax.plot(xs, [loss for loss in curve["loss"] if loss is not None], marker="o", markersize=3)
    ax.set_xlabel("position in the document (bucket start)")
    ax.set_ylabel("mean token loss")
    ax.set_title(f"Loss by position, step {step}")
    ax.grid(alpha=0.3)
    files.append(os.path.join(folder, f"loss_by_position_step{step}.png"))
    fig.savefig(files[-1], dpi=120)

    grid = result["passkey"]
    values = [[math.nan if x is None else x for x in row] for row in grid["accuracy"]]
    fig = Figure(figsize=(1.2 + 0.9 * len(grid["lengths"]), 1.0 + 0.5 * len(grid["depths"])), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
    ax.set_yticks(range(len(grid["depths"])), [f"{d:g}" for d in grid["depths"]])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("passkey depth")
    ax.set_title(f"Passkey accuracy, step {step}")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax)
    files.append(os.path.join(folder, f"passkey_step{step}.png"))
    fig.savefig(files[-1], dpi=120)
    return files
