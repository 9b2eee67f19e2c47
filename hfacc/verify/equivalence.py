"""``hfacc verify``: is k accumulated micro-batches exactly one big batch, for *this* model and data?

It takes one window of real data, computes the gradient twice from the same parameters in fp32 — by accumulation,
exactly as training does it, and as one forward/backward of the whole window — and compares them. Then it names
what breaks equivalence and why: batch-statistics layers, randomness (dropout), auxiliary losses computed per
micro-batch, a loss that ignores ``num_items_in_batch`` (what stock ``transformers.Trainer`` would do with it), and
the size of mixed-precision rounding: in each mixed precision, the accumulation against the big batch computed in
that precision, next to that precision's own noise floor (how far its rounding moves the big batch from fp32).
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

from ..objectives import Objective
from ..ops.loss import WindowCounts
from ..ops.model_io import get_aux_loss, get_base_model
from ..ops.precision import get_rounding_bound
from ..runtime.distributed import get_gradient_scale
from ..setup.model_setup import build_model_setup
from ..training.arguments import TokenWeightedArguments
from ..training.audit import AccumulationAuditCallback, clear_grads, flatten_grads, get_audit_tolerance, relative_error
from ..training.window import compute_micro_batch_loss, count_window
from .diagnosis import Finding, diagnose, stock_loss

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
        metadata={
            "help": "Mixed precisions (autocast) the accumulation is also run in, against one big batch in the same "
            "precision, next to that precision's noise floor (informational: PASS is the fp32 check): bf16, fp16."
        },
    )
    sp_size: int = field(
        default=0,
        metadata={"help": "Sequence-parallel size to check (DeepSpeed Ulysses, under a DeepSpeed launch); 0: the "
                  "accelerate config's (parallelism_config_sp_size), 1 without one."},
    )  # fmt: skip
    num_worst: int = field(default=5, metadata={"help": "How many of the worst parameter tensors to list."})
    seed: int = field(default=0, metadata={"help": "Seed of the data sampling and of random ops."})
    fused_loss: bool = training_field("fused_loss")
    json_path: str | None = field(default=None, metadata={"help": "Also write the report as JSON here."})
    loss_type: str | None = field(
        default=None,
        metadata={"help": "With --objective grpo: the loss type to check (None: every one: token, sequence, dr_grpo, "
                  "cispo, sapo)."},
    )  # fmt: skip
    importance_sampling_level: str = field(
        default="token",
        metadata={"help": "With --objective grpo: 'token', or 'sequence' (GSPO: one ratio per completion, bounds "
                  "epsilon 3e-4 / epsilon_high 4e-4 as in the paper)."},
    )  # fmt: skip
    advantage_estimator: str = field(
        default="grpo",
        metadata={"help": "With --objective grpo: the rollout's advantages ('grpo', 'rloo', 'reinforce_pp'), taken "
                  "over every rank's rewards."},
    )  # fmt: skip
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={"help": "With --objective grpo: 'normalize_then_sum' is GDPO's advantage (one reward here)."},
    )  # fmt: skip
    multi_turn: bool = field(
        default=False,
        metadata={"help": "With --objective grpo: multi-turn rows, as tools make them: each completion is two turns "
                  "with a tool result of seeded uneven length between (context: labels -100, in no count); the "
                  "comparison shows the big batch whose denominators also count the tool tokens."},
    )  # fmt: skip

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
    precision_errors: dict[str, float]  # precision -> accumulated vs one big batch, both in that autocast
    noise_floors: dict[str, float]  # precision -> the big batch in that autocast vs in fp32
    findings: list[Finding]
    window: dict[str, Any]
    model: str

    def format(self) -> str:
        w = self.window
        other = w.get("stock", "stock transformers.Trainer") if self.path == "hfacc" else "hfacc TokenWeightedTrainer"
        unit = w.get("unit", "targets")
        units = "" if unit == "examples" else f", {w['num_targets']} {unit}"  # a unit that is the example: once
        lines = [
            "hfacc verify: do the accumulated micro-batches give the gradient of one big batch?",
            "",
            f"model       {self.model}",
            f"window      {w['micro_batch_size']} per micro-batch x {w['accumulation_steps']} micro-batches x "
            f"{w['world_size']} rank(s) = {w['examples']} examples{units}",
            f"            {w.get('unit', 'targets')} per micro-batch (rank 0): {w['targets_per_micro_batch']}",
            f"objective   {w['objective']}, normalization '{w['normalization']}', path '{self.path}'",
            *[
                f"statistic   {name} = {value:.4g} over the window (every micro-batch reads it)"
                for name, value in w.get("statistics", {}).items()
            ],
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
            floor = self.noise_floors[precision]
            verdict = (
                f"exact up to {precision} rounding"
                if self.within_rounding(precision)
                else f"beyond {precision} rounding (over twice its noise floor)"
            )
            lines.append(
                f"{precision} autocast: accumulated vs one big batch, both in {precision}: relative error {err:.2e}; "
                f"{precision}'s noise floor (its big batch vs fp32's) {floor:.2e}: {verdict}"
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

    def within_rounding(self, precision: str) -> bool:
        """Whether the accumulation error in ``precision`` is that precision's rounding
        (:func:`hfacc.ops.precision.get_rounding_bound` of its noise floor)."""
        return self.precision_errors[precision] <= get_rounding_bound(self.noise_floors[precision])

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
    # A statistic of the whole window (KTO's reference point), as training takes it; what peers do instead is each
    # micro-batch's own (the stock path passes none, so each micro-batch is its own window).
    with torch.no_grad():
        statistics = objective.window_statistics(wrapped, micro_batches, accelerator)
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
                        objective,
                        wrapped,
                        batch,
                        window,
                        normalization=normalization,
                        world_size=scale,
                        statistics=statistics,
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

    def reference(autocast: torch.dtype | None = None) -> torch.Tensor:
        clear_grads(named)
        torch.manual_seed(seed + 1)
        inner = get_base_model(model) if world > 1 else model
        amp = torch.autocast(accelerator.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with amp:
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
    # Mixed precision: the accumulation against the big batch, both under the same autocast, next to that
    # precision's own noise floor, how far its rounding moves the big batch's gradient from the fp32 one
    # (hfacc.ops.precision.get_rounding_bound).
    precision_errors, noise_floors = {}, {}
    for precision in precisions:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        try:
            accumulated, big = accumulate(path, autocast=dtype), reference(autocast=dtype)
        except RuntimeError:  # e.g. fp16 autocast unsupported on this device
            continue
        precision_errors[precision] = relative_error(accumulated, big)
        noise_floors[precision] = relative_error(big, ref)
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
        noise_floors=noise_floors,
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
            "statistics": {k: float(v) for k, v in statistics.items() if isinstance(v, (int, float))},
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


# ---- distillation: the user's student and teacher, through verify_accumulation ---------------------------------
@dataclass
class DistillVerifyArguments:
    """Settings of ``hfacc verify --objective distill`` (the names of ``hfacc distill``)."""

    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "--objective distill: the teacher (None with the embedded student: a bigger embedded one)."},
    )
    beta: float = field(default=1.0, metadata={"help": "--objective distill: 0 forward KL, 1 reverse KL, else JSD."})
    temperature: float = field(default=1.0, metadata={"help": "--objective distill: both logits / temperature."})
    ce_weight: float = field(default=0.0, metadata={"help": "--objective distill: weight of the CE term."})


def build_verify_kto(model: nn.Module, seed: int = 0, scale: float = 2.0):
    """The :class:`hfacc.KTOObjective` ``hfacc verify --objective kto`` checks: its reference a frozen copy of
    ``model`` whose output head is perturbed (seeded noise of std ``scale / sqrt(hidden)``).

    The default reference, a copy of the policy, makes every log-ratio 0 and the reference point z0 = 0 at the
    weights verify runs from: a z0 taken per micro-batch would then pass too. Noise on the reference's logits lowers
    its log-prob of tokens it was not sure of (Jensen: the log-sum-exp grows), so the KL rows' log-ratios and z0 are
    clearly above 0 and differ between micro-batches, and the window's z0 is what the check checks."""
    from ..objectives.kto import KTOObjective

    reference = copy.deepcopy(get_base_model(model))
    weight = reference.get_output_embeddings().weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        weight.add_((noise * (scale / math.sqrt(weight.shape[-1]))).to(weight))
    return KTOObjective(ref_model=reference)


def build_verify_distillation(distill_args: DistillVerifyArguments, model_args, tokenizer, seed: int = 0):
    """The :class:`hfacc.DistillationObjective` ``hfacc verify --objective distill`` checks: the teacher named, or
    for the embedded student a bigger embedded teacher (random: verify checks the accumulation, not the teacher)."""
    from ..objectives.distillation import DistillationObjective
    from ..runtime.config import ConfigError

    teacher = distill_args.teacher_model_name_or_path
    if teacher is None:
        if model_args.model_name_or_path is not None:
            raise ConfigError("--objective distill: name the teacher with --teacher_model_name_or_path.")
        from ..data.embedded import build_default_model

        teacher = build_default_model(tokenizer, hidden_size=2 * model_args.embedded_hidden_size, seed=seed + 1)
    return DistillationObjective(
        teacher, beta=distill_args.beta, temperature=distill_args.temperature, ce_weight=distill_args.ce_weight,
        vocab_size=len(getattr(tokenizer, "tokenizer", tokenizer)),
    )  # fmt: skip


# ---- policy gradients: a fixed rollout of the model, split over micro-batches, ranks and optimizer steps ----------
@dataclass
class PolicyGradientVerifyReport:
    """``hfacc verify --objective grpo``: per loss type, the accumulated steps of one rollout vs their big batches.

    ``errors[loss_type][f"spg={n}"]`` lists each optimizer step's relative error (steps_per_generation = n
    micro-batches); ``micro_batch_errors`` is what normalizing each micro-batch by its own units and dividing by GA
    gives instead (TRL's ``bnpo``; its GRPO and Dr. GRPO divided by GA), ``generation_errors`` what dividing by the
    whole generation batch's units gives when a generation serves two steps.
    """

    passed: bool
    tolerance: float
    errors: dict[str, dict[str, list[float]]]
    micro_batch_errors: dict[str, float]
    generation_errors: dict[str, float]
    rollout: dict[str, Any]
    findings: list[Finding]
    model: str
    tool_counting_errors: dict[str, float] = field(default_factory=dict)

    def format(self) -> str:
        r = self.rollout
        lines = [
            "hfacc verify --objective grpo: does each optimizer step of a rollout give its big batch's update?",
            "",
            f"model       {self.model}",
            f"rollout     {r['completions']} completions sampled from the model ({r['num_generations']} per prompt, "
            f"up to {r['max_completion_length']} tokens: {r['completion_tokens']} completion tokens), "
            f"{r['clipped_share']:.0%} of the ratios clipped"
            + (
                f"; multi-turn: {r['tool_tokens']} tool tokens between two turns (context)"
                if "tool_tokens" in r
                else ""
            ),
            f"split       {r['micro_batch_size']} per micro-batch x {r['accumulation_steps']} micro-batches x "
            f"{r['world_size']} rank(s); steps_per_generation {' and '.join(r['steps_per_generation'])}",
            f"loss        {r['loss_path']}, beta {r['beta']} (k3 KL to a reference), importance_sampling_level "
            f"{r.get('importance_sampling_level', 'token')!r}, advantages {r.get('advantages', 'grpo')}",
            "",
            "relative error of each optimizer step's gradient vs one big batch of what that step consumes (fp32):",
        ]
        for loss_type, by_split in self.errors.items():
            splits = "   ".join(f"{split}: {', '.join(f'{e:.1e}' for e in errs)}" for split, errs in by_split.items())
            lines.append(f"  {loss_type:<9s} {splits}")
        lines += ["for comparison:"]
        for loss_type, err in self.micro_batch_errors.items():
            lines.append(f"  {loss_type:<9s} each micro-batch over its own units, / GA: {err:.2e}")
        for loss_type, err in self.generation_errors.items():
            lines.append(
                f"  {loss_type:<9s} two steps per generation, divided by the generation batch's units: {err:.2e}"
            )
        for loss_type, err in self.tool_counting_errors.items():
            lines.append(f"  {loss_type:<9s} denominators that also count the tool tokens: {err:.2e}")
        lines += ["", "checks:"]
        for f in self.findings:
            lines.append(f"  [{'ok' if f.ok else '!!'}] {f.name}: {f.message}")
            if not f.ok and f.fix:
                lines.append(f"       fix: {f.fix}")
        worst = max((e for by in self.errors.values() for errs in by.values() for e in errs), default=0.0)
        verdict = "PASS" if self.passed else "FAIL"
        lines += [
            "",
            f"{verdict}: worst relative error {worst:.2e} {'<=' if self.passed else '>'} {self.tolerance:.0e}",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["findings"] = [f.__dict__ for f in self.findings]
        return data


def verify_policy_gradient(
    model: nn.Module,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    micro_batch_size: int = 2,
    gradient_accumulation_steps: int = 4,
    num_generations: int = 2,
    max_completion_length: int = 16,
    beta: float = 0.04,
    tolerance: float = 1e-5,
    accelerator=None,
    seed: int = 0,
    fused_loss: bool = True,
    loss_types: Sequence[str] | None = None,
    importance_sampling_level: str = "token",
    advantage_estimator: str = "grpo",
    multi_objective_aggregation: str = "sum_then_normalize",
    multi_turn: bool = False,
) -> PolicyGradientVerifyReport:
    """Sample a fixed rollout from ``model`` and check, for every loss type, that each optimizer step of it —
    ``steps_per_generation`` = GA and 2 x GA, over the ranks of ``accelerator`` — gives the gradient of one big batch
    of what that step consumes.

    The rollout is made hard on purpose: completions cut at seeded random lengths, seeded random rewards (group
    advantages), old log-probs and reference
    log-probs that are the model's own plus noise (so ratios are clipped on both sides and the KL term is not zero).
    Each rank samples for its own prompts; every rank then holds all rows, for the reference. The accumulation runs
    as training does (the window's counts over all ranks, the loss path training would choose, DDP's ``no_sync``);
    the reference is the plain path (full logits) on one batch.

    ``loss_types`` (None: all of them) and ``importance_sampling_level`` pick the variants (GSPO: ``"sequence"``,
    with its paper's bounds 3e-4 / 4e-4; CISPO's cap on the ratio is 1.2 here, so the rollout reaches it); the
    advantages are ``advantage_estimator`` / ``multi_objective_aggregation``'s over every rank's rewards.

    ``multi_turn``: each completion (of 2 tokens or more) is split at a seeded point and a tool result of seeded
    uneven length (1 to ``max_completion_length`` tokens, the tokenizer's ids of a tool-like text) goes between the
    two turns, as :mod:`hfacc.generation.tools` makes rows: attended, labels -100, in no count. For the loss types
    token and sequence, the comparison is the big batch whose denominators also count the tool tokens (its
    policy-gradient term: TRL's replayed rows that lost their tool mask, verl's horizon with tool tokens).
    """
    from ..data.collator import DataCollatorForCausalLM
    from ..generation.rollout import SamplingSettings, build_rollout_rows, compute_advantages, sample_completions
    from ..objectives.policy_gradient import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, PolicyGradientObjective

    loss_types = list(LOSS_TYPES if loss_types is None else loss_types)
    bad = [t for t in loss_types if t not in LOSS_TYPES]
    if bad or importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"loss_type {bad or ''} / importance_sampling_level={importance_sampling_level!r}: use loss types of "
            f"{list(LOSS_TYPES)} and a level of {list(IMPORTANCE_SAMPLING_LEVELS)}."
        )

    if accelerator is None:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    base = get_base_model(model)
    if any(p.dtype != torch.float32 for p in base.parameters() if p.is_floating_point()):
        model = base = copy.deepcopy(base).float()
    ga, spgs = gradient_accumulation_steps, (gradient_accumulation_steps, 2 * gradient_accumulation_steps)
    per_rank = micro_batch_size * spgs[-1]  # completions per rank of the larger generation batch
    if per_rank % num_generations:
        raise ValueError(f"micro_batch_size x 2 x GA = {per_rank} completions must be a multiple of num_generations.")
    prompts = per_rank // num_generations
    if len(prompt_ids) < prompts * world:
        raise ValueError(f"verify needs {prompts * world} prompts for the rollout; got {len(prompt_ids)}.")
    mine = [list(p) for p in prompt_ids[rank * prompts : (rank + 1) * prompts] for _ in range(num_generations)]
    torch.manual_seed(seed + rank)
    model.eval()
    completions, _ = sample_completions(model, tokenizer, mine, SamplingSettings(max_completion_length))
    generator = torch.Generator().manual_seed(seed + 100 + rank)
    # Each completion is cut at a seeded random length: micro-batches then hold different numbers of tokens and
    # completions, which is what the normalizer must get right (an untrained model samples only full lengths).
    cuts = torch.randint(1, max_completion_length + 1, (len(completions),), generator=generator).tolist()
    completions = [c[: max(1, min(n, len(c)))] for c, n in zip(completions, cuts, strict=True)]
    masks = None
    if multi_turn:
        completions, masks = _add_tool_results(tokenizer, completions, max_completion_length, generator)
    rewards = torch.rand(len(completions), generator=generator, dtype=torch.float64)
    everyone_rewards = rewards
    if world > 1:  # batch statistics of the advantages are over every rank's completions
        from accelerate.utils import gather_object

        everyone_rewards = torch.cat(gather_object([rewards]))
    advantages = compute_advantages(
        everyone_rewards[:, None],
        num_generations,
        advantage_estimator=advantage_estimator,
        multi_objective_aggregation=multi_objective_aggregation,
    )[rank * len(rewards) : (rank + 1) * len(rewards)]
    rows = build_rollout_rows(mine, completions, advantages.tolist(), masks)
    collate = DataCollatorForCausalLM(tokenizer.pad_token_id)
    with torch.no_grad():  # the old policy and the reference: the model's log-probs, moved by noise
        for row in rows:
            ids = torch.tensor([row["input_ids"]], device=device)
            logp = base(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0].cpu()
            for key, scale in (("old_logps", 0.3), ("ref_logps", 0.5)):
                noisy = logp + scale * torch.randn(logp.shape, generator=generator)
                row[key] = [0.0] + noisy.tolist()
    everyone = rows
    if world > 1:
        from accelerate.utils import gather_object

        everyone = gather_object([rows])  # one list per rank, in rank order
        everyone = [row for part in everyone for row in part]
    model.train()
    first = _to(collate(rows[:micro_batch_size]), device)
    setup = build_model_setup(
        model,
        first,
        accelerator,
        objective=PolicyGradientObjective(beta=beta),
        padding_free=False,
        fused_loss=fused_loss,
    )
    wrapped = accelerator.prepare_model(model) if world > 1 else model
    named = [(n, p) for n, p in base.named_parameters() if p.requires_grad]
    scale = get_gradient_scale(accelerator.distributed_type, world)

    def step_gradient(objective, step_rows, normalization="token", counts=None):
        clear_grads(named)
        batches = [
            _to(collate(step_rows[i : i + micro_batch_size]), device)
            for i in range(0, len(step_rows), micro_batch_size)
        ]
        window = counts or count_window(objective.count, batches, accelerator, size=len(objective.units))
        for i, batch in enumerate(batches):
            sync = contextlib.nullcontext() if i == len(batches) - 1 or world == 1 else accelerator.no_sync(wrapped)
            with sync:
                loss, _, _ = compute_micro_batch_loss(
                    objective, wrapped, batch, window, normalization=normalization, world_size=scale
                )
                loss.backward()
        return flatten_grads(named), window

    def big_batch_gradient(objective, step_rows):
        clear_grads(named)
        plain = copy.copy(objective)
        plain.fused = False
        batch = _to(collate(step_rows), device)
        _, sums = plain(base, batch)
        units = tuple(plain.count(batch).tolist())
        plain.loss(sums, WindowCounts(units[0], units[1], 1, units)).backward()
        return flatten_grads(named)

    def rank_rows(step, size):  # the rows optimizer step `step` consumes on each rank, and on all of them
        local = slice(step * size, (step + 1) * size)
        per = len(rows)
        return rows[local], [r for k in range(world) for r in everyone[k * per : (k + 1) * per][local]]

    def counting_tool_tokens(objective, step_rows):
        """The big batch whose denominators count the tool tokens too: each policy token's surrogate scaled by
        (policy tokens) / (policy + tool tokens), of the step (token) or of its row (sequence)."""

        def policy_and_tool(row):
            targets = [i for i, y in enumerate(row["labels"]) if y != -100]
            return len(targets), targets[-1] - targets[0] + 1 - len(targets)

        sizes = [policy_and_tool(r) for r in step_rows]
        step_share = sum(n for n, _ in sizes) / sum(n + t for n, t in sizes)
        weighted = []
        for row, (n, t) in zip(step_rows, sizes, strict=True):
            share = step_share if objective.loss_type == "token" else n / (n + t)
            weighted.append({**row, "importance_weights": [share] * len(row["input_ids"])})
        return big_batch_gradient(objective, weighted)

    errors, micro, generation, clipped, tool_counting = {}, {}, {}, [], {}
    gspo = importance_sampling_level == "sequence"
    for loss_type in loss_types:
        bounds = (3e-4, 4e-4) if gspo else (0.2, None)
        if loss_type == "cispo":  # its cap is on the ratio itself: 1.2 is reached by the noisy old log-probs
            bounds = (0.2, 1.2)
        objective = PolicyGradientObjective(
            loss_type,
            *bounds,
            beta=beta,
            max_completion_length=max_completion_length,
            importance_sampling_level=importance_sampling_level,
        )
        objective.fused, objective.chunk_size = setup.objective.fused, setup.objective.chunk_size
        errors[loss_type] = {}
        for spg in spgs:
            size = micro_batch_size * ga
            found = []
            for step in range(spg // ga):
                local, step_all = rank_rows(step, size)
                got, _ = step_gradient(objective, local)
                found.append(relative_error(got, big_batch_gradient(objective, step_all)))
            errors[loss_type][f"spg={spg}"] = found
        local, step_all = rank_rows(0, micro_batch_size * ga)
        want = big_batch_gradient(objective, step_all)
        micro[loss_type] = relative_error(step_gradient(objective, local, "micro_batch")[0], want)
        # Both steps' rows counted as one window (the generation batch), applied to the first step's rows.
        whole = count_window(objective.count, [_to(collate(rows), device)], accelerator, size=len(objective.units))
        generation[loss_type] = relative_error(step_gradient(objective, local, counts=whole)[0], want)
        if multi_turn and loss_type in ("token", "sequence"):
            got = step_gradient(objective, local)[0]
            tool_counting[loss_type] = relative_error(got, counting_tool_tokens(objective, step_all))
    with torch.no_grad():
        batch = _to(collate(rows), device)
        _, sums = setup.objective(base, batch)
        clipped.append(float((sums.clipped_low + sums.clipped_high) / sums.num_tokens.clamp(min=1)))
    clear_grads(named)
    plain_batch = {k: first[k] for k in ("input_ids", "attention_mask")}
    findings = [
        f for f in diagnose(model, setup.objective, plain_batch, "hfacc", "token", None, []) if f.name != "objective"
    ]
    worst = max(e for by in errors.values() for errs in by.values() for e in errs)
    return PolicyGradientVerifyReport(
        passed=bool(worst <= tolerance) and all(f.ok for f in findings),
        tolerance=tolerance,
        errors=errors,
        micro_batch_errors=micro,
        generation_errors=generation,
        tool_counting_errors=tool_counting,
        rollout={
            "completions": len(everyone),
            "num_generations": num_generations,
            "max_completion_length": max_completion_length,
            "completion_tokens": sum(sum(1 for y in r["labels"] if y != -100) for r in everyone),
            "clipped_share": clipped[0],
            "micro_batch_size": micro_batch_size,
            "accumulation_steps": ga,
            "world_size": world,
            "steps_per_generation": [f"{spgs[0]} (= GA)", f"{spgs[1]} (= 2 x GA: two optimizer steps)"],
            "loss_path": "chunked log-probs from the hidden states" if setup.objective.fused else "full logits",
            "beta": beta,
            "importance_sampling_level": importance_sampling_level,
            "advantages": advantage_estimator
            + (", GDPO's normalize_then_sum" if multi_objective_aggregation == "normalize_then_sum" else ""),
            **({"tool_tokens": sum(m.count(False) for m in masks)} if multi_turn else {}),
        },
        findings=findings,
        model=f"{type(base).__name__}, {sum(p.numel() for _, p in named) / 1e6:.2f} M trainable parameters, "
        "checked in fp32",
    )


def _add_tool_results(tokenizer, completions, max_completion_length: int, generator):
    """``(completions, target masks)``: each completion of 2 ids or more split at a seeded point, a tool result of
    seeded length (1 to ``max_completion_length`` ids of a tool-like text) between its two turns, masked out."""
    text = tokenizer("\n[tool result] 42 17 0.5 ok", add_special_tokens=False)["input_ids"] or [0]
    out, masks = [], []
    for c in completions:
        if len(c) < 2:
            out.append(list(c))
            masks.append([True] * len(c))
            continue
        split = int(torch.randint(1, len(c), (1,), generator=generator))
        length = int(torch.randint(1, max_completion_length + 1, (1,), generator=generator))
        tool = [text[i % len(text)] for i in range(length)]
        out.append(list(c[:split]) + tool + list(c[split:]))
        masks.append([True] * split + [False] * length + [True] * (len(c) - split))
    return out, masks


__all__ = [
    "VerifyArguments",
    "DistillVerifyArguments",
    "build_verify_distillation",
    "build_verify_kto",
    "VerifyReport",
    "PolicyGradientVerifyReport",
    "verify_policy_gradient",
    "Finding",
    "verify_accumulation",
    "diagnose",
    "AccumulationAuditCallback",
    "get_audit_tolerance",
]
