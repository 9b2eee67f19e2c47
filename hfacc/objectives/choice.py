"""Which objective a model and its labels call for (``objective="auto"``), or the one named."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..ops.loss import IGNORE_INDEX
from ..ops.model_io import get_base_model, get_num_virtual_tokens
from .base import Objective
from .causal_lm import CausalLMObjective
from .distillation import DistillationObjective
from .heads import (
    ModelLossObjective,
    MultiLabelObjective,
    RegressionObjective,
    SequenceClassificationObjective,
    TokenObjective,
)
from .kto import KTOObjective
from .policy_gradient import PolicyGradientObjective
from .preference import DPOObjective
from .reward import RewardObjective

logger = logging.getLogger(__name__)


OBJECTIVES = {
    cls.name: cls
    for cls in (
        CausalLMObjective,
        TokenObjective,
        SequenceClassificationObjective,
        MultiLabelObjective,
        RegressionObjective,
        ModelLossObjective,
        DPOObjective,
        PolicyGradientObjective,
        DistillationObjective,
        RewardObjective,
        KTOObjective,
    )
}


def get_objective(
    model: nn.Module, batch: Mapping[str, Any], name: str = "auto", label_smoothing: float = 0.0
) -> Objective:
    """Pick the objective of ``model`` for batches like ``batch``, or build the one named ``name``.

    ``"auto"`` decides from the model class and the labels: ``*ForCausalLM`` (and decoder-only
    ``*ForConditionalGeneration``) -> ``causal_lm``; encoder-decoder models, ``*ForTokenClassification`` and
    ``*ForMaskedLM`` -> ``token``; ``*ForSequenceClassification`` -> by ``config.problem_type`` as transformers
    decides it (1 label -> ``regression``, integer labels -> ``sequence_classification``, else ``multi_label``).
    A plain ``nn.Module`` with integer labels of shape ``[B]`` is taken for a classifier. With labels of shape
    ``[B, T]`` it could be a language model (position i predicts label i + 1) or a tagger (label i belongs to
    position i): hfacc takes it for a causal LM only when the labels are a copy of ``input_ids`` (where not -100),
    as language-model data is, and says so at WARNING level; otherwise it refuses to guess and asks for
    ``objective='causal_lm'`` or ``'token'``. Anything else falls back to ``model_loss``, said once in the log.
    For PEFT prompt tuning, the causal-LM targets account for the virtual tokens (see
    :func:`get_num_virtual_tokens`).
    """
    objective = _pick_objective(model, batch, name, label_smoothing)
    if isinstance(objective, CausalLMObjective):  # and distillation, which counts its targets the same way
        objective.num_virtual_tokens = get_num_virtual_tokens(model)
    return objective


def _pick_objective(model: nn.Module, batch: Mapping[str, Any], name: str, label_smoothing: float) -> Objective:
    base = get_base_model(model)
    config = getattr(base, "config", None)
    is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if name != "auto":
        if name not in OBJECTIVES:
            raise ValueError(f"objective must be 'auto' or one of {sorted(OBJECTIVES)}, got {name!r}")
        if name == "token":
            return TokenObjective(label_smoothing, encoder_decoder=is_encoder_decoder)
        if name in (PolicyGradientObjective.name, RewardObjective.name, KTOObjective.name):
            return OBJECTIVES[name]()  # their settings are their own (loss_type, beta, ...): the defaults
        return OBJECTIVES[name](label_smoothing=label_smoothing)

    labels = batch.get("labels")
    if not torch.is_tensor(labels):
        raise ValueError(
            "The batch has no 'labels' tensor, so there is nothing to train on. Give each example a 'labels' field "
            "(-100 where no loss is wanted), e.g. with hfacc.build_sft_dataset, or pass objective=... for a loss "
            f"that needs no labels. Batch keys: {sorted(batch)}"
        )
    class_name = type(base).__name__
    is_integer = not labels.is_floating_point()
    if is_encoder_decoder or class_name.endswith(("ForTokenClassification", "ForMaskedLM")):
        return TokenObjective(label_smoothing, encoder_decoder=is_encoder_decoder)
    if class_name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        return CausalLMObjective(label_smoothing)
    if class_name.endswith("ForSequenceClassification"):
        problem_type = getattr(config, "problem_type", None)
        if problem_type is None:
            num_labels = getattr(config, "num_labels", 2)
            if num_labels == 1:
                problem_type = "regression"
            elif is_integer:
                problem_type = "single_label_classification"
            else:
                problem_type = "multi_label_classification"
        return {
            "regression": RegressionObjective,
            "single_label_classification": SequenceClassificationObjective,
            "multi_label_classification": MultiLabelObjective,
        }[problem_type](label_smoothing)
    if is_integer and labels.dim() >= 2:
        if batch.get("shift_labels") is None and not _labels_copy_inputs(labels, batch.get("input_ids")):
            # A tagger's labels look like a language model's; training one as the other is silently wrong.
            raise ValueError(
                f"hfacc cannot tell what the labels of shape {tuple(labels.shape)} of {class_name} (not a transformers "
                "head) are. Pass objective='causal_lm' if position i predicts label i + 1 (language modelling; "
                "the labels are then usually a copy of input_ids), or objective='token' if label i belongs to "
                "position i (token classification, tagging)."
            )
        logger.warning(
            "hfacc: %s is not a transformers head; its labels [batch, length] copy input_ids, so they are taken as "
            "causal-LM labels (position i predicts label i + 1). Pass objective='causal_lm' to say so, or "
            "objective='token' if label i belongs to position i.",
            class_name,
        )
        return CausalLMObjective(label_smoothing)
    if is_integer and labels.dim() == 1:
        return SequenceClassificationObjective(label_smoothing)
    logger.warning(
        "hfacc: cannot tell what the targets of %s are (labels %s of shape %s), so it trains on the model's own loss, "
        "averaged over micro-batches. That is exact only when every micro-batch has the same number of targets. "
        "Pass objective=<an hfacc.Objective> (or hfacc.FunctionObjective(count_fn, loss_fn)) to make it exact.",
        class_name,
        labels.dtype,
        tuple(labels.shape),
    )
    return ModelLossObjective()


def _labels_copy_inputs(labels: torch.Tensor, input_ids: Any) -> bool:
    """Whether ``labels`` equal ``input_ids`` wherever they are not -100: the mark of language-model labels."""
    if not torch.is_tensor(input_ids) or input_ids.shape != labels.shape:
        return False
    targets = labels != IGNORE_INDEX
    return bool(targets.any()) and bool((labels[targets] == input_ids[targets]).all())
