"""``hfacc verify``: is k accumulated micro-batches exactly one big batch, for *this* model and data?

It takes one window of real data, computes the gradient twice from the same parameters in fp32 — by accumulation,
exactly as training does it, and as one forward/backward of the whole window — and compares them. Then it names
what breaks equivalence and why: batch-statistics layers, randomness (dropout), auxiliary losses computed per
micro-batch, a loss that ignores ``num_items_in_batch`` (what stock ``transformers.Trainer`` would do with it), and
the size of mixed-precision rounding.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .arguments import TokenWeightedArguments
from .audit import (
    AccumulationAuditCallback,
    clear_grads,
    flatten_grads,
    get_audit_tolerance,
    relative_error,
)
from .diagnosis import Finding, diagnose, stock_loss
from .distributed import get_gradient_scale
from .loss import WindowCounts
from .model_io import get_aux_loss, get_base_model
from .model_setup import build_model_setup
from .objectives import Objective
from .window import compute_micro_batch_loss, count_window

PATHS = ("hfacc", "stock")
logger = logging.getLogger(__name__)


def training_field(name: str):
    """The field ``name`` as :class:`TokenWeightedArguments` defines it: verify checks what training would do."""
    defined = TokenWeightedArguments.__dataclass_fields__[name]
    return field(default=defined.default, metadata=dict(defined.metadata))


@dataclass
class VerifyArguments:
    """Settings of ``hfacc verify`` (names as in ``TrainingArguments``, so a recipe config fits)."""

    per_device_train_batch_size: int = field(default=2, metadata={"help": "Micro-batch size (per rank)."})
    gradient_accumulation_steps: int = field(default=4, metadata={"help": "Micro-batches per optimizer step."})
    normalization: str = training_field("normalization")
    objective: str = training_field("objective")
    tolerance: float = field(
        default=1e-5, metadata={"help": "Largest relative L2 error of the whole gradient that counts as exact (fp32)."}
    )
    path: str = field(
        default="hfacc",
        metadata={
            "help": "Which training path to verify: 'hfacc' (TokenWeightedTrainer) or 'stock' (what "
            "transformers.Trainer does); the other one is reported for comparison.",
            "choices": list(PATHS),
        },
    )
    precisions: list[str] = field(
        default_factory=lambda: ["bf16"],
        metadata={"help": "Mixed precisions whose rounding is measured against fp32 (informational): bf16, fp16."},
    )
    num_worst: int = field(default=5, metadata={"help": "How many of the worst parameter tensors to list."})
    seed: int = field(default=0, metadata={"help": "Seed of the data sampling and of random ops."})
    fused_loss: bool = training_field("fused_loss")
    json_path: str | None = field(default=None, metadata={"help": "Also write the report as JSON here."})

    def __post_init__(self):
        if self.per_device_train_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError("per_device_train_batch_size and gradient_accumulation_steps must be >= 1.")
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}: use one of {list(PATHS)}.")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance={self.tolerance}: it must be > 0.")
        bad = [p for p in self.precisions if p not in ("bf16", "fp16")]
        if bad:
            raise ValueError(f"precisions {bad}: use bf16 and/or fp16.")


@dataclass
class VerifyReport:
    passed: bool
    path: str
    error: float
    tolerance: float
    worst: list[tuple[str, float]]
    other_path_error: float | None
    precision_errors: dict[str, float]
    findings: list[Finding]
    window: dict[str, Any]
    model: str

    def format(self) -> str:
        w = self.window
        other = w.get("stock", "stock transformers.Trainer") if self.path == "hfacc" else "hfacc TokenWeightedTrainer"
        lines = [
            "hfacc verify: do the accumulated micro-batches give the gradient of one big batch?",
            "",
            f"model       {self.model}",
            f"window      {w['micro_batch_size']} per micro-batch x {w['accumulation_steps']} micro-batches x "
            f"{w['world_size']} rank(s) = {w['examples']} examples, {w['num_targets']} {w.get('unit', 'targets')}",
            f"            {w.get('unit', 'targets')} per micro-batch (rank 0): {w['targets_per_micro_batch']}",
            f"objective   {w['objective']}, normalization '{w['normalization']}', path '{self.path}'",
            f"loss        {w.get('loss_path', 'plain')}",
            "",
            f"gradient, accumulated vs one big batch (fp32): relative error {self.error:.2e}"
            f" (tolerance {self.tolerance:.0e})",
            "worst parameter tensors:",
            *[f"  {err:.2e}  {name}" for name, err in self.worst],
        ]
        if self.other_path_error is not None:
            lines.append(f"for comparison, {other}: relative error {self.other_path_error:.2e}")
        for precision, err in self.precision_errors.items():
            lines.append(
                f"{precision} autocast moves the accumulated gradient by {err:.2e} relative to fp32 "
                "(rounding, not an accumulation error: a floor for any tolerance in that precision)"
            )
        lines += ["", "checks:"]
        for f in self.findings:
            lines.append(f"  [{'ok' if f.ok else '!!'}] {f.name}: {f.message}")
            if not f.ok and f.fix:
                lines.append(f"       fix: {f.fix}")
        verdict = "PASS" if self.passed else "FAIL"
        lines += [
            "",
            f"{verdict}: relative error {self.error:.2e} {'<=' if self.passed else '>'} {self.tolerance:.0e}",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["findings"] = [f.__dict__ for f in self.findings]
        return data


def verify_accumulation(
    model: nn.Module,
    examples: Sequence[Mapping[str, Any]],
    collate: Callable[[list], Mapping[str, torch.Tensor]],
    *,
    micro_batch_size: int = 2,
    gradient_accumulation_steps: int = 4,
    normalization: str = "token",
    objective: Objective | str = "auto",
    tolerance: float = 1e-5,
    path: str = "hfacc",
    precisions: Sequence[str] = ("bf16",),
    num_worst: int = 5,
    accelerator=None,
    seed: int = 0,
    fused_loss: bool = True,
) -> VerifyReport:
    """Compare the accumulated gradient of one window with the big-batch gradient, and diagnose the difference.

    Args:
        model: the model, as it will train (``train()`` mode is set here). A non-fp32 model is checked on an fp32 copy.
        examples: at least ``micro_batch_size * gradient_accumulation_steps * world_size`` tokenized examples; the
            first ones form the window (rank r takes the r-th block).
        collate: turns a list of examples into a batch (e.g. ``DataCollatorForCausalLM``).
        path: ``"hfacc"`` verifies TokenWeightedTrainer's loss; ``"stock"`` what ``transformers.Trainer`` does.
        accelerator: an ``accelerate.Accelerator`` for the distributed check (several processes); None: one process.
        fused_loss: accumulate through the fused chunked cross-entropy where training would (the reference always
            uses the full logits).

    Returns:
        A :class:`VerifyReport`; ``report.passed`` when the relative L2 error is within ``tolerance``.
    """
    if accelerator is None:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    world, rank = accelerator.num_processes, accelerator.process_index
    per_rank = micro_batch_size * gradient_accumulation_steps
    need = per_rank * world
    if len(examples) < need:
        raise ValueError(f"verify needs {need} examples for one window; got {len(examples)}.")
    examples = list(examples[:need])
    local = examples[rank * per_rank : (rank + 1) * per_rank]
    micro_batches = [
        _to(collate(local[i : i + micro_batch_size]), accelerator.device) for i in range(0, per_rank, micro_batch_size)
    ]
    full_batch = _to(collate(examples), accelerator.device)

    base = get_base_model(model)
    if any(p.dtype != torch.float32 for p in base.parameters() if p.is_floating_point()):
        base = copy.deepcopy(base).float()
        model = base
    model.train()
    # The decisions training takes, by the same function (padded micro-batches: verify checks the accumulation).
    setup = build_model_setup(
        model,
        micro_batches[0],
        accelerator,
        objective=objective,
        padding_free=False,
        fused_loss=fused_loss,
        normalization=normalization,
    )
    objective = setup.objective
    # The reference always takes the plain path (full logits); the accumulation takes the path training takes.
    reference_objective = copy.copy(objective)
    loss_path = "plain"
    if objective.supports_fused:
        reference_objective.fused = False
        loss_path = objective.fused_description if objective.fused else f"plain ({setup.loss_path_problem})"
    wrapped = accelerator.prepare_model(model) if world > 1 else model
    named = [(n, p) for n, p in get_base_model(model).named_parameters() if p.requires_grad]

    window = count_window(objective.count, micro_batches, accelerator, size=len(objective.units))
    scale = get_gradient_scale(accelerator.distributed_type, world)

    def accumulate(which: str, autocast: torch.dtype | None = None) -> torch.Tensor:
        clear_grads(named)
        torch.manual_seed(seed + 1 + rank)
        for i, batch in enumerate(micro_batches):
            sync = (
                contextlib.nullcontext() if i == len(micro_batches) - 1 or world == 1 else accelerator.no_sync(wrapped)
            )
            amp = torch.autocast(accelerator.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
            with sync, amp:
                if which == "hfacc":
                    loss, _, _ = compute_micro_batch_loss(
                        objective, wrapped, batch, window, normalization=normalization, world_size=scale
                    )
                elif objective.stock_normalization:  # what peers do with this loss (DPO: each micro-batch's mean / k)
                    loss, _, _ = compute_micro_batch_loss(
                        objective,
                        wrapped,
                        batch,
                        window,
                        normalization=objective.stock_normalization,
                        world_size=scale,
                    )
                else:
                    loss = stock_loss(wrapped, batch, objective, window, len(micro_batches), scale)
                loss.backward()
        return flatten_grads(named)

    def reference() -> torch.Tensor:
        clear_grads(named)
        torch.manual_seed(seed + 1)
        inner = get_base_model(model) if world > 1 else model
        outputs, sums = reference_objective(inner, full_batch, per_sequence=normalization == "sequence")
        if normalization == "micro_batch":
            loss = _micro_batch_reference(
                inner, reference_objective, examples, collate, micro_batch_size, accelerator.device
            )
        else:
            units = tuple(reference_objective.count(full_batch).tolist())  # the big batch: one window, one rank
            whole = WindowCounts(units[0], units[1], 1, units)
            loss = reference_objective.loss(sums, whole, normalization=normalization)
        aux = get_aux_loss(inner, outputs)  # the big batch's own router loss: what one big step would add
        (loss if aux is None else loss + aux).backward()
        return flatten_grads(named)

    ref = reference()
    main = accumulate(path)
    try:
        other_error = relative_error(accumulate("stock" if path == "hfacc" else "hfacc"), ref)
    except (TypeError, KeyError, AttributeError, ValueError):  # e.g. stock needs a model that takes labels
        other_error = None
    error = relative_error(main, ref)
    sizes = [p.numel() for _, p in named]
    per_tensor = [
        (name, relative_error(a, b))
        for (name, _), a, b in zip(named, main.split(sizes), ref.split(sizes), strict=True)
        if b.norm() > 0 or a.norm() > 0
    ]
    worst = sorted(per_tensor, key=lambda x: -x[1] if math.isfinite(x[1]) else -math.inf)[:num_worst]
    precision_errors = {}
    for precision in precisions:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        try:
            precision_errors[precision] = relative_error(accumulate(path, autocast=dtype), main)
        except RuntimeError:  # e.g. fp16 autocast unsupported on this device
            continue
    clear_grads(named)
    findings = diagnose(model, objective, micro_batches[0], path, normalization, window, micro_batches)
    report = VerifyReport(
        passed=bool(error <= tolerance),
        path=path,
        error=error,
        tolerance=tolerance,
        worst=worst,
        other_path_error=other_error,
        precision_errors=precision_errors,
        findings=findings,
        window={
            "micro_batch_size": micro_batch_size,
            "accumulation_steps": gradient_accumulation_steps,
            "world_size": world,
            "examples": need,
            "num_targets": window.num_targets,
            "targets_per_micro_batch": [int(objective.count(b)[0]) for b in micro_batches],
            "objective": objective.name,
            "unit": objective.units[0],
            "stock": "the mean of micro-batch means (as TRL's trainers)"
            if objective.stock_normalization
            else "stock transformers.Trainer",
            "normalization": normalization,
            "loss_path": loss_path,
        },
        model=f"{type(get_base_model(model)).__name__}, {sum(p.numel() for _, p in named) / 1e6:.2f} M trainable "
        f"parameters, checked in fp32",
    )
    if not report.passed and all(f.ok for f in findings):
        findings.append(
            Finding(
                "unexplained difference",
                False,
                "none of the known causes was found; the model may use batch-dependent operations hfacc cannot see "
                "(e.g. batch-level normalization inside custom code)",
                "compare micro-batch sizes 1 and 2 with this command to narrow it down",
            )
        )
    return report


def _micro_batch_reference(model, objective, examples, collate, size, device):
    # 'micro_batch' is defined over micro-batches: the big-batch reference is the mean of all their means.
    parts = [_to(collate(examples[i : i + size]), device) for i in range(0, len(examples), size)]
    total = 0
    for part in parts:
        _, sums = objective(model, part)
        total = total + objective.mean_loss(sums)
    return total / len(parts)


def _to(batch, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


__all__ = [
    "VerifyArguments",
    "VerifyReport",
    "Finding",
    "verify_accumulation",
    "diagnose",
    "AccumulationAuditCallback",
    "get_audit_tolerance",
]
