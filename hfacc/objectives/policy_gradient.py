"""Policy gradients on a rollout (the GRPO family: GRPO, DAPO, Dr. GRPO): exact over what each optimizer step consumes.

A rollout row is a prompt and one sampled completion: ``input_ids``, ``labels`` (-100 outside the completion), one
``advantages`` float, and optionally ``old_logps`` (the sampling policy's log-prob of each completion token) and
``ref_logps`` (the reference's). Per completion token t, with ``r_t = exp(logp_t - old_logp_t)``:

    l_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps_high) A)  (+ beta * KL_t, the k3 estimate to the reference)

and the step's loss divides the sum of l over everything the optimizer step consumes (all micro-batches, all ranks)
by the loss type's unit, counted the same way:

- ``"token"`` (DAPO): ``sum_t l_t / N_tokens``;
- ``"sequence"`` (GRPO): ``sum_b mean_{t in b} l_t / N_completions``;
- ``"dr_grpo"``: ``sum_t l_t / (N_completions * max_completion_length)``;
- ``"cispo"`` (MiniMax-M1): ``l_t = -sg(min(r_t, eps_high)) A log pi_t``, divided as ``"token"``;
- ``"sapo"``: ``l_t = -(4 / tau) sigmoid(tau (r_t - 1)) A`` (tau: ``sapo_temperature_pos`` for A > 0, else
  ``_neg``), divided as ``"sequence"`` (TRL's rule for both).

``importance_sampling_level="sequence"`` (GSPO) replaces ``r_t`` by one ratio per completion b,
``r_b = exp(mean_{t in b}(logp_t - old_t))``, for every token of b (clipped once per completion). Its unit is the
completion: every token of b must be in the micro-batch that computes ``r_b``. A completion is one row and
micro-batches (padded or padding-free) are sets of whole rows, so that always holds here; the mean is taken over
the completion's ``sequence_ids`` (padding-free) or its row, never over a packed row or a micro-batch.

A rollout sampled by another engine than the trained model (vLLM) may carry ``importance_weights``: one fixed weight
``w_t`` per completion token, the importance-sampling correction of the sampler's mismatch
(:func:`importance_sampling_weights`); then ``l_t = -w_t min(r_t A, clip(r_t) A) (+ beta KL_t)``. The weights are
data, fixed before the first backward, so the step stays exact over the same units.

The unit exists only after the rollout and a rollout is split over micro-batches, ranks and optimizer steps, so this
is the method's best-known bug class (normalizing by each micro-batch's own tokens: 0.59 relative error at bs 2 x
GA 4 on a fixed rollout, notebook 07). Here the window counts the units before the first backward, as for SFT.

The math is in pure functions (:func:`clipped_surrogate_loss`, :func:`cispo_loss`, :func:`sapo_loss`,
:func:`sequence_log_ratio`, :func:`k3_kl`, :func:`importance_sampling_weights`, :func:`policy_gradient_sums`,
:func:`normalize_policy_loss`); :class:`PolicyGradientObjective` reads a batch and routes them.
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

LOSS_TYPES = ("token", "sequence", "dr_grpo", "cispo", "sapo")
# The unit each loss type divides by (TRL: cispo sums over the step's tokens as dapo does, sapo averages per
# completion as grpo does).
LOSS_UNITS = {"token": "token", "sequence": "sequence", "dr_grpo": "dr_grpo", "cispo": "token", "sapo": "sequence"}
# TRL's GRPOConfig.importance_sampling_level: one ratio per token, or one per completion (GSPO).
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
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


def sequence_log_ratio(log_ratio: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """GSPO's length-normalized log-ratio of each completion, given back per token ``[N]``.

    ``s_b = (1 / n_b) sum_{t in b} (logp_t - old_t)`` over all ``n_b`` tokens of completion b (``rows`` names each
    token's completion); token t of b gets ``s_b``, differentiable through every token of b. ``r_b = exp(s_b)``.

    >>> sequence_log_ratio(torch.tensor([0.2, 0.4, -1.0]), torch.tensor([0, 0, 1]), 2)
    tensor([ 0.3000,  0.3000, -1.0000])
    """
    sums = log_ratio.new_zeros(num_rows).index_add(0, rows, log_ratio)
    counts = torch.bincount(rows, minlength=num_rows).clamp(min=1)
    return (sums / counts.to(log_ratio.dtype))[rows]


def cispo_loss(
    log_ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1) per token: ``(loss, clipped)``, both ``[N]``.

    ``loss_t = -sg(min(r_t, epsilon_high)) * A_t * logp_t`` with ``r_t = exp(log_ratio_t)``: the ratio is detached
    and capped, so every token keeps the gradient ``-min(r_t, epsilon_high) A_t grad(logp_t)`` (no token's gradient is
    dropped by a clip). ``epsilon_high`` is the cap on the ratio itself (TRL's meaning; ScaleRL uses 5.0).
    ``clipped`` is ``r_t > epsilon_high`` with ``A_t > 0`` (TRL's ``cispo_clip_ratio``).

    >>> loss, clipped = cispo_loss(torch.tensor([0.0, 2.0]), torch.tensor([-1.0, -1.0]), torch.ones(2), 5.0)
    >>> loss, clipped  # r = 1, and e^2 = 7.4 capped at 5
    (tensor([1., 5.]), tensor([False,  True]))
    """
    ratio = torch.exp(log_ratio.detach())
    loss = -torch.clamp(ratio, max=epsilon_high) * advantages * logps
    return loss, (ratio > epsilon_high) & (advantages > 0)


def sapo_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float = 1.0, temperature_neg: float = 1.05
) -> torch.Tensor:
    """SAPO's soft gate per token ``[N]``: ``loss_t = -(4 / tau_t) * sigmoid(tau_t * (r_t - 1)) * A_t``.

    ``r_t = exp(log_ratio_t)``, ``tau_t = temperature_pos`` where ``A_t > 0``, else ``temperature_neg`` (TRL's
    ``sapo_temperature_pos`` / ``_neg``). At ``r = 1`` the gradient is ``-A grad(logp)``, as the clipped surrogate's;
    away from 1 it fades smoothly instead of dropping to 0 at a bound.

    >>> sapo_loss(torch.zeros(2), torch.tensor([1.0, -1.0]))  # r = 1: -(4 / tau) * 0.5 * A
    tensor([-2.0000,  1.9048])
    """
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg).to(log_ratio.dtype)
    return -(4 / tau) * torch.sigmoid(tau * (torch.exp(log_ratio) - 1)) * advantages


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
    - ``"dr_grpo"``: ``P * S / (N_completions * max_completion_length)``;
    - ``"cispo"`` as ``"token"``, ``"sapo"`` as ``"sequence"``.

    Summed over the window and averaged over the ranks (DDP), that is the loss of one batch holding the whole step.
    A step without completions gives 0 instead of 0 / 0.
    """
    if loss_type not in LOSS_UNITS:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    unit = LOSS_UNITS[loss_type]  # cispo divides as token, sapo as sequence
    if unit == "token":
        denominator = num_tokens
    elif unit == "sequence":
        denominator = num_completions
    else:
        denominator = num_completions * max_completion_length
    return loss_sum * (world_size / max(denominator, 1))


class PolicyGradientSums(NamedTuple):
    """Sums over the completion tokens of one micro-batch (the loss's, differentiable; the rest detached).

    Args:
        loss: what the loss type divides: ``sum_t l_t`` (token, dr_grpo, cispo) or ``sum_b mean_{t in b} l_t``
            (sequence, sapo).
        num_tokens: completion tokens.
        num_completions: completions with at least one token.
        clipped_low, clipped_high: tokens whose ratio was clipped below (A < 0) / above (A > 0); completions at
            ``importance_sampling_level="sequence"``; for ``"cispo"`` ``clipped_high`` counts the capped ratios.
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
        importance_sampling_level: ``"token"`` (one ratio per token) or ``"sequence"`` (GSPO: one length-normalized
            ratio per completion, :func:`sequence_log_ratio`; TRL's setting of the same name).
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for A > 0 and A <= 0 (TRL's names).

    ``loss_type`` adds ``"cispo"`` (:func:`cispo_loss`, ``epsilon_high`` is its cap on the ratio and must be set)
    and ``"sapo"`` (:func:`sapo_loss`) to the clipped surrogate's three normalizations.

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
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
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
        if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level={importance_sampling_level!r}: use one of {list(IMPORTANCE_SAMPLING_LEVELS)}."
            )
        if loss_type == "cispo" and epsilon_high is None:
            raise ValueError(
                "loss_type='cispo' caps the ratio at epsilon_high itself (TRL's meaning, not 1 + epsilon_high): set "
                "epsilon_high (ScaleRL: 5.0); left unset, TRL would cap it at epsilon."
            )
        if loss_type == "cispo" and epsilon_high <= 1:
            raise ValueError(
                f"loss_type='cispo' caps the ratio at epsilon_high itself: epsilon_high={epsilon_high} <= 1 caps even "
                "the on-policy ratio 1 (a PPO bound like 0.28 does not carry over); set epsilon_high > 1 (ScaleRL: 5.0)."
            )
        if not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
            raise ValueError(
                f"sapo_temperature_pos={sapo_temperature_pos}, sapo_temperature_neg={sapo_temperature_neg}: both > 0."
            )
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: it must be > 0.")
        self.loss_type, self.epsilon, self.beta = loss_type, epsilon, beta
        self.epsilon_high = epsilon if epsilon_high is None else epsilon_high
        self.ref_model, self.max_completion_length, self.temperature = ref_model, max_completion_length, temperature
        self.reference = None  # built by setup() when beta > 0 and the rows carry no ref_logps
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
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
        token_advantages = advantages.to(logps.dtype)[rows]
        log_ratio = logps - old
        if self.importance_sampling_level == "sequence":  # GSPO: every token of the completion is in this batch
            log_ratio = sequence_log_ratio(log_ratio, rows, num_rows)
        if self.loss_type == "cispo":
            per_token, high = cispo_loss(log_ratio, logps, token_advantages, self.epsilon_high)
            low = torch.zeros_like(high)
        elif self.loss_type == "sapo":
            per_token = sapo_loss(log_ratio, token_advantages, self.sapo_temperature_pos, self.sapo_temperature_neg)
            low = high = torch.zeros_like(per_token, dtype=torch.bool)
        else:
            per_token, low, high = clipped_surrogate_loss(
                log_ratio, torch.zeros_like(log_ratio), token_advantages, self.epsilon, self.epsilon_high
            )
        if self.importance_sampling_level == "sequence":  # clipped completions, as TRL counts them at this level
            low = _any_per_row(low, rows, num_rows)
            high = _any_per_row(high, rows, num_rows)
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
            loss=sequence_sum if LOSS_UNITS[self.loss_type] == "sequence" else token_sum,
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
        den = denominator[LOSS_UNITS[self.loss_type]]
        logs = {
            f"{prefix}loss": loss / den if den else math.nan,
            f"{prefix}num_completion_tokens": int(tokens),
            f"{prefix}num_completions": int(completions),
        }
        if tokens:
            logs[f"{prefix}entropy"] = entropy / tokens
            if self.beta > 0:
                logs[f"{prefix}kl"] = kl / tokens
            # TRL's clip metrics: per token, or per completion at importance_sampling_level="sequence".
            unit = completions if self.importance_sampling_level == "sequence" else tokens
            if self.loss_type == "cispo":
                logs[f"{prefix}cispo_clip_ratio"] = high / max(unit, 1)
            elif self.loss_type != "sapo":  # TRL logs no clip metric for SAPO's gate
                logs[f"{prefix}clip_ratio/low_mean"] = low / max(unit, 1)
                logs[f"{prefix}clip_ratio/high_mean"] = high / max(unit, 1)
                logs[f"{prefix}clip_ratio/region_mean"] = (low + high) / max(unit, 1)
        return logs

    def __repr__(self) -> str:
        return (
            f"PolicyGradientObjective(loss_type={self.loss_type!r}, epsilon={self.epsilon}, "
            f"epsilon_high={self.epsilon_high}, beta={self.beta}, "
            f"importance_sampling_level={self.importance_sampling_level!r})"
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


def _any_per_row(flags: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-token flags ``[N]`` to one flag per completion that has any (``[num_rows]``): a sequence-level count."""
    return flags.new_zeros(num_rows, dtype=torch.long).index_add(0, rows, flags.long()) > 0


def _inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    inputs = {k: v for k, v in model_inputs(batch).items() if k not in POLICY_KEYS}
    if packed_position_ids(inputs) is not None:
        inputs["use_cache"] = False  # with a cache, transformers does not keep packed sequences apart
    return inputs


__all__ = [
    "PolicyGradientObjective",
    "PolicyGradientSums",
    "clipped_surrogate_loss",
    "cispo_loss",
    "sapo_loss",
    "sequence_log_ratio",
    "k3_kl",
    "importance_sampling_weights",
    "policy_gradient_sums",
    "normalize_policy_loss",
    "get_completion_targets",
    "get_aligned_values",
    "LOSS_TYPES",
    "LOSS_UNITS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "IMPORTANCE_SAMPLING_MODES",
]
