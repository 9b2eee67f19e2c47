"""What breaks "k micro-batches = one big batch" for a model, and what stock ``transformers.Trainer`` would do.

:func:`diagnose` inspects a model and a window for batch statistics, randomness, per-micro-batch auxiliary losses,
an inexact objective and the stock Trainer's normalization; each :class:`Finding` says why and how to fix it.
``hfacc verify`` prints them under its measured error.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..ops.model_io import get_base_model, get_dropout_settings, model_inputs


@dataclass
class Finding:
    """One check of an assumption behind equivalence."""

    name: str
    ok: bool
    message: str
    fix: str = ""


def diagnose(model, objective, batch, path, normalization, window, micro_batches) -> list[Finding]:
    """Inspect the model and the run for what breaks equivalence; each finding says why and how to fix it."""
    base = get_base_model(model)
    findings = []
    batchnorms = [n for n, m in base.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    findings.append(
        Finding(
            "batch statistics",
            not batchnorms,
            f"BatchNorm in train mode normalizes with the statistics of each micro-batch: {batchnorms[:3]}"
            if batchnorms
            else "no BatchNorm (or other batch-statistics layer) in train mode",
            "put those layers in eval mode (frozen statistics), or replace them with LayerNorm/GroupNorm",
        )
    )
    dropouts = get_dropout_settings(base, active_only=True)
    random_ops = _forward_is_random(model, batch)
    if random_ops or dropouts:
        why = "two identical forwards differ" if random_ops else "dropout is active (its masks also change gradients)"
        message = (
            f"{why}: random ops draw different values per micro-batch ({', '.join(dropouts[:4]) or 'unknown op'})"
        )
    else:
        message = "two identical forwards agree and no dropout is active"
    findings.append(
        Finding(
            "randomness",
            not (random_ops or dropouts),
            message,
            "set dropout to 0 (config attention_dropout/hidden_dropout, lora_dropout) for an exact step; with "
            "dropout the accumulated step is a different random draw of the same expected update",
        )
    )
    config = getattr(base, "config", None)
    aux = getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
    findings.append(
        Finding(
            "auxiliary losses",
            not aux,
            f"the model adds a router load-balancing loss (coef {aux}) computed from each micro-batch's own routing "
            "statistics; averaged over micro-batches it depends on how the window is split"
            if aux
            else "no auxiliary loss computed per micro-batch",
            "accept it as an approximation, or turn it off (output_router_logits=False) when checking exactness",
        )
    )
    if objective.exact:
        findings.append(Finding("objective", True, f"'{objective.name}' counts {objective.units[0]} exactly"))
    else:
        findings.append(
            Finding(
                "objective",
                False,
                f"'{objective.name}' uses the model's own mean loss: every micro-batch weighs the same",
                "pass an hfacc.Objective (or FunctionObjective) that returns loss sums and target counts",
            )
        )
    if path == "stock" and objective.stock_normalization:
        counts = [int(objective.count(b)[0]) for b in micro_batches]
        findings.append(
            Finding(
                "peers' normalization",
                len(set(counts)) == 1,
                f"the mean of micro-batch means weighs micro-batches of {counts} {objective.units[0]} the same",
                "use hfacc.TokenWeightedTrainer with this objective: each unit counted over the window",
            )
        )
    elif path == "stock":
        findings.append(_stock_finding(model, objective, micro_batches, window))
    if normalization == "micro_batch":
        findings.append(
            Finding(
                "normalization",
                True,
                "'micro_batch' is the mean of micro-batch means: exact for its own definition, which is not the "
                "big-batch token mean unless all micro-batches have the same number of targets",
            )
        )
    return findings


def _stock_finding(model, objective, micro_batches, window) -> Finding:
    accepts = _accepts_loss_kwargs(model)
    counts = [int(objective.count(b)[0]) for b in micro_batches]
    uneven = len(set(counts)) > 1
    if not accepts:
        return Finding(
            "stock Trainer",
            not uneven,
            f"the model's forward has no **kwargs, so stock Trainer divides each micro-batch's mean loss by k: "
            f"micro-batches of {counts} targets then weigh the same"
            if uneven
            else "stock Trainer divides each micro-batch mean by k; exact here only because all micro-batches have "
            "the same number of targets",
            "use hfacc.TokenWeightedTrainer (it counts the targets itself)",
        )
    batch = micro_batches[0]
    with torch.no_grad():
        plain = _own_loss(model(**batch))
        told = _own_loss(model(**batch, num_items_in_batch=torch.tensor(max(window.num_targets, 1))))
    if plain is not None and told is not None and torch.allclose(plain, told):
        return Finding(
            "stock Trainer",
            False,
            "the model's forward takes **kwargs, so stock Trainer passes num_items_in_batch and skips its own "
            "division by k, but this model's loss ignores it: the accumulated gradient is about k times too large",
            "use hfacc.TokenWeightedTrainer, or make the model's loss sum over targets and divide by num_items_in_batch",
        )
    return Finding(
        "stock Trainer",
        True,
        "the model's loss consumes num_items_in_batch, so stock Trainer normalizes by the window",
    )


def stock_loss(model, batch, objective, window, k, scale):
    """What transformers.Trainer (5.x) backpropagates for one micro-batch, with average_tokens_across_devices."""
    if _accepts_loss_kwargs(model):
        n = torch.tensor(max(window.num_targets, 1), device=batch["labels"].device)
        return _own_loss(model(**batch, num_items_in_batch=n)) * scale
    return _own_loss(model(**batch)) / k


def _own_loss(outputs) -> torch.Tensor:
    """The loss a model computed itself (as Trainer reads it: ``outputs["loss"]`` or ``outputs[0]``)."""
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]


def _accepts_loss_kwargs(model) -> bool:
    base = get_base_model(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def _forward_is_random(model, batch) -> bool:
    inputs = model_inputs(batch)
    with torch.no_grad():
        a = _first_tensor(model(**inputs))
        b = _first_tensor(model(**inputs))
    return not torch.equal(a, b)


def _first_tensor(outputs):
    if torch.is_tensor(outputs):
        return outputs
    if isinstance(outputs, Mapping):
        return next(v for v in outputs.values() if torch.is_tensor(v))
    return outputs[0]
