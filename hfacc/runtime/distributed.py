"""What data parallelism changes, in one place: the factor that cancels the ranks' gradient averaging, decisions
every rank must take together, the examples accelerate repeats at the end of an epoch, and DeepSpeed's and FSDP2's
ways of (not) stepping.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import DistributedType, extract_model_from_parallel
from torch import nn
from transformers.trainer_utils import has_length

from .sequence_parallel import check_parallelism

logger = logging.getLogger(__name__)


def get_gradient_scale(distributed_type: DistributedType, num_processes: int) -> int:
    """The factor P that cancels the data-parallel backend's gradient averaging.

    DDP (any ``MULTI_*`` type), FSDP (v1 and v2) and DeepSpeed all *average* gradients over the P ranks. Each rank
    backpropagates ``S_rank / N_global * P``, so the average is ``sum over ranks of S_rank / N_global``: the global
    token mean. DeepSpeed must additionally not divide by the accumulation steps itself: transformers' Trainer
    passes ``scale_wrt_gas=False`` to its backward. One process (or ``torch.nn.DataParallel``, which gathers the
    outputs before the loss) needs no factor.
    """
    if distributed_type == DistributedType.MEGATRON_LM:
        raise NotImplementedError("hfacc does not support Megatron-LM, which computes the loss inside its pipeline.")
    if distributed_type == DistributedType.NO:
        return 1
    return num_processes


def all_ranks_agree(flag: bool, accelerator) -> bool:
    """True only if ``flag`` is True on every rank (one collective), so that all ranks take the same path."""
    if accelerator.num_processes == 1:
        return flag
    # accelerate's reduce knows sum, mean and max only: count the ranks that said yes.
    votes = accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), reduction="sum")
    return int(votes.item()) == accelerator.num_processes


def reduce_sum(t: torch.Tensor, accelerator) -> torch.Tensor:
    """``t`` summed over all ranks (a copy); ``t`` itself on one process."""
    return accelerator.reduce(t.clone(), reduction="sum") if accelerator.num_processes > 1 else t


def count_real_rows(accelerator, rows: int) -> int:
    """How many of the ``rows`` of the batch just drawn are real examples, not accelerate's repeats.

    On several ranks, accelerate's ``even_batches`` completes the last global batch of an epoch with examples from
    its start. Ranks take consecutive blocks of that batch, so rank r's real rows are
    ``clamp(remainder - r * per_rank, 0, per_rank)`` (the rule ``gather_for_metrics`` drops them by); with a batch
    sampler of varying batch sizes whole batches are repeated, to the ranks past ``num_batches % P``.
    """
    world = accelerator.num_processes
    loader = accelerator.gradient_state.active_dataloader
    if world == 1 or loader is None or not getattr(loader, "end_of_dataloader", False):
        return rows
    from accelerate.data_loader import DataLoaderShard

    if not isinstance(loader, DataLoaderShard):
        return rows  # DataLoaderDispatcher (iterable datasets) pads differently: nothing known to drop
    rank = accelerator.process_index
    shard = getattr(loader, "batch_sampler", None)
    if getattr(shard, "batch_size", 1) is None:  # varying batch sizes (e.g. hfacc's token budget)
        extra = getattr(shard, "total_length", 0) % world
        return 0 if extra and rank >= extra else rows
    remainder = getattr(loader, "remainder", -1)
    if remainder is None or remainder <= 0 or getattr(shard, "drop_last", False):
        return rows  # the last global batch is full (or dropped, or unknown)
    per_rank = loader.total_batch_size // world
    return min(rows, max(0, min(per_rank, remainder - rank * per_rank)))


def take_rows(batch: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The first ``n`` rows of every tensor of ``batch`` that has its batch dimension."""
    rows = num_rows(batch)
    return {k: v[:n] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v for k, v in batch.items()}


def num_rows(batch: Mapping[str, Any]) -> int:
    """The batch dimension of ``batch``, read from its labels or inputs."""
    for key in ("labels", "input_ids", "inputs_embeds", "attention_mask"):
        if torch.is_tensor(batch.get(key)) and batch[key].dim() > 0:
            return batch[key].shape[0]
    return next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)


def gather_objects(obj: Any, accelerator) -> list[Any]:
    """``obj`` of every rank, in rank order (one collective on several processes; ``[obj]`` on one)."""
    if accelerator.num_processes == 1:
        return [obj]
    from accelerate.utils import gather_object

    return gather_object([obj])


def mark_for_deepspeed_skip(loss: torch.Tensor, skip_if_nonfinite: bool, skip: bool = False) -> torch.Tensor:
    """``loss``, made to give NaN gradients when its window's step must be skipped, for DeepSpeed to skip it.

    Under DeepSpeed the optimizer step runs inside the last micro-batch's backward (accelerate's engine wrapper), so
    no callback can drop the gradients before it. DeepSpeed skips a step whose gradients hold inf/NaN and zeroes them
    (its overflow check, the one fp16 loss scaling relies on), so a window to skip is turned into such a window: its
    loss is multiplied by NaN (``skip``: a window without targets) or, with ``skip_if_nonfinite``, by NaN when the
    loss is not finite (an inf loss can have finite gradients). Otherwise the factor is exactly 1.0: bit for bit the
    same gradient. No host sync: the factor is chosen on the device.
    """
    if skip:
        return loss * float("nan")
    if not skip_if_nonfinite:
        return loss
    ok = torch.isfinite(loss.detach())
    return loss * torch.where(ok, torch.ones_like(loss), torch.full_like(loss, float("nan")))


def deepspeed_overflow_problem(engine: Any) -> str | None:
    """Why the DeepSpeed ``engine`` would apply a step with inf/NaN gradients instead of skipping it, or None.

    DeepSpeed 0.19: ZeRO-3 always checks the gradient norm; ZeRO-1/2 check when ``bf16.check_grad_overflow`` (the
    default) or, outside bf16, when ``zero_optimization.compute_grad_norm`` (the default) is on; fp16 always checks.
    An optimizer of unknown kind is given the benefit of the doubt, and ``_drop_gradients`` still catches a step that
    was not skipped.
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or engine.zero_optimization_stage() >= 3:
        return None
    if hasattr(optimizer, "check_grad_overflow"):  # DeepSpeedZeroOptimizer (ZeRO-1/2)
        by_norm = getattr(optimizer, "compute_grad_norm", True) and optimizer.dtype != torch.bfloat16
        if optimizer.check_grad_overflow or by_norm:
            return None
        return (
            "its ZeRO optimizer checks no gradient for inf/NaN (set bf16.check_grad_overflow: true, or "
            "zero_optimization.compute_grad_norm: true)"
        )
    if not hasattr(optimizer, "overflow"):  # a plain torch optimizer: no ZeRO, no fp16/bf16 wrapper
        return f"its optimizer ({type(optimizer).__name__}) does not check gradients for inf/NaN; use ZeRO stage 1-3"
    return None


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with torch's ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return False
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def fsdp2_no_sync(model):
    """Keep an FSDP2 model's gradients unsharded and local for the block (its ``no_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass(frozen=True)
class EpochLayout:
    """Where accelerate's repeated examples sit in every epoch of this rank's map-style training loader.

    Args:
        micro_batches: this rank's micro-batches per epoch (the length of its loader).
        last_real_rows: how many rows of this rank's last micro-batch of an epoch are real examples; ``None`` when
            all of them are (one process, a full last global batch, ``drop_last``).
    """

    micro_batches: int
    last_real_rows: int | None = None

    def real_rows(self, index: int, rows: int) -> int:
        """How many of the ``rows`` of micro-batch ``index`` (from 0, within the epoch) are real examples."""
        if self.last_real_rows is None or index != self.micro_batches - 1:
            return rows
        return min(rows, self.last_real_rows)


def get_epoch_layout(
    accelerator,
    *,
    num_examples: int | None = None,
    batch_size: int | None = None,
    num_batches: int | None = None,
    drop_last: bool = False,
) -> EpochLayout:
    """The :class:`EpochLayout` of a loader accelerate shards (``BatchSamplerShard``), from its sizes alone.

    Either ``num_examples`` rows in batches of ``batch_size`` (per process; the whole global batch with accelerate's
    ``split_batches``), or a batch sampler of ``num_batches`` micro-batches of varying size (hfacc's token budget).
    Computed from sizes, not read from the loader: after a resume the Trainer iterates ``skip_first_batches``'
    loader, whose ``batch_size`` is None and ``remainder`` -1.

    With ``even_batches`` (accelerate's default), the sampler's batches go round-robin to the P ranks and the last
    round is completed with examples from the start of the epoch: a round of P batches of ``batch_size`` rows holds
    ``N mod (P * batch_size)`` real rows, in rank order, so rank r's last micro-batch has
    ``clamp(remainder - r * batch_size, 0, batch_size)`` of them (the rule ``gather_for_metrics`` drops repeats
    by). Batches of varying size are repeated whole, to the ranks past ``num_batches mod P``.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    even = accelerator.even_batches
    if num_batches is not None:  # a batch sampler of varying batch sizes: whole batches go round-robin
        if world == 1 or not even:
            return EpochLayout(len(range(rank, num_batches, world)))
        extra = num_batches % world
        return EpochLayout(-(-num_batches // world), 0 if extra and rank >= extra else None)
    batches = num_examples // batch_size if drop_last else -(-num_examples // batch_size)
    if world == 1 or drop_last:
        return EpochLayout(batches if world == 1 or accelerator.split_batches else batches // world)
    if accelerator.split_batches:  # every rank takes its slice of each global batch of batch_size rows
        per_rank, remainder, micro_batches = batch_size // world, num_examples % batch_size, batches
        if not even:  # no repeats (the ranks past the end of the last, short batch get nothing)
            return EpochLayout(micro_batches)
    else:  # every rank takes whole batches, round-robin
        per_rank, remainder = batch_size, num_examples % (batch_size * world)
        if not even:
            return EpochLayout(len(range(rank, batches, world)))
        micro_batches = -(-batches // world)
    if remainder == 0:
        return EpochLayout(micro_batches)
    return EpochLayout(micro_batches, max(0, min(per_rank, remainder - rank * per_rank)))


@dataclass
class EpochCursor:
    """How many micro-batches of the running epoch this rank has drawn, to find the epoch's last one.

    The Trainer makes a new iterator every epoch; on a resume mid-epoch the first one starts after the ``skip``
    micro-batches already trained (``skip_first_batches``).
    """

    layout: EpochLayout
    skip: int = 0
    iterator: Any = None
    drawn: int = 0

    def real_rows(self, iterator: Any, batch_samples: list, examples: int | None = None) -> int:
        """How many examples of the last of ``batch_samples`` (the window just drawn from ``iterator``) are real;
        ``examples``: how many it holds (default its rows; a preference pair is two rows, one example)."""
        if iterator is not self.iterator:  # a new epoch
            self.iterator, self.drawn, self.skip = iterator, self.skip, 0
        self.drawn += len(batch_samples)
        return self.layout.real_rows(self.drawn - 1, num_rows(batch_samples[-1]) if examples is None else examples)


def get_epoch_cursor(
    layout: EpochLayout | None, loader: Any, global_step: int, accumulation_steps: int, resumed: bool
) -> EpochCursor | None:
    """An :class:`EpochCursor` for the Trainer's training ``loader`` at ``global_step``; None (said once) when the
    layout is unknown or does not fit the loader (a loader built by code other than hfacc and the stock Trainer).

    ``resumed``: the Trainer skips the resumed epoch's micro-batches trained before the checkpoint, as it does
    unless ``ignore_data_skip``.
    """
    if layout is None:
        return None
    length = len(loader) if has_length(loader) else None
    if length != layout.micro_batches:
        logger.warning(
            "hfacc: the training loader has %s micro-batches per epoch where the dataset's size gives %d; hfacc "
            "asks accelerate's loader which examples it repeats at the end of an epoch instead (after a resume "
            "mid-epoch it cannot tell).",
            length,
            layout.micro_batches,
        )
        return None
    per_epoch = max(-(-length // accumulation_steps), 1)  # the Trainer's num_update_steps_per_epoch
    return EpochCursor(layout, (global_step % per_epoch) * accumulation_steps if resumed else 0)


def forward_set_epoch(loader: Any, batch_sampler: Any) -> None:
    """Make ``set_epoch`` reach ``batch_sampler`` (hfacc's token budget, which orders each epoch by its number)
    through accelerate's ``BatchSamplerShard``, which has no ``set_epoch`` of its own.

    The Trainer sets the epoch on ``loader.batch_sampler.batch_sampler``: the shard's sampler normally, but the shard
    itself after a resume mid-epoch (``skip_first_batches`` wraps it once more), so a resumed run on several ranks
    would replay epoch 0's order in every later epoch.
    """
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and shard is not batch_sampler and not hasattr(shard, "set_epoch"):
        shard.set_epoch = batch_sampler.set_epoch


def trim_repeated_examples(
    batch_samples: list, real_rows: int, rank: int, warn: bool = True, examples: Any = None
) -> tuple[set[int], int]:
    """Cut the examples accelerate repeats at the end of an epoch out of a window's micro-batches, in place.

    With several ranks, accelerate (``even_batches``) fills the last batch of every rank with examples from the
    start of the epoch, so that all ranks take the same number of steps. Stock Trainer trains those examples a
    second time, and counts them. Here the last micro-batch is cut to its ``real_rows`` (from
    :meth:`EpochLayout.real_rows`); a micro-batch that holds only repeats still runs (every rank must take part in
    the gradient all-reduce) but must contribute nothing.

    ``examples`` (an :class:`hfacc.Objective`) says what an example of a batch is (``num_examples``,
    ``select_examples``: a preference pair is two rows); None: a row. Returns ``(indices of the micro-batches that
    hold only repeats, number of repeated examples cut)``; with ``warn``, a cut is said at WARNING level.
    """
    if not batch_samples:
        return set(), 0
    last = batch_samples[-1]
    rows = examples.num_examples(last) if examples is not None else num_rows(last)
    if real_rows >= rows:
        return set(), 0
    if warn:
        logger.warning(
            "hfacc: the last batch of the epoch on rank %d holds %d example(s) that accelerate repeats so that "
            "every rank gets a full batch (even_batches); hfacc neither counts nor trains them, so the last step "
            "is the exact mean over the real examples (stock Trainer trains them twice).",
            rank,
            rows - real_rows,
        )
    keep = max(real_rows, 1)
    batch_samples[-1] = examples.select_examples(last, 0, keep) if examples is not None else take_rows(last, keep)
    return ({len(batch_samples) - 1} if real_rows == 0 else set()), rows - real_rows


def check_data_parallel(accelerator, is_fsdp_enabled: bool) -> None:
    """Refuse what hfacc's counting does not cover (tensor/context parallelism, processes that train alone), and say when an FSDP config silently became DDP."""
    check_parallelism(accelerator)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"{launched} processes were launched (WORLD_SIZE) but this one trains alone (world size "
            f"{accelerator.num_processes}), so every process would train its own copy. On a machine without "
            "GPUs pass use_cpu=True (TokenWeightedArguments does this by itself) so the processes join over gloo."
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not is_fsdp_enabled:
        # accelerate enables FSDP only for GPU-like distributed types (state.py); CPU processes get DDP silently.
        logger.warning(
            "hfacc: the accelerate config asks for FSDP, but accelerate shards only on GPUs (and XPU/NPU/...): "
            "these %d CPU processes train as plain data parallel (DDP), each holding the whole model. The update "
            "is the same; the memory saving is not there.",
            accelerator.num_processes,
        )


def undo_evaluation_preparation(accelerator, model: nn.Module, model_wrapped: nn.Module) -> None:
    """Let ``train()`` wrap the model for data parallelism after an ``evaluate()`` that came first.

    The stock evaluation loop prepares a bare model in evaluation mode (no DDP wrapper), and accelerate marks it
    prepared; ``train()``'s own prepare then returns it unwrapped, so on several ranks each rank steps with its
    own gradient, never all-reduced (transformers 5.24 with accelerate 1.15; the recipe evaluates first).
    DeepSpeed and FSDP prepare fully in evaluation too: nothing to undo.
    """
    plugins = (getattr(accelerator.state, "deepspeed_plugin", None), getattr(accelerator.state, "fsdp_plugin", None))
    if (
        accelerator.num_processes > 1
        and all(p is None for p in plugins)
        and model_wrapped is model
        and getattr(model, "_is_accelerate_prepared", False)
    ):
        extract_model_from_parallel(model, keep_fp32_wrapper=False)  # prepare() puts the autocast wrapper back
        model._is_accelerate_prepared = False
        accelerator._models = [m for m in accelerator._models if m is not model]
