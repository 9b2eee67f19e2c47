"""What a *target* is for each kind of model head, and how to sum the loss over the targets of a micro-batch.

An :class:`Objective` answers two questions, in this order:

1. ``count(batch)`` — how many targets does this micro-batch hold? It is asked for every micro-batch of a window
   *before* the first forward, because the window's total is the denominator of every micro-batch's loss and must be
   known before the first ``backward()``.
2. ``objective(model, batch)`` — run the model and return its outputs and the :class:`~hfacc.loss.LossSums`.

hfacc never hands ``labels`` to the model (it would compute, and pay for, a second loss that is then thrown away),
except for :class:`ModelLossObjective`, the explicit fallback for losses hfacc cannot reproduce.

Next door: :mod:`hfacc.objective_choice` picks the objective a model calls for (``objective="auto"``);
:mod:`hfacc.function_objective` builds one from the user's functions (``FunctionObjective``, ``compute_loss_func``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .fused_loss import FusedOutputHead, swap_output_head
from .loss import (
    IGNORE_INDEX,
    LossSums,
    binary_cross_entropy_sums,
    count_targets,
    cross_entropy_sums,
    get_sequence_ids,
    per_sequence_sums,
    shift_labels,
    squared_error_sums,
)
from .model_io import (
    get_base_model,
    get_logits,
    get_num_virtual_tokens,
    model_inputs,
    packed_position_ids,
)
from .multimodal import with_packed_positions


class Objective(ABC):
    """Base class: subclass it to make a custom loss exact under accumulation.

    Args:
        label_smoothing: label smoothing factor of cross-entropy objectives.

    Subclasses set ``name``, implement :meth:`count` and :meth:`__call__`, and set ``has_accuracy = False`` when
    "correct" means nothing for them.

    >>> class MeanAbsoluteError(Objective):
    ...     name = "mae"
    ...     has_accuracy = False
    ...     def count(self, batch):
    ...         n = batch["labels"].numel()
    ...         return torch.tensor([n, batch["labels"].shape[0]])
    ...     def __call__(self, model, batch, per_sequence=False):
    ...         outputs = model(**model_inputs(batch))
    ...         err = (get_logits(outputs).squeeze(-1) - batch["labels"]).abs()
    ...         zeros = torch.zeros((), dtype=torch.long)
    ...         return outputs, LossSums(err.sum(), torch.tensor(err.numel()), zeros)
    """

    name = "custom"
    has_accuracy = True
    exact = True
    # Whether ``__call__(..., per_sequence=True)`` returns one sum per sequence. Evaluation on several ranks needs
    # them to drop the examples accelerate repeats; objectives without them are evaluated on the real rows only.
    sums_per_sequence = True

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    @abstractmethod
    def count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``tensor([num_targets, num_sequences_with_a_target])`` of one micro-batch (int64), before any forward."""

    @abstractmethod
    def __call__(self, model: nn.Module, batch: Mapping[str, Any], per_sequence: bool = False):
        """Run ``model`` on ``batch``; return ``(outputs, LossSums)``: sums over the targets ``count`` counted."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class CausalLMObjective(Objective):
    """Next-token prediction: ``logits[:, i]`` is scored against ``labels[:, i + 1]`` (labels != -100).

    Targets follow :func:`hfacc.loss.shift_labels`, the one definition: the shift never crosses a sequence boundary
    (``position_ids`` that restart) and padding is never a target. A batch may carry ``shift_labels`` (already
    aligned, e.g. from a padding-free collator); they are used as is, except at padding positions.
    Packed rows (``position_ids`` that restart, no ``attention_mask``) run with ``use_cache=False``: with a cache,
    transformers does not keep packed sequences apart. Their per-sequence sums (``normalization="sequence"``) are
    per packed sequence, not per row.

    With ``fused=True`` the output projection's forward is swapped, for the length of one forward, for one that
    computes the loss sums from the final hidden states in chunks (:mod:`hfacc.fused_loss`), so the full
    ``[B, T, V]`` logits never exist; the model's output then holds the loss sum where its logits would be. The head
    module itself is still called inside the model's own forward, so DDP sees every parameter it expects and
    FSDP2/ZeRO-3 gather its weight as usual. :func:`hfacc.loss_path.choose_loss_path` decides whether a model can be
    taken apart like this.
    """

    name = "causal_lm"

    def __init__(
        self, label_smoothing: float = 0.0, fused: bool = False, chunk_size: int = 0, num_virtual_tokens: int = 0
    ):
        super().__init__(label_smoothing)
        self.fused, self.chunk_size = fused, chunk_size
        self.fused_in_eval = True  # False when evaluation needs the logits (predictions, compute_metrics)
        # PEFT prompt tuning puts this many virtual tokens before the inputs, so the logits have as many more
        # positions (see get_num_virtual_tokens).
        self.num_virtual_tokens = num_virtual_tokens

    def count(self, batch):
        targets = self._targets(batch) != IGNORE_INDEX
        sequences = get_batch_sequences(batch, targets.shape)
        if sequences is None:
            return torch.stack([targets.sum(), targets.any(-1).sum()])
        ids, n = sequences  # rows holding several sequences: count sequences, not rows
        hit = torch.zeros(n, dtype=torch.long, device=targets.device).index_fill_(0, ids[targets], 1)
        return torch.stack([targets.sum(), hit.sum()])

    def __call__(self, model, batch, per_sequence=False):
        inputs = model_inputs(batch)
        if packed_position_ids(inputs) is not None:
            inputs["use_cache"] = False
            inputs = with_packed_positions(model, inputs)  # hfacc.multimodal: mrope positions per sequence (Qwen2-VL)
        targets = self._targets(batch)
        sequences = get_batch_sequences(batch, targets.shape) if per_sequence else None
        if self.fused and (model.training or self.fused_in_eval) and not (per_sequence and torch.is_grad_enabled()):
            return self._fused(model, inputs, targets, per_sequence, sequences)
        outputs = model(**inputs)
        sums = cross_entropy_sums(
            get_logits(outputs),
            targets,
            label_smoothing=self.label_smoothing,
            per_sequence=per_sequence,
            sequences=sequences,
        )
        return outputs, sums

    def _fused(self, model, inputs, targets, per_sequence, sequences=None):
        head = FusedOutputHead(
            get_base_model(model).get_output_embeddings(), targets, self.chunk_size, self.label_smoothing
        )
        with swap_output_head(model, head):
            outputs = model(**inputs)
        sums, per_target, correct = head.result
        if per_sequence:  # evaluation: per-sequence sums for the exact cross-rank eval metrics, no gradient needed
            return outputs, per_sequence_sums(per_target, correct, targets != IGNORE_INDEX, sequences)
        returned = get_logits(outputs)
        if returned.requires_grad and returned.dim() == 0:
            # Backpropagate from what the model returned, not from the kernel's own output: FSDP2 and ZeRO-3 hook
            # their backward (re-gather the weight, reduce-scatter its gradient) on the head's output as the model
            # passed it on. `check_fused_loss` made sure the model returns that value unchanged.
            sums = sums._replace(loss=returned)
        return outputs, sums

    def _targets(self, batch):
        n = self.num_virtual_tokens
        mask = batch.get("attention_mask")
        if n and torch.is_tensor(mask):
            mask = F.pad(mask, (n, 0), value=1)  # PEFT's forward attends to the virtual tokens: so does the shift
        if batch.get("shift_labels") is not None:
            targets = F.pad(batch["shift_labels"], (n, 0), value=IGNORE_INDEX) if n else batch["shift_labels"]
            if torch.is_tensor(mask) and mask.shape == targets.shape:
                targets = targets.masked_fill(mask == 0, IGNORE_INDEX)  # padding predicts nothing
            return targets
        labels, positions = batch["labels"], batch.get("position_ids")
        if n:
            # As PEFT's own loss: the virtual positions get label -100 before the shift, so the last virtual token
            # predicts the first real one (a target when its label is not -100) and the others predict nothing.
            # Prompt tuning never takes padding-free or packed rows (padding_free_problem), so no position_ids.
            labels, positions = F.pad(labels, (n, 0), value=IGNORE_INDEX), None
        return shift_labels(labels, position_ids=positions, attention_mask=mask)


def get_batch_sequences(batch: Mapping[str, Any], shape: torch.Size) -> tuple[torch.Tensor, int] | None:
    """``(ids, n)``: which of the batch's n sequences each position belongs to, where rows hold several; None when
    every row is one sequence. From hfacc's ``sequence_ids`` when a layout set them (padding-free: the original
    rows), else from the restarts of packed rows' ``position_ids`` (:func:`hfacc.loss.get_sequence_ids`)."""
    if batch.get("sequence_ids") is not None:
        return batch["sequence_ids"], batch["num_sequences"]
    positions = packed_position_ids(batch)
    return None if positions is None else get_sequence_ids(positions.expand(shape))


class TokenObjective(Objective):
    """Aligned per-token labels: token classification, masked LM, and encoder-decoder (seq2seq) decoders.

    Encoder-decoder models build their decoder inputs from the labels; hfacc does that itself with the model's
    ``prepare_decoder_input_ids_from_labels`` so the model never sees the labels. A model without that method gets
    the labels and computes a loss that is discarded (correct, a little slower).
    """

    name = "token"

    def __init__(self, label_smoothing: float = 0.0, encoder_decoder: bool = False):
        super().__init__(label_smoothing)
        self.encoder_decoder = encoder_decoder

    def count(self, batch):
        targets = batch["labels"] != IGNORE_INDEX
        return torch.stack([targets.sum(), targets.reshape(targets.shape[0], -1).any(-1).sum()])

    def __call__(self, model, batch, per_sequence=False):
        inputs = model_inputs(batch)
        if (
            self.encoder_decoder
            and inputs.get("decoder_input_ids") is None
            and inputs.get("decoder_inputs_embeds") is None
        ):
            prepare = getattr(get_base_model(model), "prepare_decoder_input_ids_from_labels", None)
            if prepare is not None:
                inputs["decoder_input_ids"] = prepare(labels=batch["labels"])
            else:
                inputs["labels"] = batch["labels"]
        outputs = model(**inputs)
        sums = cross_entropy_sums(
            get_logits(outputs), batch["labels"], label_smoothing=self.label_smoothing, per_sequence=per_sequence
        )
        return outputs, sums


class SequenceClassificationObjective(Objective):
    """One class label per example (labels != -100); the target is the example."""

    name = "sequence_classification"

    def count(self, batch):
        n = (batch["labels"] != IGNORE_INDEX).sum()
        return torch.stack([n, n])

    def __call__(self, model, batch, per_sequence=False):
        outputs = model(**model_inputs(batch))
        logits = get_logits(outputs)
        labels = batch["labels"].reshape(-1)
        sums = cross_entropy_sums(
            logits.reshape(labels.shape[0], -1),
            labels,
            label_smoothing=self.label_smoothing,
            per_sequence=per_sequence,
        )
        return outputs, sums


class MultiLabelObjective(Objective):
    """Independent binary labels ``[B, C]`` (BCE with logits); each (example, label) pair is a target."""

    name = "multi_label"

    def count(self, batch):
        labels = batch["labels"]
        return torch.tensor([labels.numel(), labels.shape[0]], device=labels.device)

    def __call__(self, model, batch, per_sequence=False):
        outputs = model(**model_inputs(batch))
        return outputs, binary_cross_entropy_sums(get_logits(outputs), batch["labels"], per_sequence=per_sequence)


class RegressionObjective(Objective):
    """Float targets (MSE); each element of ``labels`` is a target."""

    name = "regression"
    has_accuracy = False

    def count(self, batch):
        labels = batch["labels"]
        return torch.tensor([labels.numel(), labels.shape[0]], device=labels.device)

    def __call__(self, model, batch, per_sequence=False):
        outputs = model(**model_inputs(batch))
        return outputs, squared_error_sums(get_logits(outputs), batch["labels"], per_sequence=per_sequence)


class ModelLossObjective(Objective):
    """Fallback for a loss hfacc cannot reproduce: the model computes its own (mean) loss from the labels.

    Each micro-batch then counts as *one* target, so the window loss is the mean of the micro-batch means — exact
    only when every micro-batch holds the same number of targets. Subclass :class:`Objective` to make it exact.
    """

    name = "model_loss"
    has_accuracy = False
    exact = False
    sums_per_sequence = False

    def count(self, batch):
        device = batch["labels"].device if torch.is_tensor(batch.get("labels")) else None
        return torch.tensor([1, 1], device=device)

    def __call__(self, model, batch, per_sequence=False):
        outputs = model(**batch)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
        one = torch.ones((), dtype=torch.long, device=loss.device)
        if per_sequence:
            return outputs, LossSums(loss.reshape(1), one.reshape(1), (one * 0).reshape(1))
        return outputs, LossSums(loss, one, one * 0)


__all__ = [
    "Objective",
    "CausalLMObjective",
    "TokenObjective",
    "SequenceClassificationObjective",
    "MultiLabelObjective",
    "RegressionObjective",
    "ModelLossObjective",
    "get_num_virtual_tokens",
    "count_targets",
]
