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
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .audit import (
    AccumulationAuditCallback,
    clear_grads,
    flatten_grads,
    get_audit_tolerance,
    relative_error,
)
from .distributed import get_gradient_scale
from .loss import LossSums, WindowCounts, normalize_window_loss
from .loss_path import choose_loss_path
from .model_io import get_aux_loss, get_base_model, model_inputs
from .objective import CausalLMObjective, Objective, get_objective
from .window import compute_micro_batch_loss, count_window

PATHS = ("hfacc", "stock")
logger = logging.getLogger(__name__)


@dataclass
class VerifyArguments:
    """Settings of ``hfacc verify`` (names as in ``TrainingArguments``, so a recipe config fits)."""

    per_device_train_batch_size: int = field(default=2, metadata={"help": "Micro-batch size (per rank)."})
    gradient_accumulation_steps: int = field(default=4, metadata={"help": "Micro-batches per optimizer step."})
    normalization: str = field(default="token", metadata={"help": "'token', 'sequence' or 'micro_batch'."})
    objective: str = field(default="auto", metadata={"help": "What a target is ('auto': from the model head)."})
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
    fused_loss: bool = field(
        default=True, metadata={"help": "Accumulate through the fused chunked loss where training would use it."}
    )
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
class Finding:
    """One check of an assumption behind equivalence."""

    name: str
    ok: bool
    message: str
    fix: str = ""


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
        other = "stock transformers.Trainer" if self.path == "hfacc" else "hfacc TokenWeightedTrainer"
        w = self.window
        lines = [
            "hfacc verify: do the accumulated micro-batches give the gradient of one big batch?",
            "",
            f"model       {self.model}",
            f"window      {w['micro_batch_size']} per micro-batch x {w['accumulation_steps']} micro-batches x "
            f"{w['world_size']} rank(s) = {w['examples']} examples, {w['num_targets']} targets",
            f"            targets per micro-batch (rank 0): {w['targets_per_micro_batch']}",
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
    if isinstance(objective, str):
        objective = get_objective(model, full_batch, name=objective)
    # The reference always takes the plain path (full logits); the accumulation takes the path training takes.
    reference_objective = copy.copy(objective)
    loss_path = "plain"
    if isinstance(objective, CausalLMObjective):
        reference_objective.fused = False
        problem = choose_loss_path(
            objective, model, micro_batches[0], accelerator, fused_loss=fused_loss, normalization=normalization
        )
        loss_path = "fused chunked cross-entropy" if objective.fused else f"plain ({problem})"
    wrapped = accelerator.prepare_model(model) if world > 1 else model
    named = [(n, p) for n, p in get_base_model(model).named_parameters() if p.requires_grad]

    window = count_window(objective.count, micro_batches, accelerator)
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
                else:
                    loss = _stock_loss(wrapped, batch, objective, window, len(micro_batches), scale)
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
            whole = WindowCounts(*_sequence_counts(sums), 1)
            loss = normalize_window_loss(sums, whole, normalization=normalization)
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


def diagnose(model, objective, batch, path, normalization, window, micro_batches) -> list[Finding]:
    """Inspect the model and the run for what breaks equivalence; each finding says why and how to fix it."""
    base = get_base_model(model)
    findings = []
    batchnorms = [n for n, m in base.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    findings.append(
        Finding(
            "batch statistics",
            not batchnorms,
            f"BatchNorm in train mode normalizes with the statistics of each micro-batch: {batchnorms[:3]}"
            if batchnorms
            else "no BatchNorm (or other batch-statistics layer) in train mode",
            "put those layers in eval mode (frozen statistics), or replace them with LayerNorm/GroupNorm",
        )
    )
    dropouts = _active_dropout(base)
    random_ops = _forward_is_random(model, batch)
    if random_ops or dropouts:
        why = "two identical forwards differ" if random_ops else "dropout is active (its masks also change gradients)"
        message = (
            f"{why}: random ops draw different values per micro-batch ({', '.join(dropouts[:4]) or 'unknown op'})"
        )
    else:
        message = "two identical forwards agree and no dropout is active"
    findings.append(
        Finding(
            "randomness",
            not (random_ops or dropouts),
            message,
            "set dropout to 0 (config attention_dropout/hidden_dropout, lora_dropout) for an exact step; with "
            "dropout the accumulated step is a different random draw of the same expected update",
        )
    )
    config = getattr(base, "config", None)
    aux = getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0)
    findings.append(
        Finding(
            "auxiliary losses",
            not aux,
            f"the model adds a router load-balancing loss (coef {aux}) computed from each micro-batch's own routing "
            "statistics; averaged over micro-batches it depends on how the window is split"
            if aux
            else "no auxiliary loss computed per micro-batch",
            "accept it as an approximation, or turn it off (output_router_logits=False) when checking exactness",
        )
    )
    if objective.exact:
        findings.append(Finding("objective", True, f"'{objective.name}' counts targets exactly"))
    else:
        findings.append(
            Finding(
                "objective",
                False,
                f"'{objective.name}' uses the model's own mean loss: every micro-batch weighs the same",
                "pass an hfacc.Objective (or FunctionObjective) that returns loss sums and target counts",
            )
        )
    if path == "stock":
        findings.append(_stock_finding(model, objective, micro_batches, window))
    if normalization == "micro_batch":
        findings.append(
            Finding(
                "normalization",
                True,
                "'micro_batch' is the mean of micro-batch means: exact for its own definition, which is not the "
                "big-batch token mean unless all micro-batches have the same number of targets",
            )
        )
    return findings


def _stock_finding(model, objective, micro_batches, window) -> Finding:
    accepts = _accepts_loss_kwargs(model)
    counts = [int(objective.count(b)[0]) for b in micro_batches]
    uneven = len(set(counts)) > 1
    if not accepts:
        return Finding(
            "stock Trainer",
            not uneven,
            f"the model's forward has no **kwargs, so stock Trainer divides each micro-batch's mean loss by k: "
            f"micro-batches of {counts} targets then weigh the same"
            if uneven
            else "stock Trainer divides each micro-batch mean by k; exact here only because all micro-batches have "
            "the same number of targets",
            "use hfacc.TokenWeightedTrainer (it counts the targets itself)",
        )
    batch = micro_batches[0]
    with torch.no_grad():
        plain = _own_loss(model(**batch))
        told = _own_loss(model(**batch, num_items_in_batch=torch.tensor(max(window.num_targets, 1))))
    if plain is not None and told is not None and torch.allclose(plain, told):
        return Finding(
            "stock Trainer",
            False,
            "the model's forward takes **kwargs, so stock Trainer passes num_items_in_batch and skips its own "
            "division by k, but this model's loss ignores it: the accumulated gradient is about k times too large",
            "use hfacc.TokenWeightedTrainer, or make the model's loss sum over targets and divide by num_items_in_batch",
        )
    return Finding(
        "stock Trainer",
        True,
        "the model's loss consumes num_items_in_batch, so stock Trainer normalizes by the window",
    )


def _stock_loss(model, batch, objective, window, k, scale):
    """What transformers.Trainer (5.x) backpropagates for one micro-batch, with average_tokens_across_devices."""
    if _accepts_loss_kwargs(model):
        n = torch.tensor(max(window.num_targets, 1), device=batch["labels"].device)
        return _own_loss(model(**batch, num_items_in_batch=n)) * scale
    return _own_loss(model(**batch)) / k


def _own_loss(outputs) -> torch.Tensor:
    """The loss a model computed itself (as Trainer reads it: ``outputs["loss"]`` or ``outputs[0]``)."""
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]


def _accepts_loss_kwargs(model) -> bool:
    base = get_base_model(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def _active_dropout(model) -> list[str]:
    names = [
        n or "model"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
    ]
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in config.to_dict().items():
            if "dropout" in key and isinstance(value, (int, float)) and value > 0:
                names.append(f"config.{key}={value}")
    return names


def _forward_is_random(model, batch) -> bool:
    inputs = model_inputs(batch)
    with torch.no_grad():
        a = _first_tensor(model(**inputs))
        b = _first_tensor(model(**inputs))
    return not torch.equal(a, b)


def _first_tensor(outputs):
    if torch.is_tensor(outputs):
        return outputs
    if isinstance(outputs, Mapping):
        return next(v for v in outputs.values() if torch.is_tensor(v))
    return outputs[0]


def _micro_batch_reference(model, objective, examples, collate, size, device):
    # 'micro_batch' is defined over micro-batches: the big-batch reference is the mean of all their means.
    parts = [_to(collate(examples[i : i + size]), device) for i in range(0, len(examples), size)]
    total = 0
    for part in parts:
        _, sums = objective(model, part)
        total = total + sums.loss / sums.count.clamp(min=1)
    return total / len(parts)


def _sequence_counts(sums: LossSums) -> tuple[int, int]:
    """(targets, sequences with a target) of the big batch's sums (per-sequence or already totalled)."""
    count = sums.count
    sequences = int((count > 0).sum()) if count.dim() else int(count > 0)
    return int(count.sum()), sequences


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
