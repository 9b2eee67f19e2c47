"""Padding-free micro-batches: the real tokens of a padded batch as one row of packed sequences, same update.

A padded ``[B, T]`` micro-batch spends every layer's compute on its padding (43 % of the positions on the benchmark
in benchmarks/README.md). :func:`remove_padding` lays the same sequences end to end in one ``[1, sum(len)]`` row
with ``position_ids`` that restart at 0 for each sequence. transformers (5.x) keeps such sequences apart by itself
when it gets ``position_ids``, no ``attention_mask`` and no cache (``masking_utils.find_packed_sequence_indices``):
sdpa, eager and flex attention build a block-diagonal causal mask, flash attention uses its variable-length kernels
(``cu_seq_lens`` from the restarts, for one row). The targets are the same (:func:`hfacc.loss.shift_labels`: the
shift never crosses a sequence boundary, padding is never a target), so the loss sums, the counts and the gradient
are those of the padded batch, to fp32 rounding. Nothing about the update changes: not the sequences of a
micro-batch, not the targets, not the normalization.

:func:`check_padding_free` runs once per model: a model whose attention does not keep packed sequences apart, that
takes no ``position_ids`` or reads positions differently falls back to the padded path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .batching import best_fit_decreasing, position_ids_problem
from .distributed import all_ranks_agree
from .loss import IGNORE_INDEX
from .model_io import get_base_model, get_logits
from .multimodal import (
    IMAGE_INPUT_KEYS,
    check_image_layout,
    get_image_inputs,
    get_ordered_rows,
    takes_images,
    with_packed_positions,
)
from .objective import CausalLMObjective, Objective

logger = logging.getLogger(__name__)


def remove_padding(batch: Mapping[str, Any], one_row: bool = True) -> dict[str, Any] | None:
    """The real tokens of a padded batch laid end to end; None when the batch cannot be laid out so.

    ``attention_mask`` ``[B, T]`` (right or left padding) says which positions are real. With ``one_row`` every
    ``[B, T, ...]`` tensor of the batch (``input_ids``, ``labels``, ``token_type_ids``, ``inputs_embeds``, ...)
    keeps its real positions, in order, as ``[1, N, ...]``: the layout of variable-length attention kernels (flash,
    flex), whose cost grows with the sum of the squared sequence lengths. Otherwise the sequences are packed
    best-fit decreasing into rows as wide as the longest one: attention that masks a dense ``[rows, W, W]`` block
    (sdpa, eager) then computes less than on one ``[N, N]`` row, and the little room left at the end of a row is
    filled by one more sequence of its own (position 0, 1, ..., no target), which nothing else attends to.

    The mask is dropped and ``position_ids`` restart at 0 for each sequence. The labels stay unshifted:
    :func:`hfacc.loss.shift_labels` finds the sequence boundaries from the restarts and gives the same targets as on
    the padded batch. ``sequence_ids`` (the original row of each position, -1 in the filler) and ``num_sequences``
    (B) keep per-sequence sums per original row, in order.

    None (keep the padded batch) when there is no 2-D ``attention_mask``, a row's real tokens are not one run
    (holes in the mask) or a row is empty, the batch has its own ``position_ids`` that do not count from each
    sequence's first token (left padding with absolute positions, 3-D rotary positions), or a tensor is not laid out
    per token (per-example values). Image inputs (:data:`hfacc.multimodal.IMAGE_INPUT_KEYS`) are kept as they are:
    the model gives image i's features to the i-th image in token order, so the rows keep the sequences in order.

    >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    ...          "labels": torch.tensor([[5, 6, 7], [8, 9, -100]])}
    >>> row = remove_padding(batch)
    >>> row["input_ids"], row["position_ids"], row["labels"]
    (tensor([[5, 6, 7, 8, 9]]), tensor([[0, 1, 2, 0, 1]]), tensor([[5, 6, 7, 8, 9]]))
    """
    mask = batch.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or not torch.is_tensor(batch.get("input_ids")):
        return None
    shape = tuple(mask.shape)
    real = mask.bool()
    # Exactly one run of real tokens per row (right or left padding): a hole or an empty row has not one start.
    starts = real.clone()
    starts[:, 1:] &= ~real[:, :-1]
    given = batch.get("position_ids")
    if given is not None and (not torch.is_tensor(given) or given.dim() != 2):
        return None
    stats = [real.sum(-1), starts.sum(-1), starts.long().argmax(-1)]
    if given is not None:  # positions of its own must be the ones the row will have
        stats.append(((given.expand(shape) != real.long().cumsum(-1) - 1) & real).sum(-1))
    stats = torch.stack(stats).tolist()  # one host sync: the layout depends on the lengths
    lengths, first = stats[0], stats[2]
    if any(runs != 1 for runs in stats[1]) or (given is not None and any(stats[3])):
        return None
    if one_row:
        rows, width = [list(range(shape[0]))], sum(lengths)
    else:
        width = max(lengths)
        # With images, in order (hfacc.multimodal): image features are matched to image tokens by their order.
        rows = get_ordered_rows(lengths, width) if get_image_inputs(batch) else best_fit_decreasing(lengths, width)
    # For every output position: the flat index of its token in the padded batch (-1: filler), its position in its
    # sequence, and its original row (-1: filler).
    index, positions, owner = [], [], []
    for members in rows:
        used = 0
        for b in members:
            n = lengths[b]
            index.append(torch.arange(b * shape[1] + first[b], b * shape[1] + first[b] + n))
            positions.append(torch.arange(n))
            owner.append(torch.full((n,), b))
            used += n
        index.append(torch.full((width - used,), -1))
        positions.append(torch.arange(width - used))
        owner.append(torch.full((width - used,), -1))
    device = mask.device
    index = torch.cat(index).to(device)
    filler = index < 0
    gather = index.clamp(min=0)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids") or value is None:
            continue
        if not torch.is_tensor(value) or key in IMAGE_INPUT_KEYS:
            out[key] = value  # flags such as return_loss; images, in the order of their tokens (kept)
        elif value.dim() >= 2 and tuple(value.shape[:2]) == shape:
            laid = value.flatten(0, 1).index_select(0, gather)
            fill = IGNORE_INDEX if key in ("labels", "shift_labels") else 0
            laid[filler] = fill
            out[key] = laid.view(len(rows), width, *value.shape[2:])
        else:
            return None
    out["position_ids"] = torch.cat(positions).to(device).view(len(rows), width)
    out["sequence_ids"] = torch.cat(owner).to(device).view(len(rows), width)
    out["num_sequences"] = shape[0]
    return out


def uses_one_row(model: nn.Module) -> bool:
    """Whether ``model``'s attention has variable-length kernels (flash attention, flex attention's block masks):
    their cost is the sum of each sequence's own, so one row is best. Dense masked attention (sdpa, eager) computes
    every pair of a row, so it gets rows as wide as the longest sequence instead (see :func:`remove_padding`)."""
    config = getattr(get_base_model(model), "config", None)
    implementation = str(getattr(config, "_attn_implementation", None) or "")
    return "flash" in implementation or "flex" in implementation


def padding_free_problem(model: nn.Module, objective: Objective) -> str | None:
    """Why padding-free micro-batches do not apply to ``model``, judged without running it; None if they may."""
    base = get_base_model(model)
    config = getattr(base, "config", None)
    if not isinstance(objective, CausalLMObjective):
        return f"the objective is {objective.name!r}; padding-free applies to causal LMs"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(base).__name__} is an encoder-decoder"
    if getattr(objective, "num_virtual_tokens", 0):
        return (
            "PEFT prompt tuning puts its virtual tokens in front of every row, so rows cannot hold several sequences"
        )
    return position_ids_problem(base)


@torch.no_grad()
def check_padding_free(
    model: nn.Module,
    batch: Mapping[str, Any],
    one_row: bool | None = None,
    tolerance: float | None = None,
    max_tokens: int = 64,
) -> str | None:
    """Run a few sequences padded and padding-free; None if every real position's logits match, else why not.

    The sequences are the first real tokens of ``batch``, cut to three of different lengths (at most
    ``max_tokens`` in all) and padded on the side ``batch`` is padded, then laid out as training will
    (``one_row``, by default from :func:`uses_one_row`): the same small forward on every rank whatever its data, so
    sharded models (FSDP, DeepSpeed) run it in step. A leak between packed sequences or a
    model that reads positions differently without padding shows as a mismatch. The comparison is relative to the
    largest logit; the tolerance is 1e-4 for fp32 weights, 3e-2 for half precision.
    """
    problem = position_ids_problem(get_base_model(model))
    if problem:
        return problem
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    tokens = ids[mask.bool()] if torch.is_tensor(mask) and mask.shape == ids.shape else ids.flatten()
    lengths = [max(1, max_tokens // 6), max(1, max_tokens // 3), max(1, max_tokens // 2)]
    tokens = tokens.repeat(-(-sum(lengths) // max(tokens.numel(), 1)))[: sum(lengths)]
    left = torch.is_tensor(mask) and mask.dim() == 2 and bool((mask[:, 0] == 0).any() & (mask[:, -1] == 1).all())
    width = max(lengths)
    padded_ids = torch.zeros(len(lengths), width, dtype=ids.dtype, device=ids.device)
    padded_mask = torch.zeros(len(lengths), width, dtype=torch.long, device=ids.device)
    offset = 0
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        padded_ids[row, cols] = tokens[offset : offset + n]
        padded_mask[row, cols] = 1
        offset += n
    padded = {"input_ids": padded_ids, "attention_mask": padded_mask}
    row = remove_padding(padded, uses_one_row(model) if one_row is None else one_row)
    if tolerance is None:
        dtype = next(model.parameters()).dtype
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    was_training = model.training
    model.eval()
    try:
        reference = get_logits(model(**padded, use_cache=False)).float()[padded_mask.bool()]
        laid = {k: v for k, v in row.items() if k not in ("sequence_ids", "num_sequences")}
        laid = with_packed_positions(model, laid)  # hfacc.multimodal: mrope models see the sequences too
        logits = get_logits(model(**laid, use_cache=False)).float()
        # Back to the padded order: the real positions of original row b are those with sequence_ids == b.
        owner = row["sequence_ids"].flatten()
        order = torch.cat([(owner == b).nonzero().flatten() for b in range(len(lengths))])
        unpadded = logits.flatten(0, 1)[order]
    except Exception as err:  # a model whose forward does something unexpected with position_ids
        return f"the padding-free forward failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    if unpadded.shape != reference.shape:
        return f"the padding-free forward returned logits of shape {tuple(unpadded.shape)}"
    worst = ((unpadded - reference).abs().max() / reference.abs().max().clamp(min=1e-6)).item()
    if not worst <= tolerance:
        return (
            f"its logits without padding differ from the padded ones by {worst:.1e} relative (packed sequences are "
            "not kept apart, or positions are read differently)"
        )
    return None


def choose_padding_free(
    objective: Objective, model: nn.Module, batch: Mapping[str, Any], accelerator
) -> tuple[bool, bool]:
    """``(padding_free, one_row)``: whether micro-batches go padding-free for this model, decided once, the same on
    every rank, and said in the log; ``one_row`` for variable-length attention kernels, else packed rows."""
    padding_free, one_row = False, True
    problem = padding_free_problem(model, objective)
    if problem is None:
        one_row = uses_one_row(model)
        problem = check_padding_free(model, batch, one_row)
        if problem is None and takes_images(model):
            problem = _image_problem(model, batch, one_row)  # a vision-language model: with real images
        padding_free = all_ranks_agree(problem is None, accelerator)
    if padding_free:
        logger.info(
            "hfacc: padding-free micro-batches (%s): checked, logits match the padded run.",
            "one row" if one_row else "packed in rows as wide as the longest sequence",
        )
    elif isinstance(objective, CausalLMObjective):
        logger.warning(
            "hfacc: padded micro-batches, as collated: %s. Set padding_free=False to skip the check.",
            problem or "another rank could not go padding-free",
        )
    else:
        logger.info("hfacc: padded micro-batches: %s.", problem)
    return padding_free, one_row


def _image_problem(model: nn.Module, batch: Mapping[str, Any], one_row: bool) -> str | None:
    """Why a vision-language model's micro-batches with images stay padded (the first one's images run both ways),
    or None. Without images in the first micro-batch there is nothing to check them with: padded."""
    if not get_image_inputs(batch):
        return "the first micro-batch has no images to check the padding-free layout of images with"
    return check_image_layout(model, batch, remove_padding(batch, one_row))
