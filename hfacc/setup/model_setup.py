"""The per-model setup: every decision hfacc takes once for a model, in one place, before its first window.

In this order, on every rank alike (each check that runs the model runs the same small work everywhere, so sharded
engines stay in step, and the ranks agree on each answer):

1. the objective: the one given, or for ``objective="auto"`` the one the model class and the labels call for
   (:func:`hfacc.objectives.get_objective`); transformers' ``compute_loss_func`` is wrapped to count like it;
2. the layout: padding-free micro-batches where the objective supports them and the model passes the check
   (:func:`hfacc.setup.layout_check.choose_padding_free`), else the batches as collated; for pairs, each prompt
   computed once where the model passes that check too (:func:`hfacc.setup.layout_check.choose_shared_prompts`);
3. the loss path: the fused chunked loss where the objective and the model allow it
   (:func:`hfacc.setup.loss_path.choose_loss_path`), else full logits;
4. the objective's own decisions (:meth:`hfacc.Objective.setup`: a reference model, a teacher, ...); a frozen model
   it runs on every micro-batch in the same layout (:meth:`hfacc.Objective.companion_models`: a distillation
   teacher) must pass the padding-free check too, else the micro-batches stay padded.

Whatever was guessed is said at WARNING once, with the setting that makes it explicit; the choices taken are said
at INFO. Training (:class:`hfacc.TokenWeightedTrainer`) runs it on its first micro-batch; ``hfacc verify`` takes the
same decisions through the same functions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..objectives import LossFunctionObjective, ModelLossObjective, Objective, get_objective
from ..objectives.base import SetupContext
from ..ops.model_io import get_base_model
from ..runtime.distributed import all_ranks_agree
from .layout_check import (
    CHECK_TOKENS,
    SharedPromptsChoice,
    check_padding_free,
    check_row_offsets,
    choose_padding_free,
    choose_shared_prompts,
)
from .loss_path import choose_loss_path

logger = logging.getLogger(__name__)


@dataclass
class ModelSetup:
    """What was decided for a model before its first window.

    Args:
        objective: the objective every window is counted and trained with.
        padding_free: whether micro-batches are laid out without their padding (:mod:`hfacc.data.padding_free`, checked
        by :mod:`hfacc.setup.layout_check`). one_row: with ``padding_free``, one row for variable-length attention
        kernels, else rows as wide as the
            longest sequence.
        max_row_length: with ``padding_free``, the longest row the check verified (0: no bound; see
            :func:`hfacc.data.padding_free.remove_padding`).
        loss_path: ``"fused"`` or ``"plain"`` (full logits).
        loss_path_problem: why not fused, where the fused loss was wanted.
        shared_prompts: with ``padding_free``, the shared-prompt layout of pairs where the objective reads pairs and
            the model passed its check (:func:`hfacc.setup.layout_check.choose_shared_prompts`); None: each sequence
            laid out on its own.
    """

    objective: Objective
    padding_free: bool = False
    one_row: bool = True
    max_row_length: int = 0
    loss_path: str = "plain"
    loss_path_problem: str | None = None
    shared_prompts: SharedPromptsChoice | None = None


def build_model_setup(
    model: nn.Module,
    batch: Mapping[str, Any],
    accelerator,
    *,
    objective: Objective | str = "auto",
    padding_free: bool = True,
    shared_prompts: bool = True,
    fused_loss: bool = True,
    normalization: str = "token",
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    compute_loss_func: Callable | None = None,
    args=None,
    trainer=None,
    longest_sequence: int = 0,
    initial_policy: nn.Module | None = None,
) -> ModelSetup:
    """Take the per-model decisions for ``model`` from its first micro-batch ``batch`` (already on the device).

    Args:
        objective: an :class:`hfacc.Objective`, or the name of a built-in one (``"auto"``: from the model and labels).
        padding_free, shared_prompts, fused_loss, normalization, chunk_size, label_smoothing: as the fields of
            :class:`hfacc.TokenWeightedArguments` (``loss_chunk_size``, ``label_smoothing_factor``) that set them.
        compute_loss_func: transformers' ``compute_loss_func``: the loss is the user's, counted by the objective.
        args, trainer: the run's arguments and trainer, for objectives whose setup reads them
            (:class:`hfacc.objectives.SetupContext`).
        longest_sequence: the training data's longest sequence where it is known (0: not known), so that the
            padding-free check runs rows as long as training will lay out, not only the first micro-batch's.
        initial_policy: a resumed run's copy of the policy before its checkpoint loaded, for the reference of an
            objective that copies the policy (:meth:`hfacc.Objective.copies_policy`).
    """
    if isinstance(objective, str):
        objective = get_objective(model, batch, name=objective, label_smoothing=label_smoothing)
    setup = ModelSetup(objective)
    if compute_loss_func is not None:
        # The user's loss, with hfacc's count of the targets: exact if it divides by num_items_in_batch. Padded
        # micro-batches: the user's function shifts the labels itself, across any packed boundary.
        setup.objective = LossFunctionObjective(compute_loss_func, counter=objective)
    elif padding_free and objective.supports_padding_free:
        budget = getattr(args, "max_tokens_per_batch", 0) or 0  # the longest one row training may lay out
        setup.padding_free, setup.one_row, setup.max_row_length = choose_padding_free(
            objective, model, batch, accelerator, max_tokens_per_batch=budget, longest_sequence=longest_sequence
        )
        if setup.padding_free and shared_prompts and objective.supports_shared_prompts:
            setup.shared_prompts = choose_shared_prompts(objective, model, batch, accelerator, args, longest_sequence)
    objective = setup.objective
    if objective.supports_fused:
        problem = choose_loss_path(
            objective,
            model,
            batch,
            accelerator,
            fused_loss=fused_loss,
            normalization=normalization,
            chunk_size=chunk_size,
        )
        setup.loss_path, setup.loss_path_problem = ("fused" if objective.fused else "plain"), problem
        if objective.fused:
            logger.info("hfacc: fused chunked loss: the full logits are never materialized.")
        elif fused_loss:
            logger.warning("hfacc: plain loss path (full logits): %s.", problem)
    objective.setup(SetupContext(model, batch, accelerator, args, trainer, initial_policy))
    if setup.padding_free:
        _check_companion_layouts(setup, objective, batch, accelerator)
    accumulation = getattr(args, "gradient_accumulation_steps", 1) or 1
    if accumulation > 1 or accelerator.num_processes > 1 or getattr(args, "max_tokens_per_batch", 0):
        _warn_about_router_loss(model)
    logger.info("hfacc: objective %s, normalization %r", objective, normalization)
    if isinstance(objective, ModelLossObjective) and normalization != "micro_batch":
        logger.warning("hfacc: with objective 'model_loss', every micro-batch counts as one target.")
    return setup


def _check_companion_layouts(setup: ModelSetup, objective: Objective, batch, accelerator) -> None:
    """The padding-free layout chosen for the trained model, checked on the frozen models the objective runs in it
    (:func:`hfacc.setup.layout_check.check_padding_free`, forward only, and as long a row as training lays out); where
    one of them does not compute it as it computes padded batches, every micro-batch stays padded, said at WARNING."""
    for companion in objective.companion_models():
        problem = check_padding_free(companion, batch, setup.one_row, gradient=False)  # frozen: no backward
        if problem is None and setup.max_row_length > CHECK_TOKENS:
            length, why = check_row_offsets(companion, batch, setup.max_row_length)
            problem = why if length < setup.max_row_length else None
        if not all_ranks_agree(problem is None, accelerator):
            setup.padding_free = False
            logger.warning(
                "hfacc: padded micro-batches, as collated: the objective's %s does not take the padding-free layout "
                "(%s). Set padding_free=False to skip the check.",
                type(get_base_model(companion)).__name__,
                problem or "not on another rank",
            )
            return


def _warn_about_router_loss(model: nn.Module) -> None:
    """A router load-balancing loss is a statistic of each micro-batch's own routing (hfacc.training.window averages it
    over the micro-batches), so the step of a split window is not one big batch's: say so where the run starts, not
    only
    in ``hfacc verify``."""
    config = getattr(get_base_model(model), "config", None)
    coef = getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
    if coef:
        logger.warning(
            "hfacc: the model adds a router load-balancing loss (router_aux_loss_coef %s) computed from each "
            "micro-batch's own routing and averaged over the micro-batches: the step depends on how the window is "
            "split, it is not exactly one big batch's. Set output_router_logits=False in the model config for an exact "
            "step.",
            coef,
        )


__all__ = ["ModelSetup", "build_model_setup"]
