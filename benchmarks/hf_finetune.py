"""Fine-tune a Hugging Face Llama-architecture model at long context under SequenceParallelStrategy.

    torchrun --nproc_per_node=4 benchmarks/hf_finetune.py --seq 131072 --documents --out hf.json

The model is ``transformers.LlamaForCausalLM`` built from a config (random init: no weights can be
downloaded on the GPU machine) with the llama3-8b shape (4096 / 32 layers / 32 heads / 8 KV
heads / 14336 / vocab 128256), passed to ``CausalLMModule`` as a dict with ``model_type`` and run
unchanged with the package's attention (transformers' AttentionInterface). Data: random tokens
packed into --seq-token samples; with --documents the samples hold documents of random lengths
(exponential, mean --mean-doc tokens; ``document_ids`` in the batch, so attention stays inside
each document and the per-document zigzag balances the ranks), else one document per sample.

Recorded like benchmarks/train.py (median step after --warmup, tokens/s/GPU, peak memory). MFU
counts 6 * N_non_embedding + the attention term 6 * L * d * sum(len_i^2) / S of the documents
actually attended (= 6 * L * S * d for one document), against 989e12.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from collect import append_records  # benchmarks/ is on sys.path when this file runs as a script
from train import _step_timer  # benchmarks/ is on sys.path when this file runs as a script

PEAK_BF16 = 989e12

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=1 << 20,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=0.0)
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, tie_word_embeddings=False)


class PackedRandomDocs(torch.utils.data.Dataset):
    """Random tokens in documents of exponential lengths (mean ``mean_doc``), ``document_ids`` and per-document labels."""

    def __init__(self, vocab: int, seq_len: int, n: int, mean_doc: int | None, seed: int = 0) -> None:
        self.vocab, self.seq_len, self.n, self.mean_doc, self.seed = vocab, seq_len, n, mean_doc, seed

    def __len__(self) -> int:
        return self.n

    def lengths(self, i: int) -> list[int]:
        if self.mean_doc is None:
            return [self.seq_len]
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        out: list[int] = []
        while sum(out) < self.seq_len:
            out.append(max(1, int(torch.empty(1).exponential_(1.0 / self.mean_doc, generator=g))))
        out[-1] -= sum(out) - self.seq_len
        return [n for n in out if n > 0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        lens = torch.tensor(self.lengths(i))
        doc = torch.repeat_interleave(torch.arange(len(lens)), lens)
        labels = torch.full_like(ids, -100)
        labels[:-1] = torch.where(doc[1:] == doc[:-1], ids[1:], torch.full_like(ids[1:], -100))
        out = {"input_ids": ids, "labels": labels}
        if self.mean_doc is not None:
            out["document_ids"] = doc
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--documents", action="store_true", help="packed documents of random lengths (document masking)")
    ap.add_argument("--mean-doc", type=int, default=16384)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--loss-chunk", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test with a tiny model (gloo)")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()

    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shape = LLAMA3_8B if cuda else TINY
    data = PackedRandomDocs(shape["vocab_size"], args.seq, (args.warmup + args.steps) * 2, args.mean_doc if args.documents else None)
    times: list[float] = []
    losses: list[float] = []

    world = int(os.environ["WORLD_SIZE"])
    strategy = SequenceParallelStrategy(sequence_parallel_size=world, attention=args.algorithm)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                        precision="bf16-mixed" if cuda else "32-true", max_steps=args.warmup + args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[_step_timer(args, times, losses)])
    module = CausalLMModule(model=dict(shape), lr=1e-5, warmup_steps=1, weight_decay=0.0, loss_chunk_size=args.loss_chunk)
    loader = torch.utils.data.DataLoader(data, batch_size=1, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"), device="cuda" if cuda else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)

    hf_model = module.model
    n_non_embedding = sum(p.numel() for name, p in hf_model.named_parameters() if "embed_tokens" not in name and "lm_head" not in name)
    sq = [sum(n * n for n in data.lengths(i)) / args.seq for i in range(args.warmup, args.warmup + args.steps)]
    attn_span = sum(sq) / len(sq)  # mean over the timed samples of sum(len^2) / S
    flops_per_token = 6 * n_non_embedding + 6 * shape["num_hidden_layers"] * attn_span * shape["hidden_size"]  # DTensor numel: global
    step = sorted(times)[len(times) // 2]
    tps = args.seq / step / world
    row = dict(bench="train", system="seqpar", algorithm=args.algorithm + ("+documents" if args.documents else ""),
               model="hf-llama3-8b" if cuda else "hf-tiny", seq=args.seq, gpus=world,
               device=torch.cuda.get_device_name() if cuda else "cpu", step_time_s=step, tokens_per_s_per_gpu=tps,
               mfu=tps * flops_per_token / PEAK_BF16, peak_mem_gb=peak.item(), losses=losses,
               documents=args.documents, mean_doc=args.mean_doc if args.documents else args.seq,
               attention_span=attn_span, commit=args.commit)
    if dist.get_rank() == 0:
        print(f"[train] {row['model']} {row['algorithm']} S={args.seq} GPUs={world}: {tps:.0f} tokens/s/GPU, MFU {row['mfu']:.3f} "
              f"(attention span {attn_span:.0f}), step {step:.2f}s, peak {row['peak_mem_gb']:.1f} GB, "
              f"losses {[round(x, 3) for x in losses]}", flush=True)
        if args.out:
            append_records(args.out, row)


if __name__ == "__main__":
    main()
