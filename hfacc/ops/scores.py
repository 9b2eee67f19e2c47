"""A reward model's scores: a sequence-classification model's output where its own pooling reads each sequence.

transformers' sequence-classification heads of decoder models (``GenericForSequenceClassification``: Llama, Qwen,
Mistral, Gemma, ...; GPT-2 and others alike) compute ``score(hidden)`` at *every* position, then keep one per row:
the one at the row's rightmost token that is not ``pad_token_id`` (position 0 when every token is). hfacc reads the
head's per-position output itself (a forward hook on ``score``; the forward still runs through every wrapper: DDP,
DeepSpeed, PEFT) and takes each sequence's value at the token that rule picks, so a model trained here scores the
same under its own forward (TRL, pipelines, :class:`hfacc.generation.rewards.RewardModelFunction`):

- in a padded batch, the row's rightmost token that is not ``pad_token_id`` (right or left padding), as the model;
- in a padding-free layout (:func:`hfacc.data.padding_free.remove_padding`), where a row holds several sequences and
  the model's own pooling would give one score per row, each sequence's rightmost token that is not
  ``pad_token_id`` (``sequence_ids``; its first token when every token is): what the model reads of it padded;
- in the shared-prompt layout of pairs (:func:`hfacc.data.shared_prompts.share_prompts`), where that token is, as
  the layout computed it (``score_index``).

With a pad token equal to EOS (TRL's default) that is the token *before* a final EOS, in both layouts, as the model
reads it; a distinct pad token makes the model (and hfacc) read the EOS itself. Without a ``pad_token_id`` the last
real token is read (the model's own pooling then takes one sequence per batch). A model without a per-position
``score`` head (an encoder whose classifier reads a pooled first token) is read through its own pooled output,
padded only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .model_io import forward_inputs, get_base_model, get_logits


def get_score_head(model: nn.Module) -> nn.Module | None:
    """The module that scores every position (``score``) of a sequence-classification model, or None."""
    head = getattr(get_base_model(model), "score", None)
    return head if isinstance(head, nn.Module) else None


def get_last_token_index(batch: Mapping[str, Any], shape: torch.Size, pad_token_id: int | None = None) -> torch.Tensor:
    """The flat index (into ``[rows * T]``) of the token each sequence is scored at, in sequence order: ``[n]``.

    With ``pad_token_id`` (the model's config's), the rule of transformers' own pooling: the rightmost token of the
    row (of the sequence, padding-free) whose id is not ``pad_token_id``, or the first position when there is none.
    Without one, the last real token. A padding-free layout says which sequence each position holds
    (``sequence_ids``, -1 in the filler); a padded batch, which positions are real (``attention_mask``); without
    either every row is one unpadded sequence.

    >>> get_last_token_index({"attention_mask": torch.tensor([[1, 1, 0], [0, 1, 1]])}, torch.Size([2, 3]))
    tensor([1, 5])
    >>> get_last_token_index({"sequence_ids": torch.tensor([[0, 0, 1, 1, 1, -1]]), "num_sequences": 2},
    ...                      torch.Size([1, 6]))
    tensor([1, 4])
    >>> get_last_token_index({"input_ids": torch.tensor([[5, 6, 2, 2], [5, 2, 7, 2]])}, torch.Size([2, 4]), 2)
    tensor([1, 6])
    """
    rows, width = shape[0], shape[1]
    ids = batch.get("input_ids")
    not_pad = ids != pad_token_id if pad_token_id is not None and torch.is_tensor(ids) else None
    owner = batch.get("sequence_ids")
    if owner is not None:
        owner = owner.expand(shape).flatten()
        real = owner >= 0
        positions = torch.arange(owner.numel(), device=owner.device)
        count = int(batch["num_sequences"])
        last = torch.full((count,), -1, dtype=torch.long, device=owner.device)
        if not_pad is None:
            return last.scatter_reduce(0, owner[real], positions[real], reduce="amax")
        read = real & not_pad.flatten()
        last = last.scatter_reduce(0, owner[read], positions[read], reduce="amax")
        first = torch.full((count,), owner.numel(), dtype=torch.long, device=owner.device)
        first = first.scatter_reduce(0, owner[real], positions[real], reduce="amin")
        return torch.where(last >= 0, last, first)  # a sequence of pad tokens only: its first, as padded
    columns = torch.arange(width, device=ids.device if torch.is_tensor(ids) else None)
    mask = batch.get("attention_mask")
    if not_pad is not None:
        last = (not_pad * columns).argmax(-1)  # transformers' rule: 0 when every token is pad_token_id
        if torch.is_tensor(mask) and mask.dim() == 2:
            _refuse_reading_padding(ids, mask, last, pad_token_id)
        return torch.arange(rows, device=columns.device) * width + last
    if torch.is_tensor(mask) and mask.dim() == 2:
        return torch.arange(rows, device=mask.device) * width + _last_attended(mask)
    device = next((v.device for v in batch.values() if torch.is_tensor(v)), None)
    return torch.arange(rows, device=device) * width + width - 1


def _last_attended(mask: torch.Tensor) -> torch.Tensor:
    """``[rows]``: the rightmost position of each row whose ``attention_mask`` is 1 (right or left padding)."""
    columns = torch.arange(mask.shape[1], device=mask.device)
    return (mask.bool() * (columns + 1)).argmax(-1)


def _refuse_reading_padding(ids: torch.Tensor, mask: torch.Tensor, last: torch.Tensor, pad_token_id: int) -> None:
    """A ``ValueError`` where the model's rule would read a row's right padding: the batch is padded with an id that
    is not the config's ``pad_token_id``. The model would score a padding position (what the collator's width
    decides, not the sequence), and a padding-free layout would read the sequence's last token instead: two layouts,
    two trainings, no error (found: a collator padding with the tokenizer's pad id beside a config with another)."""
    reads_padding = (last.to(mask.device) > _last_attended(mask)) & mask.bool().any(-1)
    if bool(reads_padding.any()):
        row = int(reads_padding.nonzero()[0, 0])
        used = int(ids[row, int(last[row])])
        raise ValueError(
            f"The batch is padded with token id {used}, but the reward model's config has pad_token_id="
            f"{pad_token_id}: its own pooling (the rightmost token that is not pad_token_id) would read row {row}'s "
            f"padding instead of its last token, and a padding-free layout would read that token: pad with the model's "
            f"pad token (DataCollatorForPreference(pad_token_id={pad_token_id}), or a tokenizer whose pad_token_id is "
            f"{pad_token_id}), or set model.config.pad_token_id = {used} (TRL sets it from the tokenizer)."
        )


def get_pad_token_id(model: nn.Module) -> int | None:
    """The ``pad_token_id`` of ``model``'s (text) config, which its own pooling reads by; None without one."""
    config = getattr(get_base_model(model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "pad_token_id", None)


def get_sequence_scores(
    model: nn.Module, batch: Mapping[str, Any], inputs: Mapping[str, Any] | None = None
) -> tuple[Any, torch.Tensor]:
    """Run ``model`` on ``inputs`` (default: ``batch``'s model inputs); return its outputs and the score of each of
    ``batch``'s sequences ``[n]`` (fp32, differentiable), read where the model's own pooling reads it (the module doc).

    ``inputs`` default to :func:`hfacc.ops.model_io.forward_inputs` (no cache for packed rows). The model must give
    one value per position and sequence (``num_labels=1``). Without a per-position head, the
    model's own pooled output is returned, which a padding-free layout cannot have (a ``ValueError`` then).
    """
    inputs = forward_inputs(batch) if inputs is None else inputs
    head, captured = get_score_head(model), []

    def keep(module, args, output):  # the head's output at every position, before the model pools one per row
        captured.append(output)

    handle = head.register_forward_hook(keep) if head is not None else None
    try:
        outputs = model(**inputs)
    finally:
        if handle is not None:
            handle.remove()
    shape = batch["input_ids"].shape if torch.is_tensor(batch.get("input_ids")) else None
    if captured and shape is not None and tuple(captured[-1].shape[:2]) == tuple(shape[:2]):
        per_position = captured[-1][..., 0].float()
        index = batch.get("score_index")  # the shared-prompt layout says where (hfacc.data.shared_prompts)
        if index is None:
            index = get_last_token_index(batch, shape, get_pad_token_id(model))
        return outputs, per_position.flatten()[index]
    if batch.get("sequence_ids") is not None or batch.get("score_index") is not None:
        # Several sequences per row (packed, or pairs sharing their prompt): the model's own pooling gives one value
        # per row, which would be read as the sequences' scores (the check ran the `score` head, not this forward).
        raise ValueError(
            f"{type(get_base_model(model)).__name__} gives no score per position (no per-position 'score' head, or "
            "its forward scores through another one), so the sequences of a padding-free row cannot be scored apart: "
            "train it padded (padding_free=False)."
        )
    return outputs, get_logits(outputs)[:, 0].float()


def reward_model_problem(model: nn.Module) -> str | None:
    """Why ``model`` is no reward model hfacc can train or score with (None: it is): one output per sequence
    (``num_labels=1``) and a ``pad_token_id`` in its config (its own pooling runs on padded batches)."""
    base = get_base_model(model)
    config = getattr(base, "config", None)
    labels = getattr(config, "num_labels", None)
    if labels != 1:
        return (
            f"{type(base).__name__} has num_labels={labels}, but a reward model gives one score per sequence: load it "
            "with num_labels=1 (AutoModelForSequenceClassification.from_pretrained(path, num_labels=1))"
        )
    if get_pad_token_id(base) is None:
        return (
            f"{type(base).__name__}'s config has no pad_token_id, which its own pooling needs for batches of several "
            "sequences: set model.config.pad_token_id = tokenizer.pad_token_id (hfacc reads each score where that "
            "pooling does: the rightmost token that is not the pad token; give the tokenizer a pad token other than "
            "EOS to score the EOS itself)"
        )
    return None


class PerPositionScores(nn.Module):
    """A reward model as hfacc's layout checks run it: the head's score at every position as ``logits``
    ``[rows, T, 1]``, from the base model's final hidden states (:mod:`hfacc.setup.layout_check`: padded vs
    padding-free, leaks between packed sequences, far row offsets).

    The checks run the model apart from training (no data-parallel wrapper, gradients only to the input embeddings),
    so the backbone and the head are called directly: what the head reads at every position is what the layout can
    change, and the model's own pooling (one score per row) is not. ``module`` is the model (hfacc's readers of a
    model, :func:`hfacc.ops.model_io.get_base_model`, find it there).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model
        self.train(model.training)  # the checks put the view in eval mode and back: back is the model's own mode

    def forward(self, **inputs) -> dict[str, torch.Tensor]:
        base = get_base_model(self.module)
        backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
        head = get_score_head(base)
        if not isinstance(backbone, nn.Module) or head is None:
            raise ValueError(
                f"{type(base).__name__} has no per-position 'score' head (its classifier reads a pooled token), so the "
                "sequences of a packed row cannot be scored apart"
            )
        outputs = backbone(**inputs)
        hidden = outputs["last_hidden_state"] if isinstance(outputs, Mapping) else outputs[0]
        scores = {"logits": head(hidden)}
        if isinstance(outputs, Mapping) and outputs.get("aux_loss") is not None:
            scores["aux_loss"] = outputs["aux_loss"]
        return scores


__all__ = [
    "PerPositionScores",
    "get_last_token_index",
    "get_pad_token_id",
    "get_score_head",
    "get_sequence_scores",
    "reward_model_problem",
]
