"""One accumulation window: the micro-batches of one optimizer step, counted once, consumed one by one.

The life of a window, in the Trainer (:class:`hfacc.TokenWeightedTrainer`):

1. ``get_batch_samples`` draws the window's k micro-batches and opens a :class:`Window`: their targets are counted
   (:func:`count_window`, one collective over the ranks) before the first forward, because every micro-batch's loss
   is divided by that total before its backward.
2. ``compute_loss`` takes the micro-batches in order (:meth:`Window.take`), backpropagates each one's share of the
   window loss (:func:`compute_micro_batch_loss`) and stages its loss sums on the window (:meth:`Window.stage`).
3. Before the optimizer step, the step gate (:class:`hfacc.step_gate.StepGate`) audits, checks and then commits the
   staged sums to the logged metrics, or drops the window.

A hand-written loop does steps 1 and 2 with :func:`hfacc.accumulation_window`; ``hfacc verify`` with the same two
functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .loss import LossSums, WindowCounts, normalize_window_loss
from .model_io import get_aux_loss
from .objective import Objective


@dataclass
class Window:
    """The micro-batches of one optimizer step and what they have contributed so far.

    Args:
        batches: the micro-batches that hold real examples (the audit recomputes the window from them).
        counts: their targets and sequences, summed over all data-parallel ranks.
        size: the micro-batches the Trainer runs, those that only repeat examples (``repeated``) included.
        repeated: positions, in running order, of the micro-batches that hold only examples accelerate repeated at
            the end of an epoch: they run (every rank takes part in the all-reduce) and contribute nothing.
        staged: ``[loss sum, correct]`` of the micro-batches run so far, on device (no host sync per micro-batch).
        losses: each micro-batch's loss sum, to name the one that was not finite.
    """

    batches: list[Mapping[str, Any]]
    counts: WindowCounts
    size: int
    staged: torch.Tensor
    repeated: frozenset[int] = frozenset()
    losses: list[torch.Tensor] = field(default_factory=list)
    taken: int = 0

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

    def stage(self, sums: LossSums) -> None:
        """Keep a micro-batch's sums until the step gate commits or drops the window."""
        loss = sums.loss.detach().sum()
        self.losses.append(loss)
        self.staged += torch.stack([loss.to(self.staged.dtype), sums.correct.sum().to(self.staged.dtype)])


def count_window(
    count: Callable[[Mapping[str, Any]], torch.Tensor],
    batches: list[Mapping[str, Any]],
    accelerator,
    device: torch.device | None = None,
) -> WindowCounts:
    """:class:`WindowCounts` of ``batches``, summed over all data-parallel ranks in one collective.

    ``count(batch)`` gives ``tensor([targets, sequences with a target])`` (:meth:`hfacc.Objective.count`).
    """
    device = accelerator.device if device is None else device
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for batch in batches:
        counts += count(batch).to(device)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    num_targets, num_sequences = counts.tolist()
    return WindowCounts(num_targets, num_sequences, len(batches))


def compute_micro_batch_loss(
    objective: Objective,
    model: nn.Module,
    batch: Mapping[str, Any],
    window: WindowCounts,
    *,
    normalization: str = "token",
    world_size: int = 1,
):
    """Run one micro-batch and return ``(loss to backpropagate, outputs, sums)``: what training does, in one place.

    The loss is the micro-batch's share of the window loss (:func:`hfacc.loss.normalize_window_loss`), plus, for
    mixture-of-experts models that return a router ``aux_loss``, ``router_aux_loss_coef * aux_loss / k``: that
    auxiliary loss is a statistic of each micro-batch's own routing, so it can only be averaged over micro-batches
    (``hfacc verify`` reports it as a split-dependent term).
    """
    outputs, sums = objective(model, batch, per_sequence=normalization == "sequence")
    loss = normalize_window_loss(sums, window, normalization=normalization, world_size=world_size)
    aux = get_aux_loss(model, outputs)
    if aux is not None:
        loss = loss + aux / max(window.num_micro_batches, 1)
    return loss, outputs, sums
