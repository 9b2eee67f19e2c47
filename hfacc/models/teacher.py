"""The teacher of distillation: frozen, in eval mode, placed like the student; its next-token distributions, live or
stored once as top-K log-probs.

Two ways to have the teacher's distributions, as the ecosystem offers them:

- a teacher model (an ``nn.Module``, or a hub id / local directory), run on every micro-batch in the student's own
  layout (padded, padding-free, packed). It is placed with the machinery of the DPO reference
  (:func:`hfacc.models.reference.build_reference_model`): on the student's device, and under DeepSpeed ZeRO-3 and FSDP2
  sharded as the student is, so no rank holds a second whole model. Its logits come chunk by chunk from its final
  hidden states (:class:`hfacc.ops.logprobs.HiddenStatesHead`) where the model allows it (checked once), so its
  ``[B, T, V]`` logits never exist;
- stored top-K log-probs (:func:`precompute_teacher_logprobs`): per token, the teacher's K likeliest next tokens and
  their log-probs, as dataset columns in Axolotl's layout (``target_token_ids``, ``target_logprobs``: one ``[K]`` list
  per token, row t the teacher's distribution of token t given the tokens before it, aligned with ``labels``).
  Training from them needs no teacher in memory.

The teacher must share the student's tokenizer (:func:`get_shared_vocabulary`): a teacher whose embedding matrix is
padded beyond the tokenizer is cut to the tokenizer's length; a different vocabulary is a named error before training.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.collator import TEACHER_COLUMNS, DataCollatorForCausalLM
from ..data.formats import DataError
from ..ops.fused_loss import fused_loss_problem, swap_output_head
from ..ops.logprobs import HiddenStatesHead, chunk_logits
from ..ops.loss import IGNORE_INDEX, shift_labels
from ..ops.model_io import get_base_model, get_logits, model_inputs
from ..ops.precision import as_autocast_dtype, autocast_like, get_autocast_dtype
from ..runtime.config import ConfigError
from .reference import build_reference_model, reshard, sharded_engine, unwrap_model

logger = logging.getLogger(__name__)

# Stored log-probs are read with this floor: -inf (a filler row, a probability that underflowed) would make
# p * log p a NaN; exp(-1e4) is exactly 0 in fp32 for any temperature up to 100.
LOGPROB_FLOOR = -1e4


@dataclass
class TeacherRows:
    """The teacher's next-token distributions at a micro-batch's N targets (row-major order of ``targets != -100``),
    in one of three forms:

    - ``hidden`` ``[N, H]`` with the projection ``weight`` ``[V, H]`` and ``bias``: logits computed per chunk;
    - ``logits`` ``[N, V]``: the teacher's full logits at the targets (a teacher whose head cannot be taken apart);
    - ``ids`` / ``logprobs`` ``[N, K]``: stored top-K (token ids and log-probs at temperature 1).
    """

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    autocast: torch.dtype | None = (
        None  # the teacher's forward's autocast: its logits of each chunk are computed in it
    )

    @property
    def is_topk(self) -> bool:
        return self.ids is not None

    def chunk(self, rows: slice) -> dict[str, torch.Tensor]:
        """The teacher of target rows ``rows``: ``{"teacher_logits": [n, V]}``, or ``teacher_ids`` and
        ``teacher_logprobs`` (the keyword arguments of :func:`hfacc.objectives.distillation.distillation_terms`)."""
        if self.ids is not None:
            return {"teacher_ids": self.ids[rows], "teacher_logprobs": self.logprobs[rows]}
        if self.logits is not None:
            return {"teacher_logits": self.logits[rows].float()}
        with autocast_like(self.hidden, self.autocast):
            return {"teacher_logits": chunk_logits(self.hidden[rows], self.weight, self.bias)}

    def full(self) -> dict[str, torch.Tensor]:
        """All N rows at once (the plain path, which holds full logits anyway)."""
        return self.chunk(slice(None))


def read_stored_rows(batch: Mapping[str, Any], mask: torch.Tensor) -> TeacherRows:
    """The stored top-K of a batch at the targets ``mask`` ``[B, T]`` (aligned with the predicting positions, as
    :func:`hfacc.ops.loss.shift_labels` gives them): position t predicts token t + 1, whose stored row is t + 1."""
    ids, logprobs = batch["target_token_ids"], batch["target_logprobs"]
    if ids.shape[:2] != mask.shape or logprobs.shape != ids.shape:
        raise ValueError(
            f"stored teacher columns of shape {tuple(ids.shape)} / {tuple(logprobs.shape)} do not match the labels "
            f"{tuple(mask.shape)}: give every token a [K] list of target_token_ids and of target_logprobs."
        )
    shift = torch.nn.functional.pad  # row t + 1 to position t, inside each packed row too (mask is False at a seam)
    ids = shift(ids[:, 1:], (0, 0, 0, 1))[mask]
    logprobs = shift(logprobs[:, 1:], (0, 0, 0, 1))[mask].float().clamp(min=LOGPROB_FLOOR)
    return TeacherRows(ids=ids.long(), logprobs=logprobs)


class TeacherModel:
    """A frozen teacher's distributions at the targets, without gradient, in eval mode.

    Args:
        module: the teacher network, placed (:func:`build_teacher`).
        vocab_size: the vocabulary shared with the student: the teacher's logits are cut to its first
            ``vocab_size`` tokens.
        fused: take the logits from the final hidden states in chunks; None decides on the first batch.
        autocast: the dtype the student's forwards autocast in (``bf16=True``): the teacher's run under it too
            (:func:`hfacc.ops.precision.autocast_like`), its last projection included; None: as the module computes.
    """

    def __init__(
        self, module: nn.Module, vocab_size: int, *, fused: bool | None = None, autocast: torch.dtype | None = None
    ):
        self.module, self.vocab_size, self.fused, self.autocast = module, vocab_size, fused, autocast
        # Sharded (ZeRO-3, FSDP2): the projection is whole only inside its forward, so the student's loss reads a copy.
        self.sharded = sharded_engine(module)
        self.copy_weight = self.sharded is not None

    @torch.no_grad()
    def rows(self, inputs: Mapping[str, Any], mask: torch.Tensor) -> TeacherRows:
        """:class:`TeacherRows` at the targets ``mask`` of ``inputs`` (the student's layout)."""
        module = self.module
        was_training = module.training
        module.eval()
        try:
            if self.fused is None:
                self.fused = self.check_fused(inputs, mask) is None
            if not self.fused:
                with autocast_like(module, self.autocast):
                    logits = get_logits(module(**inputs))[mask][:, : self.vocab_size]
                return TeacherRows(logits=logits.detach())
            head = HiddenStatesHead(
                get_base_model(module).get_output_embeddings(), mask, self.copy_weight, self.vocab_size
            )
            with swap_output_head(module, head), autocast_like(module, self.autocast):
                module(**inputs)
        finally:
            module.train(was_training)
            if self.sharded == "FSDP2":
                reshard(module)  # its root would stay gathered after the forward: no backward follows
        return TeacherRows(hidden=head.hidden, weight=head.weight, bias=head.bias, autocast=self.autocast)

    @torch.no_grad()
    def check_fused(self, inputs: Mapping[str, Any], mask: torch.Tensor) -> str | None:
        """Why the teacher's logits cannot come from its hidden states in chunks (None: they can): its projection
        must be a plain ``Linear`` (:func:`hfacc.ops.fused_loss.fused_loss_problem`) whose output the model returns
        unchanged, so that the chunked logits are the model's own (no soft-capping or scaling after the head)."""
        problem = fused_loss_problem(self.module)
        if problem is not None:
            return problem
        module = self.module
        was_training = module.training
        module.eval()  # dropout would make the two runs differ for reasons that have nothing to do with the head
        try:
            with autocast_like(module, self.autocast):
                plain = get_logits(module(**inputs))[mask][:, : self.vocab_size].float()
            head = HiddenStatesHead(get_base_model(module).get_output_embeddings(), mask, True, self.vocab_size)
            try:
                with swap_output_head(module, head), autocast_like(module, self.autocast):
                    module(**inputs)
            except Exception as err:  # a model whose forward does something unexpected with the projection's output
                return f"the teacher's forward without its logits failed ({type(err).__name__}: {err})"
        finally:
            module.train(was_training)
            if self.sharded == "FSDP2":
                reshard(module)
        with autocast_like(module, self.autocast):
            chunked = chunk_logits(head.hidden, head.weight, head.bias)
        scale = plain.abs().max().clamp(min=1.0) if plain.numel() else 1.0
        difference = float((chunked - plain).abs().max() / scale) if plain.numel() else 0.0
        tolerance = 1e-5 if head.weight.dtype == torch.float32 and self.autocast is None else 2e-2
        if not difference <= tolerance:
            return f"the teacher post-processes its logits (they differ from its projection's by {difference:.1e})"
        return None

    def __repr__(self) -> str:
        return f"TeacherModel({type(get_base_model(self.module)).__name__}, vocab {self.vocab_size})"


def get_vocab_rows(model: nn.Module) -> int:
    """The rows of a model's vocabulary (its config's ``vocab_size``: the embedding rows, sharded or not)."""
    config = getattr(get_base_model(model), "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "vocab_size", None)
    if size is None:
        head = get_base_model(model).get_output_embeddings()
        size = tuple(getattr(head.weight, "ds_shape", head.weight.shape))[0]
    return int(size)


def get_shared_vocabulary(student_rows: int, teacher_rows: int | None, tokenizer_length: int | None) -> int:
    """The vocabulary student and teacher share: ``tokenizer_length`` where the tokenizer is known (both models'
    logits are cut to it: rows beyond it are padding no token id reaches), else the student's rows, which the
    teacher's must equal. A model with fewer rows than the tokenizer has another vocabulary: a :class:`ConfigError`.

    >>> get_shared_vocabulary(320, 384, 320)   # a teacher padded to a multiple of 128: cut to the tokenizer
    320
    """
    for who, rows in (("student", student_rows), ("teacher", teacher_rows)):
        if rows is not None and tokenizer_length is not None and rows < tokenizer_length:
            raise ConfigError(
                f"the {who}'s vocabulary has {rows} rows, fewer than the tokenizer's {tokenizer_length} tokens: "
                "distillation compares next-token distributions over one vocabulary, so teacher and student must "
                "share the tokenizer (resize the embeddings, or use a teacher of the student's family)."
            )
    if tokenizer_length is not None:
        return tokenizer_length
    if teacher_rows is not None and teacher_rows != student_rows:
        raise ConfigError(
            f"the student's vocabulary has {student_rows} rows and the teacher's {teacher_rows}: distillation needs "
            "one vocabulary. Give the trainer the tokenizer (processing_class) if one of them is only padded "
            "beyond it, or pass vocab_size=<the tokenizer's length>; otherwise use a teacher with the student's "
            "tokenizer."
        )
    return student_rows


def check_teacher_tokenizer(teacher_name: str, tokenizer) -> None:
    """A teacher given by name whose own tokenizer maps tokens to other ids than the student's: a ConfigError."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return
    from .loading import TOKENIZER_FILES, get_tokenizer

    path = Path(teacher_name)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return  # a folder with weights only: nothing to compare
    try:
        theirs = get_tokenizer(teacher_name).get_vocab()
    except Exception:  # noqa: BLE001 - a hub id that cannot be reached here, a folder without a tokenizer
        return
    mine = tokenizer.get_vocab()
    differing = [t for t, i in mine.items() if theirs.get(t) != i]
    if differing or len(theirs) != len(mine):
        example = differing[0] if differing else next(iter(set(theirs) - set(mine)), "?")
        raise ConfigError(
            f"teacher {teacher_name}: its tokenizer has another vocabulary than the student's ({len(theirs)} vs "
            f"{len(mine)} tokens; {example!r} differs): distillation compares next-token distributions token by "
            "token, so both must share one tokenizer."
        )


def build_teacher(
    student: nn.Module,
    teacher: nn.Module | str,
    accelerator=None,
    *,
    tokenizer=None,
    vocab_size: int | None = None,
    dtype: str | torch.dtype = "auto",
) -> TeacherModel:
    """The frozen teacher of ``student``, placed like it (:func:`hfacc.models.reference.build_reference_model`: the
    same device; sharded like the student under ZeRO-3 and FSDP2), its vocabulary checked against the student's
    (:func:`get_shared_vocabulary`). ``teacher``: a model, or a hub id / local directory (loaded with
    :func:`hfacc.load_causal_lm`, safetensors only)."""
    if isinstance(teacher, str):
        from .loading import load_causal_lm

        check_teacher_tokenizer(teacher, tokenizer)
        teacher = load_causal_lm(teacher, dtype=dtype)
    if not isinstance(teacher, nn.Module):
        raise TypeError(f"teacher_model must be a model or a name/path, got {type(teacher).__name__}")
    length = vocab_size if vocab_size is not None else get_tokenizer_length(tokenizer)
    shared = get_shared_vocabulary(get_vocab_rows(student), get_vocab_rows(teacher), length)
    teacher = unwrap_model(teacher)
    if sharded_engine(teacher) is not None:  # set up before, for this run: placed already
        module = teacher
    else:
        module = build_reference_model(student, teacher, accelerator).module
    logger.info("hfacc: teacher %s, frozen, vocabulary of %d tokens.", type(get_base_model(module)).__name__, shared)
    return TeacherModel(module, shared, autocast=get_autocast_dtype(student))  # the student's forwards' precision


def get_tokenizer_length(tokenizer) -> int | None:
    """The tokenizer's number of tokens (a processor's tokenizer's), or None where there is none."""
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    try:
        return len(inner)
    except TypeError:
        return None


# ---- stored top-K log-probs ------------------------------------------------------------------------------------
def check_stored_columns(dataset, vocab_size: int | None = None, name: str = "the training data") -> int:
    """Check a dataset's stored teacher columns row by row; return K. Every row needs one ``[K]`` list of
    ``target_token_ids`` and of ``target_logprobs`` per token (as long as ``input_ids``), the same K everywhere,
    token ids in ``[0, vocab_size)``, and log-probs that are not NaN nor above 0 (up to :data:`LOGPROB_ROUNDING`;
    -inf is a probability of 0); at every target token a distribution: K different ids, not every log-prob -inf, not
    the precompute's filler for a token that is no target. A :class:`hfacc.data.formats.DataError` naming the first
    row that has not."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:] if hasattr(dataset, "with_format") else None
    if table is None:
        return 0
    lengths = pc.list_value_length(table["input_ids"]).to_pylist()
    k = None
    for column in TEACHER_COLUMNS:
        if column not in table.column_names:
            raise DataError(f"{name} has {TEACHER_COLUMNS[0]!r} but no {column!r} column: give both.")
        outer = pc.list_value_length(table[column]).to_pylist()
        for row, (n, m) in enumerate(zip(lengths, outer, strict=True)):
            if n != m:
                raise DataError(
                    f"row {row} of {name}: {m} entries of {column!r} for {n} tokens (input_ids): one [K] list per "
                    "token is needed (recompute them with hfacc.precompute_teacher_logprobs for these rows)."
                )
        inner = pc.list_value_length(pc.list_flatten(table[column])).to_numpy()
        if inner.size:
            ks = set(int(x) for x in set(inner.tolist()))
            if len(ks) > 1 or (k is not None and ks != {k}):
                found = sorted(ks | ({k} if k else set()))
                raise DataError(f"{name}: {column!r} lists have different lengths {found}: one K for every token.")
            k = next(iter(ks))
    if k:
        _check_stored_values(table, vocab_size, name)
        _check_stored_targets(table, k, name)
    return k or 0


# A stored log-prob a little above 0 is rounding (a log-softmax of a peaked row); more than this is no log-prob.
LOGPROB_ROUNDING = 1e-4


def _check_stored_values(table, vocab_size: int | None, name: str) -> None:
    """Token ids in ``[0, vocab_size)`` and log-probs that are log-probs: not NaN, not above
    :data:`LOGPROB_ROUNDING` (probabilities stored instead of their logarithm are all > 0); -inf is a probability of
    0, read with :data:`LOGPROB_FLOOR`. A :class:`DataError` naming the first row and token that is not."""
    import numpy as np

    fix = "recompute the columns with hfacc.precompute_teacher_logprobs for these rows"
    ids = TEACHER_COLUMNS[0]
    found = _first_stored(table, ids, lambda v: v < 0)
    if found is not None:
        row, token, value = found
        raise DataError(
            f"row {row} of {name}: {ids!r} holds {value} at token {token}: a token id is never negative; {fix}."
        )
    if vocab_size is not None:
        found = _first_stored(table, ids, lambda v: v >= vocab_size)
        if found is not None:
            row, token, value = found
            raise DataError(
                f"row {row} of {name}: {ids!r} holds {value} at token {token}, beyond the student's vocabulary of "
                f"{vocab_size} tokens: the log-probs were computed with another tokenizer; {fix} with this one."
            )
    logprobs = TEACHER_COLUMNS[1]
    found = _first_stored(table, logprobs, np.isnan)
    if found is not None:
        row, token, _ = found
        raise DataError(
            f"row {row} of {name}: {logprobs!r} holds NaN at token {token}: every stored log-prob must be a number "
            f"(-inf, a probability of 0, is one); {fix}."
        )
    found = _first_stored(table, logprobs, lambda v: v > LOGPROB_ROUNDING)
    if found is not None:
        row, token, value = found
        raise DataError(
            f"row {row} of {name}: {logprobs!r} holds {value:.4g} at token {token}: log-probs are <= 0 (up to "
            f"{LOGPROB_ROUNDING:g} of rounding). Probabilities stored instead? Store their logarithm, or {fix}."
        )


def _check_stored_targets(table, k: int, name: str) -> None:
    """At every target token (``labels[t] != -100``, t not the first token of its sequence: row t is the
    distribution of token t), a top-K that is a distribution: not the precompute's filler (K zero ids and K zero
    log-probs, what it stores for a token that is no target: the columns were computed for other labels than the
    rows hold), no token id twice, and not every log-prob -inf (read with :data:`LOGPROB_FLOOR`, that row would
    train the student towards a uniform distribution over its K ids). Each is a :class:`DataError` naming the
    first row and token; rows without ``labels`` are not checked here."""
    import numpy as np

    if "labels" not in table.column_names:
        return
    labels = table["labels"].combine_chunks()
    row_starts = labels.offsets.to_numpy() - labels.offsets[0].as_py()
    target = labels.flatten().to_numpy(zero_copy_only=False) != IGNORE_INDEX
    if not target.any():
        return
    first = np.zeros(len(target), dtype=bool)  # the first token of a row, or of a packed sequence, is no target
    first[row_starts[:-1][row_starts[:-1] < len(target)]] = True
    if "position_ids" in table.column_names:
        positions = table["position_ids"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        first[1:] |= positions[1:] != positions[:-1] + 1
    target &= ~first
    ids = table[TEACHER_COLUMNS[0]].combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
    logprobs = table[TEACHER_COLUMNS[1]].combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
    if len(ids) != len(target) * k:  # labels not as long as input_ids: the collator names that
        return
    ids, logprobs = ids.reshape(-1, k), logprobs.reshape(-1, k)

    def where(flags):
        token = int(np.argmax(flags))
        row = int(np.searchsorted(row_starts, token, side="right")) - 1
        return row, token - int(row_starts[row])

    fix = "recompute the columns with hfacc.precompute_teacher_logprobs for the rows as they are now"
    filler = target & (ids == 0).all(-1) & (logprobs == 0).all(-1) if k > 1 else np.zeros_like(target)
    if filler.any():
        row, token = where(filler)
        raise DataError(
            f"row {row} of {name}: token {token} is a target (its label is not -100) but its stored top-K is the "
            f"precompute's filler for a token that is no target ({k} zero ids and log-probs): the columns were "
            f"computed for other labels than the rows hold now; {fix}."
        )
    ordered = np.sort(ids, axis=-1)
    repeated = target & (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    if repeated.any():
        row, token = where(repeated)
        flat = int(row_starts[row]) + token
        twice = int(ordered[flat, 1:][ordered[flat, 1:] == ordered[flat, :-1]][0])
        raise DataError(
            f"row {row} of {name}: {TEACHER_COLUMNS[0]!r} holds token {twice} twice at token {token}: a top-K lists "
            f"K different tokens (its log-probs would count that token's probability twice); {fix}."
        )
    empty = target & np.isneginf(logprobs).all(-1)
    if empty.any():
        row, token = where(empty)
        raise DataError(
            f"row {row} of {name}: {TEACHER_COLUMNS[1]!r} is -inf for all {k} tokens at token {token}, a target: "
            f"that is no distribution (the student would be trained towards a uniform one over these ids); {fix}."
        )


def _first_stored(table, column: str, bad) -> tuple[int, int, Any] | None:
    """``(row, token, value)`` of the first stored value of ``column`` (a ``[K]`` list per token) where ``bad`` of
    the flat values is true, or None."""
    import numpy as np

    rows = table[column].combine_chunks()
    tokens = rows.flatten()
    values = tokens.flatten().to_numpy(zero_copy_only=False)
    flags = bad(values)
    if not flags.any():
        return None
    i = int(np.argmax(flags))
    token_starts = tokens.offsets.to_numpy() - tokens.offsets[0].as_py()
    token = int(np.searchsorted(token_starts, i, side="right")) - 1
    row_starts = rows.offsets.to_numpy() - rows.offsets[0].as_py()
    row = int(np.searchsorted(row_starts, token, side="right")) - 1
    return row, token - int(row_starts[row]), values[i].item()


@torch.no_grad()
def precompute_teacher_logprobs(
    dataset,
    teacher: nn.Module | TeacherModel,
    *,
    top_k: int = 32,
    pad_token_id: int = 0,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
    block_size: int = 512,
    show_progress: bool = True,
    mixed_precision: str | torch.dtype | None = None,
):
    """``dataset`` (SFT rows: ``input_ids``, ``labels``) with the teacher's top-K next-token log-probs as columns
    ``target_token_ids`` and ``target_logprobs``, computed once, with a progress bar.

    Per token t of a row that is a target (``labels[t] != -100`` after the causal shift), the teacher's K likeliest
    tokens at the position that predicts it and their log-probs (log-softmax at temperature 1, over the first
    ``vocab_size`` tokens: the tokenizer's length, default the teacher's rows); other tokens get K zeros. Row t is the
    distribution of token t (Axolotl's layout), so the columns line up with ``input_ids`` and ``labels``. Temperature
    is applied when training (tempering the stored log-probs over the top-K is exact: see
    :func:`hfacc.objectives.distillation.topk_support`). The teacher's logits come from its hidden states in chunks
    where its head allows it.

    ``cache_dir``: resumable. Every ``block_size`` rows are written there as they are done (with a fingerprint of the
    dataset, the teacher and the settings); a run stopped midway computes only the blocks not written yet, and a
    finished one reads them all. Every process computes every row (a sharded teacher's forwards are collectives).

    ``mixed_precision``: the mixed precision training will run in (``"bf16"``, ``"fp16"``, a dtype;
    :func:`hfacc.ops.precision.get_training_autocast` reads it from ``TrainingArguments``): the teacher runs under
    that autocast, as a live teacher beside the student would. None: as ``teacher`` computes now.
    """
    import datasets
    from tqdm.auto import tqdm

    if top_k < 1:
        raise ValueError(f"top_k={top_k}: it must be >= 1.")
    if not isinstance(teacher, TeacherModel):
        module = unwrap_model(teacher)
        teacher = TeacherModel(module, vocab_size or get_vocab_rows(module), autocast=get_autocast_dtype(teacher))
    if mixed_precision is not None:
        teacher = copy.copy(teacher)  # the caller's TeacherModel keeps its own precision
        teacher.autocast = as_autocast_dtype(mixed_precision)
    module = teacher.module
    if top_k > teacher.vocab_size:
        raise ValueError(
            f"top_k={top_k} exceeds the vocabulary ({teacher.vocab_size} tokens): set top_k={teacher.vocab_size} or lower."
        )
    device = torch.device(device) if device is not None else next(module.parameters()).device
    rows = dataset.select_columns([c for c in ("input_ids", "labels", "position_ids") if c in dataset.column_names])
    cache = _BlockCache(cache_dir, rows, teacher, top_k, block_size) if cache_dir else None
    done = cache.done_rows() if cache else 0
    bar = tqdm(total=len(rows), initial=done, desc="Teacher log-probs", unit="row", disable=not show_progress)
    ids_column, logps_column = [], []
    for block_start in range(0, len(rows), block_size if cache else len(rows) or 1):
        block_stop = min(block_start + (block_size if cache else len(rows)), len(rows))
        stored = cache.read(block_start) if cache else None
        if stored is not None:
            ids_column += stored[0]
            logps_column += stored[1]
            continue
        block_ids, block_logps = [], []
        for start in range(block_start, block_stop, batch_size):
            part = [rows[i] for i in range(start, min(start + batch_size, block_stop))]
            ids, logps = _topk_rows(teacher, part, top_k, device, pad_token_id)
            block_ids += ids
            block_logps += logps
            bar.update(len(part))
        if cache:
            cache.write(block_start, block_ids, block_logps)
        ids_column += block_ids
        logps_column += block_logps
    bar.close()
    dataset = dataset.remove_columns([c for c in (*TEACHER_COLUMNS, "target_mask") if c in dataset.column_names])
    features_ids = datasets.List(datasets.List(datasets.Value("int32")))
    features_logps = datasets.List(datasets.List(datasets.Value("float32")))
    dataset = dataset.add_column(TEACHER_COLUMNS[0], ids_column, feature=features_ids)
    return dataset.add_column(TEACHER_COLUMNS[1], logps_column, feature=features_logps)


def _topk_rows(teacher: TeacherModel, part: list[dict], top_k: int, device, pad_token_id: int = 0):
    """Per example of ``part``: ``[T, K]`` ids and log-probs (zeros where a token is no target)."""
    batch = DataCollatorForCausalLM(pad_token_id)(part)
    batch = {k: v.to(device) for k, v in batch.items()}
    positions = batch.get("position_ids")  # packed rows: the shift never crosses a sequence boundary
    targets = shift_labels(batch["labels"], position_ids=positions, attention_mask=batch.get("attention_mask"))
    mask = targets != IGNORE_INDEX
    found = teacher.rows(model_inputs(batch), mask)
    n = int(mask.sum())
    ids = torch.zeros(n, top_k, dtype=torch.long, device=device)
    logps = torch.zeros(n, top_k, dtype=torch.float32, device=device)
    step = max(1, 2**22 // max(teacher.vocab_size, 1))
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        logits = found.chunk(rows)["teacher_logits"].log_softmax(-1)
        logps[rows], ids[rows] = logits.topk(top_k, dim=-1)
    if not bool(torch.isfinite(logps).all()):
        raise ValueError("the teacher gave a non-finite log-prob: check the teacher model and the data.")
    # Position t predicts token t + 1: its top-K is row t + 1 of the example.
    out_ids = torch.zeros(*mask.shape, top_k, dtype=torch.long, device=device)
    out_logps = torch.zeros(*mask.shape, top_k, dtype=torch.float32, device=device)
    shifted = torch.zeros_like(mask)
    shifted[:, 1:] = mask[:, :-1]
    out_ids[shifted], out_logps[shifted] = ids, logps
    lengths = [len(e["input_ids"]) for e in part]  # right padding: row i's tokens are its first lengths[i]
    ids_rows = [out_ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
    logps_rows = [out_logps[i, : lengths[i]].tolist() for i in range(len(lengths))]
    return ids_rows, logps_rows


class _BlockCache:
    """Blocks of precomputed rows on disk, under a fingerprint of what they were computed from."""

    def __init__(self, directory, rows, teacher: TeacherModel, top_k: int, block_size: int):
        self.directory = Path(directory)
        self.block_size, self.num_rows = block_size, len(rows)
        params = get_base_model(teacher.module).parameters()
        first = next(params, None)
        sample = [] if first is None else first.detach().flatten()[:64].float().cpu().tolist()
        key = {
            "data": getattr(rows, "_fingerprint", None) or len(rows),
            "teacher": type(get_base_model(teacher.module)).__name__,
            "teacher_sample": [round(x, 6) for x in sample],
            "top_k": top_k,
            "vocab": teacher.vocab_size,
            "block": block_size,
        }
        if teacher.autocast is not None:  # log-probs computed in another precision are other log-probs
            key["autocast"] = str(teacher.autocast)
        self.fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        marker = self.directory / "fingerprint.txt"
        if marker.is_file() and marker.read_text().strip() != self.fingerprint:
            raise ConfigError(
                f"{self.directory} holds teacher log-probs of other data, another teacher or other settings; give "
                "another cache_dir (or delete it to compute them afresh)."
            )
        marker.write_text(self.fingerprint)

    def _path(self, start: int) -> Path:
        return self.directory / f"rows-{start:09d}.json"

    def done_rows(self) -> int:
        return sum(
            min(self.block_size, self.num_rows - start)
            for start in range(0, self.num_rows, self.block_size)
            if self._path(start).is_file()
        )

    def read(self, start: int):
        path = self._path(start)
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return data["ids"], data["logprobs"]

    def write(self, start: int, ids, logprobs) -> None:
        path = self._path(start)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"ids": ids, "logprobs": logprobs}))
        partial.replace(path)  # a block is there whole or not at all


__all__ = [
    "TeacherModel",
    "TeacherRows",
    "build_teacher",
    "read_stored_rows",
    "get_shared_vocabulary",
    "get_vocab_rows",
    "get_tokenizer_length",
    "check_stored_columns",
    "check_teacher_tokenizer",
    "precompute_teacher_logprobs",
    "LOGPROB_FLOOR",
    "LOGPROB_ROUNDING",
]
