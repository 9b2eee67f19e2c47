"""What goes into a model and what comes out: the batch keys it takes, its logits, the module under its wrappers.

The bottom layer under the objectives, the fused loss and the padding-free layout: none of them needs more of a model
than these few readings.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

# Batch keys that describe targets or hfacc's bookkeeping, never model inputs. `sequence_ids` / `num_sequences`: which
# of the batch's sequences each position belongs to (-1: none), where a layout put several in a row (padding-free);
# `padded_index`: where each position's token was in the padded batch; `score_index`, `layout_index`: where the
# shared-prompt layout of preference pairs put each sequence's scored position and each padded token
# (hfacc.data.shared_prompts).
NON_MODEL_KEYS = (
    "labels",
    "shift_labels",
    "sequence_ids",
    "num_sequences",
    "padded_index",
    "score_index",
    "layout_index",
)


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``batch`` that go to the model: everything but the labels."""
    return {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}


def forward_inputs(batch: Mapping[str, Any], row_keys: Collection[str] = ()) -> dict[str, Any]:
    """What of ``batch`` goes into the model's forward: its model inputs without the per-row values an objective
    reads (``row_keys``), and no cache for packed rows (with one, transformers does not keep packed sequences
    apart: :func:`packed_position_ids`), nor for a 4-D mask of the layout's own (hfacc.data.shared_prompts)."""
    inputs = {k: v for k, v in model_inputs(batch).items() if k not in row_keys}
    mask = inputs.get("attention_mask")
    if packed_position_ids(inputs) is not None or (torch.is_tensor(mask) and mask.dim() == 4):
        inputs["use_cache"] = False
    return inputs


def get_logits(outputs: Any) -> torch.Tensor:
    """The logits of a model output: a ``ModelOutput``/dict (``"logits"``), a tuple (first entry) or a tensor."""
    if torch.is_tensor(outputs):
        return outputs
    if isinstance(outputs, Mapping):
        if "logits" not in outputs:
            raise ValueError(f"The model output has no 'logits'; it has {list(outputs)}. Return logits to train it.")
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    raise TypeError(f"Cannot find logits in a model output of type {type(outputs).__name__}")


def get_base_model(model: nn.Module) -> nn.Module:
    """``model`` without its DDP/FSDP/compile and PEFT wrappers: the module whose class says what its head is."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP, DataParallel, DeepSpeed engine
            model = model.module
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft.PeftModel
            model = model.get_base_model()
    return model


def get_aux_loss(model: nn.Module, outputs: Any) -> torch.Tensor | None:
    """``router_aux_loss_coef * outputs.aux_loss`` for MoE models that return one, else None."""
    if not isinstance(outputs, Mapping) or outputs.get("aux_loss") is None:
        return None
    coef = getattr(getattr(get_base_model(model), "config", None), "router_aux_loss_coef", 0.0) or 0.0
    return coef * outputs["aux_loss"] if coef else None


def packed_position_ids(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The ``position_ids`` of a batch of packed rows (given, 2-D, and no ``attention_mask``), else None.

    This is when transformers (5.x) looks for sequences inside a row and keeps them apart in attention.
    """
    positions = batch.get("position_ids")
    if torch.is_tensor(positions) and positions.dim() == 3 and positions.shape[0] == 4:
        positions = positions[0]  # multimodal rotary positions: the text channel (see hfacc.ops.loss.shift_labels)
    if torch.is_tensor(positions) and positions.dim() == 2 and batch.get("attention_mask") is None:
        return positions
    return None


def get_num_virtual_tokens(model: nn.Module) -> int:
    """Virtual tokens a PEFT prompt-learning model puts before the inputs (0 for any other model).

    Prompt tuning, P-tuning and multitask prompt tuning prepend them to the input embeddings, so the logits have
    that many more positions than the labels. Prefix tuning passes them as a key/value cache instead: the logits
    keep the inputs' length and the count is 0.
    """
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        config = getattr(model, "active_peft_config", None)
        if config is not None:
            if not getattr(config, "is_prompt_learning", False):
                return 0
            kind = str(getattr(config, "peft_type", ""))
            if kind.endswith(("PREFIX_TUNING", "CARTRIDGE")):
                return 0
            if kind.endswith("CPT"):
                raise NotImplementedError(
                    "PEFT CPT trains on its prompt tokens with its own weighting; hfacc cannot count its targets. "
                    "Pass objective='model_loss' (the model's own loss, averaged over micro-batches)."
                )
            return int(config.num_virtual_tokens)
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return 0


def get_dropout_settings(model: nn.Module, active_only: bool = False) -> list[str]:
    """The dropouts ``model`` would apply in training: dropout modules with ``p > 0`` (whatever their current mode;
    ``active_only``: those in train mode) and config entries named ``*dropout*`` above 0 (attention dropout is a
    functional call, with no module)."""
    found = [
        f"{n or 'model'}.p={m.p}"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and (m.training or not active_only)
    ]
    config = getattr(model, "config", None)
    for key, value in (config.to_dict() if config is not None else {}).items():
        if "dropout" in key and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{key}={value}")
    return found


def get_input_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's input embedding module, or None (a plain module, or a transformers class that does not say)."""
    base = get_base_model(model)
    try:
        embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    except NotImplementedError:
        return None
    return embeddings if isinstance(embeddings, nn.Module) else None
