"""Which way the loss is computed: fused with the output projection (:mod:`hfacc.ops.fused_loss`) or from full logits.

:func:`choose_loss_path` is the one decision, taken once per model by training and by ``hfacc verify`` alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..objectives import Objective
from ..ops.precision import check_precision
from ..runtime.distributed import all_ranks_agree


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

    Tried only for objectives that support it (``supports_fused``: causal LMs, and the preference and
    policy-gradient objectives, whose log-probs come from the hidden states in chunks) with ``fused_loss`` on; it
    needs an output projection that is a whole 2-D weight (not FSDP v1's flattened one), and a model that returns
    the projection's output unchanged: the objective's ``check_fused(model, batch, normalization)`` runs one
    micro-batch both ways. Every rank must take the same path, so the ranks agree (one collective) unless fusion is
    off.
    """
    if not getattr(objective, "supports_fused", False):
        return f"objective '{objective.name}' has no output projection to fuse"
    if chunk_size is not None:
        objective.chunk_size = chunk_size
    if not fused_loss:
        objective.fused = False
        return "fused_loss=False"
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
        problem = "FSDP v1 flattens the parameters (FSDP2, fsdp_version: 2, keeps the output projection whole)"
    else:
        # DDP, DeepSpeed ZeRO-1/2 (whole parameters), FSDP2 and ZeRO-3: the engine gathers a sharded output
        # projection for the head's forward, inside which the fused loss runs (hfacc.ops.fused_loss.FusedOutputHead).
        # Where the layout checks run (fp32 with autocast off for fp32 weights): a question of the model, not of
        # a bf16 run's rounding.
        with check_precision(model):
            problem = objective.check_fused(model, batch, normalization=normalization)
    objective.fused = all_ranks_agree(problem is None, accelerator)
    return None if objective.fused else problem or "another rank could not fuse"
