"""Collators: dynamic right padding for causal-LM batches, with the labels of padding set to -100."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

# Entries of policy-gradient rollout rows (hfacc.PolicyGradientObjective) the collator carries: one float per row, and
# per-token floats aligned with input_ids.
ROW_FLOATS = ("advantages",)
TOKEN_FLOATS = ("old_logps", "ref_logps", "importance_weights")
# Stored teacher log-probs of distillation (hfacc.precompute_teacher_logprobs, Axolotl's columns): per token a [K] list
# of token ids and one of log-probs, row t the teacher's distribution of token t.
TEACHER_COLUMNS = ("target_token_ids", "target_logprobs")


@dataclass
class DataCollatorForCausalLM:
    """Pad a list of tokenized examples on the right to the longest one in the micro-batch.

    Args:
        pad_token_id: id written into ``input_ids`` at padding positions (the labels there are always -100, so
            it may equal EOS without hiding the EOS targets of the examples). Packed rows are padded with a real
            token of the row instead (see below).
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor cores like multiples of 8).
        max_length: truncate longer examples to this many tokens (``None``: no truncation here).

    Examples keep their ``labels``; an example without labels is trained on every token (``labels = input_ids``).
    Policy-gradient rollout rows also keep ``advantages`` (one float per row, ``[B]``) and ``old_logps`` /
    ``ref_logps`` / ``importance_weights`` (one float per token, padded with 0: ``[B, T]``); distillation rows their
    stored teacher top-K, ``target_token_ids`` and ``target_logprobs`` (a ``[K]`` list per token, padded with 0:
    ``[B, T, K]``).
    Packed rows (examples with ``position_ids``, or with TRL's ``seq_lengths``: the length of each sequence in the
    row) get ``position_ids`` that restart per sequence and no ``attention_mask``: see
    :func:`hfacc.data.batching.pack_examples`. Their targets never cross a sequence boundary
    (:func:`hfacc.ops.loss.shift_labels`). Their padding is one more sequence, of the row's first token repeated.

    >>> collate = DataCollatorForCausalLM(pad_token_id=0)
    >>> batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}])
    >>> batch["input_ids"]
    tensor([[5, 6, 7],
            [8, 9, 0]])
    >>> batch["labels"]
    tensor([[-100,    6,    7],
            [   8,    9, -100]])
    >>> batch["attention_mask"]
    tensor([[1, 1, 1],
            [1, 1, 0]])
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    max_length: int | None = None

    def __post_init__(self):
        if self.pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token (hfacc.get_tokenizer does it for you).")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty list of examples.")
        ids = [list(e["input_ids"])[: self.max_length] for e in examples]
        labels = [
            list(e["labels"] if e.get("labels") is not None else e["input_ids"])[: self.max_length] for e in examples
        ]
        for i, (x, y) in enumerate(zip(ids, labels, strict=True)):
            if len(x) != len(y):
                raise ValueError(f"example {i} of the micro-batch: {len(x)} input_ids but {len(y)} labels")
        length = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": _pad(ids, length, self.pad_token_id),
            "attention_mask": _pad([[1] * len(x) for x in ids], length, 0),
            "labels": _pad(labels, length, IGNORE_INDEX),
        }
        # Rollout rows (hfacc.PolicyGradientObjective): one float per row, and per-token floats aligned with
        # input_ids (0 on padding, which is never a target).
        for key in ROW_FLOATS:
            if all(e.get(key) is not None for e in examples):
                batch[key] = torch.tensor([float(e[key]) for e in examples], dtype=torch.float32)
        for key in TOKEN_FLOATS:
            if all(e.get(key) is not None for e in examples):
                values = [list(e[key])[: self.max_length] for e in examples]
                for i, (x, v) in enumerate(zip(ids, values, strict=True)):
                    if len(v) != len(x):
                        raise ValueError(f"example {i} of the micro-batch: {len(x)} input_ids but {len(v)} {key}")
                batch[key] = _pad(values, length, 0.0, torch.float32)
        for key, dtype in zip(TEACHER_COLUMNS, (torch.long, torch.float32), strict=True):
            if all(e.get(key) is not None for e in examples):
                batch[key] = _pad_lists([list(e[key])[: self.max_length] for e in examples], ids, length, key, dtype)
        if all(e.get("position_ids") is None and e.get("seq_lengths") is not None for e in examples):
            examples = [{**e, "position_ids": _positions_from_lengths(e, i)} for i, e in enumerate(examples)]
        if all(e.get("position_ids") is not None for e in examples):
            # Packed rows (hfacc.data.batching.pack_examples): transformers keeps the sequences of a row apart only
            # when it gets position_ids and no attention_mask. The padding becomes one more sequence of its own
            # (positions 0, 1, ...), attended by nothing else and carrying no targets, made of the row's first token,
            # not the pad token: a pad embedding may be zero (padding_idx), which some models cannot
            # backpropagate through on its own (Gemma3n: NaN), and a pad id at a row's end without attention_mask
            # makes transformers warn that the input "may be padded".
            del batch["attention_mask"]
            for row, x in enumerate(ids):
                if x:
                    batch["input_ids"][row, len(x) :] = x[0]
            batch["position_ids"] = torch.stack(
                [
                    torch.tensor(list(e["position_ids"])[: self.max_length] + list(range(length - len(x))))
                    for e, x in zip(examples, ids, strict=True)
                ]
            )
        return batch


def _positions_from_lengths(example: dict[str, Any], index: int) -> list[int]:
    lengths = list(example["seq_lengths"])
    if sum(lengths) != len(example["input_ids"]) or any(n < 0 for n in lengths):
        raise ValueError(
            f"example {index} of the micro-batch: seq_lengths {lengths} do not add up to its "
            f"{len(example['input_ids'])} input_ids."
        )
    return [p for n in lengths for p in range(n)]


def _pad(rows: Sequence[Sequence[float]], length: int, value: float, dtype: torch.dtype = torch.long) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def _pad_lists(rows, ids, length: int, key: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-token ``[K]`` lists of each example as one ``[B, length, K]`` tensor, 0 on padding."""
    widths = {len(v) for row in rows for v in row}
    for i, (x, row) in enumerate(zip(ids, rows, strict=True)):
        if len(row) != len(x):
            raise ValueError(
                f"example {i} of the micro-batch: {len(x)} input_ids but {len(row)} {key} (one per token)"
            )
    if len(widths) > 1:
        raise ValueError(
            f"{key}: lists of different lengths {sorted(widths)} in one micro-batch; one K for all tokens"
        )
    out = torch.zeros(len(rows), length, widths.pop() if widths else 0, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def warn_about_padding_labels(batches: list[Mapping[str, Any]]) -> None:
    """Say once when a collator left labels on padding: padding is never a target
    (:func:`hfacc.ops.loss.shift_labels`).

    Stock ``Trainer`` would train them (the last token learns to predict the pad, pads predict pads); hfacc does not,
    padded or padding-free, so the two give the same update.
    """
    found = 0
    for batch in batches:
        labels, mask = batch.get("labels"), batch.get("attention_mask")
        if torch.is_tensor(labels) and torch.is_tensor(mask) and mask.shape == labels.shape:
            found += int(((labels != IGNORE_INDEX) & (mask == 0)).sum())
    if found:
        logger.warning(
            "hfacc: %d labels at padding positions (attention_mask 0) are not -100 in the first window; padding is "
            "never a target, so they are ignored. To train an end-of-sequence token, put it in the examples.",
            found,
        )
