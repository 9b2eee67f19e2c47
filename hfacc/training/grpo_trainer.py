"""``GRPOTrainer``: online policy gradients (GRPO, DAPO, Dr. GRPO) as a :class:`TokenWeightedTrainer` that generates.

Online methods wrap the trainer's step, they do not fork it. Here the step is unchanged; what changes is where its
micro-batches come from. The train dataloader (:class:`RolloutLoader`) draws a batch of prompts, samples
``num_generations`` completions for each with the policy, scores them with the reward functions and gives each its
group advantage (:mod:`hfacc.generation.rollout`), then yields the rollout as ``steps_per_generation`` micro-batches of
``per_device_train_batch_size`` completions, ``num_iterations`` times over. The Trainer draws each optimizer step's
``gradient_accumulation_steps`` micro-batches from it as from any dataloader, and the window counts what *that* step
consumes (completion tokens and completions, over all ranks) before its first backward: the normalizer of every loss
type is the step's own, whether a generation serves one optimizer step or several. The loss is
:class:`hfacc.PolicyGradientObjective`'s, through the same window, layout (padding-free) and chunked log-probs as
every other objective.

When a micro-batch is trained after an optimizer step that followed its generation (``steps_per_generation`` or
``num_iterations`` such that a generation does not fit in one step), the rows carry ``old_logps``: the log-probs of
the policy that sampled them, taken right after sampling, before the first pass. Otherwise the ratio is 1 and none
are needed (TRL's rule).

Each rank samples the completions of its own prompts (a prompt's group never spans ranks); the rewards of every
rank are gathered before the advantages (:func:`hfacc.generation.rollout.compute_advantages`), so the batch
statistics of ``scale_rewards="batch"``, REINFORCE++, GDPO and ``normalize_advantages`` are the whole generation's,
equal on every rank, before any backward; the logged rewards, lengths and clip ratios are sums over all ranks and the logging interval, each
over its own unit.

The sampling goes through the trainer's generation engine (:mod:`hfacc.generation.engine`): the policy's own
``generate``, or with ``use_vllm=True`` a vLLM engine in each process (:mod:`hfacc.generation.vllm_engine`) that
gets the policy's weights before every generation that follows an optimizer step. With vLLM the policy's own
log-probs of the samples are taken right after sampling: their difference from the sampler's is logged
(``sampling/sampling_logp_difference/*``) and, with the correction on, turned into per-token importance weights
(TRL's ``vllm_importance_sampling_*``), data of the rows like ``old_logps``, so the step stays exact.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import TrainingArguments

from ..data.collator import DataCollatorForCausalLM
from ..generation.engine import GenerationEngine
from ..generation.rewards import get_reward_function
from ..generation.rollout import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    Rollout,
    SamplingSettings,
    build_rollout,
    get_prompt_ids,
    get_reward_name,
)
from ..generation.tools import EnvironmentPool, MultiTurnSampler
from ..generation.vllm_engine import VLLMArguments, check_vllm_settings
from ..models.model_init import get_policy_for_trainer
from ..objectives.policy_gradient import (
    IMPORTANCE_SAMPLING_LEVELS,
    IMPORTANCE_SAMPLING_MODES,
    LOSS_TYPE_ALIASES,
    LOSS_TYPES,
    PolicyGradientObjective,
    importance_sampling_weights,
)
from ..ops.logprobs import check_fused_logprobs, get_token_logprobs
from ..ops.loss import IGNORE_INDEX, shift_labels
from ..runtime.config import ConfigError
from .arguments import TokenWeightedArguments, convert_arguments
from .online_trainer import OnlineTrainer, RolloutLoader

logger = logging.getLogger(__name__)


@dataclass
class GRPOArguments(TokenWeightedArguments, VLLMArguments):
    """``TokenWeightedArguments`` plus the rollout, the policy loss and generation on vLLM (TRL's ``GRPOConfig``
    names; :class:`hfacc.generation.vllm_engine.VLLMArguments` for ``use_vllm`` and the engine's settings).

    ``per_device_train_batch_size`` counts completions, as in TRL: a rank's generation batch is
    ``per_device_train_batch_size x steps_per_generation`` completions, ``num_generations`` per prompt.
    """

    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (a group)."})
    max_completion_length: int = field(default=256, metadata={"help": "Longest completion sampled, in tokens."})
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Keep only the last this many prompt tokens (None: the whole prompt)."}
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature; the log-probs are those of logits / temperature."}
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: keep the smallest set of this mass."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k likeliest tokens (0: all)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "transformers' repetition penalty (1: none)."})
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches one generation batch makes (None: gradient_accumulation_steps, one generation "
            "per optimizer step). 2 x gradient_accumulation_steps: one generation serves two optimizer steps."
        },
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Passes over each generation batch (PPO epochs; > 1 needs old log-probs)."}
    )
    loss_type: str = field(
        default="token",
        metadata={
            "help": "'token' (DAPO: every completion token of the step weighs the same), 'sequence' (GRPO: every "
            "completion weighs the same), 'dr_grpo' (sum / (completions x max_completion_length)); TRL's 'dapo' "
            "and 'grpo' name the first two. 'cispo' (MiniMax-M1: the detached ratio capped at epsilon_high, x A x "
            "log pi; divided as 'token') and 'sapo' (a sigmoid gate instead of the clip; divided as 'sequence')."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one ratio per token; 'sequence' (GSPO): one ratio per completion, exp of the mean of its "
            "tokens' log-ratios, clipped per completion (GSPO uses epsilon 3e-4, epsilon_high 4e-4, loss_type "
            "'sequence').",
            "choices": ["token", "sequence"],
        },
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "SAPO's gate temperature for completions with positive advantage."}
    )
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "SAPO's gate temperature for completions with advantage <= 0."}
    )
    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "'grpo': reward minus the group's mean (scale_rewards); 'rloo': minus the mean of the group's "
            "other completions (TRL's RLOOTrainer); 'reinforce_pp' (REINFORCE++-baseline): minus the group's mean, "
            "then normalized over the generation batch of all ranks.",
            "choices": ["grpo", "rloo", "reinforce_pp"],
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': weighted sum of the rewards, then the advantage; 'normalize_then_sum' "
            "(GDPO): each reward normalized in its group, then the weighted sum normalized over the generation batch.",
            "choices": ["sum_then_normalize", "normalize_then_sum"],
        },
    )
    normalize_advantages: bool = field(
        default=False,
        metadata={"help": "Whiten the advantages over the generation batch of all ranks (TRL's RLOOConfig setting)."},
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound of the ratio: r >= 1 - epsilon."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping bound: r <= 1 + epsilon_high (None: epsilon; DAPO: 0.28)."}
    )
    beta: float = field(
        default=0.0, metadata={"help": "Weight of the k3 KL estimate to the reference model (0: no reference)."}
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Divide advantages by the std of the prompt's group ('group'), of the whole generation batch "
            "('batch'), or not at all ('none', Dr. GRPO).",
            "choices": list(SCALE_REWARDS),
        },
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function in the total reward (None: all 1)."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "With use_vllm: weigh each completion token's loss by the importance ratio of the trained "
            "policy to the sampler (vLLM), truncated or masked by vllm_importance_sampling_mode (TRL's correction)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate' / 'token_mask': a ratio per token, clipped to [clip_min, clip_max] / zero "
            "outside it; 'sequence_truncate' / 'sequence_mask': one ratio per completion (the product of its "
            "tokens'), clipped / zero outside.",
            "choices": list(IMPORTANCE_SAMPLING_MODES),
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the importance ratios (None: none)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the importance ratios (None: none)."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "TRL's former name of vllm_importance_sampling_clip_max (sets it)."}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "With tools: the most rounds of tool results per trajectory (None: only max_completion_length, "
            "which bounds the whole trajectory, model and tool tokens, bounds them)."
        },
    )
    tool_timeout: float | None = field(
        default=None,
        metadata={
            "help": "With tools: seconds a tool may take before its call fails with an error message (None: no limit)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        validate_grpo_settings(self)


def validate_grpo_settings(args: GRPOArguments) -> None:
    """Check the rollout settings; raise ``ValueError`` naming the field and the fix."""
    if args.num_generations < 2:
        raise ValueError(
            f"num_generations={args.num_generations}: group advantages need >= 2 completions per prompt (with one, "
            "every advantage is 0)."
        )
    for name in ("max_completion_length", "steps_per_generation", "num_iterations"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)}: it must be >= 1.")
    batch = args.per_device_train_batch_size * args.steps_per_generation
    if batch % args.num_generations:
        raise ValueError(
            f"a rank's generation batch, per_device_train_batch_size x steps_per_generation = "
            f"{args.per_device_train_batch_size} x {args.steps_per_generation} = {batch} completions, must hold whole "
            f"groups of num_generations={args.num_generations}: make it a multiple."
        )
    if LOSS_TYPE_ALIASES.get(args.loss_type, args.loss_type) not in LOSS_TYPES:
        raise ValueError(f"loss_type={args.loss_type!r}: use one of {list(LOSS_TYPES)} (or TRL's 'dapo', 'grpo').")
    if args.scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={args.scale_rewards!r}: use one of {list(SCALE_REWARDS)}.")
    if args.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={args.importance_sampling_level!r}: use one of "
            f"{list(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    if args.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator={args.advantage_estimator!r}: use one of {list(ADVANTAGE_ESTIMATORS)}.")
    if args.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation={args.multi_objective_aggregation!r}: use one of "
            f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}."
        )
    if args.multi_objective_aggregation == "normalize_then_sum" and args.advantage_estimator != "grpo":
        raise ValueError(
            "multi_objective_aggregation='normalize_then_sum' (GDPO) normalizes each reward in its group itself: "
            f"set advantage_estimator='grpo' (not {args.advantage_estimator!r})."
        )
    if args.loss_type == "cispo" and (args.epsilon_high is None or args.epsilon_high <= 1):
        raise ValueError(
            f"loss_type='cispo' caps the ratio at epsilon_high itself (TRL's meaning), epsilon_high="
            f"{args.epsilon_high}: set --epsilon_high above 1 (ScaleRL: 5.0); a PPO bound like 0.28 caps every ratio."
        )
    if args.normalization == "sequence":
        raise ValueError("normalization='sequence' does not apply to GRPO: set loss_type='sequence' instead.")
    if not args.temperature > 0:
        raise ValueError(f"temperature={args.temperature}: it must be > 0.")
    check_importance_sampling_settings(args)
    check_vllm_settings(args)  # last: its own last check is whether vLLM is installed
    # The loss's own checks (epsilon, epsilon_high, beta), here where the settings are made: a job would otherwise
    # meet them only when its trainer is built, after a short SFT and the held-out scoring, as a traceback.
    PolicyGradientObjective(
        loss_type=args.loss_type,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        beta=args.beta,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
    )


def check_importance_sampling_settings(args: GRPOArguments) -> None:
    """TRL's checks of the importance-sampling correction (``vllm_importance_sampling_*``)."""
    if args.vllm_importance_sampling_cap is not None:  # TRL 1.6 renamed it; a config written for it still works
        args.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_cap
        args.vllm_importance_sampling_cap = None
    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if args.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}: use one of "
            f"{list(IMPORTANCE_SAMPLING_MODES)}."
        )
    if (low is not None and low < 0) or (high is not None and high <= 0):
        raise ValueError(
            f"vllm_importance_sampling_clip_min={low}, _clip_max={high}: the bounds of a ratio are >= 0 (max > 0)."
        )
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"vllm_importance_sampling_clip_min={low} must be below vllm_importance_sampling_clip_max={high}."
        )
    truncating = args.vllm_importance_sampling_mode.endswith("truncate")
    if args.vllm_importance_sampling_correction and truncating and low is None and high is None:
        raise ValueError(
            f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r} clips the ratios: set "
            "vllm_importance_sampling_clip_max (or _clip_min)."
        )


def check_reward_weights(weights: Sequence[float] | None, funcs: Sequence[Callable]) -> None:
    """One weight per reward function, or none (all 1): a :class:`ConfigError` (a user's setting) otherwise."""
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(
            f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions: give one each."
        )


def as_grpo_arguments(args: TrainingArguments | None) -> GRPOArguments:
    """``args`` as :class:`GRPOArguments`: itself, or converted once (every field the user set is kept)."""
    return convert_arguments(args, GRPOArguments)


class GRPOTrainer(OnlineTrainer):
    """Online GRPO / DAPO / Dr. GRPO: sample, score, and take exact policy-gradient steps on what was sampled.

    Args:
        model: the policy, a causal LM (its ``generate`` samples the completions).
        reward_funcs: a function ``f(prompts, completions, **columns) -> list[float]`` or a list of them; ``columns``
            are the prompts dataset's other columns, one entry per completion. Chat prompts get completions as
            ``[{"role": "assistant", "content": text}]`` (as in TRL). A reward model (a sequence-classification model
            with ``num_labels=1``, or the path of one) scores prompt + completion through its own tokenizer, as in TRL
            (:class:`hfacc.generation.rewards.RewardModelFunction`).
        args: :class:`GRPOArguments` (a plain ``TrainingArguments`` is converted, with GRPO's defaults).
        train_dataset: prompts: a ``"prompt"`` column of text or chat messages, plus any columns the rewards read.
        processing_class: the tokenizer (chat template, EOS and pad token).
        ref_model: the reference for ``beta > 0`` (None: a frozen copy as training starts, or a PEFT policy's base).
        reward_processing_classes: the tokenizer of each reward model among ``reward_funcs`` (one, or a list with
            one entry per reward function, None for functions); None: each model's own, saved with it (TRL's name).
        engine: the :class:`hfacc.generation.engine.GenerationEngine` to sample with (None: the one ``args`` asks
            for, built at the first generation: the policy's ``generate``, or vLLM with ``use_vllm=True``). An
            engine given gets this policy's weights at the first generation.
        tools: Python functions the policy may call (TRL's ``tools``): multi-turn rollouts, the policy's tokens the
            only targets (:mod:`hfacc.generation.tools`, docs/tools_and_environments.md). Chat prompts only.
        environment_factory: TRL's (one callable): one environment per completion, reset with its prompt's row, its
            public methods tools, its ``get_reward()`` (if any) a reward of weight 1; the reward functions get them
            as ``environments`` (:class:`hfacc.generation.tools.EnvironmentPool`).
        callbacks, optimizers, **kwargs: as for ``transformers.Trainer`` (no ``eval_dataset``: score held-out prompts
            after training, as ``recipes/grpo.py`` does).

    >>> def correct(prompts, completions, answer, **kwargs):  # doctest: +SKIP
    ...     return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]
    >>> trainer = GRPOTrainer(model, correct, GRPOArguments(output_dir="out", num_generations=8),  # doctest: +SKIP
    ...                       train_dataset=prompts, processing_class=tokenizer)
    >>> trainer.train()  # doctest: +SKIP
    """

    args: GRPOArguments

    def __init__(
        self,
        model: nn.Module | str,
        reward_funcs: Callable | Sequence[Callable],
        args: TrainingArguments | None = None,
        train_dataset=None,
        processing_class=None,
        ref_model: nn.Module | None = None,
        callbacks=None,
        reward_processing_classes=None,
        optimizers=(None, None),
        engine: GenerationEngine | None = None,
        peft_config=None,
        tools: Sequence[Callable] | None = None,
        environment_factory: Callable | None = None,
        **kwargs,
    ):
        args = as_grpo_arguments(args)
        # TRL's call shape: a model's name (loaded with model_init_kwargs), no processing_class, a peft_config.
        model, processing_class = get_policy_for_trainer(model, processing_class, args, peft_config, "GRPOTrainer")
        if processing_class is None or getattr(processing_class, "pad_token_id", None) is None:
            raise ValueError("GRPOTrainer needs processing_class=<the tokenizer>, with a pad token (and EOS).")
        if kwargs.get("eval_dataset") is not None:
            raise ValueError(
                "GRPOTrainer does not evaluate during training; score held-out prompts after training (recipes/grpo.py "
                "reports their reward and exact match) and pass no eval_dataset."
            )
        if reward_funcs is None:
            reward_funcs = []  # an environment_factory whose environments give the reward (get_reward)
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        tokenizers = reward_processing_classes
        if not isinstance(tokenizers, (list, tuple)):
            tokenizers = [tokenizers] * len(funcs)
        if len(tokenizers) != len(funcs):
            raise ValueError(f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward_funcs.")
        # Reward models (objects or paths) become functions that score through their own tokenizer (TRL's rule).
        funcs = [get_reward_function(f, t, args.device) for f, t in zip(funcs, tokenizers, strict=True)]
        check_reward_weights(args.reward_weights, funcs)
        # Multi-turn rollouts with tools and environments: schemas and environments checked here, before model work.
        pool = EnvironmentPool(environment_factory) if environment_factory is not None else None
        if pool is not None and pool.has_reward:  # TRL's rule: one more reward, of weight 1, named after the class
            funcs.append(pool.reward_function())
            if args.reward_weights is not None:
                args.reward_weights = [*args.reward_weights, 1.0]
        if not funcs or not all(callable(f) for f in funcs):
            raise ValueError(
                "reward_funcs must be a function f(prompts, completions, **columns) or a list of them (or give an "
                "environment_factory whose environments have get_reward())."
            )
        if train_dataset is None or "prompt" not in getattr(train_dataset, "column_names", ()):
            raise ValueError(
                "train_dataset must be a datasets.Dataset with a 'prompt' column (text or chat messages)."
            )
        self.reward_funcs = funcs
        self.tool_sampler = (
            MultiTurnSampler(tools or [], processing_class, args.max_tool_calling_iterations, args.tool_timeout, pool)
            if tools or pool is not None
            else None
        )
        objective = PolicyGradientObjective(
            loss_type=args.loss_type,
            epsilon=args.epsilon,
            epsilon_high=args.epsilon_high,
            beta=args.beta,
            ref_model=ref_model,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            importance_sampling_level=args.importance_sampling_level,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
        )
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            data_collator=DataCollatorForCausalLM(processing_class.pad_token_id),
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            objective=objective,
            engine=engine,
            **kwargs,
        )
        # This rank's latest generation batch: its rows in training order (input_ids, labels: the targets, -100 on
        # prompt and tool tokens; advantages; old_logps / sampler_logps where taken), what to inspect after a step.
        self.rollout: Rollout | None = None
        self.rollout_meter = RolloutMeter(
            [get_reward_name(f) for f in funcs], args.num_generations, tools=self.tool_sampler is not None
        )
        self._logprobs_fused: bool | None = None  # old log-probs from the hidden states in chunks: checked once

    # ---- where the micro-batches come from -------------------------------------------------------------------
    @property
    def needs_old_logps(self) -> bool:
        """Whether some micro-batch of a generation is trained after an optimizer step that followed its sampling.

        A generation's micro-batches all fall in one optimizer step only when they divide the step's
        ``gradient_accumulation_steps`` (the Trainer draws a whole step's micro-batches before its first forward).
        """
        args = self.args
        return args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0

    def generation_request(self, indices: Sequence[int], generation: int):
        """``(prompt_ids, settings, seed)`` of :meth:`generate_micro_batches`' one ``engine.sample`` call, ahead of
        it (``async_generation``): each prompt's ids ``num_generations`` times. None with tools (their turns depend
        on the results)."""
        if self.tool_sampler is not None:
            return None
        args = self.args
        ids = [get_prompt_ids(self.processing_class, self.train_dataset[i]["prompt"], args.max_prompt_length)
               for i in indices]  # fmt: skip
        settings = SamplingSettings(
            args.max_completion_length, args.temperature, args.top_p, args.top_k, args.repetition_penalty
        )
        return [p for p in ids for _ in range(args.num_generations)], settings, self.sampling_seed(generation)

    def generate_micro_batches(self, indices: Sequence[int], generation: int = 0) -> list[dict[str, torch.Tensor]]:
        """The ``steps_per_generation`` micro-batches of one generation batch: prompts ``indices`` of the dataset.

        ``generation`` numbers the generation batch in the run (epoch after epoch): it seeds the engine's sampling
        (vLLM) and the order of the rows, so that a run and its resumption draw the same.
        """
        args, start = self.args, time.perf_counter()
        policy = self.accelerator.unwrap_model(self.model)
        engine = self.sync_engine()  # the weights this generation's steps train
        base_seed = args.data_seed if args.data_seed is not None else args.seed
        rank = self.accelerator.process_index
        rollout = build_rollout(
            engine,
            self.processing_class,
            [self.train_dataset[i] for i in indices],
            self.reward_funcs,
            num_generations=args.num_generations,
            settings=SamplingSettings(
                args.max_completion_length, args.temperature, args.top_p, args.top_k, args.repetition_penalty
            ),
            reward_weights=args.reward_weights,
            scale_rewards=args.scale_rewards,
            max_prompt_length=args.max_prompt_length,
            row_names=[f"row {i} of the prompts dataset" for i in indices],
            seed=self.sampling_seed(generation),
            advantage_estimator=args.advantage_estimator,
            multi_objective_aggregation=args.multi_objective_aggregation,
            normalize_advantages=args.normalize_advantages,
            # Batch statistics (scale_rewards='batch', reinforce_pp, GDPO, normalize_advantages) are the whole
            # generation's: every rank's rewards, gathered before any advantage (groups stay within a rank).
            gather=self.gather_rewards if self.accelerator.num_processes > 1 else None,
            rank=rank,
            tool_sampler=self.tool_sampler,
        )
        if rollout.sampler_logps is not None:  # aligned with labels, as old_logps are
            for row, logps in zip(rollout.rows, rollout.sampler_logps, strict=True):
                row["sampler_logps"] = [0.0] * (len(row["input_ids"]) - len(logps)) + list(logps)
        # Groups are mixed over the micro-batches (as TRL does): the step's update does not depend on the order,
        # but a micro-batch of one prompt's completions would have a zero-mean advantage.
        order = torch.randperm(
            len(rollout.rows), generator=torch.Generator().manual_seed(base_seed + 7919 * generation)
        )
        rollout.rows = [rollout.rows[i] for i in order.tolist()]
        size = args.per_device_train_batch_size
        chunks = [rollout.rows[i : i + size] for i in range(0, len(rollout.rows), size)]
        batches = [self.data_collator(chunk) for chunk in chunks]
        if self.needs_old_logps or rollout.sampler_logps is not None:
            for batch, chunk in zip(batches, chunks, strict=True):
                self.add_sampler_terms(policy, batch, chunk)
        self.rollout = rollout
        seconds = time.perf_counter() - start
        self.rollout_meter.add(rollout, seconds)
        self.generation_seconds += seconds
        # The rate logged for training leaves the rollout out; it is logged apart (generation_time).
        self.meter.exclude_time(seconds)
        return batches

    def gather_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[N, F]`` rewards, in rank order (on the accelerator's device for the collective)."""
        return self.accelerator.gather(rewards.to(self.accelerator.device)).cpu()

    def add_sampler_terms(self, policy: nn.Module, batch: dict[str, torch.Tensor], rows: list[dict]) -> None:
        """What one micro-batch needs of the sampling policy, in ``batch`` (and in ``rows``, so that a test can rebuild
        the rollout exactly): ``old_logps`` where a generation outlives an optimizer step; with a sampler other
        than the policy (vLLM), the mismatch measured and, with the correction on, ``importance_weights``.

        With vLLM, ``old_logps`` are the policy's own log-probs of the samples, taken now (before any update), when
        the importance-sampling correction is on (TRL's rule: the sampler's enter through the weights); with it
        off they are the sampler's.
        """
        args = self.args
        policy_logps = self.get_old_logps(policy, batch)
        old = policy_logps
        if "sampler_logps" in rows[0]:
            sampler = torch.zeros_like(policy_logps)
            for i, row in enumerate(rows):
                sampler[i, : len(row["sampler_logps"])] = torch.tensor(row["sampler_logps"])
            mask = batch["labels"] != IGNORE_INDEX
            owner = torch.arange(mask.shape[0])[:, None].expand(mask.shape)[mask]
            weights, ratios = importance_sampling_weights(
                policy_logps[mask],
                sampler[mask],
                owner,
                mask.shape[0],
                args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min,
                args.vllm_importance_sampling_clip_max,
            )
            correct = args.vllm_importance_sampling_correction
            self.rollout_meter.add_sampling((policy_logps[mask] - sampler[mask]).abs(), ratios if correct else None)
            if correct:
                aligned = torch.zeros_like(policy_logps)
                aligned[mask] = weights.float()
                batch["importance_weights"] = aligned
            else:
                old = sampler
        if self.needs_old_logps:
            batch["old_logps"] = old
        for key in ("old_logps", "importance_weights"):
            if key in batch:
                for values, row in zip(batch[key], rows, strict=True):
                    row[key] = values[: len(row["input_ids"])].tolist()

    @torch.no_grad()
    def get_old_logps(self, policy: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sampling policy's log-prob of each completion token, aligned with ``labels`` (0 elsewhere), ``[B, T]``."""
        device = self.args.device
        inputs = {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device)}
        targets = shift_labels(batch["labels"].to(device), attention_mask=inputs["attention_mask"])
        if self._logprobs_fused is None:
            self._logprobs_fused = self.args.fused_loss and (
                check_fused_logprobs(policy, inputs, targets, self.args.temperature) is None
            )
        was_training = policy.training
        policy.eval()
        try:
            _, result = get_token_logprobs(
                policy, inputs, targets, fused=self._logprobs_fused, temperature=self.args.temperature
            )
        finally:
            policy.train(was_training)
        # Position t predicts token t + 1: its log-prob belongs to input_ids[t + 1], where the labels say so.
        aligned = torch.zeros(batch["labels"].shape, dtype=torch.float32, device=device)
        aligned[:, 1:][result.mask[:, :-1]] = result.logps.float()
        return aligned.cpu()

    # ---- what is logged --------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The token-weighted logs, plus the rollouts of the interval (rewards, lengths) and the time apart."""
        if "loss" in logs:
            logs.update(self.rollout_meter.interval_logs(self.accelerator))
            logs["training_time"] = round(self.meter.training_seconds(), 3)
        super().log(logs, start_time)


class RolloutMeter:
    """The logged rollout metrics of one interval: rewards, completion lengths and times, summed over all ranks.

    Rewards and lengths are over completions (their unit), the share of groups whose rewards all agree over prompt
    groups; min/max lengths over all ranks. TRL's names: ``reward``, ``reward_std``, ``rewards/{f}/mean``,
    ``rewards/{f}/std``, ``frac_reward_zero_std``, ``completions/mean_length``, ``min_length``, ``max_length``,
    ``clipped_ratio``; and ``generation_time`` (seconds per rank: sampling, scoring, old log-probs),
    ``generation_tokens_per_second`` (completion tokens sampled over the sampling time, all ranks).

    With a sampler other than the policy (vLLM), the mismatch, over every completion token of the interval on all
    ranks: ``sampling/sampling_logp_difference/mean`` and ``/max`` (``|log pi(y_t) - log q(y_t)|``, the trained
    policy's log-prob of each sampled token against the sampler's); with the correction on,
    ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max`` over the ratios of its mode (per token, or per
    completion), after truncation or masking (TRL's names; TRL averages per-rank means, here each is over all units).

    With tools: ``tools/call_frequency`` (calls run per completion), ``tools/failure_frequency`` (failed calls per
    call; TRL's names) and ``tools/mean_turns`` (assistant turns per completion); the lengths count the policy's
    tokens only.
    """

    def __init__(self, names: list[str], num_generations: int, tools: bool = False):
        self.names, self.num_generations, self.tools = names, num_generations, tools
        self.reset()

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None
        self.min_length, self.max_length = math.inf, 0
        # sum |delta|, tokens, sum ratio, ratios; and max |delta|, max ratio, -min ratio
        self.sampling = torch.zeros(4, dtype=torch.float64)
        self.sampling_extremes = torch.full((3,), -math.inf, dtype=torch.float64)

    def add_sampling(self, difference: torch.Tensor, ratios: torch.Tensor | None) -> None:
        """One micro-batch's ``|log pi - log q|`` per completion token, and its importance ratios (or None)."""
        difference = difference.double()
        values = [difference.sum(), float(difference.numel()), 0.0, 0.0]
        extremes = [difference.max() if difference.numel() else -math.inf, -math.inf, -math.inf]
        if ratios is not None and ratios.numel():
            ratios = ratios.double()
            values[2:] = [ratios.sum(), float(ratios.numel())]
            extremes[1:] = [ratios.max(), -ratios.min()]
        self.sampling += torch.tensor([float(v) for v in values], dtype=torch.float64)
        self.sampling_extremes = torch.maximum(
            self.sampling_extremes, torch.tensor([float(v) for v in extremes], dtype=torch.float64)
        )

    def add(self, rollout: Rollout, seconds: float) -> None:
        rewards, total = rollout.rewards, rollout.total
        groups = total.view(-1, self.num_generations)
        lengths = torch.tensor(rollout.completion_lengths, dtype=torch.float64)
        values = torch.cat(
            [
                torch.tensor([float(len(total)), total.sum(), (total**2).sum()], dtype=torch.float64),
                rewards.sum(0),
                (rewards**2).sum(0),
                torch.tensor(
                    [
                        lengths.sum(),
                        float(sum(rollout.truncated)),
                        float((groups.max(-1).values - groups.min(-1).values <= 1e-8).sum()),
                        float(groups.shape[0]),
                        rollout.seconds,
                        seconds,
                        float(sum(rollout.tool_calls)),
                        float(sum(rollout.tool_failures)),
                        float(sum(rollout.turns)),
                    ],
                    dtype=torch.float64,
                ),
            ]
        )
        self.sums = values if self.sums is None else self.sums + values
        self.min_length = min(self.min_length, min(rollout.completion_lengths))
        self.max_length = max(self.max_length, max(rollout.completion_lengths))

    def interval_logs(self, accelerator) -> dict[str, float]:
        """The interval's rollout logs (none when it sampled nothing: every rank samples at the same steps)."""
        if self.sums is None:
            return {}
        device, world = accelerator.device, accelerator.num_processes
        sums = torch.cat([self.sums, self.sampling])
        extremes = torch.cat(
            [torch.tensor([-self.min_length, self.max_length], dtype=torch.float64), self.sampling_extremes]
        )
        if world > 1:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            sums = accelerator.reduce(sums.to(device, dtype), reduction="sum").cpu().double()
            extremes = accelerator.reduce(extremes.to(device, dtype), reduction="max").cpu().double()
        self.reset()
        sums, sampling = sums[:-4], sums[-4:].tolist()
        extremes, sampling_extremes = extremes[:2], extremes[2:].tolist()
        f = len(self.names)
        n, total, total_sq = sums[:3].tolist()
        func_sums, func_sqs = sums[3 : 3 + f].tolist(), sums[3 + f : 3 + 2 * f].tolist()
        length, truncated, zero_std, groups, sampling_seconds, seconds, calls, failures, turns = sums[
            3 + 2 * f :
        ].tolist()
        logs = {"reward": total / n, "reward_std": _std(total, total_sq, n)}
        for name, s, sq in zip(self.names, func_sums, func_sqs, strict=True):
            logs[f"rewards/{name}/mean"] = s / n
            logs[f"rewards/{name}/std"] = _std(s, sq, n)
        logs.update(
            {
                "frac_reward_zero_std": zero_std / groups,
                "completions/mean_length": length / n,
                "completions/min_length": -extremes[0].item(),
                "completions/max_length": extremes[1].item(),
                "completions/clipped_ratio": truncated / n,
                "generation_time": round(seconds / world, 3),
                "generation_tokens_per_second": round(length / max(sampling_seconds / world, 1e-9), 2),
            }
        )
        if self.tools:
            logs["tools/call_frequency"] = calls / n
            logs["tools/failure_frequency"] = failures / calls if calls else 0.0
            logs["tools/mean_turns"] = turns / n
        difference, tokens, ratio, ratios = sampling
        if tokens:
            logs["sampling/sampling_logp_difference/mean"] = difference / tokens
            logs["sampling/sampling_logp_difference/max"] = sampling_extremes[0]
        if ratios:
            logs["sampling/importance_sampling_ratio/min"] = -sampling_extremes[2]
            logs["sampling/importance_sampling_ratio/mean"] = ratio / ratios
            logs["sampling/importance_sampling_ratio/max"] = sampling_extremes[1]
        return logs


def _std(total: float, squares: float, n: float) -> float:
    """The sample standard deviation from a sum and a sum of squares (Bessel's correction, as TRL's ``nanstd``)."""
    if n < 2:
        return 0.0
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


__all__ = ["GRPOTrainer", "GRPOArguments", "RolloutLoader", "RolloutMeter", "validate_grpo_settings"]
