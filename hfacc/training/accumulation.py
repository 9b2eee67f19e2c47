"""Exact accumulation for a hand-written PyTorch + Accelerate training loop.

The classic loop divides each micro-batch's *mean* loss by k. That weighs a micro-batch of 3 target tokens like
one of 300. Here each micro-batch backpropagates its loss *sum* times ``P / N``, N the window's targets over all
ranks, so the step equals one big batch:

>>> for batches in iter_windows(dataloader, gradient_accumulation_steps=4):       # doctest: +SKIP
...     for mb in accumulation_window(accelerator, model, batches):
...         with mb.sync():                     # no_sync() for all but the last micro-batch: forward AND backward
...             logits = model(input_ids=mb.batch["input_ids"], attention_mask=mb.batch["attention_mask"]).logits
...             accelerator.backward(mb.scale(causal_lm_sums(logits, mb.batch["labels"])))
...     optimizer.step()
...     optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
from torch import nn

from ..objectives import CausalLMObjective, Objective
from ..objectives.base import with_statistics
from ..ops.loss import LossSums, WindowCounts, normalize_window_loss
from ..runtime.distributed import fsdp2_no_sync, get_gradient_scale, is_fsdp2
from .window import count_window


@dataclass
class MicroBatch:
    """One micro-batch of a window, with what it needs to contribute its exact share.

    Args:
        batch: the micro-batch as the dataloader gave it.
        index: its position in the window (0-based).
        window: the window's counts, summed over all ranks.
        is_last: whether it is the window's last micro-batch (the one whose backward synchronizes gradients).
    """

    batch: Mapping[str, Any]
    index: int
    window: WindowCounts
    is_last: bool
    _accelerator: Any
    _model: nn.Module
    _normalization: str
    _objective: Objective | None = None

    def sync(self) -> contextlib.AbstractContextManager:
        """``accelerator.no_sync(model)`` for all but the last micro-batch; wrap the forward *and* the backward.

        DDP decides in its forward whether the next backward all-reduces; a forward outside ``no_sync`` followed by
        a backward inside it still synchronizes (and costs a full all-reduce per micro-batch).
        """
        if self.is_last:
            return contextlib.nullcontext()
        if is_fsdp2(self._model) and not getattr(self._accelerator, "is_fsdp2", False):
            # A model sharded with torch's fully_shard directly (accelerate's no_sync only knows its own FSDP2):
            # keep the gradients unsharded and local until the last micro-batch, as accelerate does.
            return fsdp2_no_sync(self._model)
        return self._accelerator.no_sync(self._model)

    def scale(self, sums: LossSums) -> torch.Tensor:
        """The loss to backpropagate for this micro-batch: ``S_j / N * P`` (see :func:`normalize_window_loss`), or
        the window's objective's own :meth:`hfacc.Objective.loss` (each of its sums over its own unit's count: per
        completion for GRPO's sequence loss, per pair for DPO).

        ``accelerator.backward`` divides by ``accelerator.gradient_accumulation_steps``; that division is undone
        here, so the result is exact whatever the Accelerator was built with.
        """
        world = get_gradient_scale(self._accelerator.distributed_type, self._accelerator.num_processes)
        if self._objective is not None:  # its own loss: each term over its own unit (policy gradients, pairs)
            loss = self._objective.loss(sums, self.window, normalization=self._normalization, world_size=world)
        else:
            loss = normalize_window_loss(sums, self.window, normalization=self._normalization, world_size=world)
        return loss * getattr(self._accelerator, "gradient_accumulation_steps", 1)


def iter_windows(dataloader: Iterable, gradient_accumulation_steps: int) -> Iterator[list]:
    """Group a dataloader's micro-batches into windows of ``gradient_accumulation_steps`` (the last may be short)."""
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    iterator = iter(dataloader)
    while window := list(islice(iterator, gradient_accumulation_steps)):
        yield window


def accumulation_window(
    accelerator,
    model: nn.Module,
    batches: list[Mapping[str, Any]],
    *,
    objective: Objective | Callable[[Mapping[str, Any]], Any] | None = None,
    normalization: str = "token",
) -> Iterator[MicroBatch]:
    """Yield the micro-batches of one window, each knowing the window's global target count.

    Counting happens up front, with one all-reduce over the ranks, because every micro-batch's loss is divided by
    the window's total before its backward; so do the objective's statistics of the whole window, where its loss
    reads one (:meth:`hfacc.Objective.window_statistics`: KTO's reference point), carried in each ``mb.batch``.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the loop.
        model: the prepared model (for ``no_sync``).
        batches: the window's micro-batches, e.g. from :func:`iter_windows`.
        objective: what counts as a target: an :class:`hfacc.Objective` (default: causal-LM labels, shifted),
            or a function ``batch -> number of targets``.
        normalization: ``"token"`` (default), ``"sequence"`` or ``"micro_batch"``.
    """
    objective = objective or CausalLMObjective()
    size, own = 2, None
    if isinstance(objective, Objective):
        count, size, own = objective.count, len(objective.units), objective
    else:

        def count(batch):
            n = torch.as_tensor(objective(batch), device=accelerator.device).long()
            return torch.stack([n, (n > 0).long()])

    window = count_window(count, batches, accelerator, size=size)
    # A statistic of the whole window the objective's loss reads (KTO's reference point), before the first backward;
    # each micro-batch carries it in its batch.
    statistics = own.window_statistics(model, batches, accelerator) if own is not None else {}
    for i, batch in enumerate(batches):
        batch = with_statistics(batch, statistics)
        yield MicroBatch(batch, i, window, i == len(batches) - 1, accelerator, model, normalization, own)
