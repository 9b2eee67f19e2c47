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

Losses that compare whole next-token distributions (distillation) are linear in their per-token terms again, so
:func:`chunked_linear_loss` forms their gradient in the forward, a chunk at a time, as the fused cross-entropy does,
for any per-chunk loss given as a function of the chunk's logits (:class:`LossHead` runs it inside a model's
forward); :class:`HiddenStatesHead` keeps a frozen model's final hidden states at the targets and its projection,
so that another model's loss can compute that model's logits chunk by chunk too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


# ---- losses over whole next-token distributions, linear in their per-token terms ------------------------------
# A chunk's loss: (logits [n, V] fp32 of rows `rows` of the N targets, with_grad) -> (losses [n], d sum(losses) /
# d logits [n, V] or None, per-target statistics [n, E] that take no gradient).
ChunkLoss = Callable[[torch.Tensor, slice, bool], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


class _ChunkedLinearLoss(torch.autograd.Function):
    """``S = sum_t loss_t(h_t W^T + b)``, its gradients formed in the forward, chunk by chunk.

    Why backward may just scale what forward computed (as :mod:`hfacc.ops.fused_loss` does for cross-entropy): the
    loss backpropagated is ``S * c`` for a scalar c that depends on none of ``h``, ``W``, ``b`` (``c = P / N``, the
    window normalization is linear in the sums). So ``dL/dh = c * dS/dh``: the gradients of S, computed while each
    chunk's logits exist, times the incoming gradient. One ``[chunk, V]`` block of logits (and the loss's own
    temporaries) exists at a time, and no logits are kept for backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, chunk_loss, chunk_size, num_stats):
        n = hidden.shape[0]
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        # fp32 accumulators: the gradient of W is a sum over all chunks.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if bias is not None and needs[2]
            else None
        )
        with_grad = grad_hidden is not None or grad_weight is not None or grad_bias is not None
        losses = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        stats = torch.zeros(n, num_stats, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            h = hidden[rows]
            losses[rows], grad_logits, stats[rows] = chunk_loss(chunk_logits(h, weight, bias), rows, with_grad)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h.float())  # in place: no [V, H] temporary per chunk
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.mark_non_differentiable(losses, stats)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return losses.sum(), losses, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_losses, _grad_stats):
        if getattr(ctx, "done", False):
            raise RuntimeError("the chunked loss scales its stored gradients in place: backward through it only once")
        ctx.done = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden.mul_(grad_loss.to(grad_hidden.dtype)),
            None if grad_weight is None else grad_weight.mul_(grad_loss).to(ctx.dtypes[0]),
            None if grad_bias is None else grad_bias.mul_(grad_loss).to(ctx.dtypes[1]),
            None,
            None,
            None,
        )


def chunked_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_loss: ChunkLoss,
    *,
    num_stats: int,
    chunk_size: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(S, losses, stats)``: ``S = sum_t losses[t]`` over the N rows of ``hidden`` ``[N, H]`` (differentiable with
    respect to ``hidden``, ``weight``, ``bias``), where ``chunk_loss(logits, rows, with_grad)`` gives the losses of
    one chunk of rows from its logits ``hidden[rows] @ weight.T + bias`` (fp32), their gradient with respect to those
    logits, and ``num_stats`` statistics per row (no gradient).

    The full ``[N, V]`` logits never exist; the gradient is formed in the forward, so ``S`` may enter the loss only
    linearly (times a constant) and be backpropagated once (see ``_ChunkedLinearLoss``).
    """
    if chunk_size <= 0:
        chunk_size = _default_chunk_size(weight.shape[0])
    return _ChunkedLinearLoss.apply(hidden, weight, bias, chunk_loss, chunk_size, num_stats)


class LossHead:
    """The output projection's ``forward`` for one model forward: it returns a chunked loss sum over the targets.

    Like :class:`LogProbHead` (swapped in with :func:`hfacc.ops.fused_loss.swap_output_head`): the head module is
    called as usual, so distributed engines gather a sharded weight around this code; backpropagate from what the
    model returns in place of its logits. ``make_loss(mask)`` gives the :data:`ChunkLoss` of the batch's target rows
    (``targets != -100``, row-major); ``result`` is :func:`chunked_linear_loss`'s ``(S, losses, stats)``.
    """

    def __init__(
        self,
        head: nn.Linear,
        targets: torch.Tensor,
        chunk_loss: ChunkLoss,
        num_stats: int,
        chunk_size: int = 0,
        vocab_size: int | None = None,
    ):
        self.head, self.targets, self.chunk_loss, self.num_stats = head, targets, chunk_loss, num_stats
        self.chunk_size, self.vocab_size = chunk_size, vocab_size
        self.result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != self.targets.shape:
            raise RuntimeError(
                f"chunked loss: hidden states {tuple(hidden.shape)} do not match the targets "
                f"{tuple(self.targets.shape)}"
            )
        weight, bias = get_head_weights(self.head, self.vocab_size)
        mask = self.targets != IGNORE_INDEX
        self.result = chunked_linear_loss(
            hidden[mask], weight, bias, self.chunk_loss, num_stats=self.num_stats, chunk_size=self.chunk_size
        )
        return self.result[0]


def get_head_weights(head: nn.Module, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output projection's ``(weight, bias)`` as its forward sees them, cut to the first ``vocab_size`` rows
    (a vocabulary padded beyond the tokenizer: its extra rows are no token). Read inside the head's forward, where
    FSDP2 and ZeRO-3 have gathered a sharded weight."""
    weight, bias = head.weight, head.bias
    if vocab_size is not None and vocab_size < weight.shape[0]:
        weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    return weight, bias


class HiddenStatesHead:
    """The output projection's ``forward`` of a frozen model, for one forward: it keeps the final hidden states at
    the ``mask`` positions (``[N, H]``) and the projection's weight and bias, and returns a 0-d zero in place of the
    logits, so the model's ``[B, T, V]`` logits never exist. Another model's :class:`LossHead` then computes this
    model's logits of each chunk from them (``chunk_logits(hidden[rows], weight, bias)``).

    ``copy_weight``: keep a copy of the weight, for a weight that is sharded (FSDP2, ZeRO-3): gathered only for the
    head's forward, it is released after it. Unsharded, the weight itself is kept (no copy).
    """

    def __init__(self, head: nn.Module, mask: torch.Tensor, copy_weight: bool = False, vocab_size: int | None = None):
        self.head, self.mask, self.copy_weight, self.vocab_size = head, mask, copy_weight, vocab_size
        self.hidden = self.weight = self.bias = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != self.mask.shape:
            raise RuntimeError(
                f"hidden states {tuple(hidden.shape)} do not match the target mask {tuple(self.mask.shape)}"
            )
        weight, bias = get_head_weights(self.head, self.vocab_size)
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        if self.copy_weight:
            weight, bias = weight.clone(), None if bias is None else bias.clone()
        self.hidden, self.weight, self.bias = hidden[self.mask].detach(), weight, bias
        return hidden.new_zeros(())


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
    "ChunkLoss",
    "chunked_linear_loss",
    "LossHead",
    "HiddenStatesHead",
    "get_head_weights",
]
