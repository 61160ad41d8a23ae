"""Context extension, shown (issue #40): does the evaluation tell a model that uses a longer context from one that
does not? One GPU (or CPU at toy size), random init, a passkey-retrieval task.

    PYTHONPATH=$PWD python benchmarks/extend.py --seq 2048 --steps 600 --extend-steps 150 --out $OUT/extend
    PYTHONPATH=$PWD python benchmarks/extend.py --tiny --out /tmp/extend          # CPU, a minute
    PYTHONPATH=$PWD python benchmarks/extend.py --cost 131072,524288 --out $OUT/eval-cost.json  # what evaluating costs

1. A word-level tokenizer of the passkey prompts' words (digits one token each) and a small Llama-shaped
   transformers model with ``max_position_embeddings`` = L (--seq) train ``--steps`` on passkey prompts of L
   tokens at random depths (labels: every next token, so the only way to predict the answer is to find the needle).
2. Evaluated by :class:`~lightning_seqpar.training.callbacks.LongContextEval` (passkey accuracy over depths x lengths up to
   4L, loss by position) through ``trainer.validate``: (a) as trained, at L ... 4L, RoPE unchanged;
   (b) after ``rope_extension(..., 4L, rope_type="yarn")`` and ``--extend-steps`` more steps at 4L.
3. ``$OUT/extend/{a,b}/long_context/``: the JSON numbers, the heatmap and the loss-by-position curve of each;
   ``summary.json``: accuracy by length for (a) and (b).

``--cost N,...``: what the evaluation costs at N tokens on one GPU, the Llama-3.2-1B shape (random init, "bf16-true",
logits in pieces of ``--loss-chunk`` tokens): one validation batch of N tokens (loss by position) and ``--samples``
passkey prompts of N tokens through :class:`~lightning_seqpar.training.callbacks.LongContextEval`, seconds of each and the peak
memory, appended to ``--out`` (a JSON list of records).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import lightning as L
import numpy as np
import torch

from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
from lightning_seqpar.data.passkey import FILLER, NEEDLE, QUESTION, passkey_prompts
from lightning_seqpar.hf import rope_extension
from lightning_seqpar.training.callbacks import LongContextEval

IGNORE = -100


def word_tokenizer(folder: str):
    """A word-level tokenizer of the prompts' words, digits one token each, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tok.train_from_iterator([FILLER, NEEDLE.format(key="0123456789"), QUESTION],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]", "[EOS]", "[PAD]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]")
    fast.save_pretrained(folder)
    return fast


class Prompts(torch.utils.data.Dataset):
    """Passkey prompts of ``length`` tokens at random depths, every next token labelled (training) or, with
    ``answer_only``, the answer's tokens only (validation: the loss curve reads them)."""

    def __init__(self, tokenizer, length: int, n: int, seed: int, answer_only: bool = False):
        depths = np.random.default_rng(seed).uniform(0, 1, n).round(3).tolist()
        self.items = [passkey_prompts(tokenizer, lengths=[length], depths=[d], samples=1, seed=seed + i, intro=False)[0]
                      for i, d in enumerate(depths)]
        self.answer_only = answer_only

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = dict(self.items[i])
        item.pop("prompt_id", None)
        if not self.answer_only:
            ids = item["input_ids"]
            item["labels"] = torch.cat([ids[1:], torch.tensor([IGNORE])])
        return item


def run(phase: str, model, *, args, tokenizer, folder: str, length: int, steps: int, overrides=None) -> tuple[dict, str]:
    """Train ``steps`` at ``length`` (0: none), then validate with LongContextEval; the results and the saved model."""
    cuda = torch.cuda.is_available()
    module = CausalLMModule(model=model, config_overrides=overrides, lr=args.lr, warmup_steps=min(20, steps),
                            max_steps=max(steps, 1), weight_decay=0.0)
    lengths = sorted({args.seq // 2, args.seq, 2 * args.seq, 4 * args.seq})
    evaluation = LongContextEval(tokenizer_path=folder + "/tokenizer", lengths=lengths, depths=[0.0, 0.25, 0.5, 0.75, 1.0],
                                 samples=args.samples, num_buckets=16, max_length=4 * args.seq, intro=False, digits=5,
                                 output_dir=f"{args.out}/{phase}/long_context")
    train = torch.utils.data.DataLoader(Prompts(tokenizer, length, max(steps, 1) * args.batch, seed=1 + len(phase),
                                                answer_only=args.labels == "answer"),
                                        batch_size=args.batch, shuffle=True)
    val = torch.utils.data.DataLoader(Prompts(tokenizer, 4 * args.seq, 2, seed=99, answer_only=args.val_labels == "answer"), batch_size=1)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed" if cuda else "32-true",
                        strategy=SequenceParallelStrategy(memory="auto" if cuda else "manual"),
                        max_steps=max(steps, 1), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_train_batches=steps if steps else 0,
                        callbacks=[evaluation], log_every_n_steps=10)
    if steps:
        trainer.fit(module, train_dataloaders=train)
        trainer.validate(module, dataloaders=val, verbose=False)
    else:
        trainer.validate(module, dataloaders=val, verbose=False)
    saved = f"{folder}/{phase}-model"
    module.save_hf_pretrained(saved)
    result = evaluation.results[-1]
    return result, saved


LLAMA32_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, attention_dropout=0.0, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # the vocabulary: the word tokenizer's


class _Clock(L.Callback):
    """Seconds of the validation batches and of what follows them (the passkey prompts), and the peak memory."""

    def __init__(self) -> None:
        self.batches: list[float] = []
        self.epoch_end = self.t = 0.0

    def _sync(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_validation_batch_start(self, *args, **kwargs) -> None:
        self.t = self._sync()

    def on_validation_batch_end(self, *args, **kwargs) -> None:
        self.t, start = self._sync(), self.t
        self.batches.append(self.t - start)

    def on_validation_epoch_end(self, *args, **kwargs) -> None:  # after LongContextEval's (callbacks run in order)
        self.epoch_end = self._sync() - self.t


def cost(args) -> None:
    """``--cost``: LongContextEval's cost at each length (one GPU), a record per length appended to ``--out``."""
    cuda = torch.cuda.is_available()
    folder = os.path.dirname(os.path.abspath(args.out)) + "/eval-cost-tokenizer"
    tokenizer = word_tokenizer(folder)
    records = []
    for n in [int(x) for x in args.cost.split(",")]:
        config = dict(LLAMA32_1B, vocab_size=len(tokenizer), max_position_embeddings=n)
        if args.tiny:
            config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        module = CausalLMModule(model=config, loss_chunk_size=args.loss_chunk)
        evaluation = LongContextEval(tokenizer_path=folder, lengths=[n], depths=[0.5], samples=args.samples, num_buckets=32,
                                     max_length=n, intro=False, digits=5, output_dir=None, plots=False)
        clock = _Clock()
        val = torch.utils.data.DataLoader(Prompts(tokenizer, n, 1, seed=7, answer_only=False), batch_size=1)
        trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-true" if cuda else "32-true",
                            strategy=SequenceParallelStrategy(), logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[evaluation, clock], default_root_dir=os.path.dirname(os.path.abspath(args.out)))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.validate(module, dataloaders=val, verbose=False)
        total = time.perf_counter() - t0
        record = dict(bench="long_context_eval_cost", seq=n, model="llama3.2-1b-shaped" + ("-tiny" if args.tiny else ""),
                      device=torch.cuda.get_device_name() if cuda else "cpu", precision="bf16-true" if cuda else "32-true",
                      loss_chunk_size=args.loss_chunk, passkey_prompts=args.samples, validation_batch_s=round(clock.batches[0], 3),
                      passkey_s_per_prompt=round(clock.epoch_end / args.samples, 3), validate_total_s=round(total, 2),
                      peak_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
                      passkey_accuracy=evaluation.results[-1]["passkey"]["accuracy"], torch=torch.__version__,
                      commit=os.environ.get("SEQPAR_COMMIT"))
        print(json.dumps(record), flush=True)
        records.append(record)
        del module, trainer
        if cuda:
            torch.cuda.empty_cache()
    old = json.load(open(args.out)) if os.path.exists(args.out) else []
    with open(args.out, "w") as f:
        json.dump(old + records, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048, help="L: the trained length (evaluated up to 4L)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--extend-steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--labels", choices=["answer", "all"], default="answer",
                    help="training labels: the passkey's answer tokens only (the retrieval signal undiluted) or every next token")
    ap.add_argument("--val-labels", choices=["answer", "all"], default="answer",
                    help="the loss-by-position curve's tokens: the answers only, or every next token of the 4L prompts")
    ap.add_argument("--tiny", action="store_true", help="CPU toy: L=96, 2 layers of 32, a few steps")
    ap.add_argument("--out", default="outputs/extend")
    ap.add_argument("--cost", default=None, help="lengths N,...: the evaluation's cost at each (records to --out, a JSON file)")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="--cost: logits of at most this many tokens at a time")
    args = ap.parse_args(argv)
    if args.cost:
        if args.samples < 1:
            ap.error("--samples must be >= 1")
        return cost(args)
    if args.tiny:
        args.seq, args.steps, args.extend_steps, args.batch, args.samples, args.layers, args.hidden = 96, 4, 2, 2, 1, 2, 32
    L.seed_everything(0)
    folder = args.out
    tokenizer = word_tokenizer(folder + "/tokenizer")
    config = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=8 if args.hidden >= 64 else 4, num_key_value_heads=4 if args.hidden >= 64 else 2,
                  max_position_embeddings=args.seq, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=True, attention_dropout=0.0)
    trained, saved = run("pretrain", config, args=args, tokenizer=tokenizer, folder=folder, length=args.seq, steps=args.steps)
    unchanged, _ = run("a-unchanged", saved, args=args, tokenizer=tokenizer, folder=folder, length=args.seq, steps=0)
    overrides = rope_extension(saved, 4 * args.seq, rope_type="yarn")
    extended, _ = run("b-yarn", saved, args=args, tokenizer=tokenizer, folder=folder, length=4 * args.seq,
                      steps=args.extend_steps, overrides=overrides)

    def by_length(result: dict) -> dict:
        p = result["passkey"]
        acc = np.asarray(p["accuracy"], dtype=float)  # depths x lengths
        return {str(n): round(float(np.nanmean(acc[:, j])), 3) for j, n in enumerate(p["lengths"])}

    summary = dict(seq=args.seq, steps=args.steps, extend_steps=args.extend_steps, layers=args.layers, hidden=args.hidden,
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", overrides=overrides,
                   accuracy_by_length={"a_unchanged": by_length(unchanged), "b_yarn_finetuned": by_length(extended)},
                   files={"a": unchanged.get("files"), "b": extended.get("files")})
    with open(f"{folder}/summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["accuracy_by_length"]))


if __name__ == "__main__":
    sys.exit(main())
