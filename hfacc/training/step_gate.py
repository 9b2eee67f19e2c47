"""The step gate: before each optimizer step, the one place that decides what the window does to the weights."""

from __future__ import annotations

import logging

import torch
from accelerate.utils import DistributedType
from transformers import TrainerCallback

from ..runtime.distributed import all_ranks_agree, deepspeed_overflow_problem
from .audit import AccumulationAuditCallback

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps had a non-finite loss or gradient."""


class StepGate(TrainerCallback):
    """Runs before every optimizer step of a :class:`hfacc.TokenWeightedTrainer`, in this order:

    1. **audit**: every :class:`hfacc.AccumulationAuditCallback` of the trainer checks the gradient exactly as it
       was accumulated (before step 2 or 3 could drop it);
    2. **no target**: a window with zero targets on every rank has a zero gradient, but an optimizer step would
       still move the weights (Adam's momentum, weight decay): its gradients are dropped;
    3. **not finite** (``skip_nonfinite_steps``): a NaN/inf loss or gradient would poison the weights: its
       gradients are dropped, the log names the micro-batch, and training stops after ``max_skipped_steps``;
    4. **commit**: otherwise the window's staged loss sums go to the logged metrics.

    A dropped window never reaches the logs, and ``optimizer.step()`` leaves every parameter as it was; the
    learning-rate schedule still advances.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.deepspeed_skips_steps = True  # whether DeepSpeed's overflow check is on (known at train start)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer.meter.reset_run()
        if trainer.is_deepspeed_enabled:
            problem = deepspeed_overflow_problem(trainer.model_wrapped)
            # Without the check, a window made to overflow would be applied: NaN weights. Never poison it then.
            self.deepspeed_skips_steps = problem is None
            if problem and args.skip_nonfinite_steps:
                raise ValueError(
                    f"hfacc: skip_nonfinite_steps=True needs DeepSpeed to skip a step with inf/NaN gradients (its "
                    f"optimizer step runs inside the last micro-batch's backward, before hfacc can act), but {problem}. "
                    "Change the DeepSpeed config as said, or pass skip_nonfinite_steps=False to let such steps through."
                )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer, meter, window = self.trainer, self.trainer.meter, self.trainer.window
        if window is None:
            return
        step = state.global_step + 1
        for callback in trainer.callback_handler.callbacks:  # 1. audit
            if isinstance(callback, AccumulationAuditCallback):
                callback.audit_step(step)
        if window.num_targets == 0:  # 2. no target
            meter.empty_windows += 1
            logger.warning(
                "hfacc: step %d: no target in the whole window (every label is -100 on every rank); the step is "
                "skipped and the weights are unchanged (%d such windows so far).",
                step,
                meter.empty_windows,
            )
            self.drop_gradients()
            return
        if args.skip_nonfinite_steps and not self.window_is_finite():  # 3. not finite
            meter.skipped_steps += 1
            culprits = [i for i, loss in enumerate(window.losses) if not torch.isfinite(loss)]
            where = (
                f"non-finite loss in micro-batch(es) {culprits} of {window.counts.num_micro_batches} on rank "
                f"{trainer.accelerator.process_index}"
                if culprits
                else "non-finite gradient (the loss was finite on this rank)"
            )
            logger.warning(
                "hfacc: step %d skipped: %s. The weights were not updated (%d skipped so far).",
                step,
                where,
                meter.skipped_steps,
            )
            self.drop_gradients()
            if args.max_skipped_steps and meter.skipped_steps >= args.max_skipped_steps:
                raise NonFiniteLossError(
                    f"{meter.skipped_steps} optimizer steps had a non-finite loss or gradient (limit "
                    f"max_skipped_steps={args.max_skipped_steps}); training stopped. The weights were never updated "
                    "with NaN/inf. Lower the learning rate, check the data the log names, or use bf16 instead of fp16."
                )
            return
        meter.commit(window)  # 4. commit

    def window_is_finite(self) -> bool:
        """Whether the window's loss and gradient are finite, decided the same on every rank."""
        trainer = self.trainer
        if trainer.is_deepspeed_enabled and trainer.optimizer.step_was_skipped:
            return False  # DeepSpeed found inf/NaN in the gradients (its flag is already agreed over the ranks)
        grads = [p.grad for group in trainer.optimizer.param_groups for p in group["params"] if p.grad is not None]
        staged = trainer.window.staged  # entry 0: the window's loss sum on this rank
        total = staged[0].float() if staged is not None else torch.zeros((), device=trainer.args.device)
        if grads:
            total = total + torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False).float()
        # Sharded (FSDP) gradients differ per rank: every rank must take the same decision.
        return all_ranks_agree(bool(torch.isfinite(total)), trainer.accelerator)

    def drop_gradients(self) -> None:
        """Make the coming ``optimizer.step()`` leave every parameter as it is."""
        trainer = self.trainer
        if trainer.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # The step already ran, inside the last backward. The window was made to overflow
            # (mark_for_deepspeed_skip), so DeepSpeed's own check must have skipped it and zeroed the gradients; if it
            # did not, say so loudly.
            if not self.deepspeed_skips_steps:  # skip_nonfinite_steps=False with DeepSpeed's check off
                logger.warning(
                    "hfacc: DeepSpeed's overflow check is off, so this step could not be skipped: it was taken."
                )
            elif not trainer.optimizer.step_was_skipped:
                raise NonFiniteLossError(
                    "hfacc: DeepSpeed applied the update of a window that had to be skipped (no targets, or an inf/NaN "
                    "loss): its overflow check is off. Enable it (bf16.check_grad_overflow: true, or "
                    "zero_optimization.compute_grad_norm: true) or pass skip_nonfinite_steps=False."
                )
            return
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        if getattr(trainer.accelerator, "scaler", None) is not None:
            # fp16's GradScaler refuses a step without gradients; an inf makes it skip the step (and halve its scale).
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("inf"))
            return
        # torch optimizers leave a parameter whose .grad is None untouched: no update, no momentum, no weight decay.
        for p in params:
            p.grad = None
