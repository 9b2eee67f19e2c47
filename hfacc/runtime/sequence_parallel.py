"""Sequence parallelism on accelerate's engine (DeepSpeed Ulysses / ALST): what hfacc's counting changes for it.

``ParallelismConfig(sp_size=S, sp_backend="deepspeed")`` splits every micro-batch's sequence over S ranks
(DeepSpeed's ``UlyssesSPDataLoaderAdapter``: each rank gets a contiguous shard of every row); the other factor of
the world, D = world / S, is data parallel. hfacc's identity is unchanged, with the window's units counted over
all D × S ranks:

    L = (1 / N) * sum over ranks r, micro-batches j of S_rj,   N = sum over ranks r, micro-batches j of n_rj

where ``S_rj`` / ``n_rj`` are the loss sum / target count of rank r's *shard*. That counts each token exactly once
because the labels are shifted BEFORE the sequence is cut (:func:`presharded_labels`): the target of the last
position of shard s is the first token of shard s + 1, and it lives on shard s only. Shifting within each shard
would drop it; shifting globally and counting again on the next shard would count it twice.

The engine sums the ranks' gradients over the sequence group and averages them over the data-parallel group (its
``seq_data_parallel_group`` all-reduce divides by D), so the factor P of the README's formula (each rank backpropagates
``S_rj / N * P``) is D, the data-parallel size, not the world size (:func:`get_sequence_parallel_gradient_scale`).

DPO's unit is a pair, whose sequences are split over the S shards: each shard's per-sequence log-prob sums (policy
and reference) are summed over the sequence group (:func:`sum_over_sequence_group`, an autograd-aware all-reduce)
BEFORE the sigmoid, and the pair is counted and its loss backpropagated on the group's first rank only (the
all-reduce's backward carries that gradient to every shard); so pairs are counted over the D data ranks, target tokens
over D x S, and P is D as for SFT. Torch's context parallelism (``cp_size``) is not supported (accelerate applies it
with FSDP2 on CUDA only); nor are the other objectives whose unit is a whole sequence (KTO, reward, GRPO, distillation
of sequences) yet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..ops.loss import IGNORE_INDEX, shift_labels

# Objectives exact under sequence parallelism: causal_lm (every unit a target token: each shard's sums add up to the
# sequence's) and dpo (its per-sequence sums summed over the sequence group before the nonlinearity).
SEQUENCE_PARALLEL_OBJECTIVES = ("causal_lm", "dpo")


def get_sequence_parallel_size(accelerator) -> int:
    """S: how many ranks share each sequence (1 without sequence parallelism)."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or not getattr(pc, "sp_enabled", False):
        return 1
    return pc.sp_size


def get_sequence_parallel_gradient_scale(accelerator) -> int:
    """P under sequence parallelism: the data-parallel size D = world / S (DeepSpeed averages over D only)."""
    return accelerator.num_processes // get_sequence_parallel_size(accelerator)


def init_deepspeed_comm() -> None:
    """Make DeepSpeed's communication layer reuse the process group torch already has. accelerate initializes it
    for GPU processes only; Ulysses asserts it before it builds its sequence groups (the CPU processes of the tests)."""
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)


def check_parallelism(accelerator) -> None:
    """Refuse, in one line each, the parallelism hfacc does not count for: tensor and context parallelism, and
    sequence parallelism on another backend than DeepSpeed's."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None:
        return
    if getattr(pc, "tp_enabled", False):
        raise NotImplementedError(
            "parallelism_config.tp_size > 1: hfacc does not count targets under tensor parallelism; set tp_size=1."
        )
    if getattr(pc, "cp_enabled", False):
        raise NotImplementedError(
            "parallelism_config.cp_size > 1: torch context parallelism is not supported by hfacc (accelerate "
            "applies it through FSDP2 on CUDA only); use sp_size with sp_backend='deepspeed' (DeepSpeed Ulysses)."
        )
    if getattr(pc, "sp_enabled", False) and pc.sp_backend != "deepspeed":
        raise NotImplementedError(f"parallelism_config.sp_backend={pc.sp_backend!r}: hfacc supports 'deepspeed'.")
    if getattr(pc, "sp_enabled", False) and pc.data_parallel_size * pc.sp_size != accelerator.num_processes:
        # accelerate gives DeepSpeed a global batch of data_parallel_size ranks; DeepSpeed's own check then fails.
        raise ValueError(
            f"parallelism_config: dp_shard_size x sp_size = {pc.data_parallel_size * pc.sp_size} but "
            f"{accelerator.num_processes} processes: set parallelism_config_dp_shard_size to "
            f"{accelerator.num_processes // pc.sp_size} (--parallelism_config_dp_shard_size)."
        )


def check_sequence_parallel_objective(name: str, sp_size: int) -> None:
    """Refuse an objective whose units are not all target tokens under sequence parallelism (one line)."""
    if sp_size > 1 and name not in SEQUENCE_PARALLEL_OBJECTIVES:
        raise NotImplementedError(
            f"objective {name!r} with sp_size={sp_size}: under sequence parallelism hfacc supports "
            f"{', '.join(SEQUENCE_PARALLEL_OBJECTIVES)} (its per-sequence sums are not yet reduced over the sequence "
            "group); set parallelism_config.sp_size=1 for this objective."
        )


def get_sequence_group():
    """DeepSpeed Ulysses' sequence group of this process (the ranks that hold the shards of the same rows)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


def is_first_sequence_rank() -> bool:
    """Whether this process holds the first shard of its sequence group's rows: where a whole-sequence unit (a pair)
    is counted and its loss backpropagated."""
    return torch.distributed.get_rank(group=get_sequence_group()) == 0


def sum_over_sequence_group(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (per-sequence sums of this shard) summed over the sequence group: the whole sequences' sums. With
    gradient, an autograd-aware all-reduce (its backward sums the ranks' gradients, so the loss of a pair backpropagated
    on one rank reaches every shard's log-probs); without, a plain one."""
    group = get_sequence_group()
    if tensor.requires_grad:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(tensor, group=group)
    tensor = tensor.clone()
    torch.distributed.all_reduce(tensor, group=group)
    return tensor


def presharded_labels(batch: Mapping[str, Any]) -> torch.Tensor:
    """``labels`` rewritten so that the engine's own shift (``labels[..., 1:]``, before it cuts the sequence) gives
    hfacc's targets (:func:`hfacc.ops.loss.shift_labels`: never across a packed sequence's start, never padding).

    >>> presharded_labels({"labels": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])})
    tensor([[-100,    6,    7, -100,    9]])
    """
    targets = shift_labels(
        batch["labels"], position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask")
    )
    return F.pad(targets[..., :-1], (1, 0), value=IGNORE_INDEX)


def with_labels(shard: Mapping[str, Any]) -> dict[str, Any]:
    """A shard from DeepSpeed's Ulysses loader, which replaces ``labels`` by ``shift_labels`` (this shard's targets,
    shifted before the cut), with ``labels`` back as the same tensor: hfacc's objectives read ``shift_labels`` when a
    batch has them, and everything that asks whether a batch has labels finds them."""
    return {**shard, "labels": shard["shift_labels"]} if "labels" not in shard and "shift_labels" in shard else shard


class DataCollatorForSequenceParallel:
    """Wraps a causal-LM collator for DeepSpeed Ulysses: every row padded to a multiple of ``sp_size`` (the engine
    cuts it into equal shards), ``position_ids`` per sequence (the engine's attention reads them; packed rows keep
    theirs, restarting per sequence) and labels shifted before the cut (:func:`presharded_labels`).

    Args:
        collator: the collator it wraps (e.g. :class:`hfacc.DataCollatorForCausalLM`).
        sp_size: the sequence-parallel size S.
        pad_token_id: written into ``input_ids`` where a row is lengthened (its labels are -100 and, padded on the
            right, no real token attends to it).

    >>> from hfacc.data.collator import DataCollatorForCausalLM
    >>> collate = DataCollatorForSequenceParallel(DataCollatorForCausalLM(pad_token_id=0), sp_size=2)
    >>> collate([{"input_ids": [3, 4, 5], "labels": [3, 4, 5]}])["labels"]
    tensor([[-100,    4,    5, -100]])
    """

    def __init__(self, collator: Callable, sp_size: int, pad_token_id: int = 0):
        self.collator, self.sp_size, self.pad_token_id = collator, sp_size, pad_token_id

    def __call__(self, examples):
        batch = dict(self.collator(examples))
        length = batch["input_ids"].shape[-1]
        if "position_ids" not in batch:
            mask = batch.get("attention_mask")
            positions = torch.arange(length).expand(batch["input_ids"].shape[0], length)
            if mask is not None:  # left padding: positions count from the first real token, as generate does
                leading = (mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)
                positions = (positions - leading).clamp(min=0)
            batch["position_ids"] = positions.contiguous()
        batch["labels"] = presharded_labels(batch)
        return pad_to_length(batch, length + (-length % self.sp_size), self.pad_token_id)


def pad_to_length(batch: Mapping[str, Any], length: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Every ``[B, T]`` tensor of ``batch`` lengthened on the right to ``length``: ``input_ids`` with
    ``pad_token_id``, labels -100, attention mask 0, ``position_ids`` continuing the row's last sequence (no new
    sequence starts in the padding). Exact: no real token attends to what comes after it, and none is a target."""
    batch = dict(batch)
    current = batch["input_ids"].shape[-1]
    extra = length - current
    if extra <= 0:
        return batch
    pads = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.dim() != 2 or value.shape[-1] != current:
            continue
        if key == "position_ids":
            batch[key] = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1, device=value.device)], dim=-1)
        else:
            batch[key] = F.pad(value, (0, extra), value=pads.get(key, 0))
    return batch


class EqualLengthLoader:
    """A prepared train loader whose micro-batches are padded to the longest of the same step on all ranks
    (:func:`pad_to_length`, one all-reduce of a length per micro-batch). DeepSpeed's Ulysses loader all-gathers each
    rank's batch over the sequence group, and gloo's all-gather takes equal shapes only (NCCL's does not need it).
    Everything else (its length, ``set_epoch``, its sampler) is the wrapped loader's."""

    def __init__(self, loader, pad_token_id: int = 0):
        self.loader, self.pad_token_id = loader, pad_token_id

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            length = torch.tensor([batch["input_ids"].shape[-1]], device=batch["input_ids"].device)
            torch.distributed.all_reduce(length, op=torch.distributed.ReduceOp.MAX)
            yield pad_to_length(batch, int(length.item()), self.pad_token_id)


def fit_ulysses_attention(training: Callable[[], bool]) -> None:
    """DeepSpeed's Ulysses attention made to run every forward of a training step, each on its shards:

    - any number of rows: it asserts every query has the ``micro_batch_size`` rows it was registered with (accelerate
      passes the loader's batch size), while a preference micro-batch of B pairs has 2B rows (and a last batch may
      have fewer); its sequence length it already updates per forward (``seq_length_is_variable``), the rows are
      updated likewise, from the query;
    - modules in eval mode while ``training()`` (the policy trains): the engine runs a module in eval mode on its
      local shard alone (accelerate's ``sp_disable_in_eval``, right for evaluation, whose batches are not cut), but a
      frozen reference model runs in eval mode on the training shards and must see the whole sequence.

    The registered attention (transformers' table, under its core implementation's name) is wrapped once."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in list(ALL_ATTENTION_FUNCTIONS.valid_keys()):
        function = ALL_ATTENTION_FUNCTIONS[name]
        cells = getattr(function, "__closure__", None) or ()
        found = [c.cell_contents for c in cells if isinstance(c.cell_contents, UlyssesSPAttentionHF)]
        if not found or getattr(function, "_hfacc_rows", False):
            continue
        ALL_ATTENTION_FUNCTIONS[name] = _on_shards(function, found[0], training)


def _on_shards(function, attention, training):
    def attention_with_rows(module, query, key, value, attention_mask, *args, **kwargs):
        rows = query.shape[0]  # [batch, heads, sequence, head size] as transformers calls it
        if rows != attention.batch_size:
            attention.batch_size = rows
            for field in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                shape = list(getattr(attention, field))
                shape[1] = rows
                setattr(attention, field, torch.Size(shape))
        local_in_eval = attention.disable_in_eval
        attention.disable_in_eval = local_in_eval and not training()
        try:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            attention.disable_in_eval = local_in_eval

    attention_with_rows._hfacc_rows = True
    return attention_with_rows
