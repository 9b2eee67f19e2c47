"""The reference model of preference and KL-regularized losses: frozen, in eval mode, log-probs without gradient.

Three ways to have one, as TRL offers them (:func:`build_reference_model`):

- a model the user gives (``ref_model=``);
- by default, a frozen copy of the policy taken when training starts (before its first update);
- for a PEFT policy, the policy itself with its adapter disabled: the base weights *are* the reference, so no
  second copy is held.

Its log-probs come from the same kernel as the policy's (:func:`hfacc.logprobs.get_token_logprobs`): chunked from
the final hidden states where the model allows it (checked once, on the first batch), else from full logits.
Precomputed reference log-probs (dataset columns) need no model at all; the objectives read them directly.

Placement: a copy lives on the policy's device. Under DDP nothing more is needed (it takes no gradient, so it is
not wrapped). Sharded engines (DeepSpeed ZeRO-3, FSDP2) shard the policy's parameters, so a copy must be made
from, and placed like, the sharded model: :func:`build_reference_model` refuses them with the fix until that is
built, rather than copying empty shards.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .logprobs import TokenLogProbs, check_fused_logprobs, get_token_logprobs
from .model_io import get_base_model

logger = logging.getLogger(__name__)


def unwrap_model(model: nn.Module) -> nn.Module:
    """``model`` without its DDP / DeepSpeed / torch.compile wrappers (a PEFT model stays a PEFT model)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return model


def is_peft_model(model: nn.Module) -> bool:
    return callable(getattr(unwrap_model(model), "disable_adapter", None))


class ReferenceModel:
    """Log-probs of a frozen reference, without gradient.

    Args:
        module: the reference network (a frozen copy, or the user's ``ref_model``), or the PEFT policy itself when
            ``disable_adapter`` (its adapter is switched off for each reference forward).
        disable_adapter: run ``module.disable_adapter()`` around each forward (PEFT policies: the base model).
        fused: take the log-probs from the hidden states in chunks; None decides on the first batch
            (:func:`hfacc.logprobs.check_fused_logprobs`).
    """

    def __init__(self, module: nn.Module, *, disable_adapter: bool = False, fused: bool | None = None):
        self.module, self.disable_adapter, self.fused = module, disable_adapter, fused

    @torch.no_grad()
    def logprobs(
        self, inputs: Mapping[str, Any], targets: torch.Tensor, *, chunk_size: int = 0, temperature: float = 1.0
    ) -> TokenLogProbs:
        """:class:`hfacc.logprobs.TokenLogProbs` of ``targets`` under the reference (eval mode: no dropout)."""
        module = self.module
        was_training = module.training
        module.eval()
        try:
            with self._context():
                if self.fused is None:
                    self.fused = check_fused_logprobs(module, inputs, targets, temperature) is None
                _, result = get_token_logprobs(
                    module, inputs, targets, fused=self.fused, chunk_size=chunk_size, temperature=temperature
                )
        finally:
            module.train(was_training)
        return result

    @torch.no_grad()
    def check_fused(self, inputs: Mapping[str, Any], targets: torch.Tensor, temperature: float = 1.0) -> str | None:
        """Why chunked log-probs would not be this reference's own (None: they are): :func:`check_fused_logprobs`
        on the reference as its forwards run (adapter disabled, eval mode)."""
        with self._context():
            return check_fused_logprobs(self.module, inputs, targets, temperature)

    def _context(self):
        return self.module.disable_adapter() if self.disable_adapter else contextlib.nullcontext()

    def __repr__(self) -> str:
        kind = "the policy with its adapter disabled" if self.disable_adapter else type(self.module).__name__
        return f"ReferenceModel({kind})"


def build_reference_model(policy: nn.Module, ref_model: nn.Module | None = None, accelerator=None) -> ReferenceModel:
    """The reference of ``policy``: ``ref_model`` if given, else the PEFT base or a frozen copy (see the module doc).

    Call it before the policy's first update: the copy is of the weights as they are now.
    """
    if ref_model is not None:
        module = unwrap_model(ref_model)
        module.requires_grad_(False)
        if accelerator is not None:
            module.to(accelerator.device)
        return ReferenceModel(module.eval())
    if is_peft_model(policy):
        logger.info("hfacc: reference model: the PEFT policy with its adapter disabled (no second copy).")
        return ReferenceModel(unwrap_model(policy), disable_adapter=True)
    refusal = sharded_engine(policy, accelerator)
    if refusal:
        raise NotImplementedError(
            f"hfacc: a frozen copy of the policy cannot be taken under {refusal}: its parameters are sharded. Pass "
            "ref_model= (loaded like the policy), or precomputed reference log-probs, or use a PEFT adapter "
            "(its base model is the reference)."
        )
    module = copy.deepcopy(get_base_model(unwrap_model(policy)))
    module.requires_grad_(False)
    logger.info("hfacc: reference model: a frozen copy of the policy as training starts.")
    return ReferenceModel(module.eval())


def sharded_engine(model: nn.Module, accelerator=None) -> str | None:
    """The name of the engine that shards ``model``'s parameters (ZeRO-3, FSDP), or None."""
    if any(hasattr(p, "ds_shape") for p in model.parameters()):
        return "DeepSpeed ZeRO-3"
    state = getattr(accelerator, "state", None)
    if getattr(state, "fsdp_plugin", None) is not None:
        return "FSDP"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return "FSDP2" if any(isinstance(m, FSDPModule) for m in model.modules()) else None


__all__ = ["ReferenceModel", "build_reference_model", "unwrap_model", "is_peft_model"]
