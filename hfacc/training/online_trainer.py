"""``OnlineTrainer``: what the trainers that generate share (:class:`hfacc.GRPOTrainer`,
:class:`hfacc.DistillationTrainer`): the train dataloader that turns prompts into sampled micro-batches
(:class:`RolloutLoader`), the generation engine (:mod:`hfacc.generation.engine`), the update that gives it the
policy's weights before a generation, each rank's sampling seed, and where a resumed run goes on.

The step is :class:`TokenWeightedTrainer`'s, unchanged; a subclass says how one generation batch becomes micro-batches
(:meth:`OnlineTrainer.generate_micro_batches`). Its arguments name what the loader and the engine read:
``per_device_train_batch_size``, ``steps_per_generation``, ``num_generations``, ``num_iterations``,
``max_prompt_length``, ``max_completion_length`` and the engine's (:class:`hfacc.generation.vllm_engine.VLLMArguments`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import torch

from ..generation.engine import GenerationEngine, get_sampling_seed
from ..generation.vllm_engine import build_generation_engine
from .trainer import TokenWeightedTrainer

logger = logging.getLogger(__name__)


class OnlineTrainer(TokenWeightedTrainer):
    """A :class:`TokenWeightedTrainer` whose micro-batches are sampled as training needs them.

    Args:
        *args, **kwargs: :class:`TokenWeightedTrainer`'s.
        engine: the :class:`hfacc.generation.engine.GenerationEngine` to sample with (None: the one ``args`` asks
            for, built at the first generation). An engine given gets this policy's weights at the first generation.
    """

    def __init__(self, *args, engine: GenerationEngine | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._engine = engine  # None: built at the first generation, on every rank together
        if engine is not None:
            engine.version = None  # whatever it held before, this policy's weights go in first
        # This rank's seconds of generation over the whole run (the logged generation_time covers the logged
        # intervals only: a run whose last steps end between two logging steps would leave them out).
        self.generation_seconds = 0.0

    # ---- the generation engine -------------------------------------------------------------------------------
    @property
    def engine(self) -> GenerationEngine:
        """The generation engine (:mod:`hfacc.generation.engine`): the policy's ``generate``, or with
        ``use_vllm=True`` a colocated vLLM engine, built on first use (on every rank at the same time)."""
        if self._engine is None:
            args = self.args
            longest = args.max_prompt_length + args.max_completion_length if args.max_prompt_length else None
            self._engine = build_generation_engine(
                args,
                self.accelerator.unwrap_model(self.model),
                self.processing_class,
                self.accelerator,
                max_model_len=longest,
                batch_size=args.per_device_train_batch_size * args.steps_per_generation,
            )
            self._engine.version = self.state.global_step  # it was built from the weights as they are now
            logger.info("hfacc: %s samples with %s.", type(self).__name__, self._engine.name)
        return self._engine

    def sync_engine(self) -> GenerationEngine:
        """:attr:`engine`, holding the policy's current weights: the once-per-generation update, which copies them
        only when an optimizer step changed them since the engine's last copy (:meth:`GenerationEngine.update`)."""
        engine = self.engine
        engine.update(self.accelerator.unwrap_model(self.model), version=self.state.global_step)
        return engine

    def sampling_seed(self, generation: int) -> int:
        """This rank's seed for generation batch ``generation`` of the run (:func:`get_sampling_seed`): distinct per
        rank and generation, the same on a resumed run."""
        args = self.args
        base_seed = args.data_seed if args.data_seed is not None else args.seed
        return get_sampling_seed(base_seed, generation, self.accelerator.process_index)

    # ---- sampling ahead (async_generation) ---------------------------------------------------------------------
    def generation_request(self, indices: Sequence[int], generation: int):
        """What generation batch ``generation`` (prompts ``indices``) will ask the engine: ``(prompt_ids, settings,
        seed)``, the exact arguments of its ``engine.sample`` call, or None where they are not known ahead. Each
        online trainer says it; with ``async_generation`` the engine samples them while the steps before train."""
        return None

    def prefetch_generation(self, indices: Sequence[int], generation: int) -> None:
        """With ``async_generation``: send generation ``generation``'s requests to the server now, under the weights
        it holds (the current step's); its :meth:`generate_micro_batches` takes them, or drops them as too stale."""
        if not getattr(self.args, "async_generation", False):
            return
        request = self.generation_request(indices, generation)
        if request is not None:
            prompt_ids, settings, seed = request
            self.engine.prefetch(prompt_ids, settings, seed=seed)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The trainer's logs, plus the server engine's (``sampling/staleness/*``, ``sampling/dropped_samples``)."""
        take = getattr(self._engine, "take_metrics", None)
        if "loss" in logs and take is not None:
            logs.update(take())
        super().log(logs, start_time)

    # ---- where the micro-batches come from -------------------------------------------------------------------
    def get_train_dataloader(self) -> RolloutLoader:
        """Micro-batches of completions, generated when the step needs them (:class:`RolloutLoader`)."""
        return RolloutLoader(self)

    def generate_micro_batches(self, indices: Sequence[int], generation: int = 0) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of one generation batch: prompts ``indices`` of the dataset; ``generation`` numbers the
        generation batch in the run (:class:`RolloutLoader`'s). Each online trainer says how it samples them."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_micro_batches.")

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``TokenWeightedTrainer.train``. A resumed run goes on with the prompts after the checkpoint's
        (:class:`RolloutLoader`): the Trainer's replay of the micro-batches trained before (``skip_first_batches``)
        would sample and throw away whole generations."""
        skip = self.args.ignore_data_skip
        self.args.ignore_data_skip = True
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.ignore_data_skip = skip
            # Async generation leaves the next generation's requests running when the last step ends: wait for them
            # (bounded by the server's timeout), so no request of this run is still on its way after train().
            wait = getattr(self._engine, "wait_in_flight", None)
            if wait is not None:
                wait()


class RolloutLoader:
    """The train dataloader of an :class:`OnlineTrainer` (:class:`hfacc.GRPOTrainer`,
    :class:`hfacc.DistillationTrainer`): micro-batches of completions, sampled when the step needs them.

    Prompts are drawn in a seeded order per epoch (``train_sampling_strategy="sequential"``: in dataset order), in
    global batches of ``P x prompts per rank``; rank r takes the r-th block of each. Each block becomes
    ``steps_per_generation`` micro-batches, yielded ``num_iterations`` times. Its length, in micro-batches, is what
    the Trainer plans its steps by.

    A resumed run (its first epoch starts past step 0) goes on where the checkpoint stopped: the generations its
    steps trained before are skipped without sampling; one the checkpoint cut in the middle (its rollout is not in
    the checkpoint) is sampled again for the same prompts, from the resumed policy, and only its micro-batches not
    trained yet are yielded. Which, is said at WARNING. Where the checkpoint falls between generations, the resumed
    run samples and trains what the uninterrupted one would have (same prompts, same seeds, the checkpoint's RNG).

    With ``async_generation`` the next generation's requests go to the server before this one's micro-batches are
    yielded (:meth:`OnlineTrainer.prefetch_generation`). Samples in flight are in no checkpoint: a resumed run
    samples its first generation again, from the resumed policy, and discards whatever the interrupted run had
    in flight (the rule above).
    """

    def __init__(self, trainer: OnlineTrainer):
        self.trainer = trainer
        self.epoch = 0
        self.placed = False  # whether this train() call's first epoch was placed (at a resumed run's step)
        args = trainer.args
        self.prompts_per_rank = args.per_device_train_batch_size * args.steps_per_generation // args.num_generations
        self.prompts_per_generation = self.prompts_per_rank * trainer.accelerator.num_processes
        if len(trainer.train_dataset) < self.prompts_per_generation:
            raise ValueError(
                f"the prompts dataset has {len(trainer.train_dataset)} rows, fewer than one generation batch needs "
                f"({self.prompts_per_generation}: per_device_train_batch_size x steps_per_generation / num_generations "
                "x processes); give more prompts or a smaller batch."
            )
        self.generations = len(trainer.train_dataset) // self.prompts_per_generation  # per epoch
        self.per_generation = args.steps_per_generation * args.num_iterations  # micro-batches

    def __len__(self) -> int:
        return self.generations * self.per_generation

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def get_resume_position(self) -> tuple[int, int]:
        """``(generation, micro-batch)`` of this epoch where a resumed run goes on: the first micro-batch no step
        trained before the checkpoint (``(0, 0)`` for a fresh run, and for every later epoch)."""
        trainer = self.trainer
        if self.placed:
            return 0, 0
        self.placed = True
        if trainer.state.global_step == 0:
            return 0, 0
        accumulation = trainer.args.gradient_accumulation_steps
        steps_per_epoch = max(math.ceil(len(self) / accumulation), 1)  # the Trainer's count
        consumed = (trainer.state.global_step - self.epoch * steps_per_epoch) * accumulation
        if consumed <= 0:
            return 0, 0
        return divmod(min(consumed, len(self)), self.per_generation)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        trainer, args = self.trainer, self.trainer.args
        n = len(trainer.train_dataset)
        if args.train_sampling_strategy == "sequential":
            order = list(range(n))
        else:
            seed = (args.data_seed if args.data_seed is not None else args.seed) + self.epoch
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        rank = trainer.accelerator.process_index
        first_generation, offset = self.get_resume_position()
        if first_generation or offset:
            self.say_resume(first_generation, offset)
        for g in range(first_generation, self.generations):
            first = g * self.prompts_per_generation + rank * self.prompts_per_rank
            indices = order[first : first + self.prompts_per_rank]
            batches = trainer.generate_micro_batches(indices, generation=self.epoch * self.generations + g)
            if g + 1 < self.generations:  # async_generation: the next generation samples while these train
                after = (g + 1) * self.prompts_per_generation + rank * self.prompts_per_rank
                trainer.prefetch_generation(
                    order[after : after + self.prompts_per_rank], self.epoch * self.generations + g + 1
                )
            yield from (batches * args.num_iterations)[offset if g == first_generation else 0 :]

    def say_resume(self, generation: int, offset: int) -> None:
        """Say at WARNING where the resumed run goes on, and which rollout it samples again."""
        step, first = self.trainer.state.global_step, generation * self.prompts_per_generation
        where = (
            f"generation {generation + 1} of {self.generations} of epoch {self.epoch} (prompts {first}-"
            f"{first + self.prompts_per_generation - 1} of the epoch's order)"
        )
        before = f"the {generation} generation(s) before it are not sampled again"
        if offset == 0:
            logger.warning(
                "hfacc: resumed at step %d: training goes on with %s, as the uninterrupted run would; %s, and no "
                "rollout is sampled again.", step, where, before,
            )  # fmt: skip
        else:
            logger.warning(
                "hfacc: resumed at step %d: the checkpoint cut %s after %d of its %d micro-batches, and its rollout is "
                "not in the checkpoint: those prompts are sampled again, from the resumed policy, and the last %d "
                "micro-batches of the new rollout are trained; %s.", step, where, offset, self.per_generation,
                self.per_generation - offset, before,
            )  # fmt: skip


__all__ = ["OnlineTrainer", "RolloutLoader"]
