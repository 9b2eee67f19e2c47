"""Rollouts: completions sampled from the policy, scored by reward functions, turned into rows with advantages.

The pieces of an online policy-gradient step before any gradient (:class:`hfacc.GRPOTrainer` runs them):

1. :func:`get_prompt_ids` — a prompt (text, or chat messages through the tokenizer's chat template) as token ids;
2. sampling — ``num_generations`` completions per prompt with the generation engine
   (:mod:`hfacc.generation.engine`: transformers ``generate``, or vLLM with the sampler's per-token log-probs;
   sampling settings, ``max_completion_length``, stop at EOS);
3. :func:`score_completions` — each reward function ``f(prompts, completions, **columns) -> list[float]`` on the
   whole batch; one that raises, returns the wrong number of rewards or a non-finite one is named, with the row;
4. :func:`compute_advantages` — the advantage estimator over the whole generation batch (every rank's completions):
   GRPO's group baseline (:func:`group_advantages`), RLOO's leave-one-out, REINFORCE++'s batch-normalized, GDPO's
   per-reward normalization before the sum;
5. :func:`build_rollout_rows` — rows for :class:`hfacc.PolicyGradientObjective`: ``input_ids`` (prompt +
   completion), ``labels`` (-100 on the prompt, and on tool tokens of a multi-turn completion) and ``advantages``.

With tools (:class:`hfacc.generation.tools.MultiTurnSampler`), step 2 samples multi-turn trajectories: the policy's
turns and the tool results between them, with the mask of what the policy sampled, from which step 5 writes the
labels (the only place a target is decided).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.formats import DataError
from ..ops.loss import IGNORE_INDEX
from .engine import GenerationEngine, SamplingSettings, TransformersEngine, left_pad, sample_completions

SCALE_REWARDS = ("group", "batch", "none")
# "grpo": the group's mean (and scale_rewards); "rloo": the mean of the group's other completions (TRL's RLOOTrainer);
# "reinforce_pp": REINFORCE++-baseline, the group's mean subtracted, then normalized over the generation batch.
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
# TRL's GRPOConfig.multi_objective_aggregation; "normalize_then_sum" is GDPO.
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class RewardFunctionError(DataError):
    """A reward function raised, or returned something other than one finite float per completion."""


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt is chat messages (a list of ``{"role", "content"}``) rather than text."""
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m for m in prompt)


def get_prompt_ids(tokenizer, prompt: Any, max_prompt_length: int | None = None, tools: list[dict] | None = None):
    """The token ids of one prompt: chat messages through the chat template (with the generation prompt and the
    ``tools``' schemas), text as is.

    A prompt longer than ``max_prompt_length`` keeps its last tokens (the end is what the completion continues).
    """
    if is_conversational(prompt):
        text = tokenizer.apply_chat_template(
            list(prompt), tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens
    elif isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    else:
        raise DataError(f"a prompt must be text or a list of chat messages, got {type(prompt).__name__}: {prompt!r}")
    return list(ids[-max_prompt_length:] if max_prompt_length else ids)


def get_reward_name(func: Callable) -> str:
    """How a reward function is named in logs and errors (TRL's rule: its ``__name__``)."""
    return getattr(func, "__name__", None) or type(func).__name__


def call_reward(func: Callable, prompts: list, completions: list, columns: Mapping[str, Any]):
    """``func``'s rewards: called as TRL calls it, ``func(prompts=..., completions=..., **columns)``, where it names
    a ``completions`` parameter (TRL's ``def reward(completions, **kwargs)``), else positionally."""
    try:
        by_name = "completions" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature
        by_name = False
    if by_name:
        return func(prompts=prompts, completions=completions, **columns)
    return func(prompts, completions, **columns)


def score_completions(
    reward_funcs: Sequence[Callable],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    row_names: Sequence[str] | None = None,
) -> torch.Tensor:
    """``[N, F]`` rewards: ``reward_funcs[f](prompts, completions, **columns)`` for the N completions.

    ``columns`` holds the prompts' other dataset columns, one entry per completion. A function that raises is called
    again row by row to name the first row it fails on; one that returns the wrong number of rewards, or a reward
    that is not a finite number, is named with that row. ``row_names`` say what each row is (e.g. "row 17 of the
    prompts dataset"). The error is a :class:`RewardFunctionError` (a user error: one message, exit code 2).
    """
    columns = dict(columns or {})
    n = len(completions)
    names = list(row_names) if row_names is not None else [f"completion {i}" for i in range(n)]
    out = torch.zeros(n, len(reward_funcs), dtype=torch.float64)
    for f, func in enumerate(reward_funcs):
        name = get_reward_name(func)
        try:
            rewards = call_reward(func, list(prompts), list(completions), columns)
        except Exception as err:
            row = _first_failing_row(func, prompts, completions, columns)
            where = f" on {names[row]} (prompt {_short(prompts[row])})" if row is not None else ""
            raise RewardFunctionError(
                f"reward function '{name}' raised {type(err).__name__}: {err}{where}. Fix the function or the row."
            ) from err
        try:
            rewards = [float(r) for r in rewards]
        except (TypeError, ValueError) as err:
            raise RewardFunctionError(
                f"reward function '{name}' must return a list of floats, one per completion; got {_short(rewards)}."
            ) from err
        if len(rewards) != n:
            raise RewardFunctionError(
                f"reward function '{name}' returned {len(rewards)} rewards for {n} completions: it must return one "
                "per completion, in order."
            )
        for i, r in enumerate(rewards):
            if not math.isfinite(r):
                raise RewardFunctionError(
                    f"reward function '{name}' returned {r} for {names[i]} (prompt {_short(prompts[i])}, completion "
                    f"{_short(completions[i])}): every reward must be a finite number."
                )
        out[:, f] = torch.tensor(rewards, dtype=torch.float64)
    return out


def _first_failing_row(func, prompts, completions, columns) -> int | None:
    for i in range(len(completions)):
        try:
            call_reward(func, [prompts[i]], [completions[i]], {k: [v[i]] for k, v in columns.items()})
        except Exception:
            return i
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Group-relative advantages of rewards ``[N]`` whose consecutive blocks of ``num_generations`` share a prompt.

    ``A_i = r_i - mean(r of i's group)``; with ``scale_rewards="group"`` divided by ``std(group) + 1e-4``, with
    ``"batch"`` by ``std(all N) + 1e-4`` (sample std, as TRL), ``"none"``: not scaled (Dr. GRPO). A group whose
    rewards are all equal has advantages 0: nothing to learn from it.

    >>> group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, "none")
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: use one of {list(SCALE_REWARDS)}.")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of num_generations={num_generations}")
    groups = rewards.view(-1, num_generations)
    advantages = (groups - groups.mean(-1, keepdim=True)).flatten()
    if scale_rewards == "group" and num_generations > 1:
        advantages = advantages / (groups.std(-1).repeat_interleave(num_generations) + 1e-4)
    elif scale_rewards == "batch" and rewards.numel() > 1:
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    weights: torch.Tensor | None = None,
    *,
    scale_rewards: str = "group",
    advantage_estimator: str = "grpo",
    multi_objective_aggregation: str = "sum_then_normalize",
    normalize_advantages: bool = False,
) -> torch.Tensor:
    """Advantages ``[N]`` of rewards ``[N, F]`` (F reward functions, weights ``w`` ``[F]``, default 1) whose consecutive
    blocks of ``num_generations`` (G) share a prompt. N is the *whole* generation batch, every rank's completions:
    the batch statistics below are over all of them (a rank's own share gives another, split-dependent advantage).
    With ``r = rewards @ w``, ``eps = 1e-4`` and sample stds:

    - ``"grpo"``: :func:`group_advantages` of r (``scale_rewards``: group std, batch std or none);
    - ``"rloo"``: ``A_i = r_i - (sum_{j in g(i)} r_j - r_i) / (G - 1)`` (TRL's ``RLOOTrainer``; no std scaling);
    - ``"reinforce_pp"``: ``a_i = r_i - mean_{g(i)} r``, then ``A = (a - mean(a)) / (std(a) + eps)`` over the batch;
    - ``multi_objective_aggregation="normalize_then_sum"`` (GDPO, with ``"grpo"``): each reward k normalized in its
      group, ``z_ik = (x_ik - mean_g x_k) / (std_g x_k + eps)``, then ``s = z @ w`` and
      ``A = (s - mean(s)) / (std(s) + eps)`` over the batch (TRL's; ``scale_rewards`` does not apply);
    - ``normalize_advantages=True`` (TRL's RLOO setting): finally ``A = (A - mean(A)) / (std(A) + eps)``.

    >>> compute_advantages(torch.tensor([[1.0], [0.0], [3.0], [1.0]]), 2, advantage_estimator="rloo").tolist()
    [1.0, -1.0, 2.0, -2.0]
    """
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator={advantage_estimator!r}: use one of {list(ADVANTAGE_ESTIMATORS)}.")
    if multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation={multi_objective_aggregation!r}: use one of "
            f"{list(MULTI_OBJECTIVE_AGGREGATIONS)}."
        )
    rewards = rewards.reshape(rewards.shape[0], -1).double()
    if rewards.shape[0] % num_generations:
        raise ValueError(f"{rewards.shape[0]} rewards do not form groups of num_generations={num_generations}")
    weights = torch.ones(rewards.shape[1], dtype=torch.float64) if weights is None else weights.double()
    g = num_generations

    def whiten(x):
        return (x - x.mean()) / (x.std() + 1e-4) if x.numel() > 1 else torch.zeros_like(x)

    if multi_objective_aggregation == "normalize_then_sum":
        if advantage_estimator != "grpo":
            raise ValueError(
                f"multi_objective_aggregation='normalize_then_sum' (GDPO) normalizes each reward in its group itself: "
                f"use it with advantage_estimator='grpo', not {advantage_estimator!r}."
            )
        groups = rewards.view(-1, g, rewards.shape[1])
        z = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
        advantages = whiten(z.reshape(-1, rewards.shape[1]) @ weights)
    else:
        total = rewards @ weights
        groups = total.view(-1, g)
        if advantage_estimator == "grpo":
            advantages = group_advantages(total, g, scale_rewards)
        elif advantage_estimator == "rloo":
            baseline = (groups.sum(-1, keepdim=True) - groups) / max(g - 1, 1)
            advantages = (groups - baseline).flatten()
        else:
            advantages = whiten((groups - groups.mean(-1, keepdim=True)).flatten())
    return whiten(advantages) if normalize_advantages else advantages


def build_rollout_rows(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    advantages: Sequence[float],
    target_masks: Sequence[Sequence[bool]] | None = None,
) -> list[dict[str, Any]]:
    """Rows for :class:`hfacc.PolicyGradientObjective`: prompt + completion, labels -100 on the prompt.

    ``target_masks`` (multi-turn completions): per completion id, True where the policy sampled it; the others (tool
    results) get -100 too. This is the one place a rollout's targets are decided: every unit, count and log-prob
    downstream reads ``labels``.

    >>> build_rollout_rows([[5, 6]], [[7, 2]], [0.5])
    [{'input_ids': [5, 6, 7, 2], 'labels': [-100, -100, 7, 2], 'advantages': 0.5}]
    >>> build_rollout_rows([[5]], [[7, 8, 9]], [1.0], [[True, False, True]])[0]["labels"]
    [-100, 7, -100, 9]
    """
    if target_masks is None:
        target_masks = [[True] * len(c) for c in completion_ids]
    rows = []
    for p, c, a, mask in zip(prompt_ids, completion_ids, advantages, target_masks, strict=True):
        if len(mask) != len(c):
            raise ValueError(f"a target mask of {len(mask)} entries for a completion of {len(c)} ids")
        labels = [IGNORE_INDEX] * len(p) + [y if m else IGNORE_INDEX for y, m in zip(c, mask, strict=True)]
        rows.append({"input_ids": list(p) + list(c), "labels": labels, "advantages": float(a)})
    return rows


@dataclass
class Rollout:
    """One generation batch of one rank: its rows and what was measured on the way.

    Args:
        rows: one per completion (:func:`build_rollout_rows`), prompt by prompt, ``num_generations`` each.
        rewards: ``[N, F]`` per reward function (unweighted); ``total`` ``[N]`` the weighted sum.
        completion_lengths: the policy's tokens per completion (EOS included; a multi-turn completion's tool tokens
            are not counted); ``truncated``: without EOS (multi-turn: ended on the token budget).
        seconds: wall time of the generation alone (sampling, not scoring).
        sampler_logps: the sampler's log-prob of each completion token (one list per row), when the engine is not
            the policy itself (vLLM); None otherwise.
        tool_calls, tool_failures, turns: per completion, with tools: calls run, failed calls, assistant turns
            (empty lists without tools).
    """

    rows: list[dict[str, Any]]
    rewards: torch.Tensor
    total: torch.Tensor
    completion_lengths: list[int]
    truncated: list[bool]
    num_generations: int
    seconds: float
    completions: list[Any] = field(default_factory=list)
    sampler_logps: list[list[float]] | None = None
    tool_calls: list[int] = field(default_factory=list)
    tool_failures: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


def build_rollout(
    model: nn.Module | GenerationEngine,
    tokenizer,
    prompt_rows: Sequence[Mapping[str, Any]],
    reward_funcs: Sequence[Callable],
    *,
    num_generations: int,
    settings: SamplingSettings,
    reward_weights: Sequence[float] | None = None,
    scale_rewards: str = "group",
    max_prompt_length: int | None = None,
    row_names: Sequence[str] | None = None,
    seed: int | None = None,
    advantage_estimator: str = "grpo",
    multi_objective_aggregation: str = "sum_then_normalize",
    normalize_advantages: bool = False,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rank: int = 0,
    tool_sampler=None,
) -> Rollout:
    """Sample ``num_generations`` completions for each prompt row (a ``"prompt"`` column: text or messages), score
    them and give each its group advantage: steps 1-5 of the module docstring.

    ``model`` samples with its own ``generate``; a :class:`~hfacc.generation.engine.GenerationEngine` (vLLM) samples
    instead, ``seed`` seeding its requests (it must hold the weights to sample from: ``engine.update(...)``).

    Reward functions get the prompts and completions as the dataset holds them (chat prompts: completions as
    ``[{"role": "assistant", "content": text}]``, as TRL passes them) and every other column of the prompt rows.

    ``gather`` (several ranks: ``accelerator.gather``) stacks every rank's rewards in rank order before
    :func:`compute_advantages`, so batch statistics are the whole generation's; this rank keeps its ``rank``-th share.

    ``tool_sampler`` (a :class:`hfacc.generation.tools.MultiTurnSampler`): chat prompts rendered with its tools'
    schemas, multi-turn completions sampled with its tools; the reward functions get each completion as its list of
    messages (assistant turns with their ``tool_calls``, and the ``tool`` results), as TRL gives them.
    """
    schemas = tool_sampler.schemas if tool_sampler is not None else None
    pool = tool_sampler.environments if tool_sampler is not None else None
    # One environment per completion, reset with its prompt's row; a text it returns ends the last prompt message.
    environments = pool.take(len(prompt_rows) * num_generations) if pool is not None else None
    prompts, columns, ids, names = [], {}, [], []
    for j, row in enumerate(prompt_rows):
        if "prompt" not in row:
            raise DataError(f"{_row_name(row_names, j)} has no 'prompt' field (text or chat messages).")
        if tool_sampler is not None and not is_conversational(row["prompt"]):
            raise DataError(
                f"{_row_name(row_names, j)}: tools need chat prompts (a list of messages), got text; the tools' schemas "
                "and results are rendered by the chat template."
            )
        prompt_ids = get_prompt_ids(tokenizer, row["prompt"], max_prompt_length, tools=schemas)
        for _ in range(num_generations):
            prompt, these_ids = row["prompt"], prompt_ids
            if environments is not None:
                observation = environments[len(prompts)].reset(**row)
                if observation is not None:
                    last = dict(prompt[-1], content=prompt[-1]["content"] + str(observation))
                    prompt = list(prompt[:-1]) + [last]
                    these_ids = get_prompt_ids(tokenizer, prompt, max_prompt_length, tools=schemas)
            prompts.append(prompt)
            ids.append(these_ids)
            names.append(_row_name(row_names, j))
            for key, value in row.items():
                if key != "prompt":
                    columns.setdefault(key, []).append(value)
    engine = model if isinstance(model, GenerationEngine) else TransformersEngine(model, tokenizer)
    start = time.perf_counter()
    masks, tools = None, {}
    if tool_sampler is not None:
        trajectories = tool_sampler.sample(engine, prompts, ids, settings, seed=seed, environments=environments)
        if environments is not None:
            columns["environments"] = list(environments)  # the reward functions get them (TRL's keyword)
        seconds = time.perf_counter() - start
        completion_ids = [t.ids for t in trajectories]
        truncated = [t.truncated for t in trajectories]
        masks = [t.mask for t in trajectories]
        completions = [t.messages for t in trajectories]
        sampler_logps = [t.logps for t in trajectories] if engine.returns_logps else None
        tools = {
            "tool_calls": [t.tool_calls for t in trajectories],
            "tool_failures": [t.tool_failures for t in trajectories],
            "turns": [t.turns for t in trajectories],
        }
    else:
        samples = engine.sample(ids, settings, seed=seed)
        seconds = time.perf_counter() - start
        completion_ids, truncated, sampler_logps = samples.completion_ids, samples.truncated, samples.logps
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [
            [{"role": "assistant", "content": text}] if is_conversational(p) else text
            for p, text in zip(prompts, texts, strict=True)
        ]
    rewards = score_completions(reward_funcs, prompts, completions, columns, names)
    weights = torch.ones(len(reward_funcs), dtype=torch.float64)
    if reward_weights is not None:
        weights = torch.tensor(list(reward_weights), dtype=torch.float64)
    total = rewards @ weights
    everyone = rewards if gather is None else gather(rewards.contiguous())
    advantages = compute_advantages(
        everyone,
        num_generations,
        weights,
        scale_rewards=scale_rewards,
        advantage_estimator=advantage_estimator,
        multi_objective_aggregation=multi_objective_aggregation,
        normalize_advantages=normalize_advantages,
    )[rank * len(total) : (rank + 1) * len(total)]
    rows = build_rollout_rows(ids, completion_ids, advantages.tolist(), masks)
    return Rollout(
        rows=rows,
        rewards=rewards,
        total=total,
        # the policy's tokens only: a multi-turn completion's tool tokens are context, in no count
        completion_lengths=[len(c) for c in completion_ids] if masks is None else [sum(m) for m in masks],
        truncated=truncated,
        num_generations=num_generations,
        seconds=seconds,
        completions=completions,
        sampler_logps=sampler_logps,
        **tools,
    )


def _row_name(row_names: Sequence[str] | None, j: int) -> str:
    return row_names[j] if row_names is not None else f"prompt row {j}"


__all__ = [
    "RewardFunctionError",
    "SamplingSettings",
    "Rollout",
    "build_rollout",
    "build_rollout_rows",
    "compute_advantages",
    "ADVANTAGE_ESTIMATORS",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "get_prompt_ids",
    "get_reward_name",
    "group_advantages",
    "is_conversational",
    "left_pad",
    "sample_completions",
    "score_completions",
]
