"""Per-token log-probabilities of given tokens, from the final hidden states in chunks: never the full logits.

Preference (DPO) and policy-gradient (GRPO) losses need ``log p(y_t | y_<t)`` of a sequence's own tokens. Unlike
cross-entropy (:mod:`hfacc.ops.fused_loss`), whose gradient can be formed in the forward because the loss is linear in
the per-token losses, these losses are non-linear in the log-probs (a sigmoid of a margin, a clipped ratio): the
weight of each token's gradient is known only after the whole forward. So the kernel here keeps what a chunk's logits
are made from — the hidden states of the target positions (``[N, H]``, small) and the projection — and recomputes
each chunk's logits in backward. One ``[chunk, V]`` block of fp32 logits exists at a time, in both passes.

Three layers, as in :mod:`hfacc.ops.fused_loss`:

- :func:`linear_logprobs_chunk` and :func:`linear_logprobs_chunk_grad`, pure functions of one chunk (tested against
  autograd in ``tests/test_logprobs.py``);
- ``_LinearLogProbs``, a thin ``torch.autograd.Function`` over the chunks;
- :class:`LogProbHead`, run in place of the output projection's forward
  (:func:`hfacc.ops.fused_loss.swap_output_head`), and :func:`get_token_logprobs`, which runs a model either that way
  or from its full logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .fused_loss import fused_loss_problem, swap_output_head
from .loss import IGNORE_INDEX
from .model_io import get_base_model, get_logits
from .precision import get_compute_dtype


def chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float = 1.0
) -> torch.Tensor:
    """``(hidden @ weight.T + bias) / temperature`` in fp32: the logits of one chunk of rows."""
    logits = F.linear(hidden, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


def linear_logprobs_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps, entropy)`` of one chunk: rows ``hidden`` ``[n, H]``, tokens ``targets`` ``[n]``.

    With ``logits = (hidden @ weight.T + bias) / temperature`` (fp32, :func:`chunk_logits`):
    ``logps[t] = logits[t, y_t] - lse_t`` (the log-softmax at the target) and
    ``entropy[t] = -sum_c p_{t,c} log p_{t,c}``, the entropy of the position's next-token distribution.
    """
    logits = chunk_logits(hidden, weight, bias, temperature)
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(1, targets[:, None]).squeeze(1) - lse
    log_p = logits.sub_(lse[:, None])  # in place over the logits
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logps, entropy


def linear_logprobs_chunk_grad(
    logits: torch.Tensor, targets: torch.Tensor, grad_logps: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The gradient of ``sum_t grad_logps[t] * logps[t]`` with respect to the chunk's *unscaled* logits ``z``.

    ``logits = z / T`` (:func:`chunk_logits`), so ``d logps[t] / d z[t, c] = (1[c = y_t] - softmax(logits)[t, c]) / T``.
    Computed in place over ``logits``' buffer: one ``[n, V]`` block in all.
    """
    lse = torch.logsumexp(logits, dim=-1)
    grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
    grad.mul_(-grad_logps[:, None])
    grad[torch.arange(len(targets), device=targets.device), targets] += grad_logps
    if temperature != 1.0:
        grad /= temperature
    return grad


def _default_chunk_size(vocab: int) -> int:
    # 2**22 fp32 logits (16 MiB) per chunk, as the fused loss: small against the model, big enough for matmuls.
    return max(32, 2**22 // max(vocab, 1))


class _LinearLogProbs(torch.autograd.Function):
    """``logps[t] = log_softmax(h_t W^T + b)[y_t]``, chunk by chunk; backward recomputes each chunk's logits.

    Why recompute: keeping the logits for backward is the ``[N, V]`` tensor this kernel exists to avoid, and the
    loss's weights ``dL/dlogps`` are not known in the forward (they depend on the whole sequence's log-prob). The
    saved tensors are the inputs (``h`` of the target positions, ``W``, ``b``), as for a plain ``nn.Linear``, so
    distributed engines that gather a sharded weight for the head's backward (FSDP2, ZeRO-3) see what they expect.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature):
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            chunk = slice(start, min(start + chunk_size, n))
            logps[chunk], entropy[chunk] = linear_logprobs_chunk(
                hidden[chunk], weight, bias, targets[chunk], temperature
            )
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        # fp32 accumulators: the gradient of W is a sum over all chunks.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            chunk = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
            h = hidden[chunk]
            logits = chunk_logits(h, weight, bias, ctx.temperature)  # recomputed: never kept from the forward
            grad_logits = linear_logprobs_chunk_grad(
                logits, targets[chunk], grad_logps[chunk].float(), ctx.temperature
            )
            if grad_hidden is not None:
                grad_hidden[chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h.float())
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_size: int = 0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps, entropy)`` ``[N]`` of ``targets`` under ``hidden @ weight.T + bias`` (fp32), never all the logits.

    ``hidden`` ``[N, H]`` are the final hidden states of the N target positions only; ``logps`` is differentiable
    (with respect to ``hidden``, ``weight`` and ``bias``), ``entropy`` is not. Same numbers as
    ``log_softmax(logits)`` on the full logits, to fp32 rounding.
    """
    if chunk_size <= 0:
        chunk_size = _default_chunk_size(weight.shape[0])
    return _LinearLogProbs.apply(hidden, weight, bias, targets, chunk_size, temperature)


class TokenLogProbs(NamedTuple):
    """Log-probabilities of a batch's targets, in the row-major order of ``targets != -100``.

    Args:
        logps: ``[N]`` fp32, differentiable: ``log p(y_t | y_<t)`` of each target.
        entropy: ``[N]`` fp32, no gradient: the entropy of each target position's next-token distribution.
        mask: ``[B, T]`` booleans, where the targets are (the positions ``logps`` belong to).
    """

    logps: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor


class LogProbHead:
    """The output projection's ``forward`` for one model forward: it returns the targets' log-probs ``[N]``.

    Swapped in with :func:`hfacc.ops.fused_loss.swap_output_head`, like :class:`hfacc.ops.fused_loss.FusedOutputHead`:
    the head module stays in the model and is called as usual, so the hooks of distributed engines run around this code
    (the weight is gathered where it is sharded), and the loss must be backpropagated from the tensor the model
    returns in place of its logits.
    """

    def __init__(self, head: nn.Linear, targets: torch.Tensor, chunk_size: int = 0, temperature: float = 1.0):
        self.head, self.targets, self.chunk_size, self.temperature = head, targets, chunk_size, temperature
        self.result: TokenLogProbs | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != self.targets.shape:
            raise RuntimeError(
                f"log-probs: hidden states {tuple(hidden.shape)} do not match the targets {tuple(self.targets.shape)}"
            )
        mask = self.targets != IGNORE_INDEX
        logps, entropy = linear_logprobs(
            hidden[mask],
            self.head.weight,
            self.head.bias,
            self.targets[mask],
            chunk_size=self.chunk_size,
            temperature=self.temperature,
        )
        self.result = TokenLogProbs(logps, entropy, mask)
        return logps


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> TokenLogProbs:
    """:class:`TokenLogProbs` from full logits ``[B, T, V]`` aligned with ``targets`` ``[B, T]`` (the plain path)."""
    mask = targets != IGNORE_INDEX
    rows = logits[mask].float()
    if temperature != 1.0:
        rows = rows / temperature
    logp_all = rows.log_softmax(-1)
    logps = logp_all.gather(1, targets[mask][:, None]).squeeze(1)
    entropy = -(logp_all.detach().exp() * logp_all.detach()).sum(-1)
    return TokenLogProbs(logps, entropy, mask)


def get_token_logprobs(
    model: nn.Module,
    inputs: Mapping[str, Any],
    targets: torch.Tensor,
    *,
    fused: bool = True,
    chunk_size: int = 0,
    temperature: float = 1.0,
) -> tuple[Any, TokenLogProbs]:
    """Run ``model`` on ``inputs``; return its outputs and the :class:`TokenLogProbs` of ``targets`` (aligned with
    the positions that predict them, e.g. :func:`hfacc.ops.loss.shift_labels`).

    ``fused``: from the final hidden states in chunks (:class:`LogProbHead`); the returned ``logps`` is then what the
    model returned in place of its logits, so that FSDP2/ZeRO-3 see the backward they hooked. Otherwise from the
    model's full logits.
    """
    if not fused:
        outputs = model(**inputs)
        return outputs, logprobs_from_logits(get_logits(outputs), targets, temperature)
    head = LogProbHead(get_base_model(model).get_output_embeddings(), targets, chunk_size, temperature)
    with swap_output_head(model, head):
        outputs = model(**inputs)
    result = head.result
    returned = get_logits(outputs)
    if returned.requires_grad and returned.shape == result.logps.shape:
        result = result._replace(logps=returned)
    return outputs, result


@torch.no_grad()
def check_fused_logprobs(
    model: nn.Module, inputs: Mapping[str, Any], targets: torch.Tensor, temperature: float = 1.0
) -> str | None:
    """Run ``inputs`` both ways; None if the chunked log-probs equal those of the model's own logits, else why not.

    This catches what a model does after its output projection (soft-capping, scaling) that the chunked path would
    skip, and a head that cannot be taken apart (:func:`hfacc.ops.fused_loss.fused_loss_problem`).
    """
    problem = fused_loss_problem(model)
    if problem is not None:
        return problem
    was_training = model.training
    model.eval()  # dropout would make the two runs differ for reasons that have nothing to do with the fusion
    try:
        try:
            outputs, fused = get_token_logprobs(model, inputs, targets, fused=True, temperature=temperature)
        except Exception as err:  # a model whose forward does something unexpected with the projection's output
            return f"the chunked log-prob forward failed ({type(err).__name__}: {err})"
        _, plain = get_token_logprobs(model, inputs, targets, fused=False, temperature=temperature)
    finally:
        model.train(was_training)
    returned = get_logits(outputs)
    if returned.shape != fused.logps.shape or not torch.equal(returned.float(), fused.logps):
        return "the model post-processes its logits (e.g. soft-capping or scaling)"
    # The precision the two runs computed in (hfacc.setup.layout_check runs this check in fp32 for fp32 weights).
    tolerance = 1e-5 if get_compute_dtype(model) == torch.float32 else 2e-2
    scale = plain.logps.abs().max().clamp(min=1.0)
    difference = ((fused.logps - plain.logps).abs().max() / scale).item() if plain.logps.numel() else 0.0
    if not difference <= tolerance:
        return f"the chunked log-probs differ from the model's own logits by {difference:.1e}"
    return None


__all__ = [
    "chunk_logits",
    "linear_logprobs_chunk",
    "linear_logprobs_chunk_grad",
    "linear_logprobs",
    "TokenLogProbs",
    "LogProbHead",
    "logprobs_from_logits",
    "get_token_logprobs",
    "check_fused_logprobs",
]
