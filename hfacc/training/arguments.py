"""hfacc's training settings: ``TrainingArguments`` plus the fields of exact accumulation, each with one default.

A plain ``TrainingArguments`` given to :class:`hfacc.TokenWeightedTrainer` is converted once, by
:func:`as_token_weighted_arguments` (as TRL's ``SFTTrainer`` turns one into an ``SFTConfig``), so the rest of the
library reads ``args.normalization`` and never restates a default.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from ..objectives import OBJECTIVES
from ..ops.loss import NORMALIZATIONS


@dataclass
class TokenWeightedArguments(TrainingArguments):
    """``TrainingArguments`` plus hfacc's settings. A plain ``TrainingArguments`` gets these defaults."""

    normalization: str = field(
        default="token",
        metadata={
            "help": "How the window's loss is normalized: 'token' (every target token weighs the same; the big-batch "
            "mean), 'sequence' (every sequence weighs the same), or 'micro_batch' (legacy mean of micro-batch means).",
            "choices": list(NORMALIZATIONS),
        },
    )
    objective: str = field(
        default="auto",
        metadata={
            "help": "What a target is: 'auto' (from the model head and labels) or one of "
            + ", ".join(sorted(OBJECTIVES))
            + "."
        },
    )
    shared_prompts: bool = field(
        default=True,
        metadata={
            "help": "Reward models, with padding_free: lay each pair out as its prompt once, then both answers, each "
            "attending to the prompt and to itself through a 4-D attention mask (positions restart after the "
            "prompt), so the shared prompt is computed once instead of twice. Each sequence is scored as its own "
            "forward scores it: checked once per model (scores, gradient, leaks between answers and pairs, long "
            "rows); attention without 4-D masks (flash, flex) or a model that fails the check keeps each sequence "
            "on its own (said at WARNING). False: off."
        },
    )
    fused_loss: bool = field(
        default=True,
        metadata={
            "help": "Causal LMs: compute the output projection and cross-entropy together in chunks over the "
            "target positions only, so the full logits never exist (less memory, faster; exact). Models that "
            "post-process their logits fall back to the plain path by themselves."
        },
    )
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Causal LMs: lay the real tokens of every micro-batch end to end in rows with position_ids "
            "that restart per sequence, so no layer computes on padding, whatever collator padded it (right or "
            "left). Same sequences, targets and normalization: exact. Checked once per model, forward and backward "
            "(loss, router loss, gradient, leaks, long rows); a model that does not compute packed sequences as it "
            "does padded ones gets the other layout or padded batches (said at WARNING). False: off."
        },
    )
    loss_chunk_size: int = field(
        default=0,
        metadata={
            "help": "Target tokens per chunk of the fused loss (0: about 16 MiB of fp32 logits: 2**22 // vocabulary size rows)."
        },
    )
    max_tokens_per_batch: int = field(
        default=0,
        metadata={
            "help": "Build training micro-batches to this many padded tokens (rows x longest row) instead of a "
            "fixed per_device_train_batch_size: sequences of similar length go together, so padding is small "
            "and memory bounded. Exact: the window is normalized by its target count. 0: off."
        },
    )
    length_group_size: int = field(
        default=0,
        metadata={
            "help": "With max_tokens_per_batch: sort by length within random groups of this many examples, "
            "drawn anew every epoch (more variety per micro-batch, a little more padding). 0: sort all."
        },
    )
    skip_nonfinite_steps: bool = field(
        default=True,
        metadata={
            "help": "Skip the optimizer step of a window whose loss or gradient is NaN/inf (the weights are never "
            "updated with it) and log which micro-batch caused it. False lets the step through."
        },
    )
    max_skipped_steps: int = field(
        default=10,
        metadata={"help": "Stop with an error after this many skipped non-finite steps (0: never stop)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir that holds another run's checkpoints: they are deleted first. "
            "Without it such a run is refused (it would mix with them: resuming could continue theirs)."
        },
    )
    auto_resume_from_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "For jobs a scheduler requeues with the same command (SLURM, spot instances): with no "
            "resume_from_checkpoint given, resume from the newest complete checkpoint of this run in output_dir "
            "if there is one, else start afresh; which one is said. Another run's checkpoints are never taken "
            "(such a directory is refused). Axolotl's name."
        },
    )
    resume_with_changed_data: bool = field(
        default=False,
        metadata={
            "help": "Resume a checkpoint whose data differs from this run's (dataset, max_length, packing, chat "
            "template, rows; docs/reliability.md), deliberately: the data is not compared, and that is said. "
            "Without it such a checkpoint is another run's, and refused."
        },
    )
    audit_every_n_steps: int = field(
        default=0,
        metadata={
            "help": "Every N optimizer steps, recompute the window's gradient example by example and log the "
            "relative error as accumulation_audit_error (0: off). Costs about one extra window per audit."
        },
    )
    audit_tolerance: float = field(
        default=0.0,
        metadata={
            "help": "Audit error above which a warning is printed. 0: from the training precision, "
            "max(1e-4, 4 x machine epsilon): 1e-4 in fp32, 3.1e-2 in bf16, 3.9e-3 in fp16."
        },
    )

    def __post_init__(self):
        if not self.use_cpu and not torch.accelerator.is_available():
            # Accelerate forms a CPU process group (gloo) only when told it runs on the CPU; otherwise each process
            # of `accelerate launch --multi_gpu --num_processes 2` on a GPU-less machine trains alone, silently.
            self.use_cpu = True
        super().__post_init__()
        validate_settings(self)


def validate_settings(args: TokenWeightedArguments) -> None:
    """Check hfacc's settings; raise ``ValueError`` naming the field and the fix."""
    if args.normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={args.normalization!r} is not supported; use one of {list(NORMALIZATIONS)}.")
    if args.objective != "auto" and args.objective not in OBJECTIVES:
        raise ValueError(f"objective={args.objective!r} is not supported; use 'auto' or one of {sorted(OBJECTIVES)}.")
    if args.max_tokens_per_batch < 0:
        raise ValueError("max_tokens_per_batch must be >= 0 (0 keeps per_device_train_batch_size batches).")
    if args.loss_chunk_size < 0:
        raise ValueError("loss_chunk_size must be >= 0 (0 picks a size from the vocabulary).")
    if args.audit_every_n_steps < 0:
        raise ValueError("audit_every_n_steps must be >= 0 (0 turns the audit off).")
    if args.audit_tolerance < 0:
        raise ValueError("audit_tolerance must be >= 0 (0 derives it from the training precision).")
    if args.auto_resume_from_checkpoints and args.overwrite_output_dir:
        raise ValueError(
            "auto_resume_from_checkpoints and overwrite_output_dir: a requeued run would delete its own checkpoints "
            "each time it starts; drop overwrite_output_dir (or choose a new output_dir to start afresh)."
        )
    if args.fp16 and args.use_cpu:  # accelerate autocasts fp16 on GPUs only: on a CPU it trained fp32, silently
        raise ValueError(
            "fp16=True on a CPU: accelerate does not autocast fp16 there, so the run would train in fp32. Use "
            "bf16=True (CPU autocast computes in bf16), or leave fp16 off (fp32), or run on a GPU."
        )
    if args.max_skipped_steps < 0:
        raise ValueError("max_skipped_steps must be >= 0 (0 never stops training).")
    if args.learning_rate < 0:
        raise ValueError(f"learning_rate={args.learning_rate}: it must be >= 0.")
    if args.gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: it must be >= 1 (1 = no accumulation)."
        )
    if args.per_device_train_batch_size < 1:
        raise ValueError(f"per_device_train_batch_size={args.per_device_train_batch_size}: it must be >= 1.")


def as_token_weighted_arguments(args: TrainingArguments | None) -> TokenWeightedArguments:
    """``args`` with hfacc's settings: itself if it has them, else converted once with their defaults.

    Every field the user set is kept (the converted object equals the original on every ``TrainingArguments``
    field); a subclass (e.g. ``Seq2SeqTrainingArguments``) keeps its own fields too. ``None`` gives the stock
    Trainer's default, ``output_dir="tmp_trainer"``.
    """
    if isinstance(args, TokenWeightedArguments):
        return args
    if args is None:
        return TokenWeightedArguments(output_dir="tmp_trainer")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return _with_hfacc_settings(type(args))(**values)


def convert_arguments(args: TrainingArguments | None, cls: type[TokenWeightedArguments]):
    """``args`` as an online trainer's arguments class ``cls`` (:class:`hfacc.GRPOArguments`,
    :class:`hfacc.DistillationArguments`): itself, or converted once, every field the user set kept and ``cls``'s
    defaults for the rest (``None``: stock's ``output_dir="tmp_trainer"``)."""
    if isinstance(args, cls):
        return args
    if args is None:
        return cls(output_dir="tmp_trainer")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name in names})


@functools.cache
def _with_hfacc_settings(cls: type) -> type:
    """``cls`` with hfacc's fields: a class made here at run time, which pickle cannot find by its name.

    Its objects pickle as "this class made from ``cls``, with this state" (``cls`` itself pickles by name), so
    ``torch.save(args)`` (every checkpoint's ``training_args.bin``) and ``torch.load`` in a fresh process work.
    """
    if cls is TrainingArguments:
        return TokenWeightedArguments
    namespace = {"__reduce__": _reduce_converted, "__module__": __name__, "_hfacc_base": cls}
    return dataclass(type(f"TokenWeighted{cls.__name__}", (cls, TokenWeightedArguments), namespace))


def _reduce_converted(args):
    return _rebuild_converted, (type(args)._hfacc_base, dict(args.__dict__))


def _rebuild_converted(base: type, state: dict):
    """The converted arguments of a ``base`` subclass, as pickled by :func:`_reduce_converted`."""
    args = object.__new__(_with_hfacc_settings(base))
    args.__dict__.update(state)
    return args
