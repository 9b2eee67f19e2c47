"""``DistillationTrainer``: on-policy distillation (GKD, TRL's ``DistillationTrainer``) as a TokenWeightedTrainer that
generates.

As for :class:`hfacc.GRPOTrainer`, the step is unchanged and only the micro-batches' source differs: both subclass
:class:`hfacc.training.online_trainer.OnlineTrainer`, whose train dataloader, the
:class:`hfacc.training.online_trainer.RolloutLoader`, draws each optimizer step's prompts
(``per_device_train_batch_size x gradient_accumulation_steps`` per rank) and asks :meth:`generate_micro_batches` for
its micro-batches. There, a seeded draw makes each micro-batch on-policy with probability ``lmbda`` (GKD's lambda;
the same draw on every rank): the student samples its completions (:meth:`DistillationTrainer.sample`, GRPO's
sampler); the others keep the dataset's ``completion``. The rows are SFT rows (labels -100 on the prompt), trained
by :class:`hfacc.DistillationObjective`: the window counts the completion tokens the step actually trains — the
*generated* ones where the student generated — over its micro-batches and ranks, before the first backward. (TRL's
GKDTrainer lets the Trainer count the dataset's labels and then replaces them by the generated ones, trl#4719.)

Generation goes through one method, :meth:`DistillationTrainer.sample`, and GRPO's generation engine
(:mod:`hfacc.generation.engine`): the student's own ``generate``, or with ``use_vllm=True`` a colocated vLLM engine
that gets the student's weights before every generation that follows an optimizer step (TRL's settings,
:class:`hfacc.generation.vllm_engine.VLLMArguments`). The divergence is the teacher's against the student's own
log-probs of the sampled tokens, so the sampler's log-probs are not used.

The teacher runs beside the student, or on a vLLM server of its own (``use_teacher_server``,
``teacher_model_server_url``, ``loss_top_k``: TRL's names): then each step's rows get the teacher's top-K
``prompt_logprobs`` from it (:class:`hfacc.generation.server_engine.ServedTeacher`) as the stored columns
``target_token_ids`` / ``target_logprobs``, and the objective trains from them as from
:func:`hfacc.precompute_teacher_logprobs`' (docs/distillation.md#a-served-teacher).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.collator import DataCollatorForCausalLM
from ..data.formats import DataError
from ..generation.rollout import SamplingSettings, get_prompt_ids, is_conversational
from ..generation.vllm_engine import VLLMArguments, check_vllm_settings
from ..models.model_init import get_policy_for_trainer
from ..objectives.distillation import DistillationObjective
from ..ops.loss import IGNORE_INDEX
from .arguments import TokenWeightedArguments, convert_arguments
from .online_trainer import OnlineTrainer

logger = logging.getLogger(__name__)


@dataclass
class DistillationArguments(TokenWeightedArguments, VLLMArguments):
    """``TokenWeightedArguments`` plus on-policy distillation's settings (the names of TRL's ``DistillationConfig``
    and ``GKDConfig``; ``use_vllm`` and the engine's, :class:`hfacc.generation.vllm_engine.VLLMArguments`, as GRPO's).
    ``per_device_train_batch_size`` counts prompts (one completion each)."""

    lmbda: float = field(
        default=1.0,
        metadata={
            "help": "Share of micro-batches whose completions the student generates (GKD's lambda). 1: always "
            "on-policy (TRL's DistillationTrainer); 0: the dataset's 'completion' only (offline distillation)."
        },
    )
    beta: float = field(
        default=1.0,
        metadata={"help": "Generalized JSD: 0 forward KL, 1 reverse KL (TRL's default), 0.5 the symmetric JSD."},
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature, and the divergence's (both logits / temperature)."}
    )
    ce_weight: float = field(
        default=0.0, metadata={"help": "Weight of the student's cross-entropy on the completions (0: none)."}
    )
    max_completion_length: int = field(default=256, metadata={"help": "Longest completion sampled, in tokens."})
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Keep only the last this many prompt tokens (None: the whole prompt)."}
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest set of this mass."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k likeliest tokens (0: all)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "transformers' repetition penalty (1: none)."})
    use_teacher_server: bool = field(
        default=False,
        metadata={
            "help": "The teacher runs on a vLLM server (teacher_model_server_url; TRL's name): its top-K log-probs "
            "of each trained sequence (loss_top_k) are what the student learns, over that support. No teacher_model."
        },
    )
    teacher_model_server_url: str | None = field(
        default=None,
        metadata={"help": "The teacher's vLLM server, http://host:port (hfacc vllm-serve --model <teacher>)."},
    )
    loss_top_k: int | None = field(
        default=None,
        metadata={
            "help": "With use_teacher_server: K, the teacher's top-K support per token (None: 20, vLLM's default "
            "--max-logprobs). A local teacher uses its full distribution."
        },
    )

    # What RolloutLoader reads: one completion per prompt, one generation per optimizer step, used once.
    num_generations = 1
    num_iterations = 1

    @property
    def steps_per_generation(self) -> int:
        return self.gradient_accumulation_steps

    def __post_init__(self):
        super().__post_init__()
        check_vllm_settings(self)
        if not 0 <= self.lmbda <= 1:
            raise ValueError(f"lmbda={self.lmbda}: it must be in [0, 1] (the share of on-policy micro-batches).")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length}: it must be >= 1.")
        if self.normalization == "sequence":
            raise ValueError("normalization='sequence' does not apply to distillation: use 'token'.")
        if self.use_teacher_server:
            url = self.teacher_model_server_url or ""
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"use_teacher_server=True needs teacher_model_server_url=http://host:port (got {url!r}): the "
                    "teacher's vLLM server (hfacc vllm-serve --model <teacher>)."
                )
            if self.loss_top_k is None:
                self.loss_top_k = 20
            if self.loss_top_k < 1:
                raise ValueError(f"loss_top_k={self.loss_top_k}: the served teacher's top-K support needs K >= 1.")
        elif self.loss_top_k is not None or self.teacher_model_server_url is not None:
            raise ValueError(
                "loss_top_k and teacher_model_server_url apply to a served teacher: set use_teacher_server=True (or "
                "drop them: a local teacher_model gives its full distribution)."
            )
        # The loss's own checks (beta, temperature, ce_weight), here where the settings are made.
        DistillationObjective(beta=self.beta, temperature=self.temperature, ce_weight=self.ce_weight)


class DistillationTrainer(OnlineTrainer):
    """On-policy knowledge distillation: the student samples completions and learns the teacher's distribution on
    them, exact per completion token over each optimizer step.

    Args:
        model: the student, a causal LM (its ``generate`` samples the completions).
        teacher_model: the teacher (a model, or its hub id / local directory), sharing the student's tokenizer;
            frozen, placed like the student (:class:`hfacc.DistillationObjective`). None with
            ``use_teacher_server=True``: the teacher is the one on ``teacher_model_server_url``.
        args: :class:`DistillationArguments` (a plain ``TrainingArguments`` is converted, with their defaults).
        train_dataset: prompts: a ``"prompt"`` column of text or chat messages, and a ``"completion"`` column (text,
            or one assistant message) for the micro-batches that are not on-policy (``lmbda < 1``).
        processing_class: the tokenizer (chat template, EOS and pad token).
        callbacks, optimizers, **kwargs: as for ``transformers.Trainer`` (no ``eval_dataset``).

    >>> trainer = DistillationTrainer(student, teacher, DistillationArguments(output_dir="out", lmbda=0.5),
    ...                               train_dataset=prompts, processing_class=tokenizer)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    """

    args: DistillationArguments

    def __init__(
        self,
        model: nn.Module | str,
        teacher_model: nn.Module | str | None = None,
        args=None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        **kwargs,
    ):
        args = convert_arguments(args, DistillationArguments)
        # TRL's call shape: a model's name (loaded with model_init_kwargs), no processing_class, a peft_config.
        model, processing_class = get_policy_for_trainer(
            model, processing_class, args, peft_config, "DistillationTrainer"
        )
        if teacher_model is None:
            teacher_model = getattr(args, "teacher_model_name_or_path", None)
        if processing_class is None or getattr(processing_class, "pad_token_id", None) is None:
            raise ValueError("DistillationTrainer needs processing_class=<the tokenizer>, with a pad token (and EOS).")
        if kwargs.get("eval_dataset") is not None:
            raise ValueError(
                "DistillationTrainer does not evaluate during training; score held-out prompts after training "
                "(recipes/distill.py reports exact match) and pass no eval_dataset."
            )
        columns = getattr(train_dataset, "column_names", ()) or ()
        if train_dataset is None or "prompt" not in columns:
            raise ValueError(
                "train_dataset must be a datasets.Dataset with a 'prompt' column (text or chat messages)."
            )
        if args.lmbda < 1 and "completion" not in columns:
            raise ValueError(
                f"lmbda={args.lmbda}: the micro-batches the student does not generate train on the dataset's "
                "completions, and train_dataset has no 'completion' column. Add one, or set lmbda=1 (always "
                "on-policy)."
            )
        if args.use_teacher_server and teacher_model is not None:
            raise ValueError(
                "use_teacher_server=True: the teacher is the one on teacher_model_server_url; pass no teacher_model "
                "(or set use_teacher_server=False to run this one beside the student)."
            )
        if teacher_model is None and not args.use_teacher_server:
            raise ValueError("DistillationTrainer needs teacher_model=<a model or its name/path>.")
        objective = DistillationObjective(
            teacher_model, beta=args.beta, temperature=args.temperature, ce_weight=args.ce_weight
        )
        self.served_teacher = None
        if args.use_teacher_server:
            from ..generation.server_engine import ServedTeacher
            from ..models.teacher import get_tokenizer_length

            self.served_teacher = ServedTeacher(
                args.teacher_model_server_url, processing_class, top_k=args.loss_top_k,
                timeout=args.vllm_server_timeout, vocab_size=get_tokenizer_length(processing_class),
            )  # fmt: skip
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            data_collator=DataCollatorForCausalLM(processing_class.pad_token_id),
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            objective=objective,
            **kwargs,
        )
        self._generations = 0
        self.generation_meter = GenerationMeter()
        self.last_rows: list[dict[str, Any]] = []  # the latest generation batch's rows, in training order

    # ---- where the micro-batches come from: OnlineTrainer's loader and engine (GRPO's) --------------------------
    def sample(self, prompt_ids: Sequence[Sequence[int]], generation: int = 0) -> tuple[list[list[int]], list[bool]]:
        """One completion per prompt from the student: ``(completion ids, truncated flags)``, sampled by
        :attr:`engine` from the student's current weights (the one place generation happens). ``generation`` numbers
        the generation batch in the run: with the rank, it seeds the engine's draw."""
        args = self.args
        settings = SamplingSettings(
            args.max_completion_length, args.temperature, args.top_p, args.top_k, args.repetition_penalty
        )
        samples = self.sync_engine().sample(prompt_ids, settings, seed=self.sampling_seed(generation))
        return samples.completion_ids, samples.truncated

    def on_policy_draws(self, count: int, generations: int | None = None) -> list[bool]:
        """Which of the next ``count`` micro-batches the student generates: seeded, the same on every rank
        (``generations``: the number of generation batches drawn before it; None: so far)."""
        args = self.args
        generations = self._generations if generations is None else generations
        seed = (args.data_seed if args.data_seed is not None else args.seed) + 7919 * generations
        rng = random.Random(seed)
        return [rng.random() < args.lmbda for _ in range(count)]

    def generation_request(self, indices: Sequence[int], generation: int):
        """``(prompt_ids, settings, seed)`` of the next :meth:`generate_micro_batches`' :meth:`sample` call, ahead of
        it (``async_generation``): the prompts of its on-policy micro-batches (None: it samples none)."""
        args, size = self.args, self.args.per_device_train_batch_size
        draws = self.on_policy_draws(-(-len(indices) // size), generations=self._generations)
        ids = [get_prompt_ids(self.processing_class, self.train_dataset[i]["prompt"], args.max_prompt_length)
               for j, i in enumerate(indices) if draws[j // size]]  # fmt: skip
        settings = SamplingSettings(
            args.max_completion_length, args.temperature, args.top_p, args.top_k, args.repetition_penalty
        )
        return (ids, settings, self.sampling_seed(generation)) if ids else None

    def generate_micro_batches(self, indices: Sequence[int], generation: int = 0) -> list[dict[str, torch.Tensor]]:
        """The ``gradient_accumulation_steps`` micro-batches of one optimizer step: prompts ``indices``, each
        micro-batch on-policy (the student's completions) or not (the dataset's), by :meth:`on_policy_draws`;
        ``generation``: the generation batch's number in the run (RolloutLoader's)."""
        args, start = self.args, time.perf_counter()
        size = args.per_device_train_batch_size
        rows = [self.train_dataset[i] for i in indices]
        prompts = [get_prompt_ids(self.processing_class, r["prompt"], args.max_prompt_length) for r in rows]
        draws = self.on_policy_draws(-(-len(rows) // size))
        self._generations += 1
        generated = [i for i in range(len(rows)) if draws[i // size]]
        completions: list[list[int] | None] = [None] * len(rows)
        truncated = 0
        if generated:
            sampled, cut = self.sample([prompts[i] for i in generated], generation)
            for i, ids, was_cut in zip(generated, sampled, cut, strict=True):
                completions[i] = ids
                truncated += was_cut
        for i, row in enumerate(rows):
            if completions[i] is None:
                completions[i] = self.completion_ids(row, indices[i])
        self.last_rows = [
            {"input_ids": list(p) + list(c), "labels": [IGNORE_INDEX] * len(p) + list(c)}
            for p, c in zip(prompts, completions, strict=True)
        ]
        if self.served_teacher is not None:  # the teacher's top-K of every row, as stored columns
            self.served_teacher.add_rows(self.last_rows)
        batches = [self.data_collator(self.last_rows[i : i + size]) for i in range(0, len(rows), size)]
        seconds = time.perf_counter() - start
        lengths = [len(completions[i]) for i in generated]
        self.generation_meter.add(lengths, truncated, sum(draws), len(draws), seconds)
        self.generation_seconds += seconds
        self.meter.exclude_time(seconds)  # the logged training rate leaves the generation out
        return batches

    def completion_ids(self, row: Mapping[str, Any], index: int) -> list[int]:
        """The dataset's completion of a prompt, as the student would have generated it: its tokens and EOS."""
        completion = row.get("completion")
        if is_conversational(completion):
            if len(completion) != 1 or completion[0].get("role") != "assistant":
                raise DataError(
                    f"row {index} of the prompts dataset: a chat 'completion' must be one assistant message."
                )
            completion = completion[0]["content"]
        if not isinstance(completion, str):
            raise DataError(f"row {index} of the prompts dataset: 'completion' must be text or one assistant message.")
        tokenizer = self.processing_class
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"][: self.args.max_completion_length - 1]
        return list(ids) + [tokenizer.eos_token_id]

    # ---- what is logged --------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The token-weighted logs, plus the interval's generations (lengths, on-policy share) and their time."""
        if "loss" in logs:
            logs.update(self.generation_meter.interval_logs(self.accelerator))
            logs["training_time"] = round(self.meter.training_seconds(), 3)
        super().log(logs, start_time)


class GenerationMeter:
    """The logged generation metrics of one interval, summed over all ranks: ``completions/mean_length``,
    ``completions/clipped_ratio`` (over generated completions), ``on_policy_fraction`` (of micro-batches) and
    ``generation_time`` (seconds per rank)."""

    def __init__(self):
        self.sums = torch.zeros(6, dtype=torch.float64)

    def add(self, lengths: list[int], truncated: int, on_policy: int, micro_batches: int, seconds: float) -> None:
        values = [len(lengths), sum(lengths), truncated, on_policy, micro_batches, seconds]
        self.sums += torch.tensor(values, dtype=torch.float64)

    def interval_logs(self, accelerator) -> dict[str, float]:
        sums, world = self.sums, accelerator.num_processes
        if world > 1:
            dtype = torch.float32 if accelerator.device.type == "mps" else torch.float64
            sums = accelerator.reduce(sums.to(accelerator.device, dtype), reduction="sum").cpu().double()
        self.sums = torch.zeros_like(self.sums)
        completions, tokens, truncated, on_policy, micro_batches, seconds = sums.tolist()
        if not micro_batches:
            return {}
        logs = {"on_policy_fraction": on_policy / micro_batches, "generation_time": round(seconds / world, 3)}
        if completions:
            logs["completions/mean_length"] = tokens / completions
            logs["completions/clipped_ratio"] = truncated / completions
        return logs


__all__ = ["DistillationTrainer", "DistillationArguments", "GenerationMeter"]
