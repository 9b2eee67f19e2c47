"""Reward models (Bradley-Terry): a pair is the unit of the loss, exact over the whole step.

A reward model is a sequence-classification model with one output (``num_labels=1``) that scores a whole sequence:
its score is the head's output where the model's own pooling reads it (:mod:`hfacc.ops.scores`). It trains on the pairs of
:func:`hfacc.build_preference_dataset` (standard, conversational or implicit-prompt rows, as for DPO; an optional
``margin`` column), collated by :class:`hfacc.DataCollatorForPreference` into one ``[2B, T]`` batch: chosen and
rejected go through the model in one forward, padding-free by default (each packed sequence scored where the model
would score it alone). The window's loss, over its P pairs on all ranks, is TRL's ``RewardTrainer`` loss as one big batch has it,

    L = (1 / P) * sum_pairs [ -log sigmoid(r_c - r_r - m) + c * (r_c + r_r)^2 ]

(r the scores, m the pair's margin, c ``center_rewards_coefficient``), so :meth:`RewardObjective.loss`
backpropagates each micro-batch's sum over the window's P. TRL takes each micro-batch's mean and lets the Trainer
divide by the accumulation steps: exact only when every micro-batch holds as many pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..data.preference import MARGIN, MARGIN_FIX, check_row_values
from ..ops.loss import WindowCounts
from ..ops.scores import (
    PerPositionScores,
    get_last_token_index,
    get_pad_token_id,
    get_sequence_scores,
    reward_model_problem,
)
from ..runtime.distributed import num_rows
from .base import Objective, SetupContext, forward_inputs
from .preference import PairedRows


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """The reward model's loss per pair (Bradley-Terry; TRL's ``RewardTrainer``):

    ``loss = -log sigmoid(r_c - r_r - m) + c * (r_c + r_r)^2``, with r the two scores, m the pair's margin (0 without
    one: the chosen score must exceed the rejected one by it, Llama 2's margin loss) and c the centering coefficient
    (None: no term; Eisenstein et al., 2023: it keeps the scores centred on zero).

    >>> round(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).item(), 6)  # no preference yet: log 2
    0.693147
    >>> round(bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([1.0]), 0.1).item(), 6)
    1.593147
    """
    difference = chosen_rewards - rejected_rewards
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses


class RewardSums(NamedTuple):
    """Per pair ``[B]``: the loss (differentiable), 1 per pair (0 for repeated examples), and the two scores
    (detached)."""

    loss: torch.Tensor
    pairs: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


class RewardObjective(PairedRows, Objective):
    """A reward model on preference pairs (Bradley-Terry, TRL's ``RewardTrainer`` loss), exact per pair under any split
    of the window.

    Args:
        center_rewards_coefficient: weight of ``(r_c + r_r)^2`` per pair (TRL's ``RewardConfig`` name); None: none.

    The model is a sequence-classification model with ``num_labels=1`` and a ``pad_token_id`` in its config (its own
    pooling needs one; hfacc reads each score where that pooling does, :mod:`hfacc.ops.scores`).
    Pairs carry an optional ``margin`` (a dataset column). Units: ``("pairs", "sequences")``. Logged (training and
    evaluation, over the interval's pairs on all ranks, TRL's names): ``loss``, ``accuracy`` (the share of pairs whose
    chosen score is higher), ``margin`` (mean ``r_c - r_r``), ``min_reward``, ``mean_reward``, ``max_reward`` (over
    every scored sequence) and ``num_pairs``.

    >>> objective = RewardObjective(center_rewards_coefficient=0.01)
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 8, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    ...          "labels": torch.tensor([[-100, 6, 7], [-100, 8, -100]])}
    >>> objective.count(batch)  # 1 pair, 2 sequences
    tensor([1, 2])
    """

    name = "reward"
    units = ("pairs", "sequences")
    has_accuracy = False
    supports_padding_free = True
    supports_shared_prompts = True
    row_keys = (MARGIN,)
    columns = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", MARGIN)
    rate_name = "pairs_per_second"
    # What TRL's RewardTrainer backpropagates: each micro-batch's mean pair loss over k (hfacc verify's comparison).
    stock_normalization = "micro_batch"

    def __init__(self, center_rewards_coefficient: float | None = None):
        super().__init__()
        if center_rewards_coefficient is not None and not center_rewards_coefficient >= 0:
            raise ValueError(
                f"center_rewards_coefficient={center_rewards_coefficient}: it must be >= 0 (None: no centering term)."
            )
        self.center_rewards_coefficient = center_rewards_coefficient
        self.pad_token_id: int | None = None  # the model's, once set up: each padded micro-batch is checked by it

    # ---- once per model ----------------------------------------------------------------------------------------
    def setup(self, context: SetupContext) -> None:
        """Refuse, before any training, a model that is no reward model (``num_labels`` != 1, no pad token), and a
        first micro-batch padded with another id than the model's pad token (its own pooling would read padding)."""
        args = context.args
        if args is not None and getattr(args, "normalization", "token") == "sequence":
            raise ValueError(
                "normalization='sequence' has no meaning for the reward objective (its unit is the pair); use 'token' "
                "(exact) or 'micro_batch' (the mean of micro-batch means, for comparison)."
            )
        problem = reward_model_problem(context.model)
        if problem:
            raise ValueError(problem)
        self.pad_token_id = get_pad_token_id(context.model)
        if context.batch is not None:
            self._refuse_reading_padding(context.batch)

    def _refuse_reading_padding(self, batch: Mapping[str, Any]) -> None:
        """Refuse a padded micro-batch (as collated, before any layout) whose padding the model's own pooling would
        read: its id is not the config's pad_token_id. The padding-free and shared-prompt layouts would read each
        sequence's last token instead, silently; and a micro-batch without padding says nothing, so every one is
        checked (:meth:`count`), not only the first (which may have none: chosen and rejected as long)."""
        ids, padded = batch.get("input_ids"), batch.get("sequence_ids") is None
        if self.pad_token_id is not None and torch.is_tensor(ids) and ids.dim() == 2 and padded:
            get_last_token_index(batch, ids.shape, self.pad_token_id)  # the ValueError, naming both ids and the fix

    def check_data(self, dataset, name: str = "the training data") -> None:
        """A ``margin`` column: a finite number in every pair, or in none (one named error before training)."""
        check_row_values(dataset, (MARGIN,), name, MARGIN_FIX)

    def layout_view(self, model: nn.Module) -> nn.Module:
        """The layout check runs the head's score at every position (:class:`hfacc.ops.scores.PerPositionScores`); a
        model without a per-position head fails it, with the reason (it stays padded)."""
        return PerPositionScores(model)

    # ---- per micro-batch ---------------------------------------------------------------------------------------
    def count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``tensor([pairs, sequences])``, before any forward (padded or padding-free). Each padded micro-batch of a
        window is checked here too, before the window's first forward, in every layout (:meth:`setup`)."""
        self._refuse_reading_padding(batch)
        sequences = int(batch["num_sequences"]) if batch.get("num_sequences") is not None else num_rows(batch)
        return torch.tensor([sequences // 2, sequences])

    def __call__(self, model, batch, per_sequence=False):
        outputs, scores = get_sequence_scores(model, batch, forward_inputs(batch, self.row_keys))
        if scores.shape[0] % 2:
            raise ValueError(
                f"a preference batch holds chosen and rejected sequences of each pair ({scores.shape[0]} is odd): "
                "collate it with hfacc.DataCollatorForPreference."
            )
        pairs = scores.shape[0] // 2
        chosen, rejected = scores[:pairs], scores[pairs:]
        margin = batch.get(MARGIN)
        losses = bradley_terry_loss(
            chosen, rejected, None if margin is None else margin.to(scores), self.center_rewards_coefficient
        )
        sums = RewardSums(losses, torch.ones_like(losses.detach()), chosen.detach(), rejected.detach())
        # What the Trainer's prediction_step returns as predictions: each pair's two scores (TRL's logits).
        return torch.stack([sums.chosen_rewards, sums.rejected_rewards], dim=-1), sums

    def loss(self, sums, counts: WindowCounts, *, normalization: str = "token", world_size: int = 1):
        """``P * (sum of pair losses) / pairs`` of the window (all ranks); ``"micro_batch"``: the micro-batch's mean
        pair loss over k (TRL's ``RewardTrainer``, for comparison)."""
        if normalization == "micro_batch":
            return self.mean_loss(sums) / max(counts.num_micro_batches, 1)
        if normalization != "token":
            raise ValueError(f"normalization={normalization!r}: the reward objective takes 'token' or 'micro_batch'.")
        return sums.loss.sum() / max(counts.units[0], 1) * world_size

    def mean_loss(self, sums):
        return sums.loss.sum() / sums.pairs.sum().clamp(min=1)

    def metric_sums(self, sums):
        """Per pair ``[B, 7]``: loss, 1, correct (chosen scored higher), ``r_c - r_r``, ``r_c + r_r``, and the pair's
        lower and higher score (+inf / -inf for a pair that only repeats an example: it holds nothing)."""
        chosen, rejected, counted = sums.chosen_rewards, sums.rejected_rewards, sums.pairs > 0
        inf = torch.full_like(chosen, math.inf)
        columns = [
            sums.loss.detach(),
            sums.pairs,
            (chosen > rejected) & counted,
            (chosen - rejected) * counted,
            (chosen + rejected) * counted,
            torch.where(counted, torch.minimum(chosen, rejected), inf),
            torch.where(counted, torch.maximum(chosen, rejected), -inf),
        ]
        return torch.stack([c.detach().float() for c in columns], dim=-1)

    def reduce_metrics(self, values: torch.Tensor) -> torch.Tensor:
        """Sums, but the lowest and the highest score (columns 5 and 6)."""
        return torch.cat([values[:, :5].sum(0), values[:, 5:6].amin(0), values[:, 6:7].amax(0)])

    def metric_logs(self, totals, prefix: str = ""):
        loss, pairs, correct, margin, total, lowest, highest = totals[:7]
        if not pairs:
            return {f"{prefix}loss": math.nan, f"{prefix}num_pairs": 0}
        return {
            f"{prefix}loss": loss / pairs,
            f"{prefix}accuracy": correct / pairs,
            f"{prefix}margin": margin / pairs,
            f"{prefix}min_reward": lowest,
            f"{prefix}mean_reward": total / (2 * pairs),
            f"{prefix}max_reward": highest,
            f"{prefix}num_pairs": int(pairs),
        }

    def __repr__(self) -> str:
        extra = (
            f"center_rewards_coefficient={self.center_rewards_coefficient}"
            if self.center_rewards_coefficient is not None
            else ""
        )
        return f"RewardObjective({extra})"


__all__ = ["RewardObjective", "RewardSums", "bradley_terry_loss"]
