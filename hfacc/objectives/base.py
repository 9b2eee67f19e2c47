"""The objective: what a *unit* of the loss is, how many a micro-batch holds, and the loss summed over them.

An :class:`Objective` is the one place a loss family plugs into hfacc. Its life, in the order hfacc asks:

1. ``setup(context)`` — once per model, before the first window: the decisions only this family can take (a frozen
   reference model, reference log-probs, ...). The generic ones — which layout (padding-free), which loss path
   (fused) — :mod:`hfacc.setup.model_setup` takes from what the objective declares (``supports_padding_free``,
   ``fused``).
2. ``count(batch)`` — the micro-batch's units, ``tensor([primary, sequences, *more])`` (int64), before any forward:
   the window's totals over all micro-batches and ranks are the denominators of every micro-batch's loss, and must
   be known before the first ``backward()``. ``units`` names the entries.
3. ``window_statistics(model, batches, accelerator)`` — right after the counts, for a loss that depends
   non-linearly on a statistic of the whole step (KTO's reference point): computed without gradient over the
   window's micro-batches and reduced over all ranks, before the first backward. Every micro-batch of the window
   then carries it in its batch (:func:`with_statistics`). Default: none, at no cost.
4. ``objective(model, batch)`` — run the model; return its outputs and the loss *sums* over the units (a
   :class:`~hfacc.ops.loss.LossSums` for one-unit losses; a family may return a richer tuple of its own).
5. ``loss(sums, counts)`` — the micro-batch's share of the window loss: each sum divided by its own unit's window
   total, times the P data-parallel ranks (:func:`hfacc.ops.loss.normalize_window_loss` for one-unit losses). Summed
   over the window and averaged over the ranks, that is the big batch's loss, whatever the split.
6. ``metric_sums(sums)`` / ``metric_logs(totals)`` — what is logged: sums added up over micro-batches, windows and
   ranks (on device until logged; :meth:`reduce_metrics` says how a column combines, a sum unless it is an
   extreme), turned into means only when logged, each over its own unit.

The trainer only routes: it counts (2) and takes the statistics (3) before the first forward, calls (4) and (5) per
micro-batch, and adds (6) up. What the once-per-model layout check runs is :meth:`layout_view`.
hfacc never hands ``labels`` to the model (it would compute, and pay for, a second loss that is then thrown away),
except for :class:`~hfacc.objectives.heads.ModelLossObjective`, the explicit fallback for losses hfacc cannot
reproduce.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ops.loss import LossSums, WindowCounts, normalize_window_loss, shift_labels
from ..ops.model_io import forward_inputs
from ..runtime.distributed import num_rows


@dataclass
class SetupContext:
    """What an objective's :meth:`Objective.setup` may read: the model as it will train and one real micro-batch.

    Args:
        model: the model as training runs it (wrapped by DDP/FSDP/DeepSpeed where they apply).
        batch: the first micro-batch, on the training device.
        accelerator: the run's ``accelerate.Accelerator``.
        args: the run's :class:`hfacc.TokenWeightedArguments` (None outside a trainer, e.g. ``hfacc verify``).
        trainer: the :class:`hfacc.TokenWeightedTrainer`, when there is one (e.g. to read its datasets once).
        initial_policy: a resumed run's copy of the policy taken before the checkpoint's weights were loaded into it
            (:func:`hfacc.models.reference.copy_initial_policy`), for an objective that
            :meth:`Objective.copies_policy`; None: the model is as training started.
    """

    model: nn.Module
    batch: Mapping[str, Any]
    accelerator: Any
    args: Any = None
    trainer: Any = None
    initial_policy: Any = None


class Objective(ABC):
    """Base class: subclass it to make a custom loss exact under accumulation.

    Args:
        label_smoothing: label smoothing factor of cross-entropy objectives.

    Subclasses set ``name``, implement :meth:`count` and :meth:`__call__`, and set ``has_accuracy = False`` when
    "correct" means nothing for them. A loss of several terms, each over a unit of its own (pairs and tokens, say),
    also overrides :meth:`loss`, :meth:`metric_sums` and :meth:`metric_logs`.

    >>> from hfacc.ops.model_io import get_logits, model_inputs
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
    # What count() returns, in order. units[0] is the primary unit: a window that holds none of it on any rank is
    # skipped (there is nothing to learn, but an optimizer step would still move the weights); units[1] is what
    # normalization="sequence" divides by.
    units: tuple[str, ...] = ("targets", "sequences")
    has_accuracy = True
    exact = True
    # Whether ``__call__(..., per_sequence=True)`` returns one sum per sequence. Evaluation on several ranks needs
    # them to drop the examples accelerate repeats; objectives without them are evaluated on the real rows only.
    sums_per_sequence = True
    # Whether micro-batches may be laid out padding-free (hfacc.data.padding_free): the objective reads its targets
    # through hfacc.ops.loss.shift_labels (which sees where packed sequences start) and anything per sequence through
    # the layout's `sequence_ids`.
    supports_padding_free = False
    # Whether a padding-free micro-batch of pairs may share each pair's prompt (hfacc.data.shared_prompts: one unit,
    # the prompt once, both answers after it under a 4-D mask): the objective reads each sequence's score through
    # hfacc.ops.scores.get_sequence_scores (which follows the layout's ``score_index``) and nothing per token.
    supports_shared_prompts = False
    # Whether the loss can be computed from the final hidden states in chunks, never holding the full logits
    # (hfacc.setup.loss_path.choose_loss_path decides, once per model, and sets ``fused``); such an objective
    # implements ``check_fused(model, batch, normalization)``: why not for this model (None: it can).
    supports_fused = False
    fused = False
    fused_description = "fused chunked cross-entropy"  # what the fused path is, in words (hfacc verify's report)
    fused_in_eval = True  # False while an evaluation needs the logits (predictions, compute_metrics)
    # Per-row entries of a batch (shape [B]) that the objective reads and that are no model inputs (advantages,
    # precomputed reference log-probs, ...): a padding-free layout keeps them as they are, indexed by original row.
    row_keys: tuple[str, ...] = ()
    # Dataset columns the objective reads that are no argument of the model's forward: the Trainer must keep them
    # (it drops unused columns before collating).
    columns: tuple[str, ...] = ()
    # The name under which the primary unit's rate is logged.
    rate_name = "target_tokens_per_second"
    # What peers do with this loss under accumulation, for ``hfacc verify``'s comparison: None, the model's own loss
    # as stock ``transformers.Trainer`` computes it; or a normalization of this objective's own loss (e.g.
    # "micro_batch": each micro-batch's mean over k, as TRL's DPOTrainer does).
    stock_normalization: str | None = None

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def setup(self, context: SetupContext) -> None:
        """Per-model decisions of this objective, taken once before the first window (default: none)."""
        return None

    @abstractmethod
    def count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``tensor([num_primary_units, num_sequences_with_one, *more])`` of one micro-batch (int64), before any
        forward; ``units`` names the entries."""

    @abstractmethod
    def __call__(self, model: nn.Module, batch: Mapping[str, Any], per_sequence: bool = False):
        """Run ``model`` on ``batch``; return ``(outputs, sums)``: the loss summed over the units ``count`` counted."""

    def loss(
        self, sums: Any, counts: WindowCounts, *, normalization: str = "token", world_size: int = 1
    ) -> torch.Tensor:
        """One micro-batch's share of the window loss, ready for ``backward()``: its sums over the window's counts
        (summed over all ranks), times ``world_size`` (:func:`hfacc.ops.loss.normalize_window_loss`)."""
        return normalize_window_loss(sums, counts, normalization=normalization, world_size=world_size)

    def mean_loss(self, sums: Any) -> torch.Tensor:
        """The micro-batch's own mean loss: what evaluation's ``prediction_step`` reports for one batch."""
        return sums.loss.sum() / sums.count.sum().clamp(min=1)

    def metric_sums(self, sums: Any) -> torch.Tensor:
        """The logged sums of one micro-batch, detached: ``[M]``, or ``[B, M]`` for per-sequence sums.

        They are added up over micro-batches, windows and ranks and given to :meth:`metric_logs`. Entry 0 is the loss
        sum (the step gate checks it is finite). Here: ``[loss sum, targets, correct]``.
        """
        return torch.stack([sums.loss.detach().float(), sums.count.float(), sums.correct.float()], dim=-1)

    def metric_logs(self, totals: Sequence[float], prefix: str = "") -> dict[str, float]:
        """The logs of summed :meth:`metric_sums` (an interval, a run, an evaluation): each sum over its unit."""
        loss, count, correct = totals[:3]
        logs = {f"{prefix}loss": loss / count if count else math.nan, f"{prefix}num_targets": int(count)}
        if self.has_accuracy and count:
            logs[f"{prefix}token_accuracy"] = correct / count
        return logs

    def check_data(self, dataset: Any, name: str = "the training data") -> None:
        """Check what the objective reads of every row of ``dataset`` (None: no dataset), before any row is collated;
        raise a :class:`hfacc.data.formats.DataError` naming the row and the fix (default: nothing to check)."""
        return None

    def companion_models(self) -> list[nn.Module]:
        """Frozen models :meth:`setup` built that run on every micro-batch in the trained model's own layout (a
        distillation teacher): the layout checks run them too (default: none)."""
        return []

    def window_statistics(
        self,
        model: nn.Module,
        batches: Sequence[Mapping[str, Any]],
        accelerator=None,
        *,
        layout: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        repeated: Collection[int] = frozenset(),
    ) -> dict[str, Any]:
        """Statistics of the whole window that every micro-batch's loss reads (default: none, and no work).

        Called once per window, after the counts and before the first forward with gradient, on every rank alike:
        ``batches`` are this rank's micro-batches of the window, as collated (those at the positions ``repeated``
        only repeat examples: they run, as a sharded model's forwards are collectives, and count nothing);
        ``layout`` lays a batch out as training does (padding-free), where the statistic runs the model; the result
        must be reduced over the ranks of ``accelerator`` here (None: one process). A loss that is non-linear in a
        statistic of the step (KTO's reference point) is exact only when the statistic is the step's, not each
        micro-batch's. The values ride in each micro-batch's batch under their keys (:func:`with_statistics`); a
        batch without them (an evaluation batch, a micro-batch run on its own) is its own window.
        """
        return {}

    def reduce_metrics(self, values: torch.Tensor) -> torch.Tensor:
        """``[N, M] -> [M]``: how N rows of :meth:`metric_sums` combine (over examples, micro-batches, windows and
        ranks). Summed, by default; an objective that logs extremes (a reward model's ``min_reward``) takes the
        minimum or maximum of those columns, and gives +inf / -inf where a row holds nothing."""
        return values.sum(0)

    def layout_view(self, model: nn.Module) -> nn.Module:
        """What the once-per-model layout check (:mod:`hfacc.setup.layout_check`) runs to see what this objective
        reads at every position: the model itself (its logits), or for a reward model its score at every position
        (:class:`hfacc.ops.scores.PerPositionScores`)."""
        return model

    def copies_policy(self) -> bool:
        """Whether :meth:`setup` copies the policy as training starts (a frozen reference): a resumed run must then
        take the copy before the checkpoint's weights are loaded (:class:`SetupContext`'s ``initial_policy``)."""
        return False

    def num_examples(self, batch: Mapping[str, Any]) -> int:
        """How many dataset examples ``batch`` holds (default: its rows; a preference pair is two rows)."""
        return num_rows(batch)

    def select_examples(self, batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
        """Examples ``start..stop`` of a collated ``batch`` (default: those rows of every tensor with the batch's rows).

        What cuts the examples accelerate repeats out of a micro-batch, and what the audit splits a window into.
        """
        rows = num_rows(batch)
        return {
            k: v[start:stop] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v
            for k, v in batch.items()
        }

    def zero_sums(self, sums: Any) -> Any:
        """``sums`` with every entry zero (a micro-batch of examples accelerate only repeated contributes nothing)."""
        return type(sums)(*(torch.zeros_like(t) for t in sums))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def get_targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """The batch's causal-LM targets, aligned with the positions that predict them (its ``shift_labels``, or its
    ``labels`` shifted by :func:`hfacc.ops.loss.shift_labels`, which sees packed sequences and padding)."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    return shift_labels(
        batch["labels"], position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask")
    )


def with_statistics(batch: Mapping[str, Any], statistics: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``batch`` carrying its window's :meth:`Objective.window_statistics` (``batch`` itself when there are none)."""
    return {**batch, **statistics} if statistics else batch


__all__ = ["Objective", "SetupContext", "LossSums", "forward_inputs", "get_targets", "with_statistics"]
