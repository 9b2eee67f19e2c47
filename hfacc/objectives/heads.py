"""The other transformers heads: aligned token labels, sequence classification, multi-label, regression, and the
model's own loss as the explicit (inexact) fallback."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..ops.loss import IGNORE_INDEX, LossSums, binary_cross_entropy_sums, cross_entropy_sums, squared_error_sums
from ..ops.model_io import get_base_model, get_logits, model_inputs
from .base import Objective


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
    "TokenObjective",
    "SequenceClassificationObjective",
    "MultiLabelObjective",
    "RegressionObjective",
    "ModelLossObjective",
]
