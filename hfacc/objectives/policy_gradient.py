"""Policy gradients on a rollout (the GRPO family: GRPO, DAPO, Dr. GRPO): exact over what each optimizer step consumes.

A rollout row is a prompt and one sampled completion: ``input_ids``, ``labels`` (-100 outside the completion), one
``advantages`` float, and optionally ``old_logps`` (the sampling policy's log-prob of each completion token) and
``ref_logps`` (the reference's). Per completion token t, with ``r_t = exp(logp_t - old_logp_t)``:

    l_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps_high) A)  (+ beta * KL_t, the k3 estimate to the reference)

and the step's loss divides the sum of l over everything the optimizer step consumes (all micro-batches, all ranks)
by the loss type's unit, counted the same way:

- ``"token"`` (DAPO): ``sum_t l_t / N_tokens``;
- ``"sequence"`` (GRPO): ``sum_b mean_{t in b} l_t / N_completions``;
- ``"dr_grpo"``: ``sum_t l_t / (N_completions * max_completion_length)``.

A rollout sampled by another engine than the trained model (vLLM) may carry ``importance_weights``: one fixed weight
``w_t`` per completion token, the importance-sampling correction of the sampler's mismatch
(:func:`importance_sampling_weights`); then ``l_t = -w_t min(r_t A, clip(r_t) A) (+ beta KL_t)``. The weights are
data, fixed before the first backward, so the step stays exact over the same units.

The unit exists only after the rollout and a rollout is split over micro-batches, ranks and optimizer steps, so this
is the method's best-known bug class (normalizing by each micro-batch's own tokens: 0.59 relative error at bs 2 x
GA 4 on a fixed rollout, notebook 07). Here the window counts the units before the first backward, as for SFT.

The math is in pure functions (:func:`clipped_surrogate_loss`, :func:`k3_kl`, :func:`importance_sampling_weights`,
:func:`policy_gradient_sums`, :func:`normalize_policy_loss`); :class:`PolicyGradientObjective` reads a batch and
routes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..models.reference import build_reference_model
from ..ops.logprobs import check_fused_logprobs, get_token_logprobs
from ..ops.loss import IGNORE_INDEX, WindowCounts, shift_labels
from ..ops.model_io import get_num_virtual_tokens, model_inputs, packed_position_ids
from .base import Objective
from .causal_lm import get_batch_sequences

LOSS_TYPES = ("token", "sequence", "dr_grpo")
# TRL's names for the same losses: its "dapo" is the token loss, its "grpo" the per-completion mean.
LOSS_TYPE_ALIASES = {"dapo": "token", "grpo": "sequence"}
# Batch entries of a rollout that are no model inputs: one float per row, and per-token floats aligned with labels.
POLICY_KEYS = ("advantages", "old_logps", "ref_logps", "importance_weights")
# TRL's importance-sampling modes (GRPOConfig.vllm_importance_sampling_mode): {token, sequence} x {truncate, mask}.
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def clipped_surrogate_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: ``(loss, clipped_low, clipped_high)``, all ``[N]``.

    ``r_t = exp(logp_t - old_logp_t)`` and ``loss_t = -min(r_t * A_t, clip(r_t, 1 - epsilon_low, 1 + epsilon_high)
    * A_t)``. ``clipped_low`` is ``r_t < 1 - epsilon_low`` with ``A_t < 0``, ``clipped_high`` is
    ``r_t > 1 + epsilon_high`` with ``A_t > 0``: the tokens where the clipped branch is the minimum, whose gradient
    is zero (TRL's ``clip_ratio/low_mean`` and ``high_mean``).

    >>> loss, low, high = clipped_surrogate_loss(torch.tensor([0.0, 0.5]), torch.zeros(2), torch.tensor([1.0, 1.0]))
    >>> loss, high  # r = 1 and e^0.5 = 1.65 (clipped to 1.2)
    (tensor([-1.0000, -1.2000]), tensor([False,  True]))
    """
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    ratio = ratio.detach()
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, low, high


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of ``KL(policy || reference)`` per token: ``exp(ref_t - logp_t) - (ref_t - logp_t) - 1``.

    Unbiased for tokens sampled from the policy and never negative (Schulman, "Approximating KL divergence"; the
    estimator of DeepSeekMath's GRPO and of TRL).

    >>> k3_kl(torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0]))  # equal log-probs: 0
    tensor([0.0000, 0.7183])
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def importance_sampling_weights(
    old_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    rows: torch.Tensor,
    num_rows: int,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's importance-sampling correction of a sampler's mismatch: ``(w, rho)``, the per-token weights ``[N]`` and
    the ratios per unit of the mode (``[N]`` tokens, or ``[num_rows]`` completions).

    ``old_logps`` are the trained policy's log-probs of the N sampled completion tokens (as it was when they were
    sampled), ``sampler_logps`` the sampler's (vLLM's), ``rows`` each token's completion. With
    ``d_t = old_t - sampler_t``:

    - ``"token_*"``: ``rho_t = exp(d_t)``; ``"sequence_*"``: ``rho_b = exp(sum_{t in b} d_t)``, every token of b gets it;
    - ``"*_truncate"``: ``w = clamp(rho, clip_min, clip_max)``; ``"*_mask"``: ``w = rho`` inside ``[clip_min,
      clip_max]``, else 0 (the token, or the whole completion, drops out of the loss but still counts in its unit).

    A bound that is None is not applied. ``w`` multiplies each token's clipped surrogate (not the KL term), as in TRL.

    >>> w, rho = importance_sampling_weights(
    ...     torch.tensor([-1.0, -2.0, -1.0]), torch.tensor([-1.5, -2.0, -1.0]), torch.tensor([0, 0, 1]), 2,
    ...     "token_truncate", clip_max=1.5)
    >>> w  # exp(0.5) = 1.65, truncated to 1.5
    tensor([1.5000, 1.0000, 1.0000])
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"importance sampling mode {mode!r}: use one of {list(IMPORTANCE_SAMPLING_MODES)}.")
    delta = (old_logps.double() - sampler_logps.double()).nan_to_num(0.0)  # a token the sampler could not score: 1
    if mode.startswith("sequence"):
        ratio = delta.new_zeros(num_rows).index_add(0, rows, delta).exp()
    else:
        ratio = delta.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(low, high)
    else:
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    weights = ratio[rows] if mode.startswith("sequence") else ratio
    if mode.startswith("sequence"):
        ratio = ratio[torch.bincount(rows, minlength=num_rows) > 0]  # completions without tokens have no ratio
    return weights.to(old_logps.dtype), ratio.to(old_logps.dtype)


def policy_gradient_sums(
    per_token_loss: torch.Tensor, rows: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_sum, sequence_sum, tokens_per_row)`` of per-token losses ``[N]`` whose row (completion) is ``rows``.

    ``token_sum = sum_t l_t`` (what ``"token"`` and ``"dr_grpo"`` divide) and ``sequence_sum = sum_b (sum_{t in b}
    l_t) / n_b`` over the completions b with ``n_b > 0`` tokens (what ``"sequence"`` divides): the completion's
    token mean is taken inside the micro-batch, because a completion never spans two micro-batches.
    """
    per_row = per_token_loss.new_zeros(num_rows).index_add(0, rows, per_token_loss)
    counts = torch.bincount(rows, minlength=num_rows)
    return per_token_loss.sum(), (per_row / counts.clamp(min=1)).sum(), counts


def normalize_policy_loss(
    loss_sum: torch.Tensor,
    loss_type: str,
    num_tokens: int,
    num_completions: int,
    max_completion_length: int | None = None,
    world_size: int = 1,
) -> torch.Tensor:
    """One micro-batch's share of the optimizer step's policy loss, ready for ``backward()``.

    ``num_tokens`` / ``num_completions`` count what the *whole step* consumes: every micro-batch of the window, summed
    over all P ranks. With S the micro-batch's sum (:func:`policy_gradient_sums`):

    - ``"token"``: ``P * S / N_tokens``;
    - ``"sequence"``: ``P * S_seq / N_completions``;
    - ``"dr_grpo"``: ``P * S / (N_completions * max_completion_length)``.

    Summed over the window and averaged over the ranks (DDP), that is the loss of one batch holding the whole step.
    A step without completions gives 0 instead of 0 / 0.
    """
    if loss_type == "token":
        denominator = num_tokens
    elif loss_type == "sequence":
        denominator = num_completions
    elif loss_type == "dr_grpo":
        denominator = num_completions * max_completion_length
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    return loss_sum * (world_size / max(denominator, 1))


class PolicyGradientSums(NamedTuple):
    """Sums over the completion tokens of one micro-batch (the loss's, differentiable; the rest detached).

    Args:
        loss: what the loss type divides: ``sum_t l_t`` (token, dr_grpo) or ``sum_b mean_{t in b} l_t`` (sequence).
        num_tokens: completion tokens.
        num_completions: completions with at least one token.
        clipped_low, clipped_high: tokens whose ratio was clipped below (A < 0) / above (A > 0).
        kl: sum of the k3 KL estimates to the reference (0 when ``beta == 0``).
        entropy: sum of the entropies of the policy's next-token distributions at the completion tokens.
    """

    loss: torch.Tensor
    num_tokens: torch.Tensor
    num_completions: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor


class PolicyGradientObjective(Objective):
    """The clipped policy-gradient loss of the GRPO family on rollout rows, exact under every split.

    Args:
        loss_type: ``"token"`` (DAPO: every completion token of the step weighs the same), ``"sequence"`` (GRPO:
            every completion weighs the same) or ``"dr_grpo"`` (sum over tokens / (completions x
            ``max_completion_length``)). TRL's names ``"dapo"`` and ``"grpo"`` are accepted for the first two.
        epsilon: lower clipping bound, ``r >= 1 - epsilon``.
        epsilon_high: upper clipping bound, ``r <= 1 + epsilon_high`` (None: ``epsilon``; DAPO's clip-higher: 0.28).
        beta: weight of the k3 KL estimate to the reference (0: no reference needed).
        ref_model: the reference for ``beta > 0`` (None: a frozen copy of the policy as training starts, or a PEFT
            policy's base: :func:`hfacc.models.reference.build_reference_model`); rows with ``ref_logps`` need none.
        max_completion_length: the longest completion the rollout could sample (``"dr_grpo"``'s constant).
        temperature: the sampling temperature: log-probs are those of ``logits / temperature``, as sampled.

    Rows: ``input_ids``, ``labels`` (-100 outside the completion), ``advantages`` (one float per row: a ``row_keys``
    entry, kept as it is by the padding-free layout), and optionally ``old_logps``, ``ref_logps`` and
    ``importance_weights``, aligned with ``labels``: ``old_logps[t]`` is the old policy's log-prob of ``input_ids[t]``,
    read where ``labels[t] != -100`` (absent: the current policy's, detached, so the ratio is 1);
    ``importance_weights[t]`` multiplies token t's clipped surrogate (:func:`importance_sampling_weights`; absent: 1).
    :class:`hfacc.DataCollatorForCausalLM` collates them. Units: ``("completion_tokens", "completions")``, counted per window over all ranks.

    >>> objective = PolicyGradientObjective(loss_type="sequence", epsilon_high=0.28)
    >>> objective.units, objective.epsilon_high
    (('completion_tokens', 'completions'), 0.28)
    """

    name = "grpo"
    units = ("completion_tokens", "completions")
    rate_name = "completion_tokens_per_second"
    has_accuracy = False
    sums_per_sequence = False
    supports_padding_free = True
    supports_fused = True
    row_keys = ("advantages",)
    columns = POLICY_KEYS

    def __init__(
        self,
        loss_type: str = "token",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        ref_model: nn.Module | None = None,
        max_completion_length: int | None = None,
        temperature: float = 1.0,
    ):
        super().__init__()
        loss_type = LOSS_TYPE_ALIASES.get(loss_type, loss_type)
        if loss_type == "bnpo":
            raise ValueError(
                "loss_type='bnpo' divides each micro-batch by its own tokens, so the step depends on how the rollout "
                "is split; loss_type='token' is the same loss divided by the step's tokens over all ranks (exact)."
            )
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r}: use one of {list(LOSS_TYPES)} (or TRL's 'dapo', 'grpo').")
        if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: set it (> 0).")
        if not 0 <= epsilon < 1 or (epsilon_high is not None and epsilon_high < 0):
            raise ValueError(
                f"epsilon={epsilon}, epsilon_high={epsilon_high}: need 0 <= epsilon < 1, epsilon_high >= 0."
            )
        if beta < 0:
            raise ValueError(f"beta={beta}: the KL weight must be >= 0.")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: it must be > 0.")
        self.loss_type, self.epsilon, self.beta = loss_type, epsilon, beta
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.ref_model, self.max_completion_length, self.temperature = ref_model, max_completion_length, temperature
        self.reference = None  # built by setup() when beta > 0 and the rows carry no ref_logps
        self.fused, self.chunk_size = False, 0

    def copies_policy(self) -> bool:
        return self.beta > 0 and self.ref_model is None

    # ---- once per model ----------------------------------------------------------------------------------------
    def setup(self, context) -> None:
        if get_num_virtual_tokens(context.model):
            raise ValueError(
                "PolicyGradientObjective: PEFT prompt tuning puts virtual tokens before every row; use LoRA instead."
            )
        self.reference = None  # a setup is for one model: never the reference of an earlier one
        if self.beta > 0 and context.batch.get("ref_logps") is None:
            self.reference = build_reference_model(
                context.model, self.ref_model, context.accelerator, initial_policy=context.initial_policy
            )

    def check_fused(self, model, batch, normalization: str = "token") -> str | None:
        """Why the chunked log-probs would not be the model's own (None: they are): :func:`check_fused_logprobs`."""
        return check_fused_logprobs(model, _inputs(batch), get_completion_targets(batch), self.temperature)

    # ---- per micro-batch ---------------------------------------------------------------------------------------
    def count(self, batch):
        targets = get_completion_targets(batch) != IGNORE_INDEX
        sequences = get_batch_sequences(batch, targets.shape)
        if sequences is None:
            return torch.stack([targets.sum(), targets.any(-1).sum()])
        ids, n = sequences
        hit = torch.zeros(n, dtype=torch.long, device=targets.device).index_fill_(0, ids[targets], 1)
        return torch.stack([targets.sum(), hit.sum()])

    def __call__(self, model, batch, per_sequence=False):
        targets = get_completion_targets(batch)
        rows, num_rows = get_target_rows(batch, targets)
        advantages = batch.get("advantages")
        if not torch.is_tensor(advantages) or advantages.shape != (num_rows,):
            got = "none" if advantages is None else f"shape {tuple(getattr(advantages, 'shape', ()))}"
            raise ValueError(
                f"PolicyGradientObjective needs 'advantages', one float per row ({num_rows} here), got {got}: give "
                "every rollout row an 'advantages' value (DataCollatorForCausalLM collates it)."
            )
        inputs = _inputs(batch)
        outputs, result = get_token_logprobs(
            model, inputs, targets, fused=self.fused, chunk_size=self.chunk_size, temperature=self.temperature
        )
        logps = result.logps
        old = get_aligned_values(batch.get("old_logps"), result.mask)
        # No old log-probs: the rollout comes from this very policy (one step per generation), so the ratio is 1 and
        # the gradient is A * grad(logp) (PPO's ratio at its anchor).
        old = logps.detach() if old is None else old
        per_token, low, high = clipped_surrogate_loss(
            logps, old, advantages.to(logps.dtype)[rows], self.epsilon, self.epsilon_high
        )
        weights = get_aligned_values(batch.get("importance_weights"), result.mask)
        if weights is not None:  # the sampler's mismatch, corrected (fixed weights: the step stays exact)
            per_token = per_token * weights.to(per_token.dtype)
        kl = None
        if self.beta > 0:
            ref = get_aligned_values(batch.get("ref_logps"), result.mask)
            if ref is None:
                if self.reference is None:
                    raise ValueError(
                        "beta > 0 needs the reference's log-probs: give the rows 'ref_logps', or let setup() build "
                        "the reference (train with TokenWeightedTrainer, or call objective.setup(...))."
                    )
                ref = self.reference.logprobs(
                    inputs, targets, chunk_size=self.chunk_size, temperature=self.temperature
                ).logps
            kl = k3_kl(logps, ref.to(logps.dtype))
            per_token = per_token + self.beta * kl
        token_sum, sequence_sum, per_row = policy_gradient_sums(per_token, rows, num_rows)
        zero = logps.new_zeros(())
        sums = PolicyGradientSums(
            loss=sequence_sum if self.loss_type == "sequence" else token_sum,
            num_tokens=torch.tensor(logps.numel(), device=logps.device),
            num_completions=(per_row > 0).sum(),
            clipped_low=low.sum(),
            clipped_high=high.sum(),
            kl=zero if kl is None else kl.detach().sum(),
            entropy=result.entropy.sum(),
        )
        return outputs, sums

    def loss(self, sums, counts: WindowCounts, *, normalization: str = "token", world_size: int = 1):
        """The micro-batch's share of the step: :func:`normalize_policy_loss` over the window's counts (all ranks).

        ``normalization="micro_batch"`` is the legacy per-micro-batch mean divided by k (TRL's ``bnpo``, its GRPO and
        Dr. GRPO divided by GA), kept for comparisons; it depends on the split.
        """
        if normalization == "micro_batch":
            return self.mean_loss(sums) / max(counts.num_micro_batches, 1)
        if normalization != "token":
            raise ValueError(
                f"PolicyGradientObjective: normalization={normalization!r} does not apply; its loss_type "
                f"({self.loss_type!r}) says what the step divides by ('sequence' for GRPO's per-completion mean)."
            )
        tokens, completions = counts.units[0], counts.units[1]
        return normalize_policy_loss(
            sums.loss, self.loss_type, tokens, completions, self.max_completion_length, world_size
        )

    def mean_loss(self, sums):
        return normalize_policy_loss(
            sums.loss, self.loss_type, int(sums.num_tokens), int(sums.num_completions), self.max_completion_length
        )

    # ---- what is logged ----------------------------------------------------------------------------------------
    def metric_sums(self, sums):
        return torch.stack([t.detach().float() for t in sums])

    def metric_logs(self, totals, prefix: str = "") -> dict[str, float]:
        loss, tokens, completions, low, high, kl, entropy = totals[:7]
        denominator = {
            "token": tokens,
            "sequence": completions,
            "dr_grpo": completions * (self.max_completion_length or 0),
        }
        den = denominator[self.loss_type]
        logs = {
            f"{prefix}loss": loss / den if den else math.nan,
            f"{prefix}num_completion_tokens": int(tokens),
            f"{prefix}num_completions": int(completions),
        }
        if tokens:
            logs[f"{prefix}entropy"] = entropy / tokens
            if self.beta > 0:
                logs[f"{prefix}kl"] = kl / tokens
            logs[f"{prefix}clip_ratio/low_mean"] = low / tokens
            logs[f"{prefix}clip_ratio/high_mean"] = high / tokens
            logs[f"{prefix}clip_ratio/region_mean"] = (low + high) / tokens
        return logs

    def __repr__(self) -> str:
        return (
            f"PolicyGradientObjective(loss_type={self.loss_type!r}, epsilon={self.epsilon}, "
            f"epsilon_high={self.epsilon_high}, beta={self.beta})"
        )


def get_completion_targets(batch: Mapping[str, Any]) -> torch.Tensor:
    """The completion tokens aligned with the positions that predict them (:func:`hfacc.ops.loss.shift_labels`)."""
    return shift_labels(
        batch["labels"], position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask")
    )


def get_target_rows(batch: Mapping[str, Any], targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(rows, n)``: the original row (completion) of each target, in the order of ``targets != -100``, and n rows.

    Padding-free layouts say it with ``sequence_ids``; rows packed by the user (several completions in a row, with
    no row of their own for ``advantages``) are refused.
    """
    mask = targets != IGNORE_INDEX
    if batch.get("sequence_ids") is not None:
        return batch["sequence_ids"][mask], int(batch["num_sequences"])
    if packed_position_ids(batch) is not None:
        raise ValueError(
            "PolicyGradientObjective: rows packed with several completions have one 'advantages' value for all of "
            "them. Give one completion per row; hfacc lays micro-batches out padding-free itself (padding_free=True)."
        )
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand(mask.shape)
    return rows[mask], mask.shape[0]


def get_aligned_values(values: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """Per-token values given aligned with ``labels`` (``values[t]`` belongs to token t), read at the targets ``mask``.

    The target of position t is token t + 1 (:func:`hfacc.ops.loss.shift_labels`), so its value is ``values[t + 1]``:
    the values shift exactly as the labels do, inside each packed row too (``mask`` is False where the next position
    starts another sequence).
    """
    if values is None:
        return None
    if values.shape != mask.shape:
        raise ValueError(
            f"per-token values of shape {tuple(values.shape)} do not match the labels {tuple(mask.shape)}"
        )
    return F.pad(values[..., 1:], (0, 1))[mask].float()


def _inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    inputs = {k: v for k, v in model_inputs(batch).items() if k not in POLICY_KEYS}
    if packed_position_ids(inputs) is not None:
        inputs["use_cache"] = False  # with a cache, transformers does not keep packed sequences apart
    return inputs


__all__ = [
    "PolicyGradientObjective",
    "PolicyGradientSums",
    "clipped_surrogate_loss",
    "k3_kl",
    "importance_sampling_weights",
    "policy_gradient_sums",
    "normalize_policy_loss",
    "get_completion_targets",
    "get_aligned_values",
    "LOSS_TYPES",
    "IMPORTANCE_SAMPLING_MODES",
]
