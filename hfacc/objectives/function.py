"""Objectives from the user's own functions: a count and a loss sum, or transformers' ``compute_loss_func``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..ops.loss import LossSums
from ..ops.model_io import model_inputs
from .base import Objective


class FunctionObjective(Objective):
    """An objective from two functions, for users who would rather not subclass.

    Args:
        count_fn: ``batch -> number of targets`` (an int or a 0-d tensor), called before any forward.
        loss_fn: ``(outputs, batch) -> summed loss over those targets`` (a 0-d tensor).
        forward_fn: ``(model, batch) -> outputs``; by default the model is called on the batch without its labels.

    >>> objective = FunctionObjective(
    ...     count_fn=lambda batch: (batch["labels"] != -100).sum(),
    ...     loss_fn=lambda outputs, batch: torch.nn.functional.cross_entropy(
    ...         outputs.logits.flatten(0, -2), batch["labels"].flatten(), reduction="sum"),
    ... )
    """

    name = "function"
    has_accuracy = False
    sums_per_sequence = False

    def __init__(
        self,
        count_fn: Callable[[Mapping[str, Any]], Any],
        loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
        forward_fn: Callable[[nn.Module, Mapping[str, Any]], Any] | None = None,
    ):
        super().__init__()
        self.count_fn, self.loss_fn, self.forward_fn = count_fn, loss_fn, forward_fn

    def count(self, batch):
        n = torch.as_tensor(self.count_fn(batch)).long().reshape(())
        return torch.stack([n, (n > 0).long()])

    def __call__(self, model, batch, per_sequence=False):
        if per_sequence:
            raise ValueError("FunctionObjective supports normalization 'token' and 'micro_batch', not 'sequence'")
        outputs = self.forward_fn(model, batch) if self.forward_fn else model(**model_inputs(batch))
        loss = self.loss_fn(outputs, batch)
        count = torch.as_tensor(self.count_fn(batch), device=loss.device).long().reshape(())
        return outputs, LossSums(loss, count, count * 0)


class LossFunctionObjective(Objective):
    """transformers' ``compute_loss_func``, made exact under accumulation.

    ``Trainer(compute_loss_func=f)`` calls ``f(outputs, labels, num_items_in_batch=N)`` and, as transformers
    documents, ``f`` returns the summed loss over the targets divided by ``N``. Called with ``num_items_in_batch=1``
    it therefore returns the sum ``S_j`` itself, which hfacc normalizes by the window's global count like any other
    loss: ``S_j / N_window * P``. The targets are counted by ``counter``, the objective hfacc picks for the model
    (for a causal LM: labels != -100 after the shift, what transformers counts too).

    A function that ignores ``num_items_in_batch`` (returns a mean) cannot be made exact that way: the first
    micro-batch with targets is evaluated with ``num_items_in_batch`` 1 and 2, and a function whose result does not
    halve is refused with an error that shows the exact alternative.

    Args:
        loss_func: ``(outputs, labels, num_items_in_batch=...) -> loss``, as given to ``transformers.Trainer``.
        counter: the objective whose ``count`` says what a target is.
    """

    name = "compute_loss_func"
    has_accuracy = False
    sums_per_sequence = False

    def __init__(self, loss_func: Callable[..., torch.Tensor], counter: Objective):
        super().__init__()
        self.loss_func, self.counter = loss_func, counter
        self.checked = False

    def count(self, batch):
        return self.counter.count(batch)

    def __call__(self, model, batch, per_sequence=False):
        if per_sequence:
            raise ValueError("compute_loss_func supports normalization 'token' and 'micro_batch', not 'sequence'")
        outputs = model(**model_inputs(batch))
        labels = batch.get("labels")
        device = labels.device if torch.is_tensor(labels) else None
        loss = self.loss_func(outputs, labels, num_items_in_batch=torch.tensor(1, device=device))
        if not self.checked:
            with torch.no_grad():
                half = self.loss_func(outputs, labels, num_items_in_batch=torch.tensor(2, device=device))
            self._check_division(loss.detach().float(), half.detach().float())
        count = self.counter.count(batch)[0].to(loss.device)
        return outputs, LossSums(loss, count, count * 0)

    def _check_division(self, one: torch.Tensor, two: torch.Tensor) -> None:
        if not (torch.isfinite(one) and one.abs() > 0):
            return  # nothing to learn from a micro-batch without targets: check the next one
        self.checked = True
        if not torch.isclose(one, 2 * two, rtol=1e-3, atol=0):
            raise ValueError(
                f"compute_loss_func does not divide by num_items_in_batch: it returned {one.item():.6g} with "
                f"num_items_in_batch=1 and {two.item():.6g} with 2. Its micro-batch means would not add up to the "
                "big batch's mean. Make it return the loss summed over the targets divided by num_items_in_batch, "
                "as transformers documents (e.g. transformers.loss.loss_utils.ForCausalLMLoss(outputs['logits'], "
                "labels, vocab_size, num_items_in_batch)), or drop compute_loss_func and pass the exact equivalent, "
                "objective=hfacc.FunctionObjective(count_fn=lambda batch: (batch['labels'][..., 1:] != -100).sum(), "
                "loss_fn=lambda outputs, batch: <the loss summed over those targets>)."
            )

    def __repr__(self) -> str:
        return f"LossFunctionObjective(counting like {self.counter!r})"
