"""Image inputs of a batch: which entries they are, how packed rows keep them right, and multimodal rotary positions.

A vision-language model takes, besides the tokens, tensors per *image* (``pixel_values``, ``image_grid_thw``,
``image_sizes``, ...) or per example of images (Idefics3's ``pixel_values`` ``[B, images, C, H, W]``). The model
encodes them and writes image i's features over the i-th run of image placeholder tokens in the flattened
``input_ids`` (``masked_scatter``): only their order counts, not which row holds which token. So a padding-free or
packed layout that keeps the sequences in order (:func:`get_ordered_rows`) is given the very same image tensors.

Qwen2-VL and its family place tokens with 3-D rotary positions ("mrope": temporal, height, width). Their forward
computes them from the padded batch; rows that hold several sequences need them per sequence, given as
``position_ids`` of shape ``[4, rows, length]`` whose first channel is the text position that restarts at each
sequence: transformers' layout for packed mrope inputs, from which attention keeps the sequences apart (and
:func:`hfacc.ops.loss.shift_labels` the targets). :func:`with_packed_positions` builds them with the model's own
``get_rope_index``, one sequence at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..ops.loss import get_sequence_starts
from ..ops.model_io import get_base_model

# The dataset column of image references (bytes or paths, datasets.Image(decode=False)) the vision collator reads.
IMAGE_COLUMN = "images"

# Batch entries of images and videos: per image (or per example of images), never per token. A layout that keeps
# the order of the sequences keeps them as they are.
IMAGE_INPUT_KEYS = (
    "pixel_values",
    "pixel_attention_mask",
    "image_grid_thw",
    "image_sizes",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)


def get_image_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The image (and video) entries of ``batch`` that are set."""
    return {k: batch[k] for k in IMAGE_INPUT_KEYS if batch.get(k) is not None}


def takes_images(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``pixel_values`` (a vision-language model)."""
    return "pixel_values" in inspect.signature(get_base_model(model).forward).parameters


def get_ordered_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in their order, cut into rows of at most ``capacity`` (next fit; empty ones left out).

    The layout for batches with images: their features are assigned to image tokens in the order of the tokens,
    which a reordering of the sequences (best-fit decreasing) would break.

    >>> get_ordered_rows([3, 2, 4, 1, 0], 5)
    [[0, 1], [2, 3]]
    """
    rows: list[list[int]] = []
    used = capacity
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        if used + n > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def get_rope_index_function(model: nn.Module):
    """The model's own ``get_rope_index`` (multimodal rotary positions: Qwen2-VL, Qwen2.5-VL, ...), or None."""
    base = get_base_model(model)
    for module in (base, getattr(base, "model", None)):
        function = getattr(module, "get_rope_index", None)
        if callable(function):
            return function
    return None


def with_packed_positions(model: nn.Module, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """``inputs`` as a multimodal-rotary model needs them when its rows hold several sequences; else unchanged.

    Packed rows carry 2-D ``position_ids`` that restart per sequence and no ``attention_mask``. A model with
    ``get_rope_index`` (Qwen2-VL family) would broadcast them to its three rotary channels and then see neither the
    sequences (attention would cross them) nor the images' 2-D positions. It gets ``[4, rows, length]`` positions
    instead: the text positions, then the three mrope channels computed by the model's own ``get_rope_index`` for
    each sequence on its own (as it computes them for a padded row), images taken in order.
    """
    positions = inputs.get("position_ids")
    if not torch.is_tensor(positions) or positions.dim() != 2 or inputs.get("attention_mask") is not None:
        return inputs
    get_rope_index = get_rope_index_function(model)
    if get_rope_index is None:
        return inputs
    ids = inputs["input_ids"]
    positions = positions.expand(ids.shape)
    types = inputs.get("mm_token_type_ids")
    images = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    if images["image_grid_thw"] is None and images["video_grid_thw"] is None:
        mrope = positions[None].expand(3, *positions.shape)  # text only: every channel is the text position
    else:
        if types is None:
            raise ValueError(
                "packed rows with images for a multimodal-rotary model need mm_token_type_ids (its processor "
                "returns them; hfacc.DataCollatorForVisionLM sets them)"
            )
        mrope = _per_sequence_rope(get_rope_index, ids, types, positions, images)
    return {**inputs, "position_ids": torch.cat([positions[None], mrope.to(positions.dtype)])}


def _per_sequence_rope(get_rope_index, ids, types, positions, images) -> torch.Tensor:
    """``[3, rows, length]`` mrope positions, each sequence of the rows computed as a padded row of its own."""
    starts = get_sequence_starts(positions).flatten().nonzero().flatten().tolist()
    width = ids.shape[-1]
    # Sequences never cross a row: a row's first position always starts one.
    spans = [(s, e) for s, e in zip(starts, starts[1:] + [ids.numel()], strict=True)]
    spans = [(s, min(e, (s // width + 1) * width)) for s, e in spans]
    longest = max(e - s for s, e in spans)
    flat_ids, flat_types = ids.flatten(), types.flatten()
    seq_ids = ids.new_zeros(len(spans), longest)
    seq_types = types.new_zeros(len(spans), longest)
    mask = ids.new_zeros(len(spans), longest)
    for j, (s, e) in enumerate(spans):
        seq_ids[j, : e - s], seq_types[j, : e - s], mask[j, : e - s] = flat_ids[s:e], flat_types[s:e], 1
    parameters = inspect.signature(get_rope_index).parameters
    kwargs = {k: v for k, v in images.items() if v is not None and k in parameters}
    if "mm_token_type_ids" in parameters:
        kwargs["mm_token_type_ids"] = seq_types
    rope, _ = get_rope_index(seq_ids, attention_mask=mask, **kwargs)
    out = rope.new_zeros(3, ids.numel())
    for j, (s, e) in enumerate(spans):
        out[:, s:e] = rope[:, j, : e - s]
    return out.view(3, *ids.shape)


def unpack_rows(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Packed rows (restarting ``position_ids``, no mask) as a right-padded batch of their sequences, in order.

    Per-token entries are split with the tokens; image entries stay as they are (same order of images).
    """
    positions = batch["position_ids"].expand(batch["input_ids"].shape)
    starts = get_sequence_starts(positions).flatten().nonzero().flatten().tolist()
    width, total = positions.shape[-1], positions.numel()
    spans = [(s, min(e, (s // width + 1) * width)) for s, e in zip(starts, starts[1:] + [total], strict=True)]
    longest = max(e - s for s, e in spans)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("position_ids", "attention_mask") or key in IMAGE_INPUT_KEYS:
            continue
        if torch.is_tensor(value) and tuple(value.shape[:2]) == tuple(positions.shape):
            flat = value.flatten(0, 1)
            rows = flat.new_zeros(len(spans), longest, *value.shape[2:])
            for j, (s, e) in enumerate(spans):
                rows[j, : e - s] = flat[s:e]
            out[key] = rows
    mask = torch.zeros(len(spans), longest, dtype=torch.long, device=positions.device)
    for j, (s, e) in enumerate(spans):
        mask[j, : e - s] = 1
    out["attention_mask"] = mask
    out.update(get_image_inputs(batch))
    return out
