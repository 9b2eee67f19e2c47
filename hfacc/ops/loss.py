"""Loss math as pure functions: per micro-batch *sums* and *counts*, and the window normalization.

Exact gradient accumulation rests on one identity. For a window of micro-batches j = 1..k (on every rank) with
n_j targets each, the big-batch loss is

    L = (1 / N) * sum_j S_j,        S_j = sum of the per-target losses of micro-batch j,   N = sum_j n_j

so its gradient is g = sum_j (n_j / N) * g_j, where g_j is the gradient of micro-batch j's own mean. Backpropagating
``S_j / N`` per micro-batch therefore accumulates exactly g. "Divide each micro-batch mean by k" equals it only when
every n_j is the same.

The functions here never divide by anything but the window's count: they return sums, and
:func:`normalize_window_loss` turns a micro-batch's sums into its share of the window's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

NORMALIZATIONS = ("token", "sequence", "micro_batch")


class LossSums(NamedTuple):
    """Sums over the targets of one micro-batch.

    Args:
        loss: sum of the per-target losses, differentiable. A scalar, or one value per sequence (shape ``[B]``) when
            computed with ``per_sequence=True``.
        count: number of targets, same shape as ``loss`` (int64).
        correct: number of targets predicted correctly (argmax, or sign for binary labels), same shape (int64).
            Always zero for regression.
    """

    loss: torch.Tensor
    count: torch.Tensor
    correct: torch.Tensor

    def total(self) -> LossSums:
        """Collapse per-sequence sums to scalars."""
        return LossSums(self.loss.sum(), self.count.sum(), self.correct.sum())


class WindowCounts(NamedTuple):
    """What one accumulation window holds, summed over all data-parallel ranks.

    Args:
        num_targets: targets (tokens, labels, pairs, ...: the objective's primary unit) of the window: N in
            ``L = sum_j S_j / N``.
        num_sequences: sequences with at least one target (the denominator of ``normalization="sequence"``).
        num_micro_batches: micro-batches of the window on *one* rank (k; the last window of an epoch may be short).
        units: every count the objective declares (``Objective.units``), in its order, summed likewise; the first
            two are ``num_targets`` and ``num_sequences``. Objectives of several terms divide each by its own.
    """

    num_targets: int
    num_sequences: int
    num_micro_batches: int
    units: tuple[int, ...] = ()


def get_sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a new sequence starts in rows that may hold several (packed) sequences: ``[..., T]`` booleans.

    A row's first position starts a sequence, and so does every position whose ``position_id`` is not the previous
    one plus 1: the rule transformers uses to keep packed sequences apart in attention
    (``masking_utils.find_packed_sequence_indices``), so hfacc's targets and the model's attention agree on where
    each sequence begins.

    >>> get_sequence_starts(torch.tensor([[0, 1, 2, 0, 1]]))
    tensor([[ True, False, False,  True, False]])
    """
    starts = torch.ones(position_ids.shape, dtype=torch.bool, device=position_ids.device)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


def get_sequence_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(ids, n)``: the index of the sequence each position belongs to, counted over the whole ``[B, T]`` batch,
    and the number n of sequences (:func:`get_sequence_starts` says where each begins).

    >>> get_sequence_ids(torch.tensor([[0, 1, 0], [0, 1, 2]]))
    (tensor([[0, 0, 1],
            [2, 2, 2]]), 3)
    """
    starts = get_sequence_starts(position_ids)
    ids = starts.flatten().cumsum(0).view(starts.shape) - 1
    return ids, int(starts.sum())


def shift_labels(
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Align causal-LM labels with the positions that predict them: the one definition of a *target*.

    ``out[..., i] = labels[..., i + 1]``: position i predicts token i + 1, so the first token of a sequence is never a
    target and the last position predicts nothing. The shift never crosses a sequence boundary: where position i + 1
    starts a new sequence (``position_ids`` restart, see :func:`get_sequence_starts`: rows packed with several
    sequences), ``out[..., i] = ignore_index``, since in the unpacked sequence nothing predicts its first token. And
    padding (``attention_mask == 0``, 2-D) is never a target nor a predictor: the last real token does not learn to
    predict the padding after it, and a left-padded sequence's first token is not predicted from the padding before it.
    So a target is a label != ``ignore_index`` after this shift, however the sequences were laid out (padded right
    or left, packed, or concatenated into one row): the same sequences always give the same targets. Multimodal
    rotary positions of packed rows (``[4, B, T]``, Qwen2-VL family) say where sequences start with their first
    channel, the text one. Shifting the labels instead of the logits keeps the logits a view (no copy of a
    ``[B, T, V]`` tensor).

    >>> shift_labels(torch.tensor([[-100, -100, 7, 8]]))
    tensor([[-100,    7,    8, -100]])
    >>> shift_labels(torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))  # two sequences
    tensor([[   6,    7, -100,    9, -100]])
    """
    out = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    no_target = None
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        # Multimodal rotary positions of packed rows, [4, B, T] (Qwen2-VL family, hfacc.data.multimodal): the first
        # channel is the text position, from which transformers keeps the sequences apart. (With 3 channels it
        # finds no sequences in a row, and neither does the shift.)
        position_ids = position_ids[0]
    if position_ids is not None and position_ids.dim() <= 2 and position_ids.shape[-1] == labels.shape[-1]:
        starts = get_sequence_starts(position_ids.expand(labels.shape))
        no_target = F.pad(starts[..., 1:], (0, 1), value=True)  # the next position begins another sequence
    if attention_mask is not None and attention_mask.shape == labels.shape:
        real = attention_mask.bool()
        padding_involved = ~(real & F.pad(real[..., 1:], (0, 1), value=False))
        no_target = padding_involved if no_target is None else no_target | padding_involved
    return out if no_target is None else out.masked_fill(no_target, ignore_index)


def count_targets(
    labels: torch.Tensor,
    *,
    shift: bool,
    ignore_index: int = IGNORE_INDEX,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Number of targets in ``labels``: entries ``!= ignore_index``, after :func:`shift_labels` when ``shift``.

    >>> count_targets(torch.tensor([[5, -100, 7, 8]]), shift=True)  # 5 is never a target: nothing predicts it
    tensor(2)
    """
    if shift:
        labels = shift_labels(labels, ignore_index, position_ids=position_ids, attention_mask=attention_mask)
    return (labels != ignore_index).sum()


def count_example_targets(labels: Sequence[int], ignore_index: int = IGNORE_INDEX) -> int:
    """Targets of one unpadded sequence given as a list of labels: :func:`count_targets` with ``shift=True``.

    The first label is never a target (nothing predicts it); the others are when not ``ignore_index``. A plain loop,
    no tensor, for counting example by example while a dataset is tokenized.

    >>> count_example_targets([5, -100, 7, 8])
    2
    """
    return sum(1 for y in labels[1:] if y != ignore_index)


def cross_entropy_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    per_sequence: bool = False,
    sequences: tuple[torch.Tensor, int] | None = None,
) -> LossSums:
    """Summed cross-entropy over the targets of aligned ``logits`` ``[..., C]`` and ``labels`` ``[...]``.

    ``loss = sum_{t : y_t != ignore_index} CE(logits_t, y_t)`` with, for label smoothing eps over C classes,
    ``CE = (1 - eps) * (-log p_y) + (eps / C) * sum_c (-log p_c)`` (the definition of ``torch.nn.CrossEntropyLoss``
    and of transformers' ``LabelSmoother``). Only target rows are gathered and upcast to fp32, so prompt and padding
    positions cost nothing. With ``per_sequence`` the sums are kept per leading index (``[B]``), or per sequence
    when ``sequences`` gives each position's sequence and their number (:func:`get_sequence_ids`, packed rows).

    >>> sums = cross_entropy_sums(torch.zeros(1, 3, 4), torch.tensor([[1, -100, 2]]))
    >>> round(sums.loss.item(), 4), sums.count.item()  # two targets, each -log(1/4)
    (2.7726, 2)
    """
    mask = labels != ignore_index
    target_logits = logits[mask].float()
    targets = labels[mask]
    ce = F.cross_entropy(target_logits, targets, reduction="none", label_smoothing=label_smoothing)
    correct = (target_logits.detach().argmax(dim=-1) == targets).long()
    if not per_sequence:
        return LossSums(ce.sum(), mask.sum(), correct.sum())
    return per_sequence_sums(ce, correct, mask, sequences)


def causal_lm_sums(logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> LossSums:
    """:func:`cross_entropy_sums` of a causal LM: ``logits[:, i]`` is scored against ``labels[:, i + 1]``."""
    return cross_entropy_sums(logits, shift_labels(labels, kwargs.get("ignore_index", IGNORE_INDEX)), **kwargs)


def binary_cross_entropy_sums(logits: torch.Tensor, labels: torch.Tensor, *, per_sequence: bool = False) -> LossSums:
    """Summed binary cross-entropy with logits over every element of ``labels`` ``[B, C]`` (multi-label heads).

    Each (example, label) pair is one target, as in ``BCEWithLogitsLoss(reduction="mean")``, whose mean is
    ``loss / count``. A target is correct when ``logit > 0`` agrees with ``label > 0.5``.
    """
    labels = labels.to(logits.dtype)
    bce = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    correct = ((logits.detach() > 0) == (labels > 0.5)).long()
    return _elementwise_sums(bce, correct, per_sequence)


def squared_error_sums(predictions: torch.Tensor, labels: torch.Tensor, *, per_sequence: bool = False) -> LossSums:
    """Summed squared error over every element of ``labels`` (regression heads).

    ``MSELoss(reduction="mean")`` of transformers' heads is ``loss / count``. ``correct`` is always 0.
    """
    predictions = predictions.float().reshape(labels.shape)
    se = (predictions - labels.float()) ** 2
    return _elementwise_sums(se, torch.zeros_like(se, dtype=torch.long), per_sequence)


def normalize_window_loss(
    sums: LossSums,
    window: WindowCounts,
    *,
    normalization: str = "token",
    world_size: int = 1,
) -> torch.Tensor:
    """One micro-batch's share of the window loss, ready for ``backward()``.

    - ``"token"``: ``S_j / N * P``. Summed over the window and averaged over P data-parallel ranks (what DDP, FSDP
      and DeepSpeed do to gradients), this is ``sum of all target losses / N``: the big-batch mean.
    - ``"sequence"``: ``sum_b (S_jb / n_jb) / B_window * P`` over sequences b with ``n_jb > 0``: every sequence
      weighs the same, whatever its length; ``sums`` must be per sequence.
    - ``"micro_batch"``: ``(S_j / n_j) / k`` (the legacy mean of micro-batch means; a micro-batch with no target
      contributes 0). The ranks' average makes it the mean over all P * k micro-batches, so no factor P.

    A window with no target gives a zero loss (and a zero gradient) instead of 0 / 0.
    """
    if normalization == "token":
        return sums.loss.sum() * (world_size / max(window.num_targets, 1))
    if normalization == "sequence":
        if sums.loss.dim() != 1:
            raise ValueError("normalization='sequence' needs per-sequence sums (compute them with per_sequence=True)")
        per_sequence_mean = sums.loss / sums.count.clamp(min=1)
        return per_sequence_mean.sum() * (world_size / max(window.num_sequences, 1))
    if normalization == "micro_batch":
        return sums.loss.sum() / sums.count.sum().clamp(min=1) / max(window.num_micro_batches, 1)
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def per_sequence_sums(
    values: torch.Tensor,
    correct: torch.Tensor,
    mask: torch.Tensor,
    sequences: tuple[torch.Tensor, int] | None = None,
) -> LossSums:
    """Per-sequence :class:`LossSums` from per-target ``values``/``correct`` of the True positions of ``mask``.

    A sequence is a row of ``mask`` ``[B, ...]``, or, with ``sequences = (ids, n)`` (:func:`get_sequence_ids`), each
    of the n sequences of rows that hold several: ``normalization="sequence"`` weighs sequences, not rows.
    """
    if sequences is None:
        return _per_row(values, correct.long(), _row_index(mask), mask.shape[0])
    ids, n = sequences
    return _per_row(values, correct.long(), ids.expand(mask.shape)[mask], n)


def sums_per_row(sums: LossSums | torch.Tensor, position_ids: torch.Tensor) -> LossSums | torch.Tensor:
    """Per-sequence sums of packed rows ``[B, T]`` (see :func:`get_sequence_ids`) added up per row: ``[B]``.

    ``sums`` is a :class:`LossSums` of ``[n]`` vectors, or one ``[n, ...]`` tensor (an objective's metric sums).
    """
    per_row = get_sequence_starts(position_ids).sum(-1)
    rows = torch.repeat_interleave(torch.arange(len(per_row), device=per_row.device), per_row)
    if torch.is_tensor(sums):
        return sums.new_zeros(len(per_row), *sums.shape[1:]).index_add(0, rows, sums)
    return LossSums(*(x.new_zeros(len(per_row)).index_add(0, rows, x) for x in sums))


def _row_index(mask: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(mask.shape[0], device=mask.device)
    return rows.view(-1, *([1] * (mask.dim() - 1))).expand_as(mask)[mask]


def _per_row(values: torch.Tensor, correct: torch.Tensor, rows: torch.Tensor, num_rows: int) -> LossSums:
    loss = values.new_zeros(num_rows).index_add(0, rows, values)
    count = torch.bincount(rows, minlength=num_rows)
    hits = correct.new_zeros(num_rows).index_add(0, rows, correct)
    return LossSums(loss, count, hits)


def _elementwise_sums(values: torch.Tensor, correct: torch.Tensor, per_sequence: bool) -> LossSums:
    if not per_sequence:
        return LossSums(values.sum(), torch.tensor(values.numel(), device=values.device), correct.sum())
    flat = values.reshape(values.shape[0], -1)
    count = torch.full((flat.shape[0],), flat.shape[1], device=values.device, dtype=torch.long)
    return LossSums(flat.sum(-1), count, correct.reshape(flat.shape).sum(-1))
