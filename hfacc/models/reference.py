"""The reference model of preference and KL-regularized losses: frozen, in eval mode, log-probs without gradient.

Three ways to have one, as TRL offers them (:func:`build_reference_model`):

- a model the user gives (``ref_model=``);
- by default, a frozen copy of the policy taken when training starts (before its first update; a resumed run copies
  the policy as it was before the checkpoint's weights were loaded into it: :func:`copy_initial_policy`);
- for a PEFT policy, the policy itself with its adapter disabled: the base weights *are* the reference, so no
  second copy is held.

Its log-probs come from the same kernel as the policy's (:func:`hfacc.ops.logprobs.get_token_logprobs`): chunked from
the final hidden states where the model allows it (checked once, on the first batch), else from full logits.
Precomputed reference log-probs (dataset columns) need no model at all; the objectives read them directly.

Placement: a copy lives on the policy's device. Under DDP nothing more is needed (it takes no gradient, so it is
not wrapped). Sharded engines (DeepSpeed ZeRO-3, FSDP2) shard the policy's parameters; the reference is sharded the
same way (:func:`build_sharded_reference`): FSDP2 copies each rank's own shards into a model sharded on the same
modules and mesh, ZeRO-3 gathers the policy one parameter at a time into a model DeepSpeed then partitions. Every
rank runs the reference's forwards together (they gather its shards), as it runs the policy's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..data.preference import (
    KTO_REFERENCE_COLUMNS,
    REFERENCE_COLUMNS,
    DataCollatorForPreference,
    DataCollatorForUnpairedPreference,
)
from ..ops.logprobs import TokenLogProbs, check_fused_logprobs, get_token_logprobs
from ..ops.loss import shift_labels
from ..ops.model_io import get_base_model
from ..ops.precision import as_autocast_dtype, autocast_like, get_autocast_dtype

logger = logging.getLogger(__name__)


def unwrap_model(model: nn.Module) -> nn.Module:
    """``model`` without its DDP / DeepSpeed / torch.compile wrappers (a PEFT model stays a PEFT model)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
    return model


def is_peft_model(model: nn.Module) -> bool:
    return callable(getattr(unwrap_model(model), "disable_adapter", None))


class ReferenceModel:
    """Log-probs of a frozen reference, without gradient.

    Args:
        module: the reference network (a frozen copy, or the user's ``ref_model``), or the PEFT policy itself when
            ``disable_adapter`` (its adapter is switched off for each reference forward).
        disable_adapter: run ``module.disable_adapter()`` around each forward (PEFT policies: the base model).
        fused: take the log-probs from the hidden states in chunks; None decides on the first batch
            (:func:`hfacc.ops.logprobs.check_fused_logprobs`).
        autocast: the dtype the policy's forwards autocast in (accelerate's ``bf16=True`` / ``fp16=True``), which
            the reference's forwards then run under too (:func:`hfacc.ops.precision.autocast_like`), wherever they
            run (inside the training step or before it, in :meth:`hfacc.Objective.window_statistics`): with the
            reference equal to the policy every log-ratio is then exactly 0 in mixed precision too. None: as the
            module computes (its weights' dtype, or the autocast wrapper a frozen copy of the policy inherits).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        disable_adapter: bool = False,
        fused: bool | None = None,
        autocast: torch.dtype | None = None,
    ):
        self.module, self.disable_adapter, self.fused, self.autocast = module, disable_adapter, fused, autocast

    @torch.no_grad()
    def logprobs(
        self, inputs: Mapping[str, Any], targets: torch.Tensor, *, chunk_size: int = 0, temperature: float = 1.0
    ) -> TokenLogProbs:
        """:class:`hfacc.ops.logprobs.TokenLogProbs` of ``targets`` under the reference (eval mode: no dropout)."""
        module = self.module
        was_training = module.training
        module.eval()
        try:
            with self._context():
                if self.fused is None:
                    self.fused = check_fused_logprobs(module, inputs, targets, temperature) is None
                _, result = get_token_logprobs(
                    module, inputs, targets, fused=self.fused, chunk_size=chunk_size, temperature=temperature
                )
        finally:
            module.train(was_training)
        return result

    @torch.no_grad()
    def check_fused(self, inputs: Mapping[str, Any], targets: torch.Tensor, temperature: float = 1.0) -> str | None:
        """Why chunked log-probs would not be this reference's own (None: they are): :func:`check_fused_logprobs`
        on the reference as its forwards run (adapter disabled, eval mode)."""
        with self._context():
            return check_fused_logprobs(self.module, inputs, targets, temperature)

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(autocast_like(self.module, self.autocast))
        if self.disable_adapter:
            stack.enter_context(self.module.disable_adapter())
        return stack

    def __repr__(self) -> str:
        kind = "the policy with its adapter disabled" if self.disable_adapter else type(self.module).__name__
        return f"ReferenceModel({kind})"


def copy_initial_policy(policy: nn.Module) -> nn.Module | None:
    """A frozen copy of ``policy`` as it is now, for the reference of a run that resumes from a checkpoint.

    The default reference is the policy as training *started*; a resumed run loads the checkpoint's trained weights
    into the policy before its first window, so a copy taken there would be the trained policy (every implicit
    reward starts at 0 again, and the loss silently changes). The Trainer takes this copy before it loads them.
    None where the policy's parameters are already partitioned (DeepSpeed ZeRO-3's ``zero.Init``): no rank holds
    the whole weights to copy.
    """
    module = get_base_model(unwrap_model(policy))
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        return None
    copied = copy.deepcopy(module)
    copied.requires_grad_(False)
    return copied.eval()


def build_reference_model(
    policy: nn.Module, ref_model: nn.Module | None = None, accelerator=None, initial_policy: nn.Module | None = None
) -> ReferenceModel:
    """The reference of ``policy``: ``ref_model`` if given, else the PEFT base or a frozen copy (see the module doc),
    placed like the policy, its forwards run in the precision the policy's run in (its autocast: ``bf16=True``).

    Call it before the policy's first update: the copy is of the weights as they are now, or ``initial_policy``'s
    (:func:`copy_initial_policy`: the policy before a resumed run loaded its checkpoint). Under DeepSpeed ZeRO-3 and
    FSDP2 the reference is sharded as the policy is (:func:`build_sharded_reference`), so no rank ever holds a
    second whole model; under DDP and ZeRO-1/2 it is whole on every rank (it takes no gradient, so it is not wrapped).
    """
    reference = _place_reference(policy, ref_model, accelerator, initial_policy)
    reference.autocast = get_autocast_dtype(policy)  # accelerate wraps only the policy's forward in it
    return reference


def _place_reference(policy, ref_model, accelerator, initial_policy) -> ReferenceModel:
    if ref_model is not None:
        module = unwrap_model(ref_model)
        module.requires_grad_(False)
        engine = sharded_engine(policy, accelerator)
        if engine is not None:
            return build_sharded_reference(policy, accelerator, engine, module)
        if accelerator is not None:
            module.to(accelerator.device)
        return ReferenceModel(module.eval())
    if is_peft_model(policy):
        logger.info("hfacc: reference model: the PEFT policy with its adapter disabled (no second copy).")
        return ReferenceModel(unwrap_model(policy), disable_adapter=True)
    if initial_policy is not None:
        logger.info("hfacc: reference model: a frozen copy of the policy as the run started (before its checkpoint).")
        return _place_reference(policy, initial_policy, accelerator, None)
    engine = sharded_engine(policy, accelerator)
    if engine is not None:
        return build_sharded_reference(policy, accelerator, engine)
    module = copy.deepcopy(get_base_model(unwrap_model(policy)))
    module.requires_grad_(False)
    logger.info("hfacc: reference model: a frozen copy of the policy as training starts.")
    return ReferenceModel(module.eval())


def build_sharded_reference(policy: nn.Module, accelerator, engine: str, given: nn.Module | None = None):
    """The reference sharded like a ZeRO-3 or FSDP2 ``policy``: ``given`` (the user's ``ref_model``), or a frozen copy.

    The copy is built empty from the policy's config and filled shard by shard, never whole:

    - **FSDP2**: the empty model gets ``fully_shard`` on the same modules, with the same device mesh, as the policy,
      so every parameter's local shard has the policy's shape; each rank copies its own shards (no communication);
    - **ZeRO-3**: the policy's parameters are gathered one at a time (``GatheredParameters``, a collective every rank
      takes in the same order) into the empty model, which DeepSpeed then partitions as an inference engine with the
      run's ZeRO-3 settings (TRL's ``prepare_deepspeed`` does the same for a given ``ref_model``).

    Buffers (rotary frequencies, ...) are not sharded; they are copied as they are. A copy needs a transformers model
    (its config rebuilds the architecture); for any other module pass ``ref_model=`` or precomputed log-probs.
    """
    if engine == "FSDP":
        raise NotImplementedError(
            "hfacc: a reference model under FSDP v1 (flattened parameters) is not supported: use FSDP2 "
            "(fsdp_version: 2), or precomputed reference log-probs (hfacc.precompute_reference_logps)."
        )
    base = get_base_model(unwrap_model(policy))
    if engine == "FSDP2":
        reshard(base)
    if given is None:
        module = _empty_like(base, engine)
    else:
        module = given
    if engine == "FSDP2":
        _shard_like(module, base)
        if given is None:
            _copy_shards(module, base)
        logger.info("hfacc: reference model: %s, sharded like the policy (FSDP2).", "yours" if given else "a copy")
        module.requires_grad_(False)
        return ReferenceModel(module.eval())
    if given is None:
        _gather_into(module, base)
    module.requires_grad_(False)
    reference = _zero3_inference_engine(module, accelerator)
    logger.info("hfacc: reference model: %s, partitioned like the policy (ZeRO-3).", "yours" if given else "a copy")
    return ReferenceModel(reference)


def _empty_like(base: nn.Module, engine: str) -> nn.Module:
    """A model of ``base``'s architecture on the meta device (FSDP2) or with uninitialized CPU weights (ZeRO-3)."""
    from transformers import PreTrainedModel

    cls = type(base)
    if engine == "FSDP2":  # fully_shard changed the class to FSDP<Cls>(FSDPModule, Cls)
        from torch.distributed.fsdp import FSDPModule

        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    if not issubclass(cls, PreTrainedModel):
        raise NotImplementedError(
            f"hfacc: a frozen copy of {cls.__name__} under {engine} needs a transformers model (it is rebuilt from its "
            "config, shard by shard). Pass ref_model= (built like the policy) or precomputed reference log-probs."
        )
    with torch.device("meta"):
        module = cls(copy.deepcopy(base.config))
    if engine != "FSDP2":
        module.to_empty(device="cpu")  # filled parameter by parameter before DeepSpeed partitions it
    return module


def reshard(module: nn.Module) -> None:
    """Shard again every FSDP2 unit of ``module``: FSDP2's root keeps its parameters whole after a forward (for the
    backward that follows), which a frozen model never runs."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _shard_like(module: nn.Module, base: nn.Module) -> None:
    """``fully_shard`` every submodule of ``module`` that is an FSDP2 unit in ``base``, deepest first, same mesh.

    A module of another architecture (a distillation teacher: more layers, other names) is sharded on the modules
    of the classes that are units in ``base`` (its decoder layers), and its root."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from ..ops.fused_loss import _module_class

    units = [name for name, m in base.named_modules() if isinstance(m, FSDPModule)]
    names = [name for name, _ in module.named_modules()]
    if names != [name for name, _ in base.named_modules()]:
        classes = {_module_class(m) for name, m in base.named_modules() if name and isinstance(m, FSDPModule)}
        units = [name for name, m in module.named_modules() if name and type(m) in classes] + [""]
    mesh = next(p.device_mesh for p in base.parameters() if isinstance(p, DTensor))
    state = base._get_fsdp_state() if hasattr(base, "_get_fsdp_state") else None
    policy = getattr(state, "_mp_policy", None) or MixedPrecisionPolicy()  # the policy's forward precision
    for name in sorted(units, key=lambda n: -(n.count(".") + 1 if n else 0)):
        fully_shard(module.get_submodule(name), mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    device = next(p for p in base.parameters()).device
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)


@torch.no_grad()
def _copy_shards(module: nn.Module, base: nn.Module) -> None:
    """Each rank's local shards of ``base``'s parameters and all its buffers into the same-sharded ``module``."""
    from torch.distributed.tensor import DTensor

    mine = dict(module.named_parameters())
    for name, p in base.named_parameters():
        source, target = p, mine[name]
        source = source.to_local() if isinstance(source, DTensor) else source
        target = target.to_local() if isinstance(target, DTensor) else target
        target.copy_(source)
    _copy_buffers(module, base)


@torch.no_grad()
def _gather_into(module: nn.Module, base: nn.Module) -> None:
    """ZeRO-3: each of ``base``'s parameters, gathered whole for the copy and released again, into ``module``."""
    mine = dict(module.named_parameters())
    for name, tensor in iter_full_parameters(base):
        mine[name].copy_(tensor)
    _copy_buffers(module, base)


@torch.no_grad()
def iter_full_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` of each of ``module``'s parameters, in order, however they are sharded.

    DeepSpeed ZeRO-3 parameters are gathered one at a time (``GatheredParameters``) and released once the consumer
    asks for the next, so use each tensor before then (or copy it); FSDP2's DTensors are gathered
    (``full_tensor``); anything else is its own tensor. Gathering is a collective: every rank iterates together, in
    the same order. FSDP v1's flattened parameters are refused.
    """
    engine = sharded_engine(module)
    if engine == "FSDP":
        raise NotImplementedError("hfacc: FSDP v1 flattens parameters; use FSDP2 (fsdp_version: 2).")
    if engine == "DeepSpeed ZeRO-3":
        import deepspeed

        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield name, p.data
        return
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        DTensor = ()
    for name, p in module.named_parameters():
        yield name, (p.full_tensor() if DTensor and isinstance(p, DTensor) else p).detach()


def _copy_buffers(module: nn.Module, base: nn.Module) -> None:
    mine = dict(module.named_buffers())
    for name, b in base.named_buffers():
        if name in mine:
            mine[name].copy_(b.to(mine[name].device))


def _zero3_inference_engine(module: nn.Module, accelerator):
    """``module`` partitioned by DeepSpeed with the run's ZeRO-3 settings, as an inference engine (no optimizer)."""
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    # No optimizer is given: DeepSpeed would build one (or a scheduler) from these blocks.
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    config = {k: v for k, v in config.items() if v != "auto"}
    config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items() if v != "auto"}
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    engine, *_ = deepspeed.initialize(model=module, config=config)
    engine.eval()  # DeepSpeedEngine.eval() returns None
    return engine


def sharded_engine(model: nn.Module, accelerator=None) -> str | None:
    """The engine that shards ``model``'s parameters: ``"DeepSpeed ZeRO-3"``, ``"FSDP2"``, ``"FSDP"`` (v1), or None."""
    if any(hasattr(p, "ds_shape") for p in model.parameters()):
        return "DeepSpeed ZeRO-3"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        FSDPModule = ()
    if FSDPModule and any(isinstance(m, FSDPModule) for m in model.modules()):
        return "FSDP2"
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
        return "FSDP"
    return None


# ---- reference log-probs, once ---------------------------------------------------------------------------------
@torch.no_grad()
def precompute_reference_logps(
    dataset,
    reference: torch.nn.Module | ReferenceModel,
    *,
    pad_token_id: int,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    chunk_size: int = 0,
    show_progress: bool = True,
    mixed_precision: str | torch.dtype | None = None,
):
    """``dataset`` (a built preference dataset) with each sequence's log-prob under ``reference``, summed over its
    scored tokens, computed once, with a progress bar: ``ref_chosen_logps`` and ``ref_rejected_logps`` for pairs;
    ``ref_logps`` (the completion) and ``ref_kl_logps`` (its KL row) for unpaired rows (KTO).

    ``reference`` is the reference network as it is now (e.g. the policy before training: the default reference),
    or a :class:`hfacc.models.reference.ReferenceModel`; a PEFT model is run with its adapter disabled (its base).
    Training with these columns needs no reference model in memory (:class:`hfacc.DPOObjective` and
    :class:`hfacc.KTOObjective` read them from the batch). Every process computes every row (a sharded reference's
    forwards are collectives).

    ``mixed_precision``: the mixed precision training will run in (``"bf16"``, ``"fp16"``, a dtype;
    :func:`hfacc.ops.precision.get_training_autocast` reads it from ``TrainingArguments``): the reference runs under
    that autocast, as the policy's forwards will, so that a reference equal to the policy gives log-ratios of
    exactly 0 (fp32 log-probs against bf16 ones differ by bf16's rounding). None: as ``reference`` computes now.
    """
    from tqdm.auto import tqdm

    if not isinstance(reference, ReferenceModel):
        reference = ReferenceModel(
            reference, disable_adapter=is_peft_model(reference), autocast=get_autocast_dtype(reference)
        )
    if mixed_precision is not None:
        reference = copy.copy(reference)  # the caller's ReferenceModel keeps its own precision
        reference.autocast = as_autocast_dtype(mixed_precision)
    module = reference.module
    device = torch.device(device) if device is not None else next(module.parameters()).device
    unpaired = "completion_input_ids" in dataset.column_names
    if unpaired:  # one batch of completions and one of their KL rows per step
        collate, outputs = DataCollatorForUnpairedPreference(pad_token_id), KTO_REFERENCE_COLUMNS
        columns = ["completion_input_ids", "completion_labels", "label", "kl_input_ids", "kl_labels"]
    else:  # one [2B, T] batch of chosen and rejected sequences
        collate, outputs = DataCollatorForPreference(pad_token_id), REFERENCE_COLUMNS
        columns = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    rows = dataset.select_columns(columns)
    found: tuple[list[float], list[float]] = ([], [])
    bar = tqdm(
        total=len(rows), desc="Reference log-probs", unit="row" if unpaired else "pair", disable=not show_progress
    )
    for start in range(0, len(rows), batch_size):
        part = [rows[i] for i in range(start, min(start + batch_size, len(rows)))]
        batch = {k: v.to(device) for k, v in collate(part).items()}
        if unpaired:
            found[0].extend(_sequence_logps(reference, batch, chunk_size))
            kl = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
            found[1].extend(_sequence_logps(reference, {**kl, "labels": batch["kl_labels"]}, chunk_size))
        else:
            logps = _sequence_logps(reference, batch, chunk_size)
            found[0].extend(logps[: len(part)])
            found[1].extend(logps[len(part) :])
        bar.update(len(part))
    bar.close()
    if not all(math.isfinite(x) for x in found[0] + found[1]):
        raise ValueError("the reference gave a non-finite log-prob: check the reference model and the data.")
    dataset = dataset.remove_columns([c for c in outputs if c in dataset.column_names])
    return dataset.add_column(outputs[0], found[0]).add_column(outputs[1], found[1])


def _sequence_logps(reference: ReferenceModel, batch, chunk_size: int) -> list[float]:
    """Each row's log-prob of its targets (summed) under ``reference``: a padded batch of one sequence per row."""
    targets = shift_labels(batch["labels"], attention_mask=batch["attention_mask"])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    result = reference.logprobs(inputs, targets, chunk_size=chunk_size)
    owner = torch.arange(targets.shape[0], device=targets.device)[:, None].expand(targets.shape)[result.mask]
    return result.logps.new_zeros(targets.shape[0]).index_add(0, owner, result.logps).tolist()


__all__ = [
    "ReferenceModel",
    "build_reference_model",
    "build_sharded_reference",
    "copy_initial_policy",
    "iter_full_parameters",
    "sharded_engine",
    "reshard",
    "unwrap_model",
    "is_peft_model",
    "precompute_reference_logps",
]
