"""The fused loss: the output projection and cross-entropy computed together, a chunk of target rows at a time.

Three layers, each readable on its own:

- :func:`linear_cross_entropy_chunk`, a pure function: the losses of one chunk and the gradient of their sum with
  respect to the chunk's logits (tested against autograd in ``tests/test_fused.py``);
- ``_FusedLinearCrossEntropy``, a thin ``torch.autograd.Function`` that runs the chunks in its forward and keeps
  only the gradients of the inputs (never the logits);
- :class:`FusedOutputHead` and :func:`swap_output_head`, which run it inside a model's own forward in place of its
  output projection's, so the full ``[B, T, V]`` logits never exist; :func:`fused_loss_problem` says whether a
  model's output projection can be taken apart like this (hfacc.ops.logprobs swaps it the same way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from .loss import IGNORE_INDEX, LossSums
from .model_io import get_base_model

try:  # FSDP2 and DTensor (torch >= 2.6); without them no weight is FSDP2-sharded
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:
    FSDPModule = DTensor = None


def linear_cross_entropy_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    label_smoothing: float = 0.0,
    with_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(losses, correct, grad_logits)`` of one chunk: rows ``hidden`` ``[n, H]`` against ``targets`` ``[n]``.

    ``logits = hidden @ weight.T + bias`` in fp32; ``losses[t] = (1 - eps) * (lse_t - logit_{t, y_t}) + eps *
    (lse_t - mean_c logit_{t, c})`` (``torch.nn.functional.cross_entropy`` with ``label_smoothing=eps``);
    ``correct[t] = argmax_c logit_{t, c} == y_t``; and the gradient of ``sum_t losses[t]`` with respect to the
    logits, ``softmax(logits) - (1 - eps) * onehot(y) - eps / V`` (None without ``with_grad``). The softmax is
    computed in place over the logits' buffer: one ``[n, V]`` block of memory in all.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, targets[:, None]).squeeze(1)
    if label_smoothing:
        smooth = lse - logits.mean(dim=-1)  # mean over classes of -log p_c
        losses = (1 - label_smoothing) * nll + label_smoothing * smooth
    else:
        losses = nll
    correct = logits.argmax(dim=-1) == targets
    if not with_grad:
        return losses, correct, None
    grad_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in place: one [chunk, V] block at a time
    grad_logits[torch.arange(len(targets), device=targets.device), targets] -= 1 - label_smoothing
    if label_smoothing:
        grad_logits -= label_smoothing / weight.shape[0]
    return losses, correct, grad_logits


def fused_linear_cross_entropy_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunk_size: int = 0,
    label_smoothing: float = 0.0,
) -> tuple[LossSums, torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, without ever holding all the logits.

    ``hidden`` ``[N, H]`` are the final hidden states of the N target positions only (prompt and padding removed),
    ``weight`` ``[V, H]`` the output projection. The sum ``S = sum_t CE(h_t W^T + b, y_t)`` is computed ``chunk_size``
    rows at a time, and so is its gradient, in the same pass: for a chunk,
    ``dS/dlogits = softmax(logits) - (1 - eps) * onehot(y) - eps / V``, then ``dS/dh = dlogits @ W`` and
    ``dS/dW += dlogits^T @ h``. Only one ``[chunk, V]`` block of fp32 logits exists at a time, and no logits are
    kept for backward: backward multiplies the stored gradients by the incoming scalar (S enters the loss
    linearly, ``S_j / N * P``), in place, so it runs once (no ``retain_graph``). Same numbers as the plain path to
    fp32 rounding.

    Returns ``(LossSums, per_target_losses, per_target_correct)``; the per-target vectors (``[N]``, no gradient)
    serve per-sequence sums in evaluation.
    """
    if chunk_size <= 0:
        # 2**22 fp32 logits (16 MiB) per chunk: small against the model, big enough for efficient matmuls.
        chunk_size = max(32, 2**22 // max(weight.shape[0], 1))
    loss, per_target, correct = _FusedLinearCrossEntropy.apply(
        hidden, weight, bias, targets, chunk_size, label_smoothing
    )
    count = torch.tensor(targets.numel(), device=targets.device)
    return LossSums(loss, count, correct.sum()), per_target, correct


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """``S = sum_t CE(h_t W^T + b, y_t)``, with its gradients computed in the forward, chunk by chunk.

    Why backward may just scale what forward computed: the loss that is backpropagated is ``S * c`` for a scalar c
    that does not depend on ``h``, ``W`` or ``b`` (``c = P / N``: hfacc's window normalization is linear in the
    sums, :func:`hfacc.ops.loss.normalize_window_loss`). So ``dL/dh = c * dS/dh``, and likewise for W and b: the
    gradients of S, computed in forward while each chunk's logits exist, times the incoming gradient ``c``. Keeping
    them instead of the logits is what saves the memory; scaling them in place keeps it saved, which is why a second
    backward through the same forward is refused.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, label_smoothing):
        n, vocab = hidden.shape[0], weight.shape[0]
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        # fp32 accumulators: the gradient of W is a sum over all chunks.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_bias = (
            torch.zeros(vocab, dtype=torch.float32, device=weight.device) if bias is not None and needs[2] else None
        )
        with_grad = grad_hidden is not None or grad_weight is not None or grad_bias is not None
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        correct = torch.empty(n, dtype=torch.long, device=hidden.device)
        for start in range(0, n, chunk_size):
            h, y = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            chunk = slice(start, start + len(y))
            losses[chunk], correct[chunk], grad_logits = linear_cross_entropy_chunk(
                h, weight, bias, y, label_smoothing, with_grad
            )
            if grad_hidden is not None:
                grad_hidden[chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h.float())  # in place: no [V, H] temporary per chunk
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.mark_non_differentiable(losses, correct)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return losses.sum(), losses, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_losses, _grad_correct):
        if getattr(ctx, "done", False):
            raise RuntimeError("the fused loss scales its stored gradients in place: backward through it only once")
        ctx.done = True
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        # In place: a second [V, H] buffer would double the memory the fusion saves.
        return (
            None if grad_hidden is None else grad_hidden.mul_(grad_loss.to(grad_hidden.dtype)),
            None if grad_weight is None else grad_weight.mul_(grad_loss).to(ctx.dtypes[0]),
            None if grad_bias is None else grad_bias.mul_(grad_loss).to(ctx.dtypes[1]),
            None,
            None,
            None,
        )


class FusedOutputHead:
    """The output projection's ``forward`` for one model forward: it returns the loss sum instead of logits.

    Only the head's ``forward`` is replaced (:func:`swap_output_head`); the head module itself stays in the model and
    is called as usual, so every hook a distributed engine put on it runs around this code. That is what gathers a
    sharded weight exactly as the engine does for its own forward: FSDP2 has unsharded it (the root's all-gather, or
    the head's own when it is a separate FSDP unit), DeepSpeed ZeRO-3 has gathered its partitions, and ``weight`` is
    read here, at call time, as the full ``[V, H]`` tensor. The engines hook their backward on the returned loss,
    which hands the weight's gradient back to them to reduce and keep only this rank's shard.
    """

    def __init__(self, head: nn.Linear, targets: torch.Tensor, chunk_size: int, label_smoothing: float):
        self.head, self.targets, self.chunk_size, self.label_smoothing = head, targets, chunk_size, label_smoothing
        self.result = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != self.targets.shape:
            raise RuntimeError(
                f"fused loss: hidden states {tuple(hidden.shape)} do not match labels {tuple(self.targets.shape)}"
            )
        mask = self.targets != IGNORE_INDEX
        self.result = fused_linear_cross_entropy_sums(
            hidden[mask],
            self.head.weight,
            self.head.bias,
            self.targets[mask],
            chunk_size=self.chunk_size,
            label_smoothing=self.label_smoothing,
        )
        return self.result[0].loss


@contextlib.contextmanager
def swap_output_head(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]):
    """Run ``forward`` in place of the forward of ``model``'s output projection for the duration of the block."""
    head = get_base_model(model).get_output_embeddings()
    own = head.__dict__.get("forward")  # a forward already set on the instance (rare) is put back afterwards
    head.forward = forward
    try:
        yield head
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def fused_loss_problem(model: nn.Module) -> str | None:
    """Why ``model``'s loss cannot be fused with its output projection, or None if it can be tried.

    A weight sharded by FSDP2 (a ``DTensor``) or DeepSpeed ZeRO-3 (a partitioned parameter) is fine: the engine
    gathers it for the head's forward, inside which the fused loss runs (see
    :class:`hfacc.ops.fused_loss.FusedOutputHead`).
    """
    base = get_base_model(model)
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or not callable(getattr(base, "set_output_embeddings", None)):
        return f"{type(base).__name__} has no get/set_output_embeddings"
    if _module_class(head) is not nn.Linear:
        return f"its output projection is a {type(head).__name__} (e.g. adapted by LoRA), not a plain nn.Linear"
    shape = _gathered_shape(head.weight, base)
    if shape is None and type(head.weight) is nn.Parameter:
        shape = tuple(head.weight.shape)
    if shape is None or len(shape) != 2 or 0 in shape:
        return "its output projection's weight is not a 2-D parameter that hfacc can gather (e.g. FSDP v1 flattens it)"
    return None


def _module_class(module: nn.Module) -> type:
    """The module's own class; FSDP2's ``fully_shard`` swaps it for a subclass ``FSDP<Class>``."""
    cls = type(module)
    if FSDPModule is not None and isinstance(module, FSDPModule):
        return cls.__mro__[getattr(cls, "_orig_cls_mro_index", 2)]
    return cls


def _gathered_shape(weight: torch.Tensor, model: nn.Module) -> tuple[int, ...] | None:
    """The full shape of a weight that FSDP2 or ZeRO-3 shards and gathers for each forward, else None."""
    if hasattr(weight, "ds_shape"):  # DeepSpeed ZeRO-3: the local tensor is empty outside the module's forward
        return tuple(weight.ds_shape)
    if DTensor is not None and isinstance(weight, DTensor) and any(isinstance(m, FSDPModule) for m in model.modules()):
        return tuple(weight.shape)  # FSDP2: a DTensor's shape is the global one
    return None
