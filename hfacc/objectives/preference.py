"""Preference optimization (DPO and its variants): a pair is the unit of the loss, a chosen target token that of its
NLL term.

A micro-batch of B pairs is one ``[2B, T]`` batch (:class:`hfacc.DataCollatorForPreference`): rows ``0..B-1`` hold
the chosen sequences, rows ``B..2B-1`` the rejected ones, with ``labels`` -100 wherever a token is not scored, as in
SFT. So chosen and rejected go through the model in one forward, the padding-free layout applies as it does to SFT
batches (``sequence_ids`` then say which row each position came from), and a target is what
:func:`hfacc.ops.loss.shift_labels` says it is. A sequence's log-probability is the sum of its targets' log-probs,
taken from the final hidden states in chunks (:mod:`hfacc.ops.logprobs`): never the full ``[2B, T, V]`` logits.

The window's loss, over its P pairs and C chosen target tokens on all ranks, is

    L = (1 / P) * sum_pairs loss_type(pair) + nll_weight * (1 / C) * sum_chosen_targets -log p(y_t | y_<t)

so :meth:`DPOObjective.loss` backpropagates, per micro-batch, each sum over its own unit's window total. Peers take
each micro-batch's mean and divide by the accumulation steps, which weighs a micro-batch of 2 pairs like one of 8 and
a chosen answer of 3 tokens like one of 300 (notebooks/06).

The loss math is in pure functions (:func:`sigmoid_loss`, :func:`ipo_loss`, :func:`hinge_loss`, :func:`robust_loss`,
:func:`simpo_loss`, dispatched by :func:`preference_losses`), testable without a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..data.preference import MARGIN, REF_LOGPS, REFERENCE_COLUMNS, REFERENCE_FIX, check_row_values
from ..models.reference import ReferenceModel, build_reference_model
from ..ops.logprobs import check_fused_logprobs, get_token_logprobs
from ..ops.loss import IGNORE_INDEX, WindowCounts
from ..runtime.distributed import all_ranks_agree, num_rows
from ..runtime.sequence_parallel import get_sequence_parallel_size, is_first_sequence_rank, sum_over_sequence_group
from .base import Objective, SetupContext, forward_inputs, get_targets
from .causal_lm import get_batch_sequences

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
# Losses that compare the policy with a reference model; simpo is reference-free.
REFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust")


# ---- the loss math: pure functions of per-sequence log-probs ---------------------------------------------------
def sigmoid_loss(margin: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al., 2023), with conservative label smoothing eps (cDPO), per pair:

    ``loss = -(1 - eps) * log sigmoid(beta * m) - eps * log sigmoid(-beta * m)``, where
    ``m = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))`` is the pair's log-ratio margin
    (sequence log-probs: sums over the scored tokens).

    >>> round(sigmoid_loss(torch.tensor([0.0]), beta=0.1).item(), 6)  # log 2: no preference yet
    0.693147
    """
    return -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)


def ipo_loss(length_normalized_margin: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al., 2023, eq. 17), per pair: ``loss = (m_bar - 1 / (2 * beta))^2``, with
    ``m_bar = (log pi(y_c) - log ref(y_c)) / |y_c| - (log pi(y_r) - log ref(y_r)) / |y_r|``: each log-ratio averaged
    over its scored tokens, as TRL computes it (confirmed with the IPO authors: the paper's numbers use this form).

    >>> ipo_loss(torch.tensor([0.0]), beta=0.5).item()
    1.0
    """
    return (length_normalized_margin - 1 / (2 * beta)) ** 2


def hinge_loss(margin: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC's hinge (Zhao et al., 2023), per pair: ``loss = max(0, 1 - beta * m)``, m the log-ratio margin.

    >>> hinge_loss(torch.tensor([20.0, 0.0]), beta=0.1).tolist()
    [0.0, 1.0]
    """
    return torch.relu(1 - beta * margin)


def robust_loss(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """Robust DPO (Chowdhury et al., 2024), eps the probability that a preference label is flipped (0 <= eps < 0.5),
    per pair: ``loss = (-(1 - eps) * log sigmoid(beta * m) + eps * log sigmoid(-beta * m)) / (1 - 2 * eps)``.

    >>> round(robust_loss(torch.tensor([0.0]), beta=0.1, label_smoothing=0.0).item(), 6)  # eps 0: DPO's sigmoid
    0.693147
    """
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * margin)
    flipped = label_smoothing * F.logsigmoid(-beta * margin)
    return (clean + flipped) / (1 - 2 * label_smoothing)


def simpo_loss(
    chosen_mean_logps: torch.Tensor,
    rejected_mean_logps: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SimPO (Meng et al., 2024), reference-free and length-normalized, per pair: with
    ``z = beta * (log pi(y_c) / |y_c| - log pi(y_r) / |y_r|) - gamma`` (gamma the target reward margin),
    ``loss = -(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)`` (TRL's CPOTrainer, ``loss_type="simpo"``,
    ``simpo_gamma=gamma``).

    >>> round(simpo_loss(torch.tensor([-1.0]), torch.tensor([-1.0]), beta=2.0, gamma=0.0).item(), 6)
    0.693147
    """
    z = beta * (chosen_mean_logps - rejected_mean_logps) - gamma
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


class PairScores(NamedTuple):
    """Per pair ``[B]``: the loss and the implicit rewards (TRL's ``rewards/chosen`` and ``rewards/rejected``)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
) -> PairScores:
    """The per-pair losses of ``loss_type`` from sequence log-probs ``[B]`` (sums over the scored tokens) and the
    numbers of scored tokens, and the rewards: ``beta * (log pi - log ref)`` of each side, or for the reference-free
    ``simpo`` ``beta * log pi / |y|`` (as TRL logs them). The formulas are those of the functions above.

    >>> scores = preference_losses(torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-5.0]),
    ...     torch.tensor([-5.0]), chosen_lengths=torch.tensor([2]), rejected_lengths=torch.tensor([3]))
    >>> round(scores.losses.item(), 4), round(scores.chosen_rewards.item(), 2), round(scores.rejected_rewards.item(), 2)
    (0.5981, 0.1, -0.1)
    """
    chosen_lengths, rejected_lengths = chosen_lengths.clamp(min=1), rejected_lengths.clamp(min=1)
    if loss_type == "simpo":
        chosen_mean, rejected_mean = chosen_logps / chosen_lengths, rejected_logps / rejected_lengths
        losses = simpo_loss(chosen_mean, rejected_mean, beta, gamma, label_smoothing)
        return PairScores(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())
    if loss_type not in REFERENCE_LOSSES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}.")
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    margin = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = sigmoid_loss(margin, beta, label_smoothing)
    elif loss_type == "ipo":
        losses = ipo_loss(chosen_ratio / chosen_lengths - rejected_ratio / rejected_lengths, beta)
    elif loss_type == "hinge":
        losses = hinge_loss(margin, beta)
    else:
        losses = robust_loss(margin, beta, label_smoothing)
    return PairScores(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


# ---- the objective ---------------------------------------------------------------------------------------------
class PreferenceSums(NamedTuple):
    """Per pair ``[B]`` (differentiable where a loss is): what one micro-batch contributes.

    Args:
        loss: the pair's preference loss.
        pairs: 1 per pair (0 in the sums of a micro-batch of repeated examples: :meth:`Objective.zero_sums`).
        nll: minus the chosen sequence's log-prob: the NLL term's sum over its target tokens.
        chosen_tokens, rejected_tokens: scored (target) tokens of each side.
        chosen_logps, rejected_logps: the policy's sequence log-probs (detached).
        chosen_rewards, rejected_rewards: the implicit rewards (detached).
    """

    loss: torch.Tensor
    pairs: torch.Tensor
    nll: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def build_objective_reference(context: SetupContext, ref_model, inputs, targets) -> ReferenceModel:
    """The frozen reference of ``context.model`` (``ref_model``, a copy, or a PEFT base: placed like the policy), with
    whether its log-probs are chunked decided once from ``inputs`` / ``targets``, on every rank alike: every rank must
    run the same forwards (a sharded reference gathers its weights in them)."""
    reference = build_reference_model(
        context.model, ref_model, context.accelerator, initial_policy=context.initial_policy
    )
    problem = reference.check_fused(inputs, targets)
    reference.fused = all_ranks_agree(problem is None, context.accelerator)
    return reference


def get_reference_logps(reference, given, inputs, targets, index, n: int, chunk_size: int, columns: str):
    """The reference's log-probs of ``n`` sequences: ``given`` (precomputed, from the batch), else computed now by
    ``reference`` on ``inputs`` and summed per sequence (``index``: the sequence of each target); an error naming
    the precomputed ``columns`` when there is neither."""
    if given is not None:
        return given
    if reference is None:
        raise ValueError(
            f"This batch has no precomputed reference log-probs ({columns}) and no reference model was set up: "
            "give every dataset (training and evaluation) the columns, or none of them."
        )
    result = reference.logprobs(inputs, targets, chunk_size=chunk_size)
    return result.logps.new_zeros(n).index_add(0, index, result.logps)


class PairedRows:
    """A micro-batch of B pairs as one ``[2B, T]`` batch (:class:`hfacc.DataCollatorForPreference`): rows ``0..B-1``
    the chosen sequences, ``B..2B-1`` the rejected ones. What its examples are (a pair is two rows) and which pair
    each position belongs to, for the objectives of pairs (:class:`DPOObjective`, :class:`hfacc.RewardObjective`)."""

    def num_examples(self, batch: Mapping[str, Any]) -> int:
        """Pairs in ``batch`` (a collated ``[2B, T]`` batch: half its rows)."""
        return num_rows(batch) // 2

    def select_examples(self, batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
        """Pairs ``start..stop`` of a collated batch: their chosen rows, then their rejected rows (and their entries of
        a per-pair value, such as a reward model's ``margin``)."""
        rows = num_rows(batch)
        pairs = rows // 2
        keep = torch.cat([torch.arange(start, stop), torch.arange(pairs + start, pairs + stop)])
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows:
                value = value[keep.to(value.device)]
            elif torch.is_tensor(value) and value.dim() == 1 and value.shape[0] == pairs:
                value = value[start:stop]
            out[key] = value
        return out

    @staticmethod
    def _owners(batch, shape) -> tuple[int, torch.Tensor]:
        """``(pairs, owner)``: the number of pairs and, per position, its sequence (chosen ``0..B-1``, rejected
        ``B..2B-1``; -1 for the filler of a padding-free layout)."""
        sequences = get_batch_sequences(batch, shape)
        if sequences is None or batch.get("sequence_ids") is None:
            rows = shape[0]
            if rows % 2:
                raise ValueError(
                    f"a preference batch holds chosen and rejected rows of each pair ({rows} rows is odd): collate it "
                    "with hfacc.DataCollatorForPreference."
                )
            owner = torch.arange(rows, device=batch["labels"].device)[:, None].expand(shape)
            return rows // 2, owner
        ids, n = sequences
        return n // 2, ids.expand(shape)


class DPOObjective(PairedRows, Objective):
    """Direct preference optimization and its variants, exact per pair under any split of the window.

    Args:
        beta: the loss's temperature (DPO's beta; for IPO the regularization tau; for SimPO its scale).
        loss_type: ``"sigmoid"`` (DPO), ``"ipo"``, ``"hinge"``, ``"robust"``, or the reference-free ``"simpo"``.
        label_smoothing: ``sigmoid``: conservative DPO's eps; ``robust``: the probability of a flipped label
            (< 0.5); ``simpo``: its label smoothing. Given by name (``objective="dpo"``) it is the run's
            ``label_smoothing_factor``.
        nll_weight: weight of the chosen side's cross-entropy (RPO / MPO style), averaged over the window's chosen
            target tokens; 0: none.
        ref_model: the reference model. None: a frozen copy of the policy taken when training starts (placed like the
            policy under DDP, ZeRO-3 and FSDP2), or for a PEFT policy the policy with its adapter disabled. Not used
            when batches carry precomputed reference log-probs (``ref_chosen_logps`` / ``ref_rejected_logps``
            columns, see :func:`hfacc.precompute_reference_logps`), nor for ``simpo``.
        gamma: SimPO's target reward margin.
        chunk_size: target tokens per chunk of the chunked log-probs (0: about 16 MiB of fp32 logits).

    Units: ``("pairs", "sequences", "chosen_tokens")``. The preference loss is the mean over the window's pairs on all
    ranks; the NLL term is the sum over chosen target tokens divided by the window's chosen target tokens. Logged
    (training and evaluation, each averaged over the interval's pairs on all ranks, TRL's names): ``loss``,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected``, ``nll_loss`` (per chosen token) and ``num_pairs``.

    >>> objective = DPOObjective(beta=0.1, loss_type="sigmoid", nll_weight=0.2)
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 0], [5, 8, 9], [5, 9, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]]),
    ...          "labels": torch.tensor([[-100, 6, 7], [-100, 6, -100], [-100, 8, 9], [-100, 9, -100]])}
    >>> objective.count(batch)  # 2 pairs, 4 sequences, 3 chosen target tokens
    tensor([2, 4, 3])
    """

    name = "dpo"
    units = ("pairs", "sequences", "chosen_tokens")
    has_accuracy = False
    supports_padding_free = True
    supports_fused = True
    fused_description = "chunked log-probs from the final hidden states"
    row_keys = (REF_LOGPS, MARGIN)  # a margin column (a reward model's) rides along unread
    columns = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "ref_chosen_logps")
    columns += ("ref_rejected_logps",)
    rate_name = "pairs_per_second"
    # What peers (TRL's DPOTrainer, torchtune) backpropagate: each micro-batch's mean over k (hfacc verify's
    # comparison, normalization="micro_batch").
    stock_normalization = "micro_batch"

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        nll_weight: float = 0.0,
        ref_model: nn.Module | None = None,
        *,
        gamma: float = 0.5,
        chunk_size: int = 0,
        fused: bool = False,
    ):
        super().__init__(label_smoothing)
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}.")
        if not beta > 0:
            raise ValueError(f"beta={beta}: it must be > 0.")
        if nll_weight < 0:
            raise ValueError(f"nll_weight={nll_weight}: it must be >= 0 (0: no NLL term).")
        if loss_type == "robust" and not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={label_smoothing}: the robust loss needs 0 <= label_smoothing < 0.5.")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing={label_smoothing}: it must be in [0, 1).")
        if loss_type == "simpo" and ref_model is not None:
            raise ValueError("loss_type='simpo' is reference-free: pass no ref_model.")
        self.beta, self.loss_type, self.nll_weight, self.gamma = beta, loss_type, nll_weight, gamma
        self.ref_model, self.chunk_size, self.fused = ref_model, chunk_size, fused
        self.reference: ReferenceModel | None = None  # built by setup(): the frozen reference the losses compare with
        # Under DeepSpeed Ulysses (set by setup()): each row is one shard of its sequences, whose sums
        # are summed over the sequence group before the loss (hfacc/runtime/sequence_parallel.py).
        self.sequence_parallel = False

    @property
    def needs_reference(self) -> bool:
        return self.loss_type in REFERENCE_LOSSES

    def copies_policy(self) -> bool:
        return self.needs_reference and self.ref_model is None

    # ---- once per model ----------------------------------------------------------------------------------------
    def setup(self, context: SetupContext) -> None:
        """Build the reference (unless the batches carry precomputed reference log-probs, or the loss needs none),
        placed like the policy, and decide once, on every rank alike, whether its log-probs are chunked."""
        args = context.args
        if args is not None and getattr(args, "normalization", "token") == "sequence":
            raise ValueError(
                "normalization='sequence' has no meaning for the preference objective (its units are pairs and "
                "chosen tokens); use 'token' (exact) or 'micro_batch' (the mean of micro-batch means, for comparison)."
            )
        self.reference = None  # a setup is for one model: never the reference of an earlier one
        self.sequence_parallel = get_sequence_parallel_size(context.accelerator) > 1
        if self.sequence_parallel and context.batch.get(REF_LOGPS) is not None:
            raise NotImplementedError(
                "precomputed ref_chosen_logps / ref_rejected_logps with sp_size > 1: DeepSpeed Ulysses shards every "
                "tensor of a batch along the sequence; drop the columns (the reference is computed on the shards)."
            )
        if not self.needs_reference or context.batch.get(REF_LOGPS) is not None:
            return
        self.reference = build_objective_reference(
            context, self.ref_model, self._inputs(context.batch), self._targets(context.batch)
        )

    def check_data(self, dataset, name: str = "the training data") -> None:
        """Precomputed ``ref_chosen_logps`` / ``ref_rejected_logps``: finite numbers in every pair, both or neither
        (one named error before training, never a failed collation or a skipped step mid-run)."""
        check_row_values(dataset, REFERENCE_COLUMNS, name, REFERENCE_FIX)

    def check_fused(self, model, batch, normalization: str = "token") -> str | None:
        """Why the chunked log-probs would not be this model's own (None: they are); see
        :func:`hfacc.ops.logprobs.check_fused_logprobs`."""
        return check_fused_logprobs(model, self._inputs(batch), self._targets(batch))

    # ---- per micro-batch ---------------------------------------------------------------------------------------
    def count(self, batch):
        """``tensor([pairs, sequences, chosen target tokens])``, before any forward (padded or padding-free)."""
        targets = self._targets(batch) != IGNORE_INDEX
        pairs, owner = self._owners(batch, targets.shape)
        chosen = (targets & (owner >= 0) & (owner < pairs)).sum()
        # A pair lives on every shard of its sequence group: counted on the first (over data ranks only).
        counted = 0 if self.sequence_parallel and not is_first_sequence_rank() else pairs
        return torch.stack([torch.tensor(counted), torch.tensor(2 * counted), chosen.cpu()]).long()

    def __call__(self, model, batch, per_sequence=False):
        inputs, targets = self._inputs(batch), self._targets(batch)
        outputs, policy = get_token_logprobs(model, inputs, targets, fused=self.fused, chunk_size=self.chunk_size)
        pairs, owner = self._owners(batch, targets.shape)
        index = owner[policy.mask]  # the sequence (original row) of every target, in the order of the log-probs
        logps = policy.logps.new_zeros(2 * pairs).index_add(0, index, policy.logps)
        lengths = torch.bincount(index, minlength=2 * pairs)
        ref = ref_chosen = ref_rejected = None
        if self.needs_reference:
            ref = self._reference_logps(batch, inputs, targets, index, pairs).to(logps)
        # Training batches are the engine's shards (evaluation batches are whole: the engine cuts the train loader's).
        sharded = self.sequence_parallel and model.training
        if sharded:  # each shard's sums -> the sequences' sums, before the nonlinearity
            logps, lengths = sum_over_sequence_group(logps), sum_over_sequence_group(lengths)
            ref = sum_over_sequence_group(ref) if ref is not None else None
        if ref is not None:
            ref_chosen, ref_rejected = ref[:pairs], ref[pairs:]
        scores = preference_losses(
            logps[:pairs],
            logps[pairs:],
            ref_chosen,
            ref_rejected,
            chosen_lengths=lengths[:pairs],
            rejected_lengths=lengths[pairs:],
            loss_type=self.loss_type,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            gamma=self.gamma,
        )
        sums = PreferenceSums(
            scores.losses,
            torch.ones_like(scores.losses.detach()),
            -logps[:pairs],
            lengths[:pairs],
            lengths[pairs:],
            logps[:pairs].detach(),
            logps[pairs:].detach(),
            scores.chosen_rewards,
            scores.rejected_rewards,
        )
        if sharded and not is_first_sequence_rank():
            # The pair is counted on the group's first rank: here it adds nothing, yet its loss stays in the graph
            # (times 0), so that every rank runs the all-reduce's backward, which brings the first rank's gradient.
            sums = PreferenceSums(*(t * 0 for t in sums))
        # What the Trainer's prediction_step returns as predictions: each pair's two rewards (as TRL's logits).
        return torch.stack([scores.chosen_rewards, scores.rejected_rewards], dim=-1), sums

    def loss(self, sums, counts: WindowCounts, *, normalization: str = "token", world_size: int = 1):
        """``P * (sum of pair losses / pairs + nll_weight * chosen NLL sum / chosen tokens)``, each over the window
        (all ranks); ``"micro_batch"``: the legacy mean of micro-batch means, ``(mean pair loss + nll_weight * mean
        chosen-token NLL) / k``, for comparison."""
        if normalization == "micro_batch":
            return self.mean_loss(sums) / max(counts.num_micro_batches, 1)
        if normalization != "token":
            raise ValueError(
                f"normalization={normalization!r}: the preference objective takes 'token' or 'micro_batch'."
            )
        pairs, chosen_tokens = counts.units[0], counts.units[2]
        loss = sums.loss.sum() / max(pairs, 1)
        if self.nll_weight:
            loss = loss + self.nll_weight * sums.nll.sum() / max(chosen_tokens, 1)
        return loss * world_size

    def mean_loss(self, sums):
        loss = sums.loss.sum() / sums.pairs.sum().clamp(min=1)
        if self.nll_weight:
            loss = loss + self.nll_weight * sums.nll.sum() / sums.chosen_tokens.sum().clamp(min=1)
        return loss

    def metric_sums(self, sums):
        """Per pair ``[B, 9]``: loss, 1, NLL sum, chosen tokens, the two rewards, correct (chosen reward higher), the
        two sequence log-probs."""
        columns = [
            sums.loss.detach(),
            sums.pairs,
            sums.nll.detach(),
            sums.chosen_tokens,
            sums.chosen_rewards,
            sums.rejected_rewards,
            sums.chosen_rewards > sums.rejected_rewards,
            sums.chosen_logps,
            sums.rejected_logps,
        ]
        return torch.stack([c.detach().float() for c in columns], dim=-1)

    def metric_logs(self, totals, prefix: str = ""):
        loss, pairs, nll, chosen_tokens, chosen, rejected, correct, logps_c, logps_r = totals[:9]
        if not pairs:
            return {f"{prefix}loss": math.nan, f"{prefix}num_pairs": 0}
        nll_mean = nll / chosen_tokens if chosen_tokens else math.nan
        logs = {
            f"{prefix}loss": loss / pairs + (self.nll_weight * nll_mean if self.nll_weight else 0.0),
            f"{prefix}rewards/chosen": chosen / pairs,
            f"{prefix}rewards/rejected": rejected / pairs,
            f"{prefix}rewards/accuracies": correct / pairs,
            f"{prefix}rewards/margins": (chosen - rejected) / pairs,
            f"{prefix}logps/chosen": logps_c / pairs,
            f"{prefix}logps/rejected": logps_r / pairs,
            f"{prefix}nll_loss": nll_mean,
            f"{prefix}num_pairs": int(pairs),
        }
        return logs

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _inputs(self, batch):
        return forward_inputs(batch, self.row_keys)

    @staticmethod
    def _targets(batch):
        return get_targets(batch)

    def _reference_logps(self, batch, inputs, targets, index, pairs) -> torch.Tensor:
        """The reference's sequence log-probs ``[2B]``: precomputed (the batch's ``ref_logps``) or computed now."""
        return get_reference_logps(self.reference, batch.get(REF_LOGPS), inputs, targets, index, 2 * pairs,
                                   self.chunk_size, "ref_chosen_logps / ref_rejected_logps")  # fmt: skip

    def __repr__(self) -> str:
        extra = f", nll_weight={self.nll_weight}" if self.nll_weight else ""
        return f"DPOObjective(loss_type={self.loss_type!r}, beta={self.beta}{extra})"


__all__ = [
    "DPOObjective",
    "PairedRows",
    "PreferenceSums",
    "PairScores",
    "preference_losses",
    "sigmoid_loss",
    "ipo_loss",
    "hinge_loss",
    "robust_loss",
    "simpo_loss",
    "LOSS_TYPES",
]
