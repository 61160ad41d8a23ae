"""ChatDataModule: chat-template rendering, assistant-only labels, packing of whole conversations, bad rows.

A word-level tokenizer built here (no download) with two equivalent chat templates: one with
``{% generation %}`` (transformers' assistant mask) and one without (the mask from rendering
prefixes). The samples are compared with a hand-written expectation, and one step under the
strategy (sp 2) gives the loss of every conversation run ALONE through the unmodified
transformers model, summed over the trained tokens and divided by their count.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from dist_utils import run_distributed  # noqa: E402

from lightning_seqpar.data.chat import ChatDataModule, assistant_mask  # noqa: E402

WORDS = ["hi", "hello", "how", "are", "you", "fine", "thanks", "bye", "be", "brief"]
SPECIAL = ["[UNK]", "[PAD]", "[EOS]", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS)}  # [UNK] 0 [PAD] 1 [EOS] 2 user 3 assistant 4 system 5 end 6 hi 7 ...
U, A, SYS, END = 3, 4, 5, 6
W = {w: VOCAB[w] for w in WORDS}

PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
         "{% if add_generation_prompt %}<|assistant|> {% endif %}")
GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>"
              "{% endgeneration %} {% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def _msgs(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


C0 = _msgs(("user", "hi"), ("assistant", "hello"))
C1 = _msgs(("system", "be brief"), ("user", "how are you"), ("assistant", "fine thanks"), ("user", "bye"), ("assistant", "bye"))
C2 = _msgs(("user", "hi"), ("assistant", "fine"))
C3 = _msgs(("user", "how are you"), ("assistant", "fine"))
LONG = _msgs(("user", " ".join(["hi"] * 30)), ("assistant", "hello"))  # 36 tokens > SEQ_LEN
# hand-written: tokens and assistant masks of the conversations
T0, M0 = [U, W["hi"], END, A, W["hello"], END], [0, 0, 0, 0, 1, 1]
T1 = [SYS, W["be"], W["brief"], END, U, W["how"], W["are"], W["you"], END, A, W["fine"], W["thanks"], END, U, W["bye"], END, A, W["bye"], END]
M1 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
T2, M2 = [U, W["hi"], END, A, W["fine"], END], [0, 0, 0, 0, 1, 1]
T3, M3 = [U, W["how"], W["are"], W["you"], END, A, W["fine"], END], [0, 0, 0, 0, 0, 0, 1, 1]
SEQ_LEN = 32  # C0 + C1 + C2 = 31 tokens (+ 1 padding) in sample 0; C3 (8) does not fit: sample 1
PAD = VOCAB["[PAD]"]


def _tokenizer(path: str, template: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]",
                                                additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"])
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


def _write(path: str, rows: list) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _labels(tokens: list[int], mask: list[int]) -> list[int]:
    """Hand rule: position t predicts token t + 1 where that token is the assistant's; the last position predicts nothing."""
    return [tokens[t + 1] if mask[t + 1] else -100 for t in range(len(tokens) - 1)] + [-100]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {"plain": _tokenizer(str(root / "plain"), PLAIN), "generation": _tokenizer(str(root / "generation"), GENERATION)}


@pytest.mark.parametrize("template", ["plain", "generation"])
def test_assistant_masks_match_the_hand_written_ones(template, tokenizers):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizers[template])
    for messages, tokens, mask in ((C0, T0, M0), (C1, T1, M1), (C3, T3, M3)):
        conversation = assistant_mask(tokenizer, messages)
        assert conversation.input_ids.tolist() == tokens
        assert conversation.assistant.tolist() == mask


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizers):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizers["plain"])
    count = "{{ messages | length }} " + PLAIN  # the rendering of turn 0 depends on how many turns follow
    with pytest.raises(ValueError, match="generation"):
        assistant_mask(tokenizer, C0, chat_template=count)


def _rows(bad: bool = True) -> list:
    rows: list = [{"messages": C0}, {"messages": C1}]
    if bad:
        rows += ["{not json", {"messages": _msgs(("user", "hi"))}, {"text": "no messages"}, {"messages": LONG}]
    return rows + [{"messages": C2}, {"messages": C3}]


@pytest.mark.parametrize("template", ["plain", "generation"])
def test_packing_and_labels_match_the_hand_written_samples(template, tokenizers, tmp_path, caplog):
    files = _write(str(tmp_path / "train.jsonl"), _rows())
    dm = ChatDataModule(train_files=files, tokenizer_path=tokenizers[template], seq_len=SEQ_LEN, batch_size=2)
    with caplog.at_level(logging.INFO):
        dm.setup("fit")
    assert dict(dm.bad_rows["train"]) == {"broken JSON": 1, "no assistant turn": 1, "no messages list": 1,
                                         "longer than seq_len (skipped)": 1}
    assert "bad rows: 1 broken JSON" in caplog.text and "on_too_long='skip'" in caplog.text
    data = dm.train_dataset
    assert len(data) == 2
    s0, s1 = data[0], data[1]
    assert s0["input_ids"].tolist() == T0 + T1 + T2 + [PAD]
    assert s0["labels"].tolist() == _labels(T0, M0) + _labels(T1, M1) + _labels(T2, M2) + [-100]
    assert s0["document_ids"].tolist() == [0] * 6 + [1] * 19 + [2] * 6 + [3]
    assert s0["document_position_ids"].tolist() == list(range(6)) + list(range(19)) + list(range(6)) + [0]
    assert s0["position_ids"].tolist() == list(range(SEQ_LEN))
    assert s1["input_ids"].tolist() == T3 + [PAD] * 24
    assert s1["labels"].tolist() == _labels(T3, M3) + [-100] * 24
    assert s1["document_ids"].tolist() == [0] * 8 + [1] * 24
    # spot checks of the rule: C0's "hello" and "<|end|>" are trained, the assistant header is not
    assert s0["labels"][3].item() == W["hello"] and s0["labels"][4].item() == END and s0["labels"][2].item() == -100
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, SEQ_LEN)


def test_no_val_files_means_no_validation_loop(tokenizers, tmp_path):
    """val_files=None (recipes/lora_finetune.yaml): the datamodule has no val_dataloader hook, so a fit runs no validation
    and Lightning does not warn that the validation list is empty; with val_files the hook gives their loader."""
    import lightning as L
    from lightning.pytorch.utilities.model_helpers import is_overridden

    files = _write(str(tmp_path / "train.jsonl"), _rows(bad=False))
    dm = ChatDataModule(train_files=files, tokenizer_path=tokenizers["plain"], seq_len=SEQ_LEN, batch_size=1)
    assert dm.val_dataloader is None and not is_overridden("val_dataloader", dm)

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.validated = 0

        def training_step(self, batch, batch_idx):
            return self.w * batch["input_ids"].float().mean()

        def validation_step(self, batch, batch_idx):
            self.validated += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Tiny()
    trainer = L.Trainer(accelerator="cpu", max_steps=2, val_check_interval=1, limit_val_batches=4, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 2 and module.validated == 0
    assert not [w for w in caught if "length" in str(w.message) and "zero" in str(w.message)], [str(w.message) for w in caught]
    with_val = ChatDataModule(train_files=files, val_files=files, tokenizer_path=tokenizers["plain"], seq_len=SEQ_LEN, batch_size=1)
    assert is_overridden("val_dataloader", with_val)
    assert next(iter(with_val.val_dataloader()))["input_ids"].shape == (1, SEQ_LEN)


def test_bad_row_policies(tokenizers, tmp_path):
    files = _write(str(tmp_path / "train.jsonl"), _rows())
    dm = ChatDataModule(train_files=files, tokenizer_path=tokenizers["plain"], seq_len=SEQ_LEN, batch_size=1, on_too_long="truncate")
    dm.setup("fit")
    # LONG's first SEQ_LEN tokens are all the user's: nothing left to train, so it is skipped all the same
    assert dm.bad_rows["train"]["longer than seq_len and no assistant token left after truncation (skipped)"] == 1
    long_answer = _msgs(("user", "hi"), ("assistant", " ".join(["fine"] * 40)))
    files = _write(str(tmp_path / "long.jsonl"), [{"messages": C0}, {"messages": long_answer}])
    dm = ChatDataModule(train_files=files, tokenizer_path=tokenizers["plain"], seq_len=SEQ_LEN, batch_size=1, on_too_long="truncate")
    dm.setup("fit")
    assert dict(dm.bad_rows["train"]) == {"longer than seq_len (truncated)": 1}
    sample = dm.train_dataset[1]
    assert sample["input_ids"].tolist() == [U, W["hi"], END, A] + [W["fine"]] * 28  # the first SEQ_LEN tokens
    assert sample["labels"].tolist() == [-100] * 3 + [W["fine"]] * 28 + [-100]
    for policy, kwargs in (("on_invalid", {"on_invalid": "error"}), ("on_too_long", {"on_too_long": "error"})):
        dm = ChatDataModule(train_files=_write(str(tmp_path / f"{policy}.jsonl"), _rows()), tokenizer_path=tokenizers["plain"],
                            seq_len=SEQ_LEN, batch_size=1, **kwargs)
        with pytest.raises(ValueError, match=rf"{policy}='error'"):
            dm.setup("fit")
    with pytest.raises(ValueError, match="on_too_long"):
        ChatDataModule(train_files=files, tokenizer_path=tokenizers["plain"], seq_len=SEQ_LEN, batch_size=1, on_too_long="drop")


# ---------------------------------------------------------------------------------------------- under the strategy


def _fit_chat(rank: int, world_size: int, model_path: str, datamodule_kwargs: dict) -> float | None:
    warnings.filterwarnings("ignore")
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    losses: list[float] = []

    class Loss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(trainer.callback_metrics["train/loss"]))

    strategy = SequenceParallelStrategy(sequence_parallel_size=world_size, attention="ring")
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Loss()])
    trainer.fit(CausalLMModule(model_path, lr=1e-3, warmup_steps=0, max_steps=1), datamodule=ChatDataModule(**datamodule_kwargs))
    return losses[0] if rank == 0 else None


def test_loss_under_the_strategy_is_the_mean_over_trained_tokens_of_conversations_run_alone(tokenizers, tmp_path):
    from hf_testing import save_tiny_model

    model_path = save_tiny_model("llama", str(tmp_path / "llama"), vocab_size=len(VOCAB))
    files = _write(str(tmp_path / "train.jsonl"), _rows(bad=False))
    kwargs = {"train_files": files, "tokenizer_path": tokenizers["plain"], "seq_len": SEQ_LEN, "batch_size": 2, "seed": 0}
    loss = run_distributed(_fit_chat, 2, model_path, kwargs, timeout=300)[0]
    # reference: every conversation alone, the unmodified model; one sum over all trained tokens / their count
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager", dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, mask in ((T0, M0), (T1, M1), (T2, M2), (T3, M3)):
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
            labels = torch.tensor(_labels(tokens, mask))
            total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    assert count == sum(M0[1:]) + sum(M1[1:]) + sum(M2[1:]) + sum(M3[1:]) == 11
    assert loss == pytest.approx(total / count, rel=1e-5)
