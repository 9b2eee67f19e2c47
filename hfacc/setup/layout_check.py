"""The once-per-model layout checks: may this model take padding-free or packed rows, and which layout is exact.

:func:`hfacc.data.padding_free.remove_padding` lays a padded micro-batch out without its padding, and packing lays
several sequences in a row; both are exact only for a model that computes each packed sequence as it computes it
alone, which a model can break in ways no signature shows: a convolution or state-space layer that runs across the
boundaries (LFM2, Jamba), a router loss that counts the filler of a row (Mixtral, Qwen-MoE, ...), a filler that
makes the backward NaN (Gemma3n), attention that reads the row index instead of ``position_ids`` (Llama 4 past 8192
tokens), image features given to the wrong sequence. So :func:`choose_padding_free` decides once per model, by
running it (:func:`check_padding_free`, :func:`check_row_offsets`, with images :func:`check_image_layout`), which
layout is exact, and falls back to the padded batch, said at WARNING, when none is; :func:`require_packing_support`
refuses packed data a model cannot keep apart (:func:`check_packing`); :func:`choose_shared_prompts` decides whether
the pairs of a reward model share their prompt's forward (:func:`check_shared_prompts`: each sequence against its own
forward, leaks between answers and pairs). Every bound is :func:`get_tolerance`'s.

The checks judge semantics, not rounding. Where the weights are fp32 they run in fp32 with autocast off, whatever
precision training computes in (:func:`hfacc.ops.precision.get_check_precision`): a bf16 run's rounding differs between
two layouts by far more than 1e-6, and would hide a leak of 1e-5 (LFM2's) as well as fake a broken model. Where the
weights themselves are half precision (or the attention kernel takes nothing else: flash attention), they run as
training computes, within the bound of that precision's rounding; what must be exactly 0 (a leak between the sequences
of a row, a gradient reaching a filler) is judged exactly in every precision, by gradients that only a leak makes
nonzero.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..data.multimodal import get_image_inputs, takes_images, unpack_rows, with_packed_positions
from ..data.padding_free import remove_padding
from ..data.shared_prompts import get_attention_width, get_attention_window, share_prompts
from ..objectives import Objective
from ..ops.fused_loss import fused_loss_problem, swap_output_head
from ..ops.loss import IGNORE_INDEX, get_sequence_starts, shift_labels
from ..ops.model_io import (
    get_aux_loss,
    get_base_model,
    get_dropout_settings,
    get_input_embeddings,
    get_logits,
    model_inputs,
)
from ..ops.precision import check_precision, get_tolerance
from ..ops.scores import get_last_token_index, get_pad_token_id
from ..runtime.distributed import all_ranks_agree

logger = logging.getLogger(__name__)

CHECK_TOKENS = 64  # tokens of the check's three sequences (check_padding_free): small work, the same on every rank


def uses_one_row(model: nn.Module) -> bool:
    """Whether ``model``'s attention has variable-length kernels (flash attention, flex attention's block masks):
    their cost is the sum of each sequence's own, so one row is best. Dense masked attention (sdpa, eager) computes
    every pair of a row, so it gets rows as wide as the longest sequence instead (see :func:`remove_padding`)."""
    config = getattr(get_base_model(model), "config", None)
    implementation = str(getattr(config, "_attn_implementation", None) or "")
    return "flash" in implementation or "flex" in implementation


def padding_free_problem(model: nn.Module, objective: Objective) -> str | None:
    """Why padding-free micro-batches do not apply to ``model``, judged without running it; None if they may."""
    base = get_base_model(model)
    config = getattr(base, "config", None)
    if not objective.supports_padding_free:
        return f"the objective {objective.name!r} does not support padding-free micro-batches (causal LMs do)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(base).__name__} is an encoder-decoder"
    if getattr(objective, "num_virtual_tokens", 0):
        return (
            "PEFT prompt tuning puts its virtual tokens in front of every row, so rows cannot hold several sequences"
        )
    return position_ids_problem(base)


def check_padding_free(
    model: nn.Module,
    batch: Mapping[str, Any],
    one_row: bool | None = None,
    tolerance: float | None = None,
    max_tokens: int = CHECK_TOKENS,
    gradient: bool = True,
) -> str | None:
    """Run a few sequences padded and padding-free, forward and backward; None if the layout is exact, else why not.

    The sequences are the first real tokens of ``batch``, cut to three of different lengths (at most
    ``max_tokens`` in all) and padded on the side ``batch`` is padded, then laid out as training will (``one_row``,
    by default from :func:`uses_one_row`; packed rows hold two of them and a filler): the same small work on every
    rank whatever its data, so sharded models (FSDP, DeepSpeed) run it in step. The run is in the check's precision
    (:func:`hfacc.ops.precision.get_check_precision`: fp32 for fp32 weights, autocast off). Compared, relative to the
    padded run, within :func:`get_tolerance` of that dtype (1e-6 in fp32):

    - what the loss sees: the logits and cross-entropy of every real position and the model's auxiliary (router)
      loss, which a filler counted by the router moves;
    - the gradient of that loss with respect to the input embeddings at every real position, which must be finite;
      at the filler it must be exactly 0 (the filler must be inert, in any precision). It is taken with
      ``torch.autograd.grad`` from the embeddings' output, so no parameter's ``.grad`` is touched and no engine's
      gradient hook runs; it goes through every layer's backward (a NaN from the filler, a leak in the backward).
      A model without ``get_input_embeddings`` is compared forward only;
    - leaks, two ways: the first sequence of each row with several is changed (other tokens) and the row run again:
      the logits of the others must not move beyond rounding (an eighth of the bound: 1 eps in fp32; bit for bit on
      a model that keeps them apart, unless it regroups tokens, as a mixture of experts does); and the gradient of
      the others' loss must not reach the first sequence's embeddings at all: exactly 0 in any precision where
      nothing runs across the sequences, and not 0 where a convolution or a scan does (LFM2, Jamba), however
      small the leak and however coarse the precision.

    ``gradient=False`` compares the forward only (the gradient leak test too is skipped), for a frozen model no
    backward ever runs through (a distillation teacher). The model runs in eval mode (dropout would make any two runs differ). The rows here are short; where training
    lays sequences far into a row, :func:`check_row_offsets` checks those offsets.
    """
    problem = position_ids_problem(get_base_model(model))
    if problem:
        return problem
    one_row = uses_one_row(model) if one_row is None else one_row
    lengths = [max(2, max_tokens // 6), max(2, max_tokens // 3), max(2, max_tokens // 2)]
    padded = _check_batch(batch, lengths, left=_is_left_padded(batch))
    row = remove_padding(padded, one_row)
    owner = row["sequence_ids"]
    # The leak test: in each row holding several sequences, the first is changed and the others are watched.
    changed = (owner == owner[:, :1]) & (owner >= 0)
    watched = (owner >= 0) & ~changed
    changed &= watched.any(-1, keepdim=True)
    other = row["input_ids"].clone()
    other[changed] = (other[changed] + 1) % _vocab_size(model, other)
    was_training = model.training
    model.eval()
    try:
        with check_precision(model) as precision:
            reference = _run_check(model, padded, with_grad=gradient)
            laid = _run_check(model, row, with_grad=gradient)
            moved = _run_check(model, {**row, "input_ids": other}, with_grad=gradient, watched=watched)
    except Exception as err:  # a model whose forward does something unexpected with position_ids
        return f"the padding-free forward failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    tolerance = get_tolerance(precision.dtype) if tolerance is None else tolerance
    if laid.logits.shape[:2] != owner.shape:
        return f"the padding-free forward returned logits of shape {tuple(laid.logits.shape)}"
    # Each real position of the padded batch and where it lies in the layout (sorted by its index in the padded batch).
    mask, real = padded["attention_mask"].bool(), owner >= 0
    order = torch.argsort(torch.where(real, row["padded_index"], mask.numel()).flatten())[: int(real.sum())]

    def unpadded(values):  # [rows, width, ...] of the layout -> [real positions, ...] in the padded order
        return values.flatten(0, 1)[order]

    # (what, relative difference, bound): what the loss sees and its gradient within the promise; a leak to rounding
    # (bit for bit where nothing regroups the tokens); the filler's gradient and a leak's exactly 0, in any precision.
    checks = [
        ("its logits", _relative(unpadded(laid.logits), reference.logits[mask]), tolerance),
        ("the loss", _relative(unpadded(laid.losses), reference.losses[mask]), tolerance),
        ("its auxiliary (router) loss", _relative(laid.aux, reference.aux), tolerance),
    ]
    if reference.grad is not None and laid.grad is not None:
        expected = reference.grad[mask]  # at the real positions (a zero pad embedding may give NaN at padding)
        if not torch.isfinite(laid.grad).all():
            padded_too = "" if torch.isfinite(expected).all() else " (nor padded: the data itself gives one)"
            return f"its gradient is not finite{padded_too}"
        checks.append(("its gradient", _relative(unpadded(laid.grad), expected), tolerance))
        filler = laid.grad[~real]
        if filler.numel():  # nothing reads the filler: no gradient reaches it unless something counts it
            checks.append(("the gradient that reaches the filler", _share(filler, expected), 0.0))
    leak = _relative(moved.logits[watched], laid.logits[watched])
    checks.append(("a sequence's logits when the one before it in its row changes (a leak)", leak, tolerance / 8))
    if moved.grad is not None and changed.any():
        # Only a path between the sequences of a row carries the later ones' loss back to the first one.
        reached = _share(moved.grad[changed], moved.grad[watched])
        checks.append(
            ("the gradient of a sequence's loss that reaches the one before it in its row (a leak)", reached, 0.0)
        )
    return describe_failed_checks(checks, "not what the padded run computes")


def describe_failed_checks(checks: list[tuple[str, float, float]], verdict: str) -> str | None:
    """``verdict`` and each ``(what, difference, bound)`` of ``checks`` past its bound (0: it must be exactly 0), in
    one line; None when every one holds."""
    wrong = [
        f"{what} by {d:.1e} relative ({f'bound {bound:.0e}' if bound else 'it must be 0'})"
        for what, d, bound in checks
        if not d <= bound
    ]
    return f"{verdict}: " + "; ".join(wrong) if wrong else None


@torch.no_grad()
def check_row_offsets(
    model: nn.Module,
    batch: Mapping[str, Any],
    row_length: int,
    tolerance: float | None = None,
    tiles: int = 4,
) -> tuple[int, str | None]:
    """``(length, why)``: how far into a row a sequence may be laid and still compute as it does padded.

    A model may read the row index where it should read ``position_ids`` (Llama 4's NoPE layers scale attention by
    the row index once it passes ``floor_scale``, 8192; its chunked attention cuts at multiples of 8192 of the row):
    a sequence laid far into a packed row then differs, by nothing at the offsets of a short check. So one row of
    ``row_length`` tokens (the longest row training will lay out) is tiled with ``tiles`` sequences of the batch's
    tokens and run, forward only, against the same sequences padded (each from 0): the final hidden states of each tile
    must match within :func:`get_tolerance` of the check's precision (relative L2; 1e-6 for fp32 weights, autocast off
    under any mixed precision: :func:`hfacc.ops.precision.get_check_precision`). The length verified is where the first
    tile that differs starts (``row_length`` if none does, with ``why`` None); rows of that length are then exact
    (:func:`remove_padding`'s ``max_row_length``). The work is one forward of ``row_length`` tokens and one of the same
    tokens padded, less than a training step's; where the output projection is a plain ``Linear`` its input is taken
    and the logits are never built.
    """
    size = max(row_length // tiles, 2)
    lengths = [size] * (tiles - 1) + [max(row_length - size * (tiles - 1), 2)]
    padded = _check_batch(batch, lengths, left=False)
    row = remove_padding(padded, one_row=True)
    was_training = model.training
    model.eval()
    try:
        with check_precision(model) as precision:
            reference = _final_states(model, padded)[padded["attention_mask"].bool()]
            laid = _final_states(model, row).flatten(0, 1)
    except Exception as err:
        return 0, f"a row of {row_length} tokens failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    tolerance = get_tolerance(precision.dtype) if tolerance is None else tolerance
    if laid.shape != reference.shape:
        return 0, f"a row of {row_length} tokens gave outputs of shape {tuple(laid.shape)}"
    start = 0
    for n, a, b in zip(lengths, reference.split(lengths), laid.split(lengths), strict=True):
        difference = _relative(b, a)
        if not difference <= tolerance:
            return start, (
                f"a sequence laid from row offset {start} on computes differently from the same sequence padded "
                f"({difference:.1e} relative, bound {tolerance:.0e}: the model reads the row index, not only "
                "position_ids)"
            )
        start += n
    return row_length, None


class PaddingFreeChoice(NamedTuple):
    """What :func:`choose_padding_free` decided: padded or not, the layout, and the longest row verified."""

    padding_free: bool
    one_row: bool = True
    max_row_length: int = 0  # the longest row verified (0: no bound)


def choose_padding_free(
    objective: Objective,
    model: nn.Module,
    batch: Mapping[str, Any],
    accelerator,
    max_tokens_per_batch: int = 0,
    longest_sequence: int = 0,
) -> PaddingFreeChoice:
    """Whether micro-batches go padding-free for this model and in which layout, decided once, the same on every
    rank, and said in the log (at WARNING when it falls back).

    The layout the attention prefers (:func:`uses_one_row`) is checked first (:func:`check_padding_free`), then
    the other one: a router loss that counts the filler of packed rows takes one row instead, whose rows have none.
    The one that passes is then run as long as training will lay out its rows (:func:`check_row_offsets`): the
    first micro-batch's longest sequence for packed rows, its padded size (or ``max_tokens_per_batch``) for one
    row, the largest over the ranks, and at least what ``longest_sequence`` (the training data's longest, where it
    is known: :func:`hfacc.data.batching.get_longest_sequence`) lays out. Rows are then bounded to the length that was
    verified (``max_row_length``), shorter where sequences compute differently far into a row: a later micro-batch
    longer than the first is beyond what was checked (Llama 4 reads the row index past ``floor_scale``), so its longer
    sequences get rows of their own (packed rows) or it stays padded (one row). Neither layout exact: padded
    micro-batches, as collated.
    """
    problem = padding_free_problem(model, objective)
    if problem is not None:
        if objective.supports_padding_free:
            logger.warning(
                "hfacc: padded micro-batches, as collated: %s. Set padding_free=False to skip the check.", problem
            )
        else:
            logger.info("hfacc: padded micro-batches: %s.", problem)
        return PaddingFreeChoice(False)
    preferred = uses_one_row(model)
    longest = _row_lengths(batch, accelerator, max_tokens_per_batch, longest_sequence)
    view = objective.layout_view(model)  # what the objective reads at each position (a reward model: its scores)
    # Each layout, in order of preference: exact (checked at training's row length), exact up to a row length, or not.
    exact, bounded, reasons = None, None, {}
    with check_precision(model) as precision:  # what the checks below compute in, said in the log
        for one_row in (preferred, not preferred):
            problem = check_padding_free(view, batch, one_row)
            if problem is None and takes_images(model):
                problem = _image_problem(model, batch, one_row)  # a vision-language model: with real images
            if not all_ranks_agree(problem is None, accelerator):
                reasons[one_row] = problem or "not exact on another rank"
                continue
            target = longest[one_row]
            # The short check's rows hold up to CHECK_TOKENS; longer ones run as long as training will lay them out.
            length, why = check_row_offsets(view, batch, target) if target > CHECK_TOKENS else (target, None)
            length = _min_over_ranks(length, accelerator)
            if length >= target:
                # Verified up to the target, not beyond: a longer row later could read offsets nothing here ran.
                exact = PaddingFreeChoice(True, one_row, target)
                break
            reasons[one_row] = why or "a long row differs on another rank"
            if length >= 2 and bounded is None:
                bounded = PaddingFreeChoice(True, one_row, length)
    choice = exact or bounded or PaddingFreeChoice(False)
    others = "".join(f" Not {_layout_name(r)}: {why}." for r, why in reasons.items() if r != choice.one_row)
    if precision.dtype != torch.float32 or precision.training != torch.float32:  # where it is not plain fp32, said
        checked = f" Checked in {precision.describe()}."
        others += checked
    else:
        checked = ""
    if not choice.padding_free:
        logger.warning(
            "hfacc: padded micro-batches, as collated: %s.%s Set padding_free=False to skip the check.",
            "; ".join(f"{_layout_name(r)}: {why}" for r, why in reasons.items()),
            checked,
        )
    elif choice is not exact:
        logger.warning(
            "hfacc: padding-free micro-batches (%s), at most %d tokens per row: %s; %s.%s Set padding_free=False to "
            "train padded.",
            _layout_name(choice.one_row),
            choice.max_row_length,
            reasons[choice.one_row],
            "a micro-batch with more real tokens stays padded"
            if choice.one_row
            else "longer sequences get a row each",
            others,
        )
    elif reasons:
        logger.warning(
            "hfacc: padding-free micro-batches (%s), checked: the loss, its gradient and rows of %d tokens match the "
            "padded run (no longer row is laid out).%s Set padding_free=False to train padded.",
            _layout_name(choice.one_row),
            longest[choice.one_row],
            others,
        )
    else:
        logger.info(
            "hfacc: padding-free micro-batches (%s): checked, the loss, its gradient and rows of %d tokens match the "
            "padded run (no longer row is laid out), and packed sequences do not leak.%s",
            _layout_name(choice.one_row),
            longest[choice.one_row],
            others,
        )
    return choice


def _layout_name(one_row: bool) -> str:
    return "one row" if one_row else "packed rows as wide as the longest sequence"


def _is_left_padded(batch: Mapping[str, Any]) -> bool:
    mask = batch.get("attention_mask")
    return torch.is_tensor(mask) and mask.dim() == 2 and bool((mask[:, 0] == 0).any() & (mask[:, -1] == 1).all())


def _check_batch(batch: Mapping[str, Any], lengths: list[int], left: bool) -> dict[str, torch.Tensor]:
    """Sequences of ``lengths`` made of ``batch``'s real tokens (repeated as needed), padded with 0 on one side;
    every real token is a target."""
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    tokens = ids[mask.bool()] if torch.is_tensor(mask) and mask.shape == ids.shape else ids.flatten()
    tokens = tokens.repeat(-(-sum(lengths) // max(tokens.numel(), 1)))[: sum(lengths)]
    width = max(lengths)
    padded_ids = torch.zeros(len(lengths), width, dtype=ids.dtype, device=ids.device)
    padded_mask = torch.zeros(len(lengths), width, dtype=torch.long, device=ids.device)
    offset = 0
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        padded_ids[row, cols] = tokens[offset : offset + n]
        padded_mask[row, cols] = 1
        offset += n
    labels = padded_ids.masked_fill(padded_mask == 0, IGNORE_INDEX)
    return {"input_ids": padded_ids, "attention_mask": padded_mask, "labels": labels}


def _vocab_size(model: nn.Module, ids: torch.Tensor) -> int:
    size = getattr(get_input_embeddings(model), "num_embeddings", None)
    size = size or getattr(getattr(get_base_model(model), "config", None), "vocab_size", None)
    return int(size) if size else int(ids.max()) + 2


def _targets(batch: Mapping[str, Any]) -> torch.Tensor:
    return shift_labels(
        batch["labels"], position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask")
    )


class _Run(NamedTuple):
    logits: torch.Tensor  # [rows, width, vocab], fp32
    losses: torch.Tensor  # [rows, width]: the cross-entropy of each position (0 where it predicts nothing)
    aux: torch.Tensor | None  # router_aux_loss_coef * aux_loss
    grad: torch.Tensor | None  # d (mean loss + aux) / d input embeddings, [rows, width, hidden]


def _run_check(
    model: nn.Module, batch: Mapping[str, Any], with_grad: bool, watched: torch.Tensor | None = None
) -> _Run:
    """One forward of the check and, ``with_grad``, the gradient with respect to the input embeddings: of the mean
    loss plus the auxiliary loss, or, with ``watched`` (a ``[rows, width]`` mask), of the summed loss of the watched
    positions alone (the auxiliary loss, a statistic of every token, left out)."""
    embeddings = get_input_embeddings(model)
    leaf = []

    def capture(module, args, output):  # the embeddings as a leaf of their own: the gradient stops here
        leaf.append(output.detach().requires_grad_())
        # The model gets a copy, not the leaf: a model that scales its embeddings in place (CTRL multiplies them
        # by sqrt(d_model)) may do so to a tensor autograd made, never to a leaf that requires grad.
        return leaf[-1].clone()

    handle = embeddings.register_forward_hook(capture) if with_grad and embeddings is not None else None
    try:
        with torch.set_grad_enabled(with_grad):
            # hfacc.data.multimodal: mrope models see the sequences of a row too (unchanged for other models)
            outputs = model(**with_packed_positions(model, model_inputs(batch)), use_cache=False)
            logits = get_logits(outputs).float()
            if logits.dim() == 3 and logits.shape[-1] == 1:
                # A scorer (a reward model, hfacc.ops.scores.PerPositionScores): its value at every real position is
                # what its loss may read (each sequence's last one), so that value is the check's loss.
                real = batch["attention_mask"].bool() if "attention_mask" in batch else batch["sequence_ids"] >= 0
                losses, counted = torch.where(real, logits[..., 0], 0.0), real
            else:
                targets = _targets(batch)
                losses = F.cross_entropy(
                    logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
                ).view(targets.shape)
                counted = targets != IGNORE_INDEX
            aux = get_aux_loss(model, outputs)
            grad = None
            if len(leaf) == 1:
                if watched is None:
                    loss = losses.sum() / counted.sum().clamp(min=1)
                    loss = loss + (aux if aux is not None else 0)
                else:  # a sum, not a mean: no rounding toward 0 of a small leak in half precision
                    loss = losses[watched].sum()
                (grad,) = torch.autograd.grad(loss, leaf[0], allow_unused=True)
    finally:
        if handle is not None:
            handle.remove()
    aux = None if aux is None else aux.detach().float()
    return _Run(logits.detach(), losses.detach(), aux, None if grad is None else grad.float())


def _final_states(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """What the output projection receives at every position, ``[rows, length, hidden]``, where it is a plain
    ``Linear``: its forward is swapped, for one forward, for one that keeps its input and returns a 0-d zero, so the
    logits are never built (as with the fused loss). Else, or where the model cannot take that, the logits."""
    inputs = {**with_packed_positions(model, model_inputs(batch)), "use_cache": False}
    if fused_loss_problem(model) is None:
        found = []

        def keep(hidden):
            found.append(hidden.detach().float())
            return hidden.new_zeros(())

        try:
            with swap_output_head(model, keep):
                model(**inputs)
            if len(found) == 1:
                return found[0]
        except Exception:  # a model that reshapes its logits: the plain forward below
            pass
    return get_logits(model(**inputs)).detach().float()


def _share(part: torch.Tensor, whole: torch.Tensor) -> float:
    """``|part| / |whole|`` (L2, in float64): how much of a gradient reaches where none should (exactly 0 if none)."""
    return (part.double().norm() / whole.double().norm().clamp(min=1e-30)).item()


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """``|a - b| / |b|`` (L2, in float64; 0 when both are empty or None, inf when only one is)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _row_lengths(
    batch: Mapping[str, Any], accelerator, max_tokens_per_batch: int, longest_sequence: int = 0
) -> dict[bool, int]:
    """The longest row each layout lays out, the largest over the ranks: {one_row: length}. From the first
    micro-batch, and from ``longest_sequence`` where the data's longest is known: packed rows are as long as the
    longest sequence; one row holds a micro-batch's tokens (``max_tokens_per_batch``, or as many sequences as the
    first micro-batch holds, each up to the longest)."""
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    longest = int(mask.sum(-1).max()) if torch.is_tensor(mask) and mask.dim() == 2 else ids.shape[-1]
    one_row = max_tokens_per_batch or max(ids.numel(), ids.shape[0] * longest_sequence)
    lengths = torch.tensor([max(longest, longest_sequence), max(ids.numel(), one_row)], device=ids.device)
    if accelerator.num_processes > 1:
        lengths = accelerator.reduce(lengths, reduction="max")
    rows, one_row = lengths.tolist()
    return {False: rows, True: one_row}


def _min_over_ranks(value: int, accelerator) -> int:
    if accelerator.num_processes == 1:
        return value
    return -int(accelerator.reduce(torch.tensor([-value], device=accelerator.device), reduction="max").item())


def _image_problem(model: nn.Module, batch: Mapping[str, Any], one_row: bool) -> str | None:
    """Why a vision-language model's micro-batches with images stay padded (the first one's images run both ways),
    or None. Without images in the first micro-batch there is nothing to check them with: padded."""
    if not get_image_inputs(batch):
        return "the first micro-batch has no images to check the padding-free layout of images with"
    return check_image_layout(model, batch, remove_padding(batch, one_row))


def position_ids_problem(model) -> str | None:
    """Why ``model`` cannot be given packed sequences because of its signature, or None if a run must decide.

    A transformers model whose forward does not name ``position_ids`` (Bloom, ...) never sees them: its
    ``**kwargs`` go to attention kernels and losses, not to the causal mask, so packed sequences would attend to
    each other. A plain module with ``**kwargs`` may pass them on; only a run can tell.
    """
    from transformers import PreTrainedModel

    parameters = inspect.signature(model.forward).parameters
    if "position_ids" in parameters:
        return None
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if takes_kwargs and not isinstance(model, PreTrainedModel):
        return None
    return (
        f"{type(model).__name__}'s forward takes no position_ids, so it cannot tell packed sequences apart: they "
        "would attend to each other"
    )


def check_packing(model, batch, tolerance: float | None = None) -> str | None:
    """Run the first packed row both packed and one sequence at a time; None if every sequence's logits match.

    A model or attention implementation that lets packed sequences attend to each other, or a layer that runs across
    them (LFM2's short convolution, Jamba's Mamba scan), would silently train on the wrong context. A model whose
    forward takes no ``position_ids`` (Bloom) cannot tell them apart at all; it is refused without a run. The
    comparison is each sequence's relative L2 difference, in the check's precision (fp32 for fp32 weights, autocast
    off: :func:`hfacc.ops.precision.get_check_precision`), within :func:`get_tolerance` (1e-6 in fp32: a fresh LFM2
    leaks by ~1e-5, under the 1e-4 this check once allowed). And, in any precision, the gradient of the row's later
    sequences' loss must not reach the first sequence's embeddings at all (exactly 0): half precision's bound is wider
    than such a leak.
    """

    problem = position_ids_problem(get_base_model(model))
    if problem:
        return problem
    if get_image_inputs(
        batch
    ):  # rows with images: all of them, against their sequences padded (hfacc.data.multimodal)
        return check_image_layout(model, unpack_rows(batch), batch, tolerance)
    was_training = model.training
    model.eval()
    try:
        positions = batch["position_ids"][:1]
        ids = batch["input_ids"][:1]
        starts = get_sequence_starts(positions[0]).nonzero().flatten().tolist() + [positions.shape[1]]
        with check_precision(model) as precision:
            with torch.no_grad():
                inputs = with_packed_positions(model, {"input_ids": ids, "position_ids": positions})  # mrope models
                packed = get_logits(model(**inputs, use_cache=False)).double()
                worst = 0.0
                for a, b in zip(starts[:-1], starts[1:], strict=True):
                    alone = get_logits(model(input_ids=ids[:, a:b], use_cache=False)).double()
                    difference = ((packed[:, a:b] - alone).norm() / alone.norm().clamp(min=1e-30)).item()
                    worst = max(worst, difference) if difference == difference else float("nan")
            reached = 0.0
            if len(starts) > 2:  # several sequences: does the later ones' loss reach the first one?
                first = torch.zeros_like(ids, dtype=torch.bool)
                first[:, : starts[1]] = True
                probe = {"input_ids": ids, "position_ids": positions, "labels": ids}
                grad = _run_check(model, probe, with_grad=True, watched=~first).grad
                reached = 0.0 if grad is None else _share(grad[first], grad[~first])
    finally:
        model.train(was_training)
    tolerance = get_tolerance(precision.dtype) if tolerance is None else tolerance
    if not worst <= tolerance:
        return (
            f"packed sequences are not kept apart by this model/attention implementation (logits differ by "
            f"{worst:.1e} relative, over {tolerance:.0e})"
        )
    if not reached == 0:
        return (
            "packed sequences are not kept apart by this model/attention implementation (the gradient of a "
            f"sequence's loss reaches the one before it in its row: {reached:.1e} relative, where it must be 0)"
        )
    return None


def require_packing_support(model, batch) -> None:
    """Raise unless ``model`` keeps the packed sequences of ``batch`` apart (:func:`check_packing`)."""
    problem = check_packing(model, batch)
    if problem:
        raise RuntimeError(
            f"hfacc: {problem}. Turn packing off (recipe: --packing false), or use a model and attention "
            "implementation that keep packed sequences apart (attn_implementation='sdpa' or "
            "'flash_attention_2' on a model whose forward takes position_ids)."
        )
    logger.info("hfacc: packed rows checked: each sequence's logits match its unpacked run.")


def check_image_layout(
    model: nn.Module, padded: Mapping[str, Any], laid: Mapping[str, Any] | None, tolerance: float | None = None
) -> str | None:
    """Run a batch with images padded and laid out (padding-free or packed); None if every real position's logits
    match, else why not.

    ``laid`` holds the same sequences in the same order (its ``sequence_ids``, when set, name each position's
    padded row). This is the check that can see what images add to a layout: features assigned to the wrong image
    tokens, 2-D positions computed across sequences, image tokens attending across sequences (Gemma 3's
    bidirectional image blocks). The logits are compared as relative L2, in the check's precision
    (:func:`hfacc.ops.precision.get_check_precision`), within :func:`get_tolerance` (1e-6 in fp32; the four
    families of tests/vision_families.py differ by 8e-8 and less where the layout is right, by 0.13 and more where
    it is not).
    """
    if laid is None:
        return "the batch with its images cannot be laid out without padding"
    keep, inputs = model_inputs(padded), model_inputs(laid)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), check_precision(model) as precision:
            reference = get_logits(model(**keep, use_cache=False)).float()[keep["attention_mask"].bool()]
            logits = get_logits(model(**with_packed_positions(model, inputs), use_cache=False)).float().flatten(0, 1)
    except Exception as err:  # a model whose forward does something unexpected with packed images
        return f"the padding-free forward with images failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    owner = laid.get("sequence_ids")
    if owner is not None:  # back to the padded order: the real positions of padded row b have sequence_ids == b
        owner = owner.flatten()
        logits = logits[torch.cat([(owner == b).nonzero().flatten() for b in range(int(laid["num_sequences"]))])]
    if logits.shape != reference.shape:
        return f"the forward without padding returned logits of shape {tuple(logits.shape)}"
    tolerance = get_tolerance(precision.dtype) if tolerance is None else tolerance
    worst = _relative(logits, reference)
    if not worst <= tolerance:
        return (
            f"with images, its logits without padding differ from the padded ones by {worst:.1e} relative (image "
            "features or positions do not follow the sequences, or image tokens attend across them)"
        )
    return None


# ---- the shared-prompt layout of preference pairs (hfacc.data.shared_prompts) ----------------------------------
class SharedPromptsChoice(NamedTuple):
    """What :func:`choose_shared_prompts` decided for a model whose pairs share their prompt's forward: how the mask
    is written for its attention, where a sequence is scored, the longest row verified, the rows' cost model and the
    longest sequence its attention takes whole (its sliding window; 0: any)."""

    mask_dtype: torch.dtype | None  # None: boolean (sdpa); else additive (eager)
    pad_token_id: int | None
    max_row_length: int
    attention_width: int
    max_sequence_length: int = 0

    def lay_out(self, batch: Mapping[str, Any], keep=()) -> dict[str, Any] | None:
        """``batch`` in the shared-prompt layout (:func:`hfacc.data.shared_prompts.share_prompts`), or None."""
        return share_prompts(
            batch,
            self.pad_token_id,
            self.mask_dtype,
            self.max_row_length,
            keep,
            self.attention_width,
            self.max_sequence_length,
        )


# The attention implementations that take a 4-D mask as given, and how it is written for each.
MASK_DTYPES = {"sdpa": None, "eager": torch.float32}


def shared_prompts_problem(model: nn.Module, objective: Objective, args=None) -> str | None:
    """Why the pairs of ``objective`` cannot share their prompt's forward on ``model``, judged without running it;
    None if a run must decide (:func:`check_shared_prompts`)."""
    if not objective.supports_shared_prompts:
        return f"the objective {objective.name!r} does not read pairs whose prompt may be shared"
    base = get_base_model(model)
    implementation = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if implementation not in MASK_DTYPES:
        return f"its attention ({implementation!r}) takes no 4-D mask (sdpa and eager do)"
    if getattr(args, "neftune_noise_alpha", None):
        return "NEFTune draws its noise per padded token, so the two copies of a prompt get different noise"
    dropout = get_dropout_settings(base)
    if dropout:
        # Two forwards draw two dropout masks over the prompt; one shared forward draws one for both answers: the
        # chosen-minus-rejected margin then sees correlated noise, another estimate than the separate forwards'.
        return (
            f"it trains with dropout ({', '.join(dropout[:3])}): a shared prompt would get one dropout draw for "
            "both answers where their own forwards draw two (set the model's dropout to 0, as TRL's RewardConfig "
            "does with disable_dropout=True, to share prompts)"
        )
    return position_ids_problem(base)


def _check_pairs(batch: Mapping[str, Any], vocab: int, pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """Three pairs made of ``batch``'s real tokens, right-padded ``[6, T]`` with ``pad_token_id`` (the model's: its
    pooling reads the rightmost token that is not it; 0 without one) (chosen rows first): prompts of 8, 4 and 3
    tokens, answers of 12 / 10, 4 / 4 and 3 / 4 that part at their first token. Laid out, the first pair has a row of
    its own (30 tokens) and the other two share one, before a filler of 8."""
    prompts, chosen, rejected = [8, 4, 3], [12, 4, 3], [10, 4, 4]
    mask, ids = batch.get("attention_mask"), batch["input_ids"]
    tokens = ids[mask.bool()] if torch.is_tensor(mask) and mask.shape == ids.shape else ids.flatten()
    total = sum(prompts) + sum(chosen) + sum(rejected)
    tokens = tokens.repeat(-(-total // max(tokens.numel(), 1)))[:total].tolist()
    sequences, rest = [[], []], iter(tokens)
    for p, c, r in zip(prompts, chosen, rejected, strict=True):
        prompt = [next(rest) for _ in range(p)]
        answer = [next(rest) for _ in range(c)]
        other = [next(rest) for _ in range(r)]
        other[0] = (answer[0] + 1) % vocab  # the two answers part at their first token
        sequences[0].append(prompt + answer)
        sequences[1].append(prompt + other)
    rows = sequences[0] + sequences[1]
    width = max(map(len, rows))
    padded_ids = torch.full((len(rows), width), pad_token_id or 0, dtype=ids.dtype, device=ids.device)
    padded_mask = torch.zeros(len(rows), width, dtype=torch.long, device=ids.device)
    for r, row in enumerate(rows):
        padded_ids[r, : len(row)] = torch.tensor(row, dtype=ids.dtype)
        padded_mask[r, : len(row)] = 1
    return {"input_ids": padded_ids, "attention_mask": padded_mask}


def _run_scores(model: nn.Module, inputs: Mapping[str, Any], weights: torch.Tensor):
    """The per-position outputs ``[rows, T]`` (fp32) of ``model`` (a :class:`hfacc.ops.scores.PerPositionScores`
    view) and the gradient of ``sum(outputs * weights)`` with respect to the input embeddings (None without them)."""
    embeddings = get_input_embeddings(model)
    leaf = []

    def capture(module, args, output):  # the embeddings as a leaf of their own (see _run_check)
        leaf.append(output.detach().requires_grad_())
        return leaf[-1].clone()

    handle = embeddings.register_forward_hook(capture) if embeddings is not None else None
    try:
        with torch.enable_grad():
            scores = get_logits(model(**inputs, use_cache=False))[..., 0].float()
            grad = None
            if len(leaf) == 1:
                (grad,) = torch.autograd.grad((scores * weights).sum(), leaf[0], allow_unused=True)
    finally:
        if handle is not None:
            handle.remove()
    return scores.detach(), None if grad is None else grad.float()


def check_shared_prompts(
    model: nn.Module,
    batch: Mapping[str, Any],
    mask_dtype: torch.dtype | None = None,
    pad_token_id: int | None = None,
    tolerance: float | None = None,
) -> str | None:
    """Run three pairs as separate padded sequences and in the shared-prompt layout, forward and backward; None if
    the layout computes every sequence as its own forward does, else why not.

    ``model`` gives a value at every position (a reward model's :class:`hfacc.ops.scores.PerPositionScores`). In the
    check's precision (:func:`hfacc.ops.precision.get_check_precision`), within :func:`get_tolerance` (1e-6 fp32):

    - every real position's value, and each sequence's score where it is read (``score_index``): a model that ignores
      ``position_ids`` (the answers' positions restart after the prompt) or the 4-D mask misses them;
    - the gradient of the sum of every sequence's values with respect to the input embeddings: at a shared prompt
      token, the sum of what its two copies get padded; at the filler exactly 0;
    - leaks: every chosen answer, and the whole of the first pair of a row with two, are changed and the layout run
      again: the other positions' values must not move beyond rounding (an eighth of the bound), and the gradient of
      their sum must not reach the changed tokens at all (exactly 0): an answer that sees the other answer, or a
      pair that sees the pair before it, does.
    """
    padded = _check_pairs(batch, _vocab_size(model, batch["input_ids"]), pad_token_id)
    laid = share_prompts(padded, pad_token_id, mask_dtype)
    real = padded["attention_mask"].bool()
    where = laid["layout_index"][real]  # the layout position of each padded real position
    rows, width = laid["input_ids"].shape
    counts = torch.zeros(rows * width, device=where.device).index_add_(
        0, where, torch.ones_like(where, dtype=torch.float)
    )
    shared = [set(laid["layout_index"][r][real[r]].tolist()) for r in range(real.shape[0])]
    pairs = real.shape[0] // 2
    changed = set().union(*(shared[i] - shared[pairs + i] for i in range(pairs)))  # the chosen answers
    changed |= shared[1] | shared[pairs + 1]  # the first pair of the second row, all of it
    changed_mask = torch.zeros(rows * width, dtype=torch.bool, device=where.device)
    changed_mask[list(changed)] = True
    watched = (counts > 0) & ~changed_mask
    other = laid["input_ids"].flatten().clone()
    other[changed_mask] = (other[changed_mask] + 1) % _vocab_size(model, other)
    view_inputs = {k: laid[k] for k in ("input_ids", "position_ids", "attention_mask")}
    was_training = model.training
    model.eval()
    try:
        with check_precision(model) as precision:
            reference, reference_grad = _run_scores(model, padded, real.float())
            scores, grad = _run_scores(model, view_inputs, counts.view(rows, width))
            moved, moved_grad = _run_scores(
                model, {**view_inputs, "input_ids": other.view(rows, width)}, watched.float().view(rows, width)
            )
    except Exception as err:  # an attention or model that does not take the 4-D mask
        return f"the shared-prompt forward failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    tolerance = get_tolerance(precision.dtype) if tolerance is None else tolerance
    if scores.shape != (rows, width):
        return f"the shared-prompt forward returned values of shape {tuple(scores.shape)}"
    read = get_last_token_index(padded, padded["input_ids"].shape, pad_token_id)
    checks = [
        ("its values", _relative(scores.flatten()[where], reference[real]), tolerance),
        ("its scores", _relative(scores.flatten()[laid["score_index"]], reference.flatten()[read]), tolerance),
        ("a value when another answer or pair changes (a leak)", _relative(moved.flatten()[watched],
                                                                           scores.flatten()[watched]), tolerance / 8),
    ]  # fmt: skip
    if grad is not None and reference_grad is not None:
        grad, moved_grad = grad.flatten(0, 1), moved_grad.flatten(0, 1)
        expected = torch.zeros_like(grad).index_add_(0, where, reference_grad[real])
        checks.append(("its gradient", _relative(grad, expected), tolerance))
        checks.append(("the gradient that reaches the filler", _share(grad[counts == 0], expected), 0.0))
        reached = _share(moved_grad[changed_mask], moved_grad[watched])
        checks.append(("the gradient of a value that reaches another answer or pair (a leak)", reached, 0.0))
    return describe_failed_checks(checks, "not what each sequence's own forward computes")


def choose_shared_prompts(
    objective: Objective,
    model: nn.Module,
    batch: Mapping[str, Any],
    accelerator,
    args=None,
    longest_sequence: int = 0,
) -> SharedPromptsChoice | None:
    """Whether the pairs of a padding-free run share their prompt's forward (:mod:`hfacc.data.shared_prompts`),
    decided once, the same on every rank, and said at WARNING either way (``shared_prompts=False`` skips it).

    :func:`shared_prompts_problem` first (no run), then :func:`check_shared_prompts` on the objective's view of the
    model, then rows as long as a pair's unit can be (twice the longest sequence, the largest over the ranks) run at
    their offsets (:func:`check_row_offsets`): rows are bounded to the length verified. None: each sequence laid out
    on its own (:func:`hfacc.data.padding_free.remove_padding`), as before.
    """
    problem = shared_prompts_problem(model, objective, args)
    if problem is not None and not objective.supports_shared_prompts:
        return None
    view = objective.layout_view(model)
    base = get_base_model(model)
    mask_dtype = MASK_DTYPES.get(getattr(getattr(base, "config", None), "_attn_implementation", None))
    pad_token_id = get_pad_token_id(model)
    if problem is None:
        problem = check_shared_prompts(view, batch, mask_dtype, pad_token_id)
    length = 0
    if all_ranks_agree(problem is None, accelerator):
        target = 2 * _row_lengths(batch, accelerator, 0, longest_sequence)[False]
        length, why = check_row_offsets(view, batch, target) if target > CHECK_TOKENS else (target, None)
        length = _min_over_ranks(length, accelerator)
        problem = None if length >= 2 else (why or "a long row differs on another rank")
    else:
        problem = problem or "not exact on another rank"
    if problem is not None:
        logger.warning(
            "hfacc: each sequence of a pair laid out on its own (its prompt computed twice): %s. Set "
            "shared_prompts=False to skip the check.",
            problem,
        )
        return None
    config = getattr(base, "config", None)
    window = get_attention_window(config)
    choice = SharedPromptsChoice(mask_dtype, pad_token_id, length, get_attention_width(config), window)
    logger.warning(
        "hfacc: shared-prompt pairs: each pair's prompt computed once, both answers after it under a 4-D mask, rows "
        "of up to %d tokens%s (checked: every sequence's values, scores and gradient match its own forward, and "
        "nothing leaks between answers or pairs). Set shared_prompts=False to lay each sequence out on its own.",
        length,
        f"; a micro-batch with a sequence longer than the model's attention window ({window}) keeps each sequence on "
        "its own (the window is not laid over a 4-D mask)"
        if window
        else "",
    )
    return choice
