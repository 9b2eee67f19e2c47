"""Padding-free micro-batches: the real tokens of a padded batch as rows of packed sequences, same update.

A padded ``[B, T]`` micro-batch spends every layer's compute on its padding (43 % of the positions on the benchmark
in benchmarks/README.md). :func:`remove_padding` lays the same sequences end to end in rows, with ``position_ids``
that restart at 0 for each sequence. transformers (5.x) keeps such sequences apart by itself when it gets
``position_ids``, no ``attention_mask`` and no cache (``masking_utils.find_packed_sequence_indices``): sdpa, eager
and flex attention build a block-diagonal causal mask, flash attention uses its variable-length kernels
(``cu_seq_lens`` from the restarts, for one row). The targets are the same (:func:`hfacc.ops.loss.shift_labels`: the
shift never crosses a sequence boundary, padding is never a target), so the loss sums, the counts and the gradient
are those of the padded batch, to fp32 rounding. Nothing about the update changes: not the sequences of a
micro-batch, not the targets, not the normalization.

This is the layout of every micro-batch, applied in training. Whether a model may take it, and which of the two
layouts (one row, or packed rows), is decided once per model by :mod:`hfacc.setup.layout_check`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

from ..ops.loss import IGNORE_INDEX
from ..ops.model_io import get_input_embeddings
from .batching import best_fit_decreasing
from .multimodal import IMAGE_INPUT_KEYS, get_image_inputs, get_ordered_rows


def remove_padding(
    batch: Mapping[str, Any], one_row: bool = True, max_row_length: int = 0, keep: Collection[str] = ()
) -> dict[str, Any] | None:
    """The real tokens of a padded batch laid end to end; None when the batch cannot be laid out so.

    ``attention_mask`` ``[B, T]`` (right or left padding) says which positions are real. With ``one_row`` every
    ``[B, T, ...]`` tensor of the batch (``input_ids``, ``labels``, ``token_type_ids``, ``inputs_embeds``, ...)
    keeps its real positions, in order, as ``[1, N, ...]``: the layout of variable-length attention kernels (flash,
    flex), whose cost grows with the sum of the squared sequence lengths. Otherwise the sequences are packed
    best-fit decreasing into rows as wide as the longest one: attention that masks a dense ``[rows, W, W]`` block
    (sdpa, eager) then computes less than on one ``[N, N]`` row, and the little room left at the end of a row is
    filled by one more sequence of its own (position 0, 1, ..., no target), which nothing else attends to. The filler
    repeats the batch's first token (a real one, and text: never an image placeholder), never padding: a pad
    token's embedding may be zero (``padding_idx``), which some models cannot backpropagate through (Gemma3n: NaN),
    and a pad id at the end of a row without ``attention_mask`` makes transformers warn that the input "may be
    padded".

    ``max_row_length`` (0: none) is the longest row :func:`check_row_offsets` verified: no sequence is laid past it,
    except a row's first sequence, which starts at 0 as it does padded. Packed rows then hold at most that many
    tokens (a longer sequence gets a row of its own); one row is refused (None) when it would be longer.

    The mask is dropped and ``position_ids`` restart at 0 for each sequence. The labels stay unshifted:
    :func:`hfacc.ops.loss.shift_labels` finds the sequence boundaries from the restarts and gives the same targets as
    on the padded batch. ``sequence_ids`` (the original row of each position, -1 in the filler) and ``num_sequences``
    (B) keep per-sequence sums per original row, in order; ``padded_index`` is the flat index in the padded batch
    of the token each position holds (the filler's: the token it repeats).

    None (keep the padded batch) when there is no 2-D ``attention_mask``, a row's real tokens are not one run
    (holes in the mask) or a row is empty, the batch has its own ``position_ids`` that do not count from each
    sequence's first token (left padding with absolute positions, 3-D rotary positions), or a tensor is not laid out
    per token (per-example values) — except the per-row entries named in ``keep`` (an objective's
    ``row_keys``: advantages, reference log-probs), which are kept as they are, still indexed by original row
    (``sequence_ids``). Image inputs (:data:`hfacc.data.multimodal.IMAGE_INPUT_KEYS`) are kept as they are too: the
    model gives image i's features to the i-th image in token order, so the rows keep the sequences in order.

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
        if max_row_length and len(lengths) > 1 and sum(lengths) > max_row_length:
            return None
        rows, width = [list(range(shape[0]))], sum(lengths)
    else:
        width = max(lengths)
        capacity = min(width, max_row_length) if max_row_length else width
        # With images, in order (hfacc.data.multimodal): image features are matched to image tokens by their order.
        rows = (
            get_ordered_rows(lengths, capacity) if get_image_inputs(batch) else best_fit_decreasing(lengths, capacity)
        )
    filler_source = first[0]  # the flat index of the token the filler repeats: the batch's first (a text token)
    # For every output position: the flat index of its token in the padded batch, its position in its sequence, and
    # its original row (-1: filler).
    index, positions, owner = [], [], []
    for members in rows:
        used = 0
        for b in members:
            n = lengths[b]
            index.append(torch.arange(b * shape[1] + first[b], b * shape[1] + first[b] + n))
            positions.append(torch.arange(n))
            owner.append(torch.full((n,), b))
            used += n
        index.append(torch.full((width - used,), filler_source))
        positions.append(torch.arange(width - used))
        owner.append(torch.full((width - used,), -1))
    device = mask.device
    index = torch.cat(index).to(device)
    owner = torch.cat(owner).to(device)
    filler = owner < 0
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids") or value is None:
            continue
        if not torch.is_tensor(value) or key in keep or key in IMAGE_INPUT_KEYS:
            # flags such as return_loss; per-row values the objective reads by sequence_ids; images, in the order
            # of their tokens
            out[key] = value
        elif value.dim() >= 2 and tuple(value.shape[:2]) == shape:
            laid = value.flatten(0, 1).index_select(0, index)
            if key in ("labels", "shift_labels"):
                laid[filler] = IGNORE_INDEX
            out[key] = laid.view(len(rows), width, *value.shape[2:])
        else:
            return None
    out["position_ids"] = torch.cat(positions).to(device).view(len(rows), width)
    out["sequence_ids"] = owner.view(len(rows), width)
    out["num_sequences"] = shape[0]
    out["padded_index"] = index.view(len(rows), width)
    return out


@contextlib.contextmanager
def padded_neftune_noise(model: nn.Module, padded: Mapping[str, Any], laid: Mapping[str, Any]):
    """Within the block, NEFTune's noise on ``laid`` (a :func:`remove_padding` layout) is the one stock Trainer draws
    for ``padded``: same magnitude, same random numbers, at the same tokens.

    Stock NEFTune (``transformers.integrations.neftune``, a forward hook on the input embeddings) scales its uniform
    noise by ``alpha / sqrt(length * hidden)`` of the tensor it sees: a re-laid batch (one row of N tokens, rows of
    W) would get another magnitude than the padded ``[B, T]`` one (1.8x with ``pad_to_multiple_of``). Two hooks of
    hfacc's, around stock's own, put the embeddings back in the padded shape for stock's hook and lay its result out
    again, so the noise is drawn for ``[B, T, hidden]`` from the same random stream as stock's.
    """
    index = laid.get("padded_index")
    embeddings = None if index is None else get_input_embeddings(model)
    if embeddings is None or getattr(embeddings, "neftune_noise_alpha", None) is None:
        yield
        return
    shape = tuple(padded["attention_mask"].shape)
    real = laid["sequence_ids"] >= 0

    def to_padded(module, args, output):  # before stock's hook: the real tokens' embeddings where they were padded
        if tuple(output.shape[:2]) != tuple(index.shape):
            return None
        flat = output.new_zeros(shape[0] * shape[1], *output.shape[2:])
        return flat.index_put((index[real],), output[real]).view(*shape, *output.shape[2:])

    def to_layout(module, args, output):  # after it: back to the layout, noise included
        if tuple(output.shape[:2]) != shape:
            return None
        return output.flatten(0, 1)[index.flatten()].view(*index.shape, *output.shape[2:])

    handles = [embeddings.register_forward_hook(to_padded, prepend=True), embeddings.register_forward_hook(to_layout)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
