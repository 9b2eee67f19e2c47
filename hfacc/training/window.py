"""One accumulation window: the micro-batches of one optimizer step, counted once, consumed one by one.

The life of a window, in the Trainer (:class:`hfacc.TokenWeightedTrainer`):

1. ``get_batch_samples`` draws the window's k micro-batches and opens a :class:`Window`: their targets are counted
   (:func:`count_window`, one collective over the ranks) before the first forward, because every micro-batch's loss
   is divided by that total before its backward; and the objective's statistics of the whole window, if its loss
   reads one (:meth:`hfacc.Objective.window_statistics`: KTO's reference point), are taken then too.
2. ``compute_loss`` takes the micro-batches in order (:meth:`Window.take`), backpropagates each one's share of the
   window loss (:func:`compute_micro_batch_loss`) and stages its loss sums on the window (:meth:`Window.stage`).
3. Before the optimizer step, the step gate (:class:`hfacc.training.step_gate.StepGate`) audits, checks and then
   commits the staged sums to the logged metrics, or drops the window.

A hand-written loop does steps 1 and 2 with :func:`hfacc.accumulation_window`; ``hfacc verify`` with the same
functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..objectives import Objective
from ..objectives.base import with_statistics
from ..ops.loss import WindowCounts
from ..ops.model_io import get_aux_loss


@dataclass
class Window:
    """The micro-batches of one optimizer step and what they have contributed so far.

    Args:
        batches: the micro-batches that hold real examples (the audit recomputes the window from them).
        counts: their targets and sequences, summed over all data-parallel ranks.
        size: the micro-batches the Trainer runs, those that only repeat examples (``repeated``) included.
        repeated: positions, in running order, of the micro-batches that hold only examples accelerate repeated at
            the end of an epoch: they run (every rank takes part in the all-reduce) and contribute nothing.
        staged: the logged sums (:meth:`hfacc.Objective.metric_sums`) of the micro-batches run so far, on device
            (no host sync per micro-batch); None until the first.
        losses: each micro-batch's loss sum, to name the one that was not finite.
        dtype: of the staged sums (float64, so that the log keeps every fp32 digit; float32 where a device has no
            float64).
        statistics: the objective's statistics of the whole window (:meth:`hfacc.Objective.window_statistics`),
            which every micro-batch's loss reads; empty for most objectives.
        reduce: how rows of logged sums combine (:meth:`hfacc.Objective.reduce_metrics`; a sum by default).
    """

    batches: list[Mapping[str, Any]]
    counts: WindowCounts
    size: int
    staged: torch.Tensor | None = None
    repeated: frozenset[int] = frozenset()
    dtype: torch.dtype = torch.float64
    losses: list[torch.Tensor] = field(default_factory=list)
    taken: int = 0
    statistics: dict[str, Any] = field(default_factory=dict)
    reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda values: values.sum(0))

    @property
    def num_targets(self) -> int:
        return self.counts.num_targets

    @property
    def left(self) -> int:
        """Micro-batches of the window not run yet."""
        return self.size - self.taken

    def take(self) -> bool:
        """Claim the next micro-batch; True when it holds only repeated examples (its loss must be zero)."""
        index = self.taken
        self.taken += 1
        return index in self.repeated

    def stage(self, values: torch.Tensor) -> None:
        """Keep a micro-batch's logged sums (:meth:`hfacc.Objective.metric_sums`, entry 0 its loss sum) until the
        step gate commits or drops the window."""
        values = self.reduce(values.reshape(-1, values.shape[-1]).to(self.dtype))
        self.losses.append(values[0])
        self.staged = values if self.staged is None else self.reduce(torch.stack([self.staged, values]))


def count_window(
    count: Callable[[Mapping[str, Any]], torch.Tensor],
    batches: list[Mapping[str, Any]],
    accelerator,
    device: torch.device | None = None,
    size: int = 2,
) -> WindowCounts:
    """:class:`WindowCounts` of ``batches``, summed over all data-parallel ranks in one collective.

    ``count(batch)`` gives ``tensor([targets, sequences with a target, *more])`` (:meth:`hfacc.Objective.count`),
    ``size`` entries (``len(Objective.units)``: every rank must reduce a vector of the same size, also a rank whose
    window is empty).
    """
    device = accelerator.device if device is None else device
    counts = torch.zeros(size, dtype=torch.long, device=device)
    for batch in batches:
        counts += count(batch).to(device)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    units = tuple(counts.tolist())
    return WindowCounts(units[0], units[1], len(batches), units)


def compute_micro_batch_loss(
    objective: Objective,
    model: nn.Module,
    batch: Mapping[str, Any],
    window: WindowCounts,
    *,
    normalization: str = "token",
    world_size: int = 1,
    statistics: Mapping[str, Any] | None = None,
):
    """Run one micro-batch and return ``(loss to backpropagate, outputs, sums)``: what training does, in one place.

    ``statistics`` are the window's (:meth:`hfacc.Objective.window_statistics`), carried in the batch the objective
    reads. The loss is the micro-batch's share of the window loss (:meth:`hfacc.Objective.loss`), plus, for
    mixture-of-experts models that return a router ``aux_loss``, ``router_aux_loss_coef * aux_loss / k``: that
    auxiliary loss is a statistic of each micro-batch's own routing, so it can only be averaged over micro-batches
    (``hfacc verify`` reports it as a split-dependent term).
    """
    batch = with_statistics(batch, statistics)
    outputs, sums = objective(model, batch, per_sequence=normalization == "sequence")
    loss = objective.loss(sums, window, normalization=normalization, world_size=world_size)
    aux = get_aux_loss(model, outputs)
    if aux is not None:
        loss = loss + aux / max(window.num_micro_batches, 1)
    return loss, outputs, sums
