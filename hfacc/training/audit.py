"""The training-time audit: every N steps, the window's accumulated gradient against a per-example recomputation."""

from __future__ import annotations

import logging
import math

import torch
from transformers import TrainerCallback

from ..ops.precision import get_compute_dtype as get_model_compute_dtype
from ..runtime.distributed import get_gradient_scale
from .window import compute_micro_batch_loss

logger = logging.getLogger(__name__)


def get_audit_tolerance(dtype: torch.dtype) -> float:
    """The largest audit error that still counts as exact when the training arithmetic runs in ``dtype``.

    The audit compares two computations of the same gradient that are equal in exact arithmetic but round
    differently (micro-batches of different shapes). In fp32 that difference is ~1e-7, and the tolerance 1e-4. In
    half precision it is a fraction of the format's machine epsilon: measured on a tiny Llama under bf16 autocast,
    1.7e-3 to 2.3e-3 (epsilon 2**-7 = 7.8e-3), while ``hfacc verify`` measures bf16's rounding against fp32 at
    5.4e-3. The tolerance is ``max(1e-4, 4 * epsilon)``: 3.1e-2 in bf16, 3.9e-3 in fp16. What breaks equivalence
    (dropout, batch statistics, a mean of micro-batch means) gives errors of 0.1 and more.

    >>> get_audit_tolerance(torch.bfloat16)
    0.03125
    """
    return max(1e-4, 4 * torch.finfo(dtype).eps)


def get_compute_dtype(trainer) -> torch.dtype:
    """The precision the trainer's arithmetic runs in (:func:`hfacc.ops.precision.get_compute_dtype` of its model):
    accelerate's autocast where it wraps the forward (``bf16=True``; ``fp16=True`` autocasts on GPUs only), else the
    dtype most weights are stored in (a bf16 model with fp32 LoRA adapters computes in bf16)."""
    return get_model_compute_dtype(trainer.model)


class AccumulationAuditCallback(TrainerCallback):
    """Audit one window every ``every_n_steps`` optimizer steps during training, and log the error.

    Just before the optimizer step (the trainer's step gate, :class:`hfacc.training.step_gate.StepGate`, runs every
    audit callback first, before it could drop the window), the window's gradient is recomputed from the same
    parameters with every example as its own micro-batch (same window normalization), and compared with the gradient
    training accumulated. Only batch size 1 is ever run, so the audit needs no more memory than training. An exact
    setup gives the rounding of the training precision (~1e-7 in fp32, ~2e-3 in bf16); batch statistics, randomness or
    a mis-normalized loss show up as large errors. The error is logged as ``accumulation_audit_error`` and a warning is
    printed above ``tolerance`` (by default :func:`get_audit_tolerance` of the precision the trainer computes in). RNG
    states are restored afterwards, so an audited run trains exactly like an unaudited one.

    >>> trainer.add_callback(AccumulationAuditCallback(trainer, every_n_steps=100))  # doctest: +SKIP
    """

    def __init__(self, trainer, every_n_steps: int = 100, tolerance: float | None = None):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: it must be >= 1.")
        if tolerance is not None and not tolerance > 0:
            raise ValueError(f"tolerance={tolerance}: it must be > 0 (or None: from the training precision).")
        self.trainer, self.every_n_steps, self.tolerance = trainer, every_n_steps, tolerance
        self.errors: list[tuple[int, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if self.tolerance is None:
            self.tolerance = get_audit_tolerance(get_compute_dtype(self.trainer))

    def audit_step(self, step: int) -> None:
        """Audit the window about to update the weights, if ``step`` is due; called by the step gate, first."""
        trainer = self.trainer
        if step % self.every_n_steps or trainer.window is None or trainer.window.num_targets == 0:
            return
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            logger.warning("hfacc: the accumulation audit needs full local gradients; skipped under DeepSpeed/FSDP.")
            return
        error = audit_window(trainer)
        self.errors.append((step, error))
        trainer.meter.extra["accumulation_audit_error"] = error
        if not error <= self.tolerance:
            logger.warning(
                "hfacc: step %d: the accumulated gradient differs from a per-example recomputation by %.2e (tolerance "
                "%.0e); run `hfacc verify` on this model and data for a diagnosis.",
                step,
                error,
                self.tolerance,
            )


def audit_window(trainer) -> float:
    """Relative error between the trainer's accumulated gradient and a per-example recomputation of its window."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trained = flatten_grads(named)
    saved = [None if p.grad is None else p.grad.detach().clone() for _, p in named]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    accelerator, window, normalization = trainer.accelerator, trainer.window.counts, trainer.args.normalization
    scale = get_gradient_scale(accelerator.distributed_type, accelerator.num_processes)
    try:
        clear_grads(named)
        for batch in trainer.window.batches:
            batch = trainer._prepare_inputs(batch)
            objective = trainer.objective
            examples = objective.num_examples(batch)  # the objective's examples: a preference pair is two rows
            # 'micro_batch' is defined by the micro-batches themselves; the others are invariant to the split.
            pieces = (
                [batch]
                if normalization == "micro_batch"
                else [objective.select_examples(batch, i, i + 1) for i in range(examples)]
            )
            for piece in pieces:
                loss, _, _ = compute_micro_batch_loss(
                    trainer.objective,
                    model,
                    piece,
                    window,
                    normalization=normalization,
                    world_size=scale,
                    statistics=trainer.window.statistics,  # the window's, as training read them
                )
                loss.backward()
        if accelerator.num_processes > 1:
            for _, p in named:  # what DDP's all-reduce does to the trained gradient
                if p.grad is not None:
                    p.grad = accelerator.reduce(p.grad, reduction="mean")
        if trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0:
            # The trained gradient was clipped already; clip the recomputed one the same way.
            torch.nn.utils.clip_grad_norm_([p for _, p in named], trainer.args.max_grad_norm)
        recomputed = flatten_grads(named)
    finally:
        for (_, p), g in zip(named, saved, strict=True):
            p.grad = g
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return relative_error(recomputed, trained)


def clear_grads(named):
    """Set the gradient of every ``(name, parameter)`` to None."""
    for _, p in named:
        p.grad = None


def flatten_grads(named) -> torch.Tensor:
    """The gradients of ``(name, parameter)`` pairs as one float64 vector (zeros where a gradient is None)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten() for _, p in named]
    )


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (L2); 0 when both are zero, inf when only ``b`` is."""
    denominator = b.norm().item()
    difference = (a - b).norm().item()
    return difference / denominator if denominator > 0 else (0.0 if difference == 0 else math.inf)
