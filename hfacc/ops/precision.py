"""The precision a model computes in, and the bound of a comparison computed in a precision.

Mixed precision comes in two forms, and a run may have both:

- fp32 weights (masters) under autocast: ``TrainingArguments(bf16=True)`` (or ``fp16=True``) gives accelerate's mixed
  precision, and ``Accelerator.prepare_model`` wraps the model's forward in ``torch.autocast`` (keeping the plain
  forward as ``model._original_forward``), on CPU too; matrix products then run in half precision, the weights and
  their gradients stay fp32. transformers' own ``autocast_smart_context_manager`` adds nothing (it leaves autocast to
  accelerate);
- weights stored in half precision (``from_pretrained(..., dtype=torch.bfloat16)``, DeepSpeed's bf16): every product
  runs in the weights' dtype, autocast or not.

:func:`get_compute_dtype` reads which one a model is in, now; :func:`without_autocast` runs a block in the weights'
own dtype; :func:`autocast_like` runs a frozen model beside the trained one (a reference, a teacher) under the
trained model's autocast, so that both compute in one precision (:func:`get_training_autocast`: the one a run's
arguments will give); :func:`get_check_precision` says where hfacc's once-per-model checks run (fp32 with autocast off for fp32
weights: they judge the model, not a precision's rounding); :func:`get_tolerance` is the bound of two computations
that are equal in exact arithmetic, and :func:`get_rounding_bound` the one of a gradient computed in half precision
against its big batch, from that precision's noise floor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .model_io import get_base_model, get_input_embeddings

# accelerate's mixed precision -> the dtype its autocast computes in ("fp8" autocasts the rest to bf16).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def get_weights_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most of ``model``'s parameter elements are stored in (a bf16 model with fp32 LoRA
    adapters is bf16; DeepSpeed ZeRO-3's partitioned parameters count their full size)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + int(getattr(p, "ds_numel", p.numel()))
    return max(sizes, key=sizes.get, default=torch.float32)


def get_autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype autocast runs ``model``'s forward in when it is called now, or None: an autocast already entered
    around the call, else accelerate's mixed-precision wrapper of its forward."""
    device = _device_type(model)
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if _autocast_owner(model) is None:
        return None
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:  # a wrapper without an accelerator: nothing says its dtype
        return None
    return AUTOCAST_DTYPES.get(str(AcceleratorState().mixed_precision))


def get_compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s matrix products run in when it is called now: autocast's, else its weights'."""
    return get_autocast_dtype(model) or get_weights_dtype(model)


def as_autocast_dtype(precision: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"fp16"`` / ``"fp8"`` (accelerate's names) or a dtype -> the dtype autocast computes in; None,
    ``"no"`` and fp32 -> None (no autocast)."""
    if precision is None or isinstance(precision, torch.dtype):
        return None if precision in (None, torch.float32) else precision
    if str(precision) in ("no", "fp32"):
        return None
    if str(precision) not in AUTOCAST_DTYPES:
        raise ValueError(f"mixed_precision={precision!r}: give 'bf16', 'fp16', 'no' or a torch dtype.")
    return AUTOCAST_DTYPES[str(precision)]


def get_training_autocast(args) -> torch.dtype | None:
    """The dtype a run with these ``TrainingArguments`` autocasts its model's forwards in: bf16 for ``bf16=True``,
    fp16 for ``fp16=True``, else None. For what is computed once before training (precomputed reference or teacher
    log-probs), so that it is computed as the policy will compute."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return None


def autocast_like(model: nn.Module | torch.Tensor, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Run ``model`` (or what is computed from a tensor) under autocast in ``dtype`` inside the block (None: as it
    runs now).

    For a frozen model beside the trained one (a DPO/KTO reference, a distillation teacher): accelerate's mixed
    precision wraps only the trained model's forward in autocast (``Accelerator.prepare_model``), so a reference the
    user gave, or one run outside that forward, computes in its fp32 weights while the policy computes in bf16:
    with reference == policy the implicit rewards ``beta * (log pi - log pi_ref)`` are then bf16's rounding, not 0.
    Under the policy's autocast both compute alike (TRL prepares its ``ref_model`` with the accelerator, which
    wraps it the same way)."""
    if dtype is None:
        return contextlib.nullcontext()
    device = model.device.type if isinstance(model, torch.Tensor) else _device_type(model)
    return torch.autocast(device, dtype=dtype)


@contextlib.contextmanager
def without_autocast(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in its weights' own dtype inside the block: accelerate's autocast wrapper of its forward is
    taken off (and put back after), and any autocast entered around the block is turned off."""
    owner = _autocast_owner(model)
    wrapped = owner.__dict__["forward"] if owner is not None else None
    if owner is not None:
        owner.forward = owner.__dict__["_original_forward"]
    try:
        with contextlib.ExitStack() as stack:
            for device in {_device_type(model), "cpu"}:
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        if owner is not None:
            owner.forward = wrapped


def needs_half_precision(model: nn.Module) -> bool:
    """Whether ``model``'s attention kernels take only half precision (flash attention: transformers casts fp32
    inputs to the autocast or weight dtype, and the kernel refuses fp32)."""
    config = getattr(get_base_model(model), "config", None)
    return "flash" in str(getattr(config, "_attn_implementation", None) or "")


@dataclass
class CheckPrecision:
    """Where a check runs: ``dtype``, what it computes in; ``training``, what training computes in; ``autocast_off``,
    whether the check takes autocast off (fp32 master weights under mixed precision); ``engine``, the half precision
    an engine turned the weights into for the forward although they are stored in fp32 (FSDP's mixed-precision
    policy casts them to its ``param_dtype``), seen in the check's own runs."""

    dtype: torch.dtype
    training: torch.dtype
    autocast_off: bool
    engine: torch.dtype | None = None

    def describe(self) -> str:
        """``"fp32"``; ``"fp32 with autocast off (training computes in bf16 ...)"``; ``"bf16, as training ..."``."""
        name, training = dtype_name(self.dtype), dtype_name(self.training)
        if self.engine is not None:
            return f"{name}, as the engine computes the fp32 weights (bound: {name} rounding)"
        if self.dtype == self.training:
            return name if self.dtype == torch.float32 else f"{name}, as training computes (bound: {name} rounding)"
        return f"{name} with autocast off (training computes in {training} autocast; the weights are {name} masters)"


def get_check_precision(model: nn.Module) -> CheckPrecision:
    """Where the layout checks of ``model`` run, decided from its weights and the autocast it is called under.

    - fp32 weights (fp32 training, or fp32 masters under ``bf16=True`` / ``fp16=True`` autocast): in fp32 with
      autocast off. The checks ask whether two layouts compute the same function (no leak, positions read right,
      no row offset read): a question of the model, not of the precision, answered best where rounding is least:
      to :func:`get_tolerance`'s 1e-6.
    - half-precision weights (``dtype=torch.bfloat16``, DeepSpeed's bf16), or attention kernels that take nothing
      else (:func:`needs_half_precision`): as training computes (:func:`get_compute_dtype`), within
      ``get_tolerance`` of that dtype. Leaks and fillers are still judged exactly (see
      :func:`hfacc.setup.layout_check.check_padding_free`).

    An engine that computes fp32 weights in half precision whatever autocast says (FSDP's ``param_dtype``) is seen
    only in a run: :func:`check_precision` watches what the input embeddings put out.
    """
    weights, training = get_weights_dtype(model), get_compute_dtype(model)
    if torch.finfo(weights).bits >= 32 and not needs_half_precision(model):
        return CheckPrecision(weights, training, True)
    return CheckPrecision(training, training, False)


@contextlib.contextmanager
def check_precision(model: nn.Module) -> Iterator[CheckPrecision]:
    """Run a check of ``model`` where :func:`get_check_precision` says; yields that :class:`CheckPrecision`, whose
    ``dtype`` is the coarser one of it and of what the input embeddings put out in the block (an engine's
    half-precision weights), once the block is over."""
    precision = get_check_precision(model)
    seen: set[torch.dtype] = set()
    embeddings = get_input_embeddings(model)

    def watch(module, args, output):
        if torch.is_tensor(output) and output.is_floating_point():
            seen.add(output.dtype)

    handle = embeddings.register_forward_hook(watch) if embeddings is not None else None
    try:
        with without_autocast(model) if precision.autocast_off else contextlib.nullcontext():
            yield precision
    finally:
        if handle is not None:
            handle.remove()
        coarsest = max(seen, key=lambda d: torch.finfo(d).eps, default=precision.dtype)
        if torch.finfo(coarsest).eps > torch.finfo(precision.dtype).eps:
            precision.dtype = precision.engine = coarsest


def get_tolerance(dtype: torch.dtype) -> float:
    """The largest relative L2 difference between two computations that are equal in exact arithmetic but round
    differently (another layout, another order of the same sums), computed in ``dtype``:

        tolerance(dtype) = 1e-6 * eps(dtype) / eps(fp32)  (about 8.4 eps(dtype))

    1e-6 in fp32: the promise on gradients. Half precision keeps the same number of rounding units: 6.6e-2 in bf16
    (eps 2**-7), 8.2e-3 in fp16 (eps 2**-10). What such rounding gives, measured on this project's models: 1e-7 and
    less in fp32; 4e-4 to 4e-3 in bf16 (logits, gradients, hidden states of a padded against a padding-free run), a
    sixteenth of the bound and less. What breaks equivalence is not rounding and is not judged against this bound
    where it can be seen exactly (a leak between packed sequences, a gradient reaching a filler: exactly 0 in any
    precision); see :mod:`hfacc.setup.layout_check`.

    >>> get_tolerance(torch.float32), round(get_tolerance(torch.bfloat16), 4)
    (1e-06, 0.0655)
    """
    return 1e-6 * torch.finfo(dtype).eps / torch.finfo(torch.float32).eps


def get_rounding_bound(noise_floor: float) -> float:
    """The largest relative difference between two computations of one gradient in a half precision that is still
    that precision's rounding, given its ``noise_floor``: how far the precision's rounding moves one of them (the
    big batch's) from the exact gradient (fp32's, exact to 1e-7).

        bound = 2 * noise_floor

    An exact accumulation rounds as much as the big batch does, so each lies about ``noise_floor`` from the exact
    gradient, and the two lie within twice that of each other (the triangle inequality). Measured on tiny Llamas
    under bf16 autocast: accumulated vs big batch 2e-3 to 4.4e-3 against a floor of 4.5e-3 to 4.8e-3 (fp16: 3e-4 to
    7.1e-4 against 6.6e-4 to 7.7e-4); a mis-normalized accumulation is off by 0.1 and more. (The same big batch in
    another order is no floor: under autocast on CPU it moves by 1e-7 to 1e-5, since only the order of fp32 sums
    changes, while any change of shapes moves a bf16 gradient by 1e-3.)

    >>> get_rounding_bound(4.5e-3)
    0.009
    """
    return 2.0 * noise_floor


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``, ``torch.float32`` -> ``"fp32"``."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def _device_type(model: nn.Module) -> str:
    parameter = next(iter(model.parameters()), None)
    return parameter.device.type if parameter is not None else "cpu"


def _autocast_owner(model: nn.Module) -> nn.Module | None:
    """The module whose forward accelerate wrapped in autocast (``model``, or the module under a DDP wrapper)."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, nn.Module) and {"_original_forward", "forward"} <= candidate.__dict__.keys():
            return candidate
    return None


__all__ = [
    "CheckPrecision",
    "check_precision",
    "get_check_precision",
    "needs_half_precision",
    "get_weights_dtype",
    "get_autocast_dtype",
    "get_compute_dtype",
    "without_autocast",
    "autocast_like",
    "as_autocast_dtype",
    "get_training_autocast",
    "get_tolerance",
    "get_rounding_bound",
    "dtype_name",
]
