"""Next-token prediction (SFT): a target is a label != -100 after the causal shift."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.multimodal import get_image_inputs, with_packed_positions
from ..ops.fused_loss import FusedOutputHead, fused_loss_problem, swap_output_head
from ..ops.loss import IGNORE_INDEX, cross_entropy_sums, get_sequence_ids, per_sequence_sums, shift_labels
from ..ops.model_io import get_base_model, get_logits, model_inputs, packed_position_ids
from ..ops.precision import get_compute_dtype
from .base import Objective


class CausalLMObjective(Objective):
    """Next-token prediction: ``logits[:, i]`` is scored against ``labels[:, i + 1]`` (labels != -100).

    Targets follow :func:`hfacc.ops.loss.shift_labels`, the one definition: the shift never crosses a sequence boundary
    (``position_ids`` that restart) and padding is never a target. A batch may carry ``shift_labels`` (already
    aligned, e.g. from a padding-free collator); they are used as is, except at padding positions.
    Packed rows (``position_ids`` that restart, no ``attention_mask``) run with ``use_cache=False``: with a cache,
    transformers does not keep packed sequences apart. Their per-sequence sums (``normalization="sequence"``) are
    per packed sequence, not per row.

    With ``fused=True`` the output projection's forward is swapped, for the length of one forward, for one that
    computes the loss sums from the final hidden states in chunks (:mod:`hfacc.ops.fused_loss`), so the full
    ``[B, T, V]`` logits never exist; the model's output then holds the loss sum where its logits would be. The head
    module itself is still called inside the model's own forward, so DDP sees every parameter it expects and
    FSDP2/ZeRO-3 gather its weight as usual. :func:`hfacc.setup.loss_path.choose_loss_path` decides whether a model can
    be taken apart like this.
    """

    name = "causal_lm"
    supports_padding_free = True
    supports_fused = True

    def __init__(
        self, label_smoothing: float = 0.0, fused: bool = False, chunk_size: int = 0, num_virtual_tokens: int = 0
    ):
        super().__init__(label_smoothing)
        self.fused, self.chunk_size = fused, chunk_size
        self.fused_in_eval = True  # False when evaluation needs the logits (predictions, compute_metrics)
        # PEFT prompt tuning puts this many virtual tokens before the inputs, so the logits have as many more
        # positions (see get_num_virtual_tokens).
        self.num_virtual_tokens = num_virtual_tokens

    def count(self, batch):
        targets = self._targets(batch) != IGNORE_INDEX
        sequences = get_batch_sequences(batch, targets.shape)
        if sequences is None:
            return torch.stack([targets.sum(), targets.any(-1).sum()])
        ids, n = sequences  # rows holding several sequences: count sequences, not rows
        hit = torch.zeros(n, dtype=torch.long, device=targets.device).index_fill_(0, ids[targets], 1)
        return torch.stack([targets.sum(), hit.sum()])

    def select_examples(self, batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
        """Rows ``start..stop`` of ``batch``; with images, the whole batch with the other rows' targets removed.

        Image entries are per image (Qwen2-VL's ``pixel_values`` per patch, ``image_grid_thw`` per image), not per
        row: cutting the rows would leave the model images whose placeholder tokens are gone (on 2 ranks with an odd
        number of examples, accelerate's repeat cut from the last batch stopped training with a size mismatch). So
        the rows stay, and those outside ``start..stop`` count and train nothing.
        """
        if not get_image_inputs(batch):
            return super().select_examples(batch, start, stop)
        out = dict(batch)
        for key in ("labels", "shift_labels"):
            if torch.is_tensor(batch.get(key)):
                out[key] = batch[key].clone()
                out[key][:start] = IGNORE_INDEX
                out[key][stop:] = IGNORE_INDEX
        return out

    def __call__(self, model, batch, per_sequence=False):
        inputs = model_inputs(batch)
        if packed_position_ids(inputs) is not None:
            inputs["use_cache"] = False
            inputs = with_packed_positions(
                model, inputs
            )  # hfacc.data.multimodal: mrope positions per sequence (Qwen2-VL)
        targets = self._targets(batch)
        sequences = get_batch_sequences(batch, targets.shape) if per_sequence else None
        if self.fused and (model.training or self.fused_in_eval) and not (per_sequence and torch.is_grad_enabled()):
            return self._fused(model, inputs, targets, per_sequence, sequences)
        outputs = model(**inputs)
        sums = cross_entropy_sums(
            get_logits(outputs),
            targets,
            label_smoothing=self.label_smoothing,
            per_sequence=per_sequence,
            sequences=sequences,
        )
        return outputs, sums

    def check_fused(self, model, batch, normalization: str = "token") -> str | None:
        """Why the fused loss would not give this model's loss (None: it does); see :func:`check_fused_loss`."""
        if normalization == "sequence":
            return "normalization='sequence' weighs targets unequally"
        return check_fused_loss(self, model, batch)

    def _fused(self, model, inputs, targets, per_sequence, sequences=None):
        head = FusedOutputHead(
            get_base_model(model).get_output_embeddings(), targets, self.chunk_size, self.label_smoothing
        )
        with swap_output_head(model, head):
            outputs = model(**inputs)
        sums, per_target, correct = head.result
        if per_sequence:  # evaluation: per-sequence sums for the exact cross-rank eval metrics, no gradient needed
            return outputs, per_sequence_sums(per_target, correct, targets != IGNORE_INDEX, sequences)
        returned = get_logits(outputs)
        if returned.requires_grad and returned.dim() == 0:
            # Backpropagate from what the model returned, not from the kernel's own output: FSDP2 and ZeRO-3 hook
            # their backward (re-gather the weight, reduce-scatter its gradient) on the head's output as the model
            # passed it on. `check_fused_loss` made sure the model returns that value unchanged.
            sums = sums._replace(loss=returned)
        return outputs, sums

    def _targets(self, batch):
        n = self.num_virtual_tokens
        mask = batch.get("attention_mask")
        if n and torch.is_tensor(mask):
            mask = F.pad(mask, (n, 0), value=1)  # PEFT's forward attends to the virtual tokens: so does the shift
        if batch.get("shift_labels") is not None:
            targets = F.pad(batch["shift_labels"], (n, 0), value=IGNORE_INDEX) if n else batch["shift_labels"]
            if torch.is_tensor(mask) and mask.shape == targets.shape:
                targets = targets.masked_fill(mask == 0, IGNORE_INDEX)  # padding predicts nothing
            return targets
        labels, positions = batch["labels"], batch.get("position_ids")
        if n:
            # As PEFT's own loss: the virtual positions get label -100 before the shift, so the last virtual token
            # predicts the first real one (a target when its label is not -100) and the others predict nothing.
            # Prompt tuning never takes padding-free or packed rows (padding_free_problem), so no position_ids.
            labels, positions = F.pad(labels, (n, 0), value=IGNORE_INDEX), None
        return shift_labels(labels, position_ids=positions, attention_mask=mask)


def get_batch_sequences(batch: Mapping[str, Any], shape: torch.Size) -> tuple[torch.Tensor, int] | None:
    """``(ids, n)``: which of the batch's n sequences each position belongs to, where rows hold several; None when
    every row is one sequence. From hfacc's ``sequence_ids`` when a layout set them (padding-free: the original
    rows), else from the restarts of packed rows' ``position_ids`` (:func:`hfacc.ops.loss.get_sequence_ids`)."""
    if batch.get("sequence_ids") is not None:
        return batch["sequence_ids"], batch["num_sequences"]
    positions = packed_position_ids(batch)
    return None if positions is None else get_sequence_ids(positions.expand(shape))


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
    # The precision the two runs computed in (hfacc.setup.layout_check runs this check in fp32 for fp32 weights).
    tolerance = 1e-5 if get_compute_dtype(model) == torch.float32 else 2e-2
    difference = (a.loss - b.loss).abs().item() / max(b.loss.abs().item(), 1e-12)
    if a.count != b.count or not difference <= tolerance:
        return f"the fused loss differs from the model's own logits by {difference:.1e} (it post-processes its logits)"
    return None


__all__ = ["CausalLMObjective", "get_batch_sequences", "check_fused_loss"]
