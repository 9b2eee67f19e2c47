"""Which way the loss is computed: fused with the output projection (:mod:`hfacc.fused_loss`) or from full logits.

:func:`choose_loss_path` is the one decision, taken once per model by training and by ``hfacc verify`` alike.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .distributed import all_ranks_agree
from .model_io import get_base_model, get_logits
from .objective import CausalLMObjective, Objective

try:  # FSDP2 and DTensor (torch >= 2.6); without them no weight is FSDP2-sharded
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:
    FSDPModule = DTensor = None


def choose_loss_path(
    objective: Objective,
    model: nn.Module,
    batch: Mapping[str, Any],
    accelerator,
    *,
    fused_loss: bool = True,
    normalization: str = "token",
    chunk_size: int | None = None,
) -> str | None:
    """Decide whether ``objective`` computes its loss fused; set ``objective.fused``; return why not (None: fused).

    The fused loss is tried only for a causal LM with ``fused_loss`` on; it needs equal weights for all targets
    (not ``normalization='sequence'``), an output projection that is a whole 2-D weight (not FSDP v1's flattened
    one), and a model that returns the projection's output unchanged (:func:`check_fused_loss`, one micro-batch run
    both ways). Every rank must take the same path, so the ranks agree (one collective) unless fusion is off.
    """
    if not isinstance(objective, CausalLMObjective):
        return f"objective '{objective.name}' has no output projection to fuse"
    if chunk_size is not None:
        objective.chunk_size = chunk_size
    if not fused_loss:
        objective.fused = False
        return "fused_loss=False"
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if normalization == "sequence":
        problem = "normalization='sequence' weighs targets unequally"
    elif plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
        problem = "FSDP v1 flattens the parameters (FSDP2, fsdp_version: 2, keeps the output projection whole)"
    else:
        # DDP, DeepSpeed ZeRO-1/2 (whole parameters), FSDP2 and ZeRO-3: the engine gathers a sharded output
        # projection for the head's forward, inside which the fused loss runs (hfacc.fused_loss.FusedOutputHead).
        problem = check_fused_loss(objective, model, batch)
    objective.fused = all_ranks_agree(problem is None, accelerator)
    return None if objective.fused else problem or "another rank could not fuse"


def fused_loss_problem(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be fused with its output projection, or None if it can be tried.

    A weight sharded by FSDP2 (a ``DTensor``) or DeepSpeed ZeRO-3 (a partitioned parameter) is fine: the engine
    gathers it for the head's forward, inside which the fused loss runs (see :class:`hfacc.fused_loss.FusedOutputHead`).
    """
    base = get_base_model(model)
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not callable(getattr(base, "set_output_embeddings", None)):
        return f"{type(base).__name__} has no get/set_output_embeddings"
    if _module_class(head) is not nn.Linear:
        return f"its output projection is a {type(head).__name__} (e.g. adapted by LoRA), not a plain nn.Linear"
    shape = _gathered_shape(head.weight, base)
    if shape is None and type(head.weight) is nn.Parameter:
        shape = tuple(head.weight.shape)
    if shape is None or len(shape) != 2 or 0 in shape:
        return "its output projection's weight is not a 2-D parameter that hfacc can gather (e.g. FSDP v1 flattens it)"
    return None


def _module_class(module: nn.Module) -> type:
    """The module's own class; FSDP2's ``fully_shard`` swaps it for a subclass ``FSDP<Class>``."""
    cls = type(module)
    if FSDPModule is not None and isinstance(module, FSDPModule):
        return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    return cls


def _gathered_shape(weight: torch.Tensor, model: nn.Module) -> tuple[int, ...] | None:
    """The full shape of a weight that FSDP2 or ZeRO-3 shards and gathers for each forward, else None."""
    if hasattr(weight, "ds_shape"):  # DeepSpeed ZeRO-3: the local tensor is empty outside the module's forward
        return tuple(weight.ds_shape)
    if DTensor is not None and isinstance(weight, DTensor) and any(isinstance(m, FSDPModule) for m in model.modules()):
        return tuple(weight.shape)  # FSDP2: a DTensor's shape is the global one
    return None


@torch.no_grad()
def check_fused_loss(objective: CausalLMObjective, model: nn.Module, batch: Mapping[str, Any]) -> str | None:
    """Run one micro-batch both ways; None if the fused loss sum matches the plain one, else why not.

    This catches whatever a model does after its output projection (logit soft-capping, scaling) that the fused
    path would skip: those models fall back to the plain path.
    """
    problem = fused_loss_problem(model)
    if problem is not None:
        return problem
    was_training = model.training
    model.eval()  # dropout would make the two runs differ for reasons that have nothing to do with the fusion
    try:
        fused, plain = copy.copy(objective), copy.copy(objective)  # same targets (e.g. virtual tokens), both paths
        fused.fused, plain.fused = True, False
        try:
            outputs, a = fused(model, batch)
        except Exception as err:  # a model whose forward does something unexpected with the projection's output
            return f"the fused forward failed ({type(err).__name__}: {err})"
        _, b = plain(model, batch)
    finally:
        model.train(was_training)
    returned = get_logits(outputs)
    if returned.shape != a.loss.shape or not torch.equal(returned.to(a.loss.dtype), a.loss):
        # What came out is not what the projection produced: the model transforms its logits (soft-capping,
        # scaling), which the fused loss would skip.
        return "the model post-processes its logits (e.g. soft-capping or scaling)"
    tolerance = 1e-5 if next(model.parameters()).dtype == torch.float32 else 2e-2
    difference = (a.loss - b.loss).abs().item() / max(b.loss.abs().item(), 1e-12)
    if a.count != b.count or not difference <= tolerance:
        return f"the fused loss differs from the model's own logits by {difference:.1e} (it post-processes its logits)"
    return None
