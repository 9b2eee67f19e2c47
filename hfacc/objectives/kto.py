"""KTO (Kahneman-Tversky optimization): the unpaired example is the unit, and the reference point is the step's.

KTO (Ethayarajh et al., 2024) trains on unpaired rows: a prompt, a completion and whether it is desirable
(:func:`hfacc.build_preference_dataset` on TRL's ``prompt`` / ``completion`` / ``label`` rows, or on pairs, which are
unpaired). Each row's implicit reward is its log-ratio ``r = log pi(y|x) - log pi_ref(y|x)`` (summed over the
completion's tokens), and the loss compares it with a *reference point*

    z0 = max(0, mean over the step's rows of [log pi(y'|x) - log pi_ref(y'|x)])

estimated from mismatched pairs: each row's prompt x with another row's completion y' (its KL row, paired once in
the dataset), without gradient. The window's loss, over its N rows on all ranks, is

    L = (1 / N) * [ sum_desirable w_D * (1 - sigmoid(beta * (r - z0))) + sum_undesirable w_U * (1 - sigmoid(beta * (z0 - r))) ]

z0 enters non-linearly, so it must be the step's: :meth:`KTOObjective.window_statistics` computes it over every
micro-batch of the window and every rank before the first backward (the window carries it to each micro-batch), and
:meth:`KTOObjective.loss` divides each micro-batch's sum by the window's N. TRL's ``KTOTrainer`` estimates z0 per
micro-batch (a mean over its ranks) and takes each micro-batch's mean: k micro-batches are then not one big batch,
even when they are as large (notebooks/09). A batch that carries no window's z0 (evaluation) is its own window.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..data.preference import KTO_REFERENCE_COLUMNS, REFERENCE_FIX, check_row_values
from ..models.reference import ReferenceModel
from ..ops.logprobs import check_fused_logprobs, get_token_logprobs
from ..ops.loss import WindowCounts
from .base import Objective, SetupContext, forward_inputs, get_targets
from .causal_lm import get_batch_sequences
from .preference import build_objective_reference, get_reference_logps

REFERENCE_POINT = "kto_reference_point"  # the window's z0, carried in each micro-batch (a float)
KL_KEYS = ("kl_input_ids", "kl_attention_mask", "kl_labels")


def kto_losses(
    logratios: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: float | torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """KTO's loss per row (Ethayarajh et al., 2024, eq. 7; TRL's ``KTOTrainer``), r the row's log-ratio
    ``log pi(y|x) - log pi_ref(y|x)`` and z0 the reference point:

    ``w_D * (1 - sigmoid(beta * (r - z0)))`` for a desirable row, ``w_U * (1 - sigmoid(beta * (z0 - r)))`` for an
    undesirable one.

    >>> kto_losses(torch.tensor([0.0, 0.0]), torch.tensor([True, False]), 0.0).tolist()  # r = z0: both 1/2
    [0.5, 0.5]
    """
    desirable = desirable.bool()
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratios - reference_point)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (reference_point - logratios)))
    return torch.where(desirable, good, bad)


def get_reference_point(kl_logratio_sum: float, rows: int) -> float:
    """``z0 = max(0, sum / rows)``: the mean KL log-ratio of the step's mismatched rows, clamped at 0 (0 for none).

    >>> get_reference_point(3.0, 4), get_reference_point(-2.0, 4)
    (0.75, 0.0)
    """
    return max(0.0, kl_logratio_sum / rows) if rows else 0.0


class KTOSums(NamedTuple):
    """Per row ``[B]``: the loss (differentiable), 1 per row (0 for repeated examples), 1 where desirable, the
    policy's log-prob of the completion, its reward ``beta * r`` and the reference point it was compared with (all
    detached)."""

    loss: torch.Tensor
    examples: torch.Tensor
    desirable: torch.Tensor
    logps: torch.Tensor
    rewards: torch.Tensor
    reference_point: torch.Tensor


class KTOObjective(Objective):
    """KTO on unpaired rows, exact per row with the step's reference point, under any split of the window.

    Args:
        beta: the temperature of the implicit reward ``beta * r``.
        desirable_weight, undesirable_weight: the weights w_D and w_U of the two kinds of rows (TRL's names; KTO's
            paper advises ``w_D * n_D / (w_U * n_U)`` in [1, 4/3]).
        ref_model: the reference model. None: a frozen copy of the policy taken when training starts (placed like the
            policy), or for a PEFT policy the policy with its adapter disabled. Not used when batches carry precomputed
            reference log-probs (``ref_logps`` / ``ref_kl_logps`` columns, :func:`hfacc.precompute_reference_logps`).
        chunk_size: target tokens per chunk of the chunked log-probs (0: about 16 MiB of fp32 logits).

    Batches come from :class:`hfacc.DataCollatorForUnpairedPreference`. Units: ``("examples", "sequences")``. Logged
    (training and evaluation, over the interval's rows on all ranks, TRL's names): ``loss``, ``kl`` (the reference
    point, averaged over the rows), ``rewards/chosen``, ``rewards/rejected`` (mean ``beta * r`` of the desirable /
    undesirable rows), ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` and ``num_examples``.

    >>> objective = KTOObjective(beta=0.1)
    >>> objective.count({"label": torch.tensor([True, False, True])})  # 3 rows
    tensor([3, 3])
    """

    name = "kto"
    units = ("examples", "sequences")
    has_accuracy = False
    supports_padding_free = True
    supports_fused = True
    fused_description = "chunked log-probs from the final hidden states"
    # Per-row values and the KL rows ride along untouched by the padding-free layout (the KL rows are laid out on
    # their own by the statistics pass).
    row_keys = ("label", "ref_logps", "ref_kl_logps", *KL_KEYS, REFERENCE_POINT)
    columns = ("completion_input_ids", "completion_labels", "label", "kl_input_ids", "kl_labels", "ref_logps")
    columns += ("ref_kl_logps",)
    rate_name = "examples_per_second"
    # What TRL's KTOTrainer backpropagates: each micro-batch's mean over k, with each micro-batch's own z0.
    stock_normalization = "micro_batch"

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        ref_model: nn.Module | None = None,
        *,
        chunk_size: int = 0,
        fused: bool = False,
    ):
        super().__init__()
        if not beta > 0:
            raise ValueError(f"beta={beta}: it must be > 0.")
        for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
            if not weight > 0:
                raise ValueError(f"{name}={weight}: it must be > 0.")
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.ref_model, self.chunk_size, self.fused = ref_model, chunk_size, fused
        self.reference: ReferenceModel | None = None  # built by setup()

    def copies_policy(self) -> bool:
        return self.ref_model is None

    # ---- once per model ----------------------------------------------------------------------------------------
    def setup(self, context: SetupContext) -> None:
        """Build the reference (unless the batches carry precomputed reference log-probs), placed like the policy."""
        args = context.args
        if args is not None and getattr(args, "normalization", "token") == "sequence":
            raise ValueError(
                "normalization='sequence' has no meaning for KTO (its unit is the row); use 'token' (exact) or "
                "'micro_batch' (each micro-batch's own mean and reference point, for comparison)."
            )
        self.reference = None  # a setup is for one model: never the reference of an earlier one
        if context.batch.get("ref_logps") is not None:
            return
        batch = context.batch
        self.reference = build_objective_reference(context, self.ref_model, forward_inputs(batch, self.row_keys),
                                                   get_targets(batch))  # fmt: skip

    def check_data(self, dataset, name: str = "the training data") -> None:
        """Precomputed ``ref_logps`` / ``ref_kl_logps``: finite numbers in every row, both or neither (one named error
        before training: a None fails a collation mid-run, a NaN skips every step it is in)."""
        check_row_values(dataset, KTO_REFERENCE_COLUMNS, name, REFERENCE_FIX)

    def check_fused(self, model, batch, normalization: str = "token") -> str | None:
        """Why the chunked log-probs would not be this model's own (None: they are)."""
        return check_fused_logprobs(model, forward_inputs(batch, self.row_keys), get_targets(batch))

    # ---- the window's reference point --------------------------------------------------------------------------
    @torch.no_grad()
    def window_statistics(
        self,
        model: nn.Module,
        batches,
        accelerator=None,
        *,
        layout=None,
        repeated: Collection[int] = frozenset(),
    ) -> dict[str, Any]:
        """``{"kto_reference_point": z0}``: z0 over the KL rows of every micro-batch of the window and every rank,
        without gradient (:func:`get_reference_point`); ``layout`` lays each micro-batch's KL rows out as training
        lays out its micro-batches."""
        device = accelerator.device if accelerator is not None else None
        total = None
        for j, batch in enumerate(batches):
            ratios = self._kl_logratios(model, batch, layout).double()
            counted = 0 if j in repeated else 1
            found = torch.stack([ratios.sum(), torch.tensor(float(ratios.numel()), device=ratios.device)]) * counted
            total = found if total is None else total + found
        if total is None:  # no micro-batch on this rank: it still takes part in the sum over the ranks
            total = torch.zeros(2, dtype=torch.float64, device=device)
        if accelerator is not None and accelerator.num_processes > 1:
            total = accelerator.reduce(total.to(accelerator.device), reduction="sum")
        kl_sum, rows = total.tolist()
        return {REFERENCE_POINT: get_reference_point(kl_sum, int(rows))}

    def _kl_logratios(self, model, batch, layout=None) -> torch.Tensor:
        """``[B]``: each KL row's ``log pi(y'|x) - log pi_ref(y'|x)``."""
        if any(batch.get(k) is None for k in KL_KEYS):
            raise ValueError(
                "This batch has no KL rows (kl_input_ids, kl_attention_mask, kl_labels), which KTO's reference point "
                "is estimated from: build the data with hfacc.build_preference_dataset (unpaired rows) and collate it "
                "with hfacc.DataCollatorForUnpairedPreference."
            )
        kl = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
        kl["labels"] = batch["kl_labels"]
        kl = layout(kl) if layout is not None else kl
        inputs, targets = forward_inputs(kl), get_targets(kl)
        _, policy = get_token_logprobs(model, inputs, targets, fused=self.fused, chunk_size=self.chunk_size)
        rows, index = self._row_of_targets(kl, targets, policy.mask)
        logps = policy.logps.new_zeros(rows).index_add(0, index, policy.logps)
        return logps - self._reference_logps(batch, "ref_kl_logps", inputs, targets, index, rows).to(logps)

    # ---- per micro-batch ---------------------------------------------------------------------------------------
    def count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``tensor([rows, rows])``, before any forward (padded or padding-free: ``label`` keeps one entry per row)."""
        if not torch.is_tensor(batch.get("label")):
            raise ValueError(
                "A KTO batch has a 'label' tensor (true: desirable): collate it with "
                "hfacc.DataCollatorForUnpairedPreference."
            )
        rows = batch["label"].shape[0]
        return torch.tensor([rows, rows])

    def __call__(self, model, batch, per_sequence=False):
        inputs, targets = forward_inputs(batch, self.row_keys), get_targets(batch)
        outputs, policy = get_token_logprobs(model, inputs, targets, fused=self.fused, chunk_size=self.chunk_size)
        rows, index = self._row_of_targets(batch, targets, policy.mask)
        logps = policy.logps.new_zeros(rows).index_add(0, index, policy.logps)
        ratios = logps - self._reference_logps(batch, "ref_logps", inputs, targets, index, rows).to(logps)
        z0 = batch.get(REFERENCE_POINT)
        if z0 is None:  # no window's reference point: this batch is its own window (evaluation)
            z0 = self.window_statistics(model, [batch])[REFERENCE_POINT]
        desirable = batch["label"].to(ratios.device).bool()
        losses = kto_losses(ratios, desirable, z0, self.beta, self.desirable_weight, self.undesirable_weight)
        sums = KTOSums(
            losses,
            torch.ones_like(losses.detach()),
            desirable.to(logps.dtype),
            logps.detach(),
            self.beta * ratios.detach(),
            torch.full_like(logps.detach(), float(z0)),
        )
        return sums.rewards, sums  # predictions (prediction_step): each row's implicit reward

    def loss(self, sums, counts: WindowCounts, *, normalization: str = "token", world_size: int = 1):
        """``P * (sum of row losses) / rows`` of the window (all ranks); ``"micro_batch"``: the micro-batch's mean
        over k (TRL's ``KTOTrainer``, for comparison)."""
        if normalization == "micro_batch":
            return self.mean_loss(sums) / max(counts.num_micro_batches, 1)
        if normalization != "token":
            raise ValueError(f"normalization={normalization!r}: KTO takes 'token' or 'micro_batch'.")
        return sums.loss.sum() / max(counts.units[0], 1) * world_size

    def mean_loss(self, sums):
        return sums.loss.sum() / sums.examples.sum().clamp(min=1)

    def metric_sums(self, sums):
        """Per row ``[B, 9]``: loss, 1, desirable, undesirable, reward and log-prob of each kind, reference point."""
        good, rows = sums.desirable * sums.examples, sums.examples
        bad = rows - good
        columns = [sums.loss.detach(), rows, good, bad, sums.rewards * good, sums.rewards * bad]
        columns += [sums.logps * good, sums.logps * bad, sums.reference_point * rows]
        return torch.stack([c.detach().float() for c in columns], dim=-1)

    def metric_logs(self, totals, prefix: str = ""):
        loss, rows, good, bad, reward_good, reward_bad, logps_good, logps_bad, z0 = totals[:9]
        if not rows:
            return {f"{prefix}loss": math.nan, f"{prefix}num_examples": 0}
        logs = {f"{prefix}loss": loss / rows, f"{prefix}kl": z0 / rows}
        if good:
            logs[f"{prefix}rewards/chosen"] = reward_good / good
            logs[f"{prefix}logps/chosen"] = logps_good / good
        if bad:
            logs[f"{prefix}rewards/rejected"] = reward_bad / bad
            logs[f"{prefix}logps/rejected"] = logps_bad / bad
        if good and bad:
            logs[f"{prefix}rewards/margins"] = reward_good / good - reward_bad / bad
        logs[f"{prefix}num_examples"] = int(rows)
        return logs

    # ---- helpers -----------------------------------------------------------------------------------------------
    @staticmethod
    def _row_of_targets(batch, targets: torch.Tensor, mask: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``(rows, index)``: the batch's rows (sequences) and the row of every target, in the log-probs' order."""
        sequences = get_batch_sequences(batch, targets.shape)
        if sequences is None:
            owner = torch.arange(targets.shape[0], device=targets.device)[:, None].expand(targets.shape)
            return targets.shape[0], owner[mask]
        ids, n = sequences
        return int(n), ids.expand(targets.shape)[mask]

    def _reference_logps(self, batch, key: str, inputs, targets, index, rows) -> torch.Tensor:
        """The reference's sequence log-probs ``[B]``: precomputed (the batch's ``key``) or computed now."""
        return get_reference_logps(self.reference, batch.get(key), inputs, targets, index, rows, self.chunk_size,
                                   "ref_logps / ref_kl_logps")  # fmt: skip

    def __repr__(self) -> str:
        weights = f", desirable_weight={self.desirable_weight}, undesirable_weight={self.undesirable_weight}"
        plain = (self.desirable_weight, self.undesirable_weight) == (1, 1)
        return f"KTOObjective(beta={self.beta}{'' if plain else weights})"


__all__ = ["KTOObjective", "KTOSums", "REFERENCE_POINT", "get_reference_point", "kto_losses"]
