"""``hfacc verify`` under sequence parallelism: one optimizer step of TokenWeightedTrainer on DeepSpeed Ulysses against
one big batch on this process.

Ulysses changes the model for the whole process (its attention expects a shard) and shards the data inside its own
loader, so the accumulation cannot be replayed micro-batch by micro-batch as :func:`hfacc.verify.verify_accumulation`
does: the big batch's gradient is taken first, on a copy of the model, and the trainer then takes one SGD step of
a huge learning rate from the same weights; the applied update ``(before - after) / lr`` is the accumulated gradient
to fp32 rounding, gathered from wherever ZeRO keeps it.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from ..objectives.causal_lm import CausalLMObjective
from ..training.arguments import TokenWeightedArguments
from ..training.trainer import TokenWeightedTrainer

LR = 1e4  # lr * gradient dwarfs the weights, so (before - after) / lr keeps the gradient's fp32 digits


@dataclass
class SequenceParallelReport:
    passed: bool
    error: float
    tolerance: float
    sp_size: int
    world_size: int
    examples: int
    num_targets: int
    micro_batch_size: int
    accumulation_steps: int
    model: str

    def format(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(
            [
                "hfacc verify: does one step on sequence-parallel shards give the gradient of one big batch?",
                "",
                f"model       {self.model}",
                f"layout      {self.world_size} rank(s) = {self.world_size // self.sp_size} data x {self.sp_size} "
                "sequence (DeepSpeed Ulysses)",
                f"window      {self.examples} examples, {self.num_targets} targets; {self.micro_batch_size} per batch, "
                f"{self.accumulation_steps} shards per step on each rank",
                f"error       {self.error:.2e} relative L2 of the whole update (tolerance {self.tolerance:g})",
                "",
                f"{verdict}",
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _full_parameters(model) -> torch.Tensor:
    """Every weight as one fp32 CPU vector, from ZeRO's fp32 master copy where it keeps one (a collective)."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params):
        from deepspeed.utils import safe_get_full_fp32_param

        params = [safe_get_full_fp32_param(p) for p in params]
    return torch.cat([p.detach().float().cpu().flatten() for p in params])


def verify_sequence_parallel(
    model,
    examples: list[dict],
    collate,
    *,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    accelerator,
    tolerance: float = 1e-5,
) -> SequenceParallelReport:
    """One step of TokenWeightedTrainer over all ``examples`` on the launched Ulysses layout vs one big batch.

    ``examples``: exactly ``micro_batch_size * gradient_accumulation_steps / sp_size * world_size`` of them (each
    rank's loader takes its share, and each of its batches runs as ``sp_size`` shards)."""
    from datasets import Dataset

    model = copy.deepcopy(model).float()
    model.train()
    reference_model = copy.deepcopy(model)
    batch = collate(examples)
    objective = CausalLMObjective()
    reference_model.zero_grad()
    _, sums = objective(reference_model, batch)
    (sums.loss / sums.count).backward()
    reference = torch.cat([p.grad.detach().float().flatten() for p in reference_model.parameters()])
    before = torch.cat([p.detach().float().flatten().clone() for p in model.parameters()])
    args = TokenWeightedArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        max_steps=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=accelerator.device.type == "cpu",
    )
    trainer = TokenWeightedTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=collate
    )
    trainer.train()
    applied = (before - _full_parameters(trainer.model)) / LR
    error = ((applied.double() - reference.double()).norm() / reference.double().norm()).item()
    return SequenceParallelReport(
        passed=error <= tolerance,
        error=error,
        tolerance=tolerance,
        sp_size=trainer.sp_size,
        world_size=accelerator.num_processes,
        examples=len(examples),
        num_targets=int(sums.count),
        micro_batch_size=micro_batch_size,
        accumulation_steps=gradient_accumulation_steps,
        model=type(model).__name__,
    )
