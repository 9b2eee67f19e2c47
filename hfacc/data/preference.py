"""Preference pairs: rows with a prompt, a chosen and a rejected answer, tokenized and masked; their collator; and
reference log-probs computed once before training.

Rows use TRL's columns: ``prompt``, ``chosen``, ``rejected`` (and ``tools``):

- standard: three strings; each answer is tokenized after the prompt, as an SFT prompt/completion row is (the
  prompt gets the tokenizer's special tokens, the answer EOS);
- conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` lists of assistant messages (tool calls
  and reasoning included);
- implicit prompt: no ``prompt``; ``chosen`` and ``rejected`` are whole conversations that share their beginning
  (the shared messages are the prompt).

Each side becomes ``input_ids`` of the whole sequence (prompt included) and ``labels`` that are -100 wherever a
token is not scored, exactly as an SFT row of the same conversation (:func:`hfacc.data.sft.build_sft_dataset`): the
scored tokens are the answer as the chat template renders it, end-of-turn marker included, found by the template
tracing of :mod:`hfacc.data.chat`, never by searching text. Output columns: ``chosen_input_ids``, ``chosen_labels``,
``rejected_input_ids``, ``rejected_labels``, and ``ref_chosen_logps`` / ``ref_rejected_logps`` when the rows have
them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..ops.loss import IGNORE_INDEX, count_example_targets
from .collator import _pad
from .formats import DataError, _is_conversation, _string, encode_row, log_masking, normalize_messages, normalize_tools
from .sources import LOCAL_FORMATS, SOURCE_ROW, _pick_splits, get_local_data_files
from .streaming import SFTStream, _worth_saying

logger = logging.getLogger(__name__)

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
UNPAIRED_COLUMNS = ("prompt", "completion", "label")  # TRL's unpaired (KTO) format
KTO_REFERENCE_COLUMNS = ("ref_logps", "ref_kl_logps")  # precomputed: the completion's and the KL row's
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
MARGIN = "margin"  # a pair's required reward gap (TRL's RewardTrainer column), kept with the pair
REF_LOGPS = "ref_logps"  # the batch key of precomputed reference log-probs, one per row ([2B]: chosen, then rejected)
SIDES = ("chosen", "rejected")
# What to do with a sequence longer than max_length: "right" cuts its end (the answer's end: TRL's keep_start),
# "left" its start (the prompt's start: TRL's keep_end), "drop" drops the pair, "error" stops.
PREFERENCE_TRUNCATIONS = ("right", "left", "drop", "error")
PARALLEL_ROWS = 10_000


def encode_pair(
    tokenizer, row: Mapping[str, Any], index: Any, *, max_length: int | None = 1024, truncation: str = "right"
) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """One preference row as ``(example or None, why it was dropped, notes)``.

    ``notes`` say how the answers were masked (``methods``, ``unclosed`` turns) and what truncation cut
    (``truncated``: sides over ``max_length``). A bad row (a missing or empty field, a malformed conversation, a
    prompt that cannot be told apart) raises :class:`hfacc.data.formats.DataError` naming the row and the field.
    """
    for field in SIDES:
        if row.get(field) is None:
            raise DataError(
                f"row {index}: no field '{field}'. A preference row has 'chosen' and 'rejected' (and a 'prompt', "
                "unless both are whole conversations that share their beginning)."
            )
    tools = normalize_tools(row.get("tools"), index)
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if prompt is None:
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected, index)
    sides = {"chosen": chosen, "rejected": rejected}
    check_answers(prompt, sides, index)
    notes: dict[str, Any] = {"methods": [], "unclosed": 0, "truncated": 0}
    example: dict[str, Any] = {}
    dropped = ""
    for field, value in sides.items():
        ids, labels, why = encode_answer(tokenizer, prompt, value, tools, index, field, max_length, truncation, notes)
        dropped = dropped or why
        example[f"{field}_input_ids"], example[f"{field}_labels"] = ids, labels
    if dropped:
        return None, dropped, notes
    if example["chosen_input_ids"] == example["rejected_input_ids"]:
        return None, "identical", notes
    for column in REFERENCE_COLUMNS:
        if row.get(column) is not None:
            example[column] = float(row[column])
    if row.get(MARGIN) is not None:
        example[MARGIN] = get_margin(row[MARGIN], index)
    return example, "", notes


def check_answers(prompt: Any, answers: Mapping[str, Any], index: Any) -> None:
    """A prompt and its answers are all text or all conversations; an error names the field it is in (``rejected``,
    ``completion``)."""
    if _is_conversation(prompt) or any(_is_conversation(v) for v in answers.values()):
        normalize_messages(prompt, index, "prompt", need_assistant=False)
        for field, value in answers.items():
            normalize_messages(value, index, field, need_assistant=True)
    else:
        _string({"prompt": prompt}, "prompt", index, allow_empty=True)
        for field, value in answers.items():
            _string({field: value}, field, index)


def encode_answer(
    tokenizer, prompt, answer, tools, index, field: str, max_length: int | None, truncation: str, notes: dict
) -> tuple[list[int], list[int], str]:
    """``(input_ids, labels, why it is dropped or "")`` of ``answer`` after ``prompt``, truncated to ``max_length``.

    The same path as an SFT prompt/completion row: the answer's tokens as the full conversation renders them.
    ``notes`` count the masking methods, unclosed turns and truncated sequences.
    """
    ids, labels, method, unclosed = encode_row(
        tokenizer, {"prompt": prompt, "completion": answer, "tools": tools}, index, "prompt_completion"
    )
    notes["methods"].append(method)
    notes["unclosed"] += unclosed
    dropped = ""
    if max_length is not None and len(ids) > max_length:
        notes["truncated"] += 1
        if truncation == "error":
            raise DataError(
                f"row {index}, field '{field}': {len(ids)} tokens exceed max_length={max_length}. Raise "
                "max_length, or set truncation='right' (cut the answer's end), 'left' (cut the prompt's start) "
                "or 'drop'."
            )
        if truncation == "drop":
            dropped = "too long"
        ids, labels = cut_to(ids, labels, max_length, truncation)
    if count_example_targets(labels) == 0:
        dropped = dropped or "no target"
    return list(ids), list(labels), dropped


def cut_to(ids: Sequence[int], labels: Sequence[int], max_length: int, truncation: str):
    """``(ids, labels)`` cut to ``max_length``: the end (``"left"``: the start) goes."""
    cut = slice(None, max_length) if truncation != "left" else slice(len(ids) - max_length, None)
    return ids[cut], labels[cut]


def as_number(value: Any) -> float:
    """``value`` as a float; NaN when it is none (a string, a list, None)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def get_margin(value: Any, index: Any) -> float:
    """A row's ``margin`` (the reward model's required score gap, TRL's column) as a finite float, or a DataError."""
    margin = as_number(value)
    if not math.isfinite(margin):
        raise DataError(f"row {index}, field 'margin': {value!r} is not a finite number.")
    return margin


def split_implicit_prompt(chosen: Any, rejected: Any, index: Any) -> tuple[list, list, list]:
    """``(prompt, chosen, rejected)`` of two whole conversations: the prompt is the messages they share at the
    start (as TRL's ``extract_prompt``), the answers what follows."""
    if not (_is_conversation(chosen) and _is_conversation(rejected)):
        raise DataError(
            f"row {index}: no field 'prompt'. Without one, 'chosen' and 'rejected' must be whole conversations "
            "(lists of messages) that share their beginning; give text rows a 'prompt' column."
        )
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError(
            f"row {index}: 'chosen' and 'rejected' share no message at their start, so there is no prompt to take "
            "from them; give the row a 'prompt' column."
        )
    return list(chosen[:shared]), list(chosen[shared:]), list(rejected[shared:])


def build_preference_dataset(
    dataset,
    tokenizer,
    *,
    max_length: int | None = 1024,
    truncation: str = "right",
    num_proc: int | None = None,
    buffer_size: int = 1000,
    unpaired: bool | None = None,
):
    """Tokenize preference rows (``prompt``, ``chosen``, ``rejected``; see the module doc) for
    :class:`hfacc.DPOObjective` and :class:`hfacc.RewardObjective`, or unpaired rows (``prompt``, ``completion``,
    ``label``) for :class:`hfacc.KTOObjective`.

    Args:
        dataset: a ``datasets.Dataset``, or a ``datasets.IterableDataset`` (streamed: rows are tokenized as training
            reads them, with the same checks; see :class:`PreferenceStream`).
        tokenizer: a fast tokenizer; conversational rows need its chat template.
        max_length: longest sequence (prompt and answer) in tokens; None: no limit.
        truncation: a longer sequence: ``"right"`` cuts the answer's end, ``"left"`` the prompt's start (the answer
            is kept whole), ``"drop"`` drops the pair, ``"error"`` stops. Counted in one warning.
        num_proc: processes for ``datasets.map`` (None: up to 8 from 10,000 rows on).
        buffer_size: streamed datasets: examples read ahead for token-budget micro-batches.
        unpaired: build unpaired examples (KTO): True, also from pairs (each pair becomes a desirable and an
            undesirable row, as TRL's ``unpair_preference_dataset``); None: when the rows are unpaired (a
            ``completion`` and a ``label`` column). See :func:`build_unpaired_dataset`.

    Pairs whose answer was cut away entirely (no scored token left) and pairs whose chosen and rejected sequences are
    the same are dropped, each counted in one warning.

    Returns:
        A ``datasets.Dataset`` with ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
        ``rejected_labels`` (and ``ref_chosen_logps``, ``ref_rejected_logps``, ``margin`` when the rows have them);
        unpaired: :func:`build_unpaired_dataset`'s columns.
    """
    import datasets

    if truncation not in PREFERENCE_TRUNCATIONS:
        raise DataError(f"truncation={truncation!r} is not supported; use one of {list(PREFERENCE_TRUNCATIONS)}.")
    if max_length is not None and max_length < 2:
        raise DataError(f"max_length={max_length}: a sequence needs at least 2 tokens to have a target.")
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no eos_token; set tokenizer.eos_token so answers can end.")
    columns = dataset.column_names or []
    if unpaired or (unpaired is None and is_unpaired(columns)):
        if isinstance(dataset, datasets.IterableDataset):
            raise DataError(
                "Unpaired (KTO) data cannot be streamed: each row's KL term pairs it with another row's completion, "
                "once over the whole dataset. Load it as a datasets.Dataset (streaming off)."
            )
        return build_unpaired_dataset(
            dataset, tokenizer, max_length=max_length, truncation=truncation, num_proc=num_proc
        )
    if isinstance(dataset, datasets.IterableDataset):
        return build_preference_stream(
            dataset, tokenizer, max_length=max_length, truncation=truncation, buffer_size=buffer_size
        )
    check_preference_columns(columns)
    if len(dataset) == 0:
        raise DataError("The dataset is empty.")
    check_chat_template(dataset[0], tokenizer)

    def encode(row: Mapping[str, Any], index: int) -> dict[str, Any]:
        index = row.get(SOURCE_ROW, index)
        example, dropped, notes = encode_pair(tokenizer, row, index, max_length=max_length, truncation=truncation)
        out = example or {f"{side}_{kind}": [] for side in SIDES for kind in ("input_ids", "labels")}
        out.update(_dropped=dropped, _truncated=notes["truncated"], _methods=notes["methods"])
        out["_unclosed"] = notes["unclosed"]
        return out

    if num_proc is None and len(dataset) >= PARALLEL_ROWS:
        num_proc = min(os.cpu_count() or 1, 8)
    num_proc = num_proc if num_proc and num_proc > 1 else None
    started = time.perf_counter()
    carried = [c for c in (*REFERENCE_COLUMNS, MARGIN) if c in columns]
    encoded = dataset.map(
        encode,
        with_indices=True,
        remove_columns=[c for c in columns if c not in carried],
        num_proc=num_proc,
        desc="Tokenizing (preference pairs)",
    )
    logger.info("hfacc: tokenized %d preference rows in %.1f s.", len(dataset), time.perf_counter() - started)
    log_masking([m for methods in encoded["_methods"] for m in methods], encoded["_unclosed"])
    reasons = encoded["_dropped"]
    truncated = sum(encoded["_truncated"])
    kept = encoded.filter(lambda why: not why, input_columns="_dropped", num_proc=num_proc)
    report_drops(len(encoded), truncated, reasons, max_length, truncation)
    if len(kept) == 0:
        raise DataError(
            f"No pair is left after tokenization ({len(encoded)} rows: their answers were cut away, they were too "
            f"long for max_length={max_length}, or chosen equals rejected). Raise max_length or check the rows."
        )
    return kept.remove_columns(["_dropped", "_truncated", "_methods", "_unclosed"])


# ---- unpaired rows (KTO): a completion and whether it is desirable ------------------------------------------------
def is_unpaired(columns: Sequence[str]) -> bool:
    """Whether rows are unpaired preference data (TRL's KTO format: ``prompt``, ``completion``, ``label``)."""
    return "completion" in columns and "label" in columns and not ("chosen" in columns or "rejected" in columns)


def unpair_rows(dataset, num_proc: int | None = None):
    """Pairs as unpaired rows, as TRL's ``unpair_preference_dataset`` makes them: per block of 1,000 pairs, their
    chosen answers (``label`` True), then their rejected ones (False), each with its pair's prompt (an implicit one
    taken from the shared beginning) and its other columns. Precomputed reference log-probs and margins of the pairs
    are dropped: they are not the unpaired rows'."""
    dropped = [c for c in (*SIDES, "prompt", *REFERENCE_COLUMNS, MARGIN) if c in dataset.column_names]

    def unpair(batch: dict[str, list]) -> dict[str, list]:
        n = len(batch["chosen"])
        prompts, chosen, rejected = [], [], []
        for i in range(n):
            prompt, c, r = batch["prompt"][i] if "prompt" in batch else None, batch["chosen"][i], batch["rejected"][i]
            if prompt is None:
                where = batch[SOURCE_ROW][i] if SOURCE_ROW in batch else i
                prompt, c, r = split_implicit_prompt(c, r, where)
            prompts.append(prompt)
            chosen.append(c)
            rejected.append(r)
        out = {"prompt": prompts + prompts, "completion": chosen + rejected, "label": [True] * n + [False] * n}
        for key, values in batch.items():
            if key not in dropped:
                out[key] = values + values
        return out

    return dataset.map(unpair, batched=True, remove_columns=dropped, num_proc=num_proc, desc="Unpairing pairs")


def check_unpaired_columns(columns: Sequence[str]) -> None:
    """The columns unpaired (KTO) data needs, with a fix."""
    missing = [c for c in UNPAIRED_COLUMNS if c not in columns]
    if missing:
        raise DataError(
            f"Unpaired preference data (KTO) needs the columns {list(UNPAIRED_COLUMNS)} (TRL's names; 'label' true "
            f"for a desirable completion, false for an undesirable one), or pairs of 'chosen' and 'rejected'; it has "
            f"{sorted(columns)}, missing {missing}."
        )


def encode_unpaired(
    tokenizer, row: Mapping[str, Any], index: Any, *, max_length: int | None = 1024, truncation: str = "right"
) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """One unpaired row as ``(example or None, why it was dropped, notes)`` (see :func:`encode_pair`): the completion
    after its prompt (``completion_input_ids``, ``completion_labels``), its ``label``, and where its prompt ends.

    A missing prompt or completion, a label that is not a boolean, a malformed conversation: a
    :class:`hfacc.data.formats.DataError` naming the row and the field.
    """
    for field in ("prompt", "completion"):
        if row.get(field) is None:
            raise DataError(
                f"row {index}: no field '{field}'. An unpaired preference row (KTO) has 'prompt', 'completion' and "
                "'label' (true: a desirable completion, false: an undesirable one)."
            )
    label = row.get("label")
    if not isinstance(label, (bool, np.bool_)):
        raise DataError(
            f"row {index}, field 'label': {label!r} ({type(label).__name__}) is not a boolean. KTO's label is true for "
            "a desirable completion and false for an undesirable one."
        )
    tools = normalize_tools(row.get("tools"), index)
    prompt, completion = row["prompt"], row["completion"]
    check_answers(prompt, {"completion": completion}, index)
    notes: dict[str, Any] = {"methods": [], "unclosed": 0, "truncated": 0}
    ids, labels, dropped = encode_answer(
        tokenizer, prompt, completion, tools, index, "completion", max_length, truncation, notes
    )
    if dropped:
        return None, dropped, notes
    start = next(i for i, y in enumerate(labels) if y != IGNORE_INDEX)  # where the prompt ends
    example = {
        "completion_input_ids": ids,
        "completion_labels": labels,
        "label": bool(label),
        "_prompt_length": start,
        "_prompt_key": hash(tuple(ids[:start])),  # ints hash the same in every process
    }
    return example, "", notes


def build_unpaired_dataset(
    dataset, tokenizer, *, max_length: int | None = 1024, truncation: str = "right", num_proc: int | None = None
):
    """Tokenize unpaired preference rows (KTO; pairs are unpaired first, :func:`unpair_rows`) and give each its KL row.

    Each row becomes its completion after its prompt (``completion_input_ids``, ``completion_labels``: -100 on the
    prompt, as an SFT row) and its ``label`` (bool). Its **KL row** (``kl_input_ids``, ``kl_labels``) is the row's own
    prompt followed by the completion of another row: the nearest row before it (cyclically, in the dataset's order)
    whose prompt differs, so that a pair unpaired into neighbouring rows never lends a row its own pair's answer.
    That is TRL's rotation by one (its row i takes row i - 1's completion), done once over the whole dataset instead
    of within each batch of ``per_device_train_batch_size``: a row's KL row is the same whatever the micro-batch
    size, the number of ranks or the shuffling, so the step's KL estimate (:class:`hfacc.KTOObjective`'s reference
    point) depends only on which rows the step holds. KL rows longer than ``max_length`` are cut as ``truncation``
    says (``"left"``: their start; otherwise their end). Rows whose completion was cut away are dropped first.

    Needs at least two rows (a KL row borrows another row's completion).

    Returns:
        A ``datasets.Dataset`` with ``completion_input_ids``, ``completion_labels``, ``label``, ``kl_input_ids``,
        ``kl_labels``.
    """
    columns = dataset.column_names
    if "chosen" in columns or "rejected" in columns:
        check_preference_columns(columns)
        dataset = unpair_rows(dataset, num_proc=num_proc)
        columns = dataset.column_names
    check_unpaired_columns(columns)
    if len(dataset) == 0:
        raise DataError("The dataset is empty.")
    check_chat_template({"prompt": dataset[0]["prompt"], "chosen": dataset[0]["completion"]}, tokenizer)

    def encode(row: Mapping[str, Any], index: int) -> dict[str, Any]:
        index = row.get(SOURCE_ROW, index)
        example, dropped, notes = encode_unpaired(tokenizer, row, index, max_length=max_length, truncation=truncation)
        empty = {"completion_input_ids": [], "completion_labels": [], "label": False}
        out = example or {**empty, "_prompt_length": 0, "_prompt_key": 0}
        out.update(_dropped=dropped, _truncated=notes["truncated"], _methods=notes["methods"])
        out["_unclosed"] = notes["unclosed"]
        return out

    if num_proc is None and len(dataset) >= PARALLEL_ROWS:
        num_proc = min(os.cpu_count() or 1, 8)
    num_proc = num_proc if num_proc and num_proc > 1 else None
    encoded = dataset.map(
        encode, with_indices=True, remove_columns=columns, num_proc=num_proc, desc="Tokenizing (unpaired preference)"
    )
    log_masking([m for methods in encoded["_methods"] for m in methods], encoded["_unclosed"])
    report_drops(len(encoded), sum(encoded["_truncated"]), encoded["_dropped"], max_length, truncation, "rows")
    kept = encoded.filter(lambda why: not why, input_columns="_dropped", num_proc=num_proc)
    if len(kept) < 2:
        raise DataError(
            f"Unpaired preference data (KTO) needs at least 2 rows: each row's KL term takes another row's "
            f"completion; {len(kept)} of {len(encoded)} rows are left after tokenization."
        )
    partners = get_kl_partners(kept["_prompt_key"])
    donors = kept.select_columns(["completion_input_ids", "completion_labels", "_prompt_length"]).select(partners)
    cut = "left" if truncation == "left" else "right"

    def add_kl_rows(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        other = donors[indices]
        kl_ids, kl_labels = [], []
        for ids, start, their_ids, their_labels, their_start in zip(
            batch["completion_input_ids"], batch["_prompt_length"], other["completion_input_ids"],
            other["completion_labels"], other["_prompt_length"], strict=True,
        ):  # fmt: skip
            x, y = ids[:start] + their_ids[their_start:], [IGNORE_INDEX] * start + their_labels[their_start:]
            if max_length is not None and len(x) > max_length:
                x, y = cut_to(x, y, max_length, cut)
            kl_ids.append(x)
            kl_labels.append(y)
        return {"kl_input_ids": kl_ids, "kl_labels": kl_labels}

    kept = kept.map(add_kl_rows, with_indices=True, batched=True, desc="KL rows (another row's completion)")
    return kept.remove_columns(["_dropped", "_truncated", "_methods", "_unclosed", "_prompt_length", "_prompt_key"])


def get_kl_partners(prompt_keys: Sequence[int]) -> list[int]:
    """For each row, the row whose completion its KL row takes: the nearest one before it, cyclically, whose prompt
    (``prompt_keys``: a hash of its tokens) differs; the one just before it when every row has the same prompt.

    >>> get_kl_partners([7, 7, 8, 9])  # rows 0 and 1 share a prompt: row 1 skips row 0, row 0 wraps to row 3
    [3, 3, 1, 2]
    """
    n = len(prompt_keys)
    if len(set(prompt_keys)) == 1:
        logger.warning(
            "hfacc: every unpaired row has the same prompt, so each KL row is the prompt with another row's "
            "completion to that very prompt (a matched pair, not the mismatched one KTO's reference point estimates)."
        )
        return [(i - 1) % n for i in range(n)]
    run_start = list(range(n))  # where the run of equal prompts a row belongs to begins (going backwards)
    for i in range(1, n):
        if prompt_keys[i] == prompt_keys[i - 1]:
            run_start[i] = run_start[i - 1]
    partners = []
    for i in range(n):
        j = (run_start[i] - 1) % n
        while prompt_keys[j] == prompt_keys[i]:  # only past the wrap-around: the first rows continue the last run
            j = (j - 1) % n
        partners.append(j)
    return partners


def check_preference_columns(columns: Sequence[str]) -> None:
    """The columns a preference dataset needs (``chosen``, ``rejected``; ``prompt`` optional), with a fix."""
    missing = [c for c in SIDES if c not in columns]
    if "completion" in columns and "label" not in columns and len(missing) == len(SIDES):
        raise DataError(  # a completion without a label: unpaired (KTO) rows that lost their label, or SFT rows
            f"These rows have {sorted(columns)} and no 'label': unpaired preference rows (KTO) need a boolean 'label' "
            "column (true: a desirable completion, false: an undesirable one); add it. Without one, this looks like SFT data: "
            "train on it with `hfacc sft` (in Python: hfacc.build_sft_dataset)."
        )
    if missing:
        hint = ""
        if is_unpaired(columns):
            hint = (
                " These are unpaired rows (KTO's format): train them with KTO (hfacc kto, hfacc.KTOObjective with "
                "hfacc.DataCollatorForUnpairedPreference), or give pairs of 'chosen' and 'rejected'."
            )
        elif "messages" in columns or "completion" in columns:
            hint = " That looks like SFT data: train on it with `hfacc sft` (in Python: hfacc.build_sft_dataset)."
        raise DataError(
            f"A preference dataset needs the columns 'chosen' and 'rejected' (and 'prompt', TRL's names); it has "
            f"{sorted(columns)}, missing {missing}.{hint}"
        )


def check_chat_template(first_row: Mapping[str, Any], tokenizer) -> None:
    chat = any(_is_conversation(first_row.get(c)) for c in PREFERENCE_COLUMNS)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "Conversational preference rows need a tokenizer with a chat template, and this one has none. Use the "
            "tokenizer of an instruct/chat model, or set one: tokenizer.chat_template = '<jinja template>'."
        )


def report_drops(
    total: int, truncated: int, reasons: Sequence[str], max_length, truncation: str, unit: str = "pairs"
) -> None:
    """The build summary: sequences truncated, pairs (or unpaired ``rows``) dropped and why, each in one warning."""
    if truncated:
        action = {
            "right": "truncated (the answer's end is cut)",
            "left": "truncated (the prompt's start is cut)",
            "drop": "dropped with their pair" if unit == "pairs" else "dropped",
        }[truncation]
        logger.warning(
            "hfacc: %d sequences of %d %s exceed max_length=%s and were %s.",
            truncated,
            total,
            unit,
            max_length,
            action,
        )
    why = {
        "no target": "have an answer with no scored token left after truncation",
        "identical": "have the same chosen and rejected sequence (they carry no preference)",
    }
    for reason, text in why.items():
        n = sum(r == reason for r in reasons)
        if n:
            logger.warning("hfacc: %d of %d %s %s and were dropped.", n, total, unit, text)


def load_preference_source(
    name_or_path: str,
    *,
    config: str | None = None,
    split: str = "train",
    eval_split: str | None = None,
    eval_fraction: float = 0.05,
    max_examples: int | None = None,
    seed: int = 0,
):
    """Raw preference rows as ``(train, eval)`` ``datasets.Dataset`` s: a local ``.json``/``.jsonl``/``.csv``/
    ``.parquet`` file, a ``save_to_disk`` directory or a hub dataset, as :func:`hfacc.data.sources.load_sft_source`
    reads them; without an ``eval_split``, a seeded ``eval_fraction`` is held out. A ``.jsonl`` row without ``chosen``
    or ``rejected`` is named by its line."""
    import datasets

    path = Path(name_or_path)
    get_local_data_files(name_or_path)  # a missing or mistyped file is said here, not looked up on the Hub
    if path.suffix in LOCAL_FORMATS:
        if path.suffix == ".jsonl":
            check_jsonl_pairs(path)
        try:
            data = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        except Exception as err:  # pyarrow errors name neither the row nor the fix
            raise DataError(f"{path} cannot be read as {LOCAL_FORMATS[path.suffix]}: {err}.") from err
        held_out = None
    elif path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        data, held_out = _pick_splits(datasets.load_from_disk(str(path)), split, eval_split, name_or_path)
    else:
        data, held_out = _pick_splits(datasets.load_dataset(name_or_path, config), split, eval_split, name_or_path)
    if not is_unpaired(data.column_names):  # pairs; unpaired rows (KTO) are checked when they are built
        check_preference_columns(data.column_names)
    if max_examples is not None:
        data = data.select(range(min(max_examples, len(data))))
    data = data.add_column(SOURCE_ROW, list(range(len(data))))  # errors name the row of the source
    if held_out is not None:
        return data, held_out.add_column(SOURCE_ROW, list(range(len(held_out))))
    if not 0 < eval_fraction < 1:
        raise DataError(f"eval_fraction={eval_fraction}: it must be between 0 and 1 (exclusive) without eval_split.")
    parts = data.train_test_split(test_size=eval_fraction, seed=seed)
    return parts["train"], parts["test"]


def check_jsonl_pairs(path: Path) -> None:
    """Every line of a ``.jsonl`` file is a JSON object with ``chosen`` and ``rejected`` (or, unpaired as its first
    line is, ``prompt``, ``completion`` and ``label``); else a DataError naming it."""
    required = SIDES
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise DataError(f"{path}: line {number} is not valid JSON ({err}).") from err
            if number == 1 and isinstance(row, Mapping):  # the columns first: another method's data is said so
                if is_unpaired(list(row)):
                    required = UNPAIRED_COLUMNS
                else:
                    check_preference_columns(list(row))
            missing = [c for c in required if not isinstance(row, Mapping) or c not in row]
            if missing:
                raise DataError(f"row {number - 1} (line {number} of {path.name}): no field {missing[0]!r}.")


# ---- streamed pairs ----------------------------------------------------------------------------------------------
def build_preference_stream(source, tokenizer, *, max_length=1024, truncation="right", buffer_size=1000):
    """``source`` (a ``datasets.IterableDataset`` of preference rows), tokenized lazily as training reads it."""
    if buffer_size < 1:
        raise DataError(f"stream_buffer_size={buffer_size}: it must be >= 1.")
    first = next(iter(source.take(1)), None)
    if first is None:
        raise DataError("The streamed dataset is empty.")
    check_preference_columns(source.column_names or list(first))
    check_chat_template(first, tokenizer)
    return PreferenceStream(source, tokenizer, max_length, truncation, buffer_size)


class PreferenceStream(SFTStream):
    """Preference pairs of a streamed source, encoded as they are read: the same checks and counts as
    :func:`build_preference_dataset`, and the same sharding, buffering and exact resume as an SFT stream
    (:class:`hfacc.data.streaming.StreamBatches`)."""

    def __init__(self, source, tokenizer, max_length, truncation, buffer_size=1000):
        super().__init__(source, tokenizer, "preference", max_length, False, truncation, buffer_size)

    def encode(self, row: Mapping[str, Any], where: str) -> dict[str, Any] | None:
        example, dropped, notes = encode_pair(
            self.tokenizer, row, where, max_length=self.max_length, truncation=self.truncation
        )
        if notes["truncated"]:
            self.truncated += 1
            if _worth_saying(self.truncated) and self.truncation != "drop":
                logger.warning(
                    "hfacc: row %s exceeds max_length=%d: truncated (%s; %d rows so far).",
                    where,
                    self.max_length,
                    "the answer's end is cut" if self.truncation == "right" else "the prompt's start is cut",
                    self.truncated,
                )
        if example is None:
            reason = {"too long": f"longer than max_length={self.max_length}", "identical": "chosen equals rejected"}
            return self._drop(where, reason.get(dropped, "an answer has no scored token left after truncation"))
        return example


# ---- batches --------------------------------------------------------------------------------------------------
@dataclass
class DataCollatorForPreference:
    """Collate preference pairs into one ``[2B, T]`` batch: rows ``0..B-1`` the chosen sequences, ``B..2B-1`` the
    rejected ones, right-padded to the longest of all, labels -100 on padding.

    Chosen and rejected of every pair thus go through the model in one forward, and the batch has the layout of an
    SFT batch (``input_ids``, ``attention_mask``, ``labels``): the padding-free layout and the one definition of a
    target (:func:`hfacc.ops.loss.shift_labels`) apply unchanged. Precomputed reference log-probs ride along as
    ``ref_logps`` ``[2B]`` (chosen, then rejected).

    Args:
        pad_token_id: id written into ``input_ids`` at padding (never a target: its labels are -100).
        pad_to_multiple_of: round the padded length up to a multiple of this.

    >>> collate = DataCollatorForPreference(pad_token_id=0)
    >>> batch = collate([{"chosen_input_ids": [5, 6, 7], "chosen_labels": [-100, 6, 7],
    ...                   "rejected_input_ids": [5, 8], "rejected_labels": [-100, 8]}])
    >>> batch["input_ids"]
    tensor([[5, 6, 7],
            [5, 8, 0]])
    >>> batch["labels"]
    tensor([[-100,    6,    7],
            [-100,    8, -100]])
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token (hfacc.get_tokenizer does it for you).")

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty list of preference pairs.")
        missing = [f"{side}_input_ids" for side in SIDES if f"{side}_input_ids" not in examples[0]]
        if missing:  # without this, a KeyError: unpaired rows (KTO) reach the pairs' collator by mistake
            unpaired = "completion_input_ids" in examples[0]
            raise DataError(
                f"DataCollatorForPreference collates pairs; this row has no {missing}"
                + (
                    ": it is an unpaired (KTO) row. Use hfacc.DataCollatorForUnpairedPreference with "
                    "hfacc.KTOObjective for unpaired rows."
                    if unpaired
                    else f" (it has {sorted(examples[0])}). Build the rows with hfacc.build_preference_dataset."
                )
            )
        batch = pad_sequences(
            [e[f"{side}_input_ids"] for side in SIDES for e in examples],
            [e[f"{side}_labels"] for side in SIDES for e in examples],
            self.pad_token_id,
            self.pad_to_multiple_of,
            names=[f"pair {i} of the micro-batch, {side}" for side in SIDES for i in range(len(examples))],
        )
        if all_or_none(examples, REFERENCE_COLUMNS, "pairs", "reference log-probs"):
            values = [e["ref_chosen_logps"] for e in examples] + [e["ref_rejected_logps"] for e in examples]
            batch[REF_LOGPS] = torch.tensor(values, dtype=torch.float32)
        if all_or_none(
            examples, (MARGIN,), "pairs", "a margin"
        ):  # the reward model's required score gap, one per pair
            batch[MARGIN] = torch.tensor([e[MARGIN] for e in examples], dtype=torch.float32)
        return batch

    @staticmethod
    def example_length(example: Mapping[str, Any]) -> int:
        """Tokens a pair takes in a padded micro-batch: two rows as long as its longer side (token budgets).

        >>> DataCollatorForPreference.example_length({"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1]})
        6
        """
        return 2 * max(len(example["chosen_input_ids"]), len(example["rejected_input_ids"]))


def pad_sequences(
    ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
    names: Sequence[str] | None = None,
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` of sequences right-padded to the longest (rounded up to a
    multiple of ``pad_to_multiple_of``), labels -100 on padding; ``names`` say which sequence is which in errors."""
    for i, (x, y) in enumerate(zip(ids, labels, strict=True)):
        if len(x) != len(y):
            raise ValueError(f"{names[i] if names else f'sequence {i}'}: {len(x)} input_ids but {len(y)} labels")
    length = max(len(x) for x in ids)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    return {
        "input_ids": _pad([list(x) for x in ids], length, pad_token_id),
        "attention_mask": _pad([[1] * len(x) for x in ids], length, 0),
        "labels": _pad([list(y) for y in labels], length, IGNORE_INDEX),
    }


def all_or_none(examples: Sequence[Mapping[str, Any]], columns: Sequence[str], unit: str, what: str) -> bool:
    """Whether every example has ``columns``; a ValueError when only some have them (never a silent mix)."""
    given = [all(e.get(c) is not None for c in columns) for e in examples]
    if any(given) and not all(given):
        raise ValueError(f"some {unit} of the micro-batch have {what} and others do not; give all or none.")
    return bool(given) and all(given)


REFERENCE_FIX = (
    "recompute them with hfacc.precompute_reference_logps, or drop the columns (the reference model then computes "
    "them)"
)
MARGIN_FIX = "give every pair a finite margin (0: no required gap), or drop the column"


def check_row_values(dataset: Any, columns: Sequence[str], name: str, fix: str) -> None:
    """Per-row numbers an objective reads (a ``margin``, precomputed reference log-probs), checked in every row of
    ``dataset`` before any is collated: each of ``columns`` it has is a finite number in every row, or None in every
    row (no column); ``columns`` are given together or not at all. Else a :class:`hfacc.data.formats.DataError`
    naming ``name`` (which data), the column, the first bad row and ``fix``. A dataset without column names (a
    stream, a list) is not read here.

    >>> from datasets import Dataset
    >>> check_row_values(Dataset.from_list([{"margin": 1.0}, {"margin": None}]), ["margin"], "the data", "fix it")
    Traceback (most recent call last):
    ...
    hfacc.data.formats.DataError: the data, row 1, column 'margin': None, but row 0 has a value: fix it.
    """
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, (list, tuple)) or not hasattr(dataset, "__len__"):
        return
    given = []
    for column in (c for c in columns if c in names):
        first_value, first_none = None, None
        for i, value in enumerate(dataset[column]):
            if value is None:
                first_none = i if first_none is None else first_none
            else:
                if not math.isfinite(as_number(value)):
                    raise DataError(f"{name}, row {i}, column {column!r}: {value!r} is not a finite number: {fix}.")
                first_value = i if first_value is None else first_value
            if first_value is not None and first_none is not None:
                raise DataError(
                    f"{name}, row {first_none}, column {column!r}: None, but row {first_value} has a value: {fix}."
                )
        if first_value is not None:
            given.append(column)
    if given and len(given) < len(columns):
        missing = [c for c in columns if c not in given]
        raise DataError(f"{name} has {given} but not {missing}, which go together: {fix}.")


@dataclass
class DataCollatorForUnpairedPreference:
    """Collate unpaired preference rows (KTO, :func:`build_unpaired_dataset`) into one ``[B, T]`` batch of
    completions after their prompts and one ``[B, T']`` batch of their KL rows, right-padded, labels -100 on padding.

    Keys: ``input_ids``, ``attention_mask``, ``labels`` (the completions, as an SFT batch: the padding-free layout and
    the one definition of a target apply unchanged); ``label`` ``[B]`` (bool: desirable); ``kl_input_ids``,
    ``kl_attention_mask``, ``kl_labels`` (each row's prompt with another row's completion); and precomputed
    ``ref_logps`` / ``ref_kl_logps`` ``[B]`` when the rows have them (:func:`hfacc.precompute_reference_logps`).

    Args:
        pad_token_id: id written into ``input_ids`` at padding (never a target: its labels are -100).
        pad_to_multiple_of: round each padded length up to a multiple of this.

    >>> collate = DataCollatorForUnpairedPreference(pad_token_id=0)
    >>> batch = collate([{"completion_input_ids": [5, 6, 7], "completion_labels": [-100, 6, 7], "label": True,
    ...                   "kl_input_ids": [5, 9], "kl_labels": [-100, 9]}])
    >>> batch["input_ids"], batch["kl_input_ids"], batch["label"]
    (tensor([[5, 6, 7]]), tensor([[5, 9]]), tensor([True]))
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.pad_token_id is None:
            raise ValueError("pad_token_id is None: set tokenizer.pad_token (hfacc.get_tokenizer does it for you).")

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty list of unpaired preference rows.")
        names = [f"row {i} of the micro-batch" for i in range(len(examples))]
        batch = pad_sequences(
            [e["completion_input_ids"] for e in examples],
            [e["completion_labels"] for e in examples],
            self.pad_token_id,
            self.pad_to_multiple_of,
            names,
        )
        labels = [e["label"] for e in examples]
        if not all(isinstance(y, (bool, np.bool_)) for y in labels):
            raise ValueError(f"'label' must be a boolean (true: desirable) in every row; got {labels}.")
        batch["label"] = torch.tensor(labels, dtype=torch.bool)
        if all_or_none(examples, ("kl_input_ids", "kl_labels"), "rows", "KL rows"):
            kl = pad_sequences(
                [e["kl_input_ids"] for e in examples],
                [e["kl_labels"] for e in examples],
                self.pad_token_id,
                self.pad_to_multiple_of,
                [f"{name}, KL row" for name in names],
            )
            batch.update({f"kl_{key}": value for key, value in kl.items()})
        if all_or_none(examples, KTO_REFERENCE_COLUMNS, "rows", "reference log-probs"):
            for column in KTO_REFERENCE_COLUMNS:
                batch[column] = torch.tensor([e[column] for e in examples], dtype=torch.float32)
        return batch

    @staticmethod
    def example_length(example: Mapping[str, Any]) -> int:
        """Tokens a row takes in a padded micro-batch, its KL row's included (token budgets).

        >>> DataCollatorForUnpairedPreference.example_length({"completion_input_ids": [1, 2, 3], "kl_input_ids": [1]})
        4
        """
        return len(example["completion_input_ids"]) + len(example.get("kl_input_ids") or ())


__all__ = [
    "build_preference_dataset",
    "build_unpaired_dataset",
    "get_kl_partners",
    "DataCollatorForUnpairedPreference",
    "encode_pair",
    "split_implicit_prompt",
    "DataCollatorForPreference",
    "PreferenceStream",
    "load_preference_source",
    "PREFERENCE_TRUNCATIONS",
]
