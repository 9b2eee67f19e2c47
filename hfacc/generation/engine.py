"""The generation engine: what an online trainer samples its completions with, kept in step with the policy.

One seam for every trainer that generates (:class:`hfacc.GRPOTrainer`, on-policy distillation) and for the jobs'
held-out answers. A trainer builds its engine once, from its arguments
(:func:`hfacc.generation.vllm_engine.build_generation_engine` reads ``use_vllm`` and the other
:class:`~hfacc.generation.vllm_engine.VLLMArguments`), and before each generation calls

    engine.update(policy, version=trainer.state.global_step)   # the policy's weights into the engine, if they moved
    samples = engine.sample(prompt_ids, settings, seed=...)     # completion ids, truncation, the sampler's log-probs

Three engines implement it:

- :class:`TransformersEngine` (``use_vllm=False``, the default): the policy's own ``generate``. It *is* the policy,
  so ``update`` has nothing to copy, and it returns no log-probs (the trainer computes the policy's own);
- :class:`hfacc.generation.vllm_engine.VLLMEngine` (``use_vllm=True``): a vLLM engine in the trainer's process
  (``vllm_mode="colocate"``, TRL's default), which samples from a copy of the policy's weights. ``update`` copies
  them after every optimizer step that a generation follows, and it returns the log-prob of each sampled token
  under the distribution it sampled from (after the repetition penalty, the temperature, top-k and top-p), so that
  the trainer can measure and correct the mismatch;
- :class:`hfacc.generation.server_engine.ServerEngine` (``vllm_mode="server"``): a vLLM server beside the trainer
  (``hfacc vllm-serve``), the weights sent through vLLM's weight-transfer routes, their version checked before each
  generation; with ``async_generation`` it samples the next generation while the current one trains.

The engine that is the policy and the engine that copies it answer the same calls (``update``, ``sample``, ``answer``
for greedy held-out answers), so a trainer never branches on which one it has.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class SamplingSettings:
    """How completions are sampled (transformers ``generate`` settings, TRL's names)."""

    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0


def left_pad(prompt_ids: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of prompts padded on the left: every row's completion starts at one column."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if len(p):
            ids[i, width - len(p) :] = torch.tensor(list(p))
            mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def sample_completions(
    model: nn.Module, tokenizer, prompt_ids: Sequence[Sequence[int]], settings: SamplingSettings
) -> tuple[list[list[int]], list[bool]]:
    """One sampled completion per prompt (repeat a prompt to get several): ``(completion ids, truncated flags)``.

    The prompts are left-padded into one batch; ``generate`` runs in eval mode without gradient and stops each row at
    the tokenizer's EOS. A completion keeps its EOS (the policy learns to stop); one that reached
    ``max_completion_length`` without it is *truncated*.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None or pad is None:
        raise ValueError("sampling completions needs a tokenizer with an EOS and a pad token")
    ids, mask = left_pad(prompt_ids, pad)  # every row's completion starts at column `width`
    width = ids.shape[1]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            max_new_tokens=settings.max_completion_length,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,  # 0: no top-k (the model's generation_config would otherwise say 50)
            repetition_penalty=settings.repetition_penalty,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    finally:
        model.train(was_training)
    completions, truncated = [], []
    for row in out[:, width:].tolist():
        end = row.index(eos) + 1 if eos in row else len(row)
        completions.append(row[:end])
        truncated.append(eos not in row)
    return completions, truncated


# ---- the engines ----------------------------------------------------------------------------------------------------
@dataclass
class Samples:
    """What an engine sampled: one completion per prompt given (a prompt repeated n times gets n).

    Args:
        completion_ids: the sampled tokens of each completion, its EOS included when it stopped there.
        truncated: whether each completion reached the length limit without EOS.
        logps: the sampler's log-prob of each sampled token (one list per completion, aligned with
            ``completion_ids``), or None when the engine is the policy itself (its log-probs are the trainer's own).
        version: the weight version (the policy's optimizer step) they were sampled under, where the engine knows it
            (a server sampling ahead of the trainer: ``async_generation``).
    """

    completion_ids: list[list[int]]
    truncated: list[bool]
    logps: list[list[float]] | None = None
    version: int | None = None


def get_sampling_seed(base_seed: int, generation: int, rank: int) -> int:
    """The seed of one rank's draw in one generation: distinct per rank (P ranks sample P independent sets of
    completions, as TRL seeds them) and per generation, the same on a resumed run (it depends on nothing else)."""
    return (base_seed * 1_000_003 + generation * 7919 + rank * 104_729) % 2**31


class GenerationEngine(ABC):
    """Samples completions from a policy. Subclasses implement :meth:`sample`, :meth:`answer` and
    :meth:`sync_weights`; :meth:`update` is the once-per-generation call that keeps the engine in step."""

    name = "engine"
    #: whether :meth:`sample` returns the sampler's log-probs (an engine that copies the policy's weights)
    returns_logps = False

    def __init__(self):
        self.version: int | None = None  # the policy version (optimizer step) the engine samples from
        self.syncs = 0

    @abstractmethod
    def sample(self, prompt_ids: Sequence[Sequence[int]], settings: SamplingSettings, *, seed: int | None = None):
        """:class:`Samples` for ``prompt_ids`` (one completion each; repeat a prompt for several), sampled with
        ``settings``. ``seed`` makes the draw reproducible and distinct per seed (give every rank its own); None
        draws from torch's global generator."""

    @abstractmethod
    def answer(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """The greedy completion of each prompt (held-out evaluation), EOS not included."""

    @abstractmethod
    def sync_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""

    def update(self, model: nn.Module, version: int) -> bool:
        """Before a generation: copy ``model``'s weights into the engine when they changed since the last copy
        (``version``: the optimizer step they are at). True when they were copied."""
        if self.version == version:
            return False
        self.sync_weights(model)
        self.version, self.syncs = version, self.syncs + 1
        return True

    def close(self) -> None:  # noqa: B027 (most engines hold nothing to free)
        """Free what the engine holds (default: nothing)."""


class TransformersEngine(GenerationEngine):
    """The policy's own ``generate`` (:func:`hfacc.generation.rollout.sample_completions`): no copy of the weights.

    Args:
        model: the policy as it trains (its wrappers removed: DDP's forward is not ``generate``).
        tokenizer: its tokenizer (EOS and pad token).
    """

    name = "transformers"

    def __init__(self, model: nn.Module, tokenizer):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer

    def sample(self, prompt_ids, settings, *, seed=None) -> Samples:
        if seed is None:
            completion_ids, truncated = sample_completions(self.model, self.tokenizer, prompt_ids, settings)
            return Samples(completion_ids, truncated)
        # ``generate`` samples from torch's global generator (it takes no torch.Generator), which every rank seeded
        # alike: draw under a forked, seeded state so each rank samples its own completions, reproducibly, and the
        # run's global stream (dropout, shuffling) is left as it was.
        device = next(self.model.parameters()).device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            completion_ids, truncated = sample_completions(self.model, self.tokenizer, prompt_ids, settings)
        return Samples(completion_ids, truncated)

    @torch.no_grad()
    def answer(self, prompt_ids, max_new_tokens, batch_size: int = 32) -> list[list[int]]:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        model, answers = self.model, []
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(prompt_ids), batch_size):
                ids, mask = left_pad(prompt_ids[start : start + batch_size], pad)
                device = next(model.parameters()).device
                out = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
                for row in out[:, ids.shape[1] :].tolist():
                    answers.append(row[: row.index(eos)] if eos in row else row)
        finally:
            model.train(was_training)
        return answers

    def sync_weights(self, model: nn.Module) -> None:
        self.model = model  # it samples from the policy itself: nothing to copy


__all__ = [
    "GenerationEngine",
    "Samples",
    "SamplingSettings",
    "TransformersEngine",
    "get_sampling_seed",
    "left_pad",
    "sample_completions",
]


def group_prompts(prompt_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Consecutive repeats of a prompt as one request of n samples: ``[(prompt, n), ...]`` in order.

    >>> group_prompts([[1, 2], [1, 2], [3], [1, 2]])
    [([1, 2], 2), ([3], 1), ([1, 2], 1)]
    """
    requests: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        ids = list(ids)
        if requests and requests[-1][0] == ids:
            requests[-1] = (ids, requests[-1][1] + 1)
        else:
            requests.append((ids, 1))
    return requests
