"""Passkey retrieval prompts (Mohtashami & Jaggi 2023) built with a tokenizer, at exact lengths and depths.

Note [Passkey prompts]
~~~~~~~~~~~~~~~~~~~~~~
A prompt of exactly ``length`` tokens (each piece tokenized on its own, without special tokens,
except the introduction, which gets what the tokenizer adds by default, e.g. BOS)::

    | intro | filler ... | needle | filler ... | question | answer |
              <- depth x filler ->

    intro     "There is an important info hidden inside a lot of irrelevant text. Find it and
               memorize it. I will quiz you about the important information there."
    filler    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and
               back again." repeated, cut to the tokens left
    needle    " The pass key is 71432. Remember it. 71432 is the pass key."
    question  " What is the pass key? The pass key is"
    answer    " 71432"

The filler before the needle is ``depth`` of all the filler tokens, rounded to a token (depth 0:
the needle follows the introduction, 1: it precedes the question; the filler is cut at token
granularity, so a sentence may be split around the needle, as the prompt must have exactly
``length`` tokens). The labels are -100
except at the positions that predict the answer's tokens (the last answer token predicts
nothing), so a forward pass gives :class:`lightning_seqpar.training.metrics.PasskeyAccuracy` the greedy
answer (Note [Passkey retrieval] in ``lightning_seqpar.training.metrics``). The passkeys are random numbers
of ``digits`` digits drawn from ``seed``: every rank builds the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX

__all__ = ["FILLER", "INTRO", "NEEDLE", "QUESTION", "PasskeyPrompts", "passkey_prompts"]

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"


def _ids(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


class PasskeyPrompts(Sequence):
    """The prompts of a depth x length x samples grid (Note [Passkey prompts]), indexed by ``prompt_id``
    ``(depth_index * len(lengths) + length_index) * samples + sample_index``; :func:`passkey_prompts` builds it.

    Only the tokenized pieces are kept; ``prompts[i]`` builds prompt i, a dict of ``input_ids``, ``labels``,
    ``position_ids`` (LongTensors ``(length,)``) and ``prompt_id`` (a LongTensor scalar), ready for a
    DataLoader's collate (a grid of 1M-token prompts is not held in memory at once).
    """

    def __init__(self, head: list[int], unit: list[int], asked: list[int], parts: list[tuple[int, float, list[int], list[int]]]) -> None:
        self._head, self._unit, self._asked, self._parts = head, unit, asked, parts

    def __len__(self) -> int:
        return len(self._parts)

    def length(self, index: int) -> int:
        """The token count of prompt ``index``."""
        return self._parts[index][0]

    @property
    def max_token_id(self) -> int:
        """The largest token id of any prompt."""
        return max(max(ids, default=-1) for ids in (self._head, self._unit, self._asked, *(p[2] + p[3] for p in self._parts)))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if not 0 <= index < len(self._parts):
            raise IndexError(f"prompt {index} out of range for {len(self._parts)} prompts")
        length, depth, hidden, answer = self._parts[index]
        budget = length - len(self._head) - len(hidden) - len(self._asked) - len(answer)
        text = (self._unit * (budget // len(self._unit) + 1))[:budget]
        before = round(depth * budget)  # filler tokens before the needle
        ids = self._head + text[:before] + hidden + text[before:] + self._asked + answer
        assert len(ids) == length
        input_ids = torch.tensor(ids, dtype=torch.int64)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        k = len(answer)
        labels[length - k - 1 : length - 1] = input_ids[length - k :]  # the positions that predict the answer
        return {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(length), "prompt_id": torch.tensor(index)}


def passkey_prompts(tokenizer: Any, *, lengths: Sequence[int], depths: Sequence[float], samples: int = 1, seed: int = 0,
                    digits: int = 5, intro: str = INTRO, filler: str = FILLER, needle: str = NEEDLE,
                    question: str = QUESTION) -> PasskeyPrompts:
    """Every prompt of the grid (Note [Passkey prompts]), as a :class:`PasskeyPrompts` sequence in the order of
    their ``prompt_id`` ``(depth_index * len(lengths) + length_index) * samples + sample_index``.

    ``intro``, ``filler``, ``needle`` (with ``{key}`` where the passkey goes) and ``question`` replace the
    texts of the prompt (``intro=""`` leaves the introduction out: short prompts for tiny models).

    Raises:
        ValueError: a length too short for the prompt's fixed parts, a depth outside [0, 1], or a tokenizer
            that cannot spell the passkey (its unknown token).
    """
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 18:
        raise ValueError(f"passkey_prompts: digits must be an integer in [1, 18], got {digits!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"passkey_prompts: samples must be a positive integer, got {samples!r}")
    if not depths or not all(0.0 <= float(d) <= 1.0 for d in depths):
        raise ValueError(f"passkey_prompts: depths must be fractions in [0, 1], got {list(depths)!r}")
    if "{key}" not in needle:
        raise ValueError(f"passkey_prompts: needle must hold '{{key}}' where the passkey goes, got {needle!r}")
    head = _ids(tokenizer, intro, special=True) if intro else []
    unit, asked = _ids(tokenizer, filler), _ids(tokenizer, question)
    if not unit:
        raise ValueError("passkey_prompts: the tokenizer gives no token for the filler text")
    rng = np.random.default_rng(seed)
    keys = rng.integers(10 ** (digits - 1), 10**digits, size=(len(depths), len(lengths), samples))
    unk = getattr(tokenizer, "unk_token_id", None)
    parts = []
    for d, depth in enumerate(depths):
        for li, length in enumerate(lengths):
            for n in range(samples):
                key = str(int(keys[d, li, n]))
                hidden, answer = _ids(tokenizer, needle.format(key=key)), _ids(tokenizer, ANSWER.format(key=key))
                if unk is not None and unk in answer:
                    raise ValueError(f"passkey_prompts: the tokenizer cannot spell the passkey {key!r} (it gives its unknown "
                                     f"token {unk}); use a tokenizer with digits")
                fixed = len(head) + len(hidden) + len(asked) + len(answer)
                if int(length) < fixed:
                    raise ValueError(f"passkey_prompts: lengths holds {length} tokens, fewer than the prompt's fixed parts "
                                     f"({fixed} tokens with this tokenizer); use longer lengths")
                parts.append((int(length), float(depth), hidden, answer))
    return PasskeyPrompts(head, unit, asked, parts)
