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
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..ops.loss import IGNORE_INDEX, count_example_targets
from .collator import _pad
from .formats import DataError, _is_conversation, _string, encode_row, log_masking, normalize_messages, normalize_tools
from .sources import LOCAL_FORMATS, SOURCE_ROW, _pick_splits
from .streaming import SFTStream, _worth_saying

logger = logging.getLogger(__name__)

PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
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
    conversational = _is_conversation(prompt) or _is_conversation(chosen) or _is_conversation(rejected)
    sides = {"chosen": chosen, "rejected": rejected}
    if conversational:
        # Checked here so that an error names the field it is in ('rejected', not the SFT path's 'completion').
        normalize_messages(prompt, index, "prompt", need_assistant=False)
        for field, value in sides.items():
            normalize_messages(value, index, field, need_assistant=True)
    else:
        _string({"prompt": prompt}, "prompt", index, allow_empty=True)
        for field, value in sides.items():
            _string({field: value}, field, index)
    notes: dict[str, Any] = {"methods": [], "unclosed": 0, "truncated": 0}
    example: dict[str, Any] = {}
    dropped = ""
    for field, value in sides.items():
        # The same path as an SFT prompt/completion row: the answer's tokens as the full conversation renders them.
        ids, labels, method, unclosed = encode_row(
            tokenizer, {"prompt": prompt, "completion": value, "tools": tools}, index, "prompt_completion"
        )
        notes["methods"].append(method)
        notes["unclosed"] += unclosed
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
            cut = slice(None, max_length) if truncation == "right" else slice(len(ids) - max_length, None)
            ids, labels = ids[cut], labels[cut]
        if count_example_targets(labels) == 0:
            dropped = dropped or "no target"
        example[f"{field}_input_ids"], example[f"{field}_labels"] = list(ids), labels
    if dropped:
        return None, dropped, notes
    if example["chosen_input_ids"] == example["rejected_input_ids"]:
        return None, "identical", notes
    for column in REFERENCE_COLUMNS:
        if row.get(column) is not None:
            example[column] = float(row[column])
    return example, "", notes


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
):
    """Tokenize preference rows (``prompt``, ``chosen``, ``rejected``; see the module doc) for
    :class:`hfacc.DPOObjective`.

    Args:
        dataset: a ``datasets.Dataset``, or a ``datasets.IterableDataset`` (streamed: rows are tokenized as training
            reads them, with the same checks; see :class:`PreferenceStream`).
        tokenizer: a fast tokenizer; conversational rows need its chat template.
        max_length: longest sequence (prompt and answer) in tokens; None: no limit.
        truncation: a longer sequence: ``"right"`` cuts the answer's end, ``"left"`` the prompt's start (the answer
            is kept whole), ``"drop"`` drops the pair, ``"error"`` stops. Counted in one warning.
        num_proc: processes for ``datasets.map`` (None: up to 8 from 10,000 rows on).
        buffer_size: streamed datasets: examples read ahead for token-budget micro-batches.

    Pairs whose answer was cut away entirely (no scored token left) and pairs whose chosen and rejected sequences are
    the same are dropped, each counted in one warning.

    Returns:
        A ``datasets.Dataset`` with ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
        ``rejected_labels`` (and ``ref_chosen_logps``, ``ref_rejected_logps`` when the rows have them).
    """
    import datasets

    if truncation not in PREFERENCE_TRUNCATIONS:
        raise DataError(f"truncation={truncation!r} is not supported; use one of {list(PREFERENCE_TRUNCATIONS)}.")
    if max_length is not None and max_length < 2:
        raise DataError(f"max_length={max_length}: a sequence needs at least 2 tokens to have a target.")
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no eos_token; set tokenizer.eos_token so answers can end.")
    if isinstance(dataset, datasets.IterableDataset):
        return build_preference_stream(
            dataset, tokenizer, max_length=max_length, truncation=truncation, buffer_size=buffer_size
        )
    columns = dataset.column_names
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
    carried = [c for c in REFERENCE_COLUMNS if c in columns]
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


def check_preference_columns(columns: Sequence[str]) -> None:
    """The columns a preference dataset needs (``chosen``, ``rejected``; ``prompt`` optional), with a fix."""
    missing = [c for c in SIDES if c not in columns]
    if missing:
        hint = ""
        if "messages" in columns or "completion" in columns:
            hint = " That looks like SFT data: build it with hfacc.build_sft_dataset instead."
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


def report_drops(total: int, truncated: int, reasons: Sequence[str], max_length, truncation: str) -> None:
    """The build summary: sequences truncated, pairs dropped and why, each in one warning."""
    if truncated:
        action = {
            "right": "truncated (the answer's end is cut)",
            "left": "truncated (the prompt's start is cut)",
            "drop": "dropped with their pair",
        }[truncation]
        logger.warning(
            "hfacc: %d sequences of %d pairs exceed max_length=%s and were %s.", truncated, total, max_length, action
        )
    why = {
        "no target": "have an answer with no scored token left after truncation",
        "identical": "have the same chosen and rejected sequence (they carry no preference)",
    }
    for reason, text in why.items():
        n = sum(r == reason for r in reasons)
        if n:
            logger.warning("hfacc: %d of %d pairs %s and were dropped.", n, total, text)


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
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"dataset {name_or_path}: no such file.")
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
    """Every line of a ``.jsonl`` file is a JSON object with ``chosen`` and ``rejected``; else a DataError naming it."""
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise DataError(f"{path}: line {number} is not valid JSON ({err}).") from err
            missing = [c for c in SIDES if not isinstance(row, Mapping) or c not in row]
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
        ids = [list(e[f"{side}_input_ids"]) for side in SIDES for e in examples]
        labels = [list(e[f"{side}_labels"]) for side in SIDES for e in examples]
        for i, (x, y) in enumerate(zip(ids, labels, strict=True)):
            if len(x) != len(y):
                side, pair = SIDES[i // len(examples)], i % len(examples)
                raise ValueError(
                    f"pair {pair} of the micro-batch: {len(x)} {side}_input_ids but {len(y)} {side}_labels"
                )
        length = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": _pad(ids, length, self.pad_token_id),
            "attention_mask": _pad([[1] * len(x) for x in ids], length, 0),
            "labels": _pad(labels, length, IGNORE_INDEX),
        }
        given = [all(e.get(c) is not None for c in REFERENCE_COLUMNS) for e in examples]
        if any(given) and not all(given):
            raise ValueError(
                "some pairs of the micro-batch have reference log-probs and others do not; give all or none."
            )
        if all(given):
            values = [e["ref_chosen_logps"] for e in examples] + [e["ref_rejected_logps"] for e in examples]
            batch[REF_LOGPS] = torch.tensor(values, dtype=torch.float32)
        return batch

    @staticmethod
    def example_length(example: Mapping[str, Any]) -> int:
        """Tokens a pair takes in a padded micro-batch: two rows as long as its longer side (token budgets).

        >>> DataCollatorForPreference.example_length({"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1]})
        6
        """
        return 2 * max(len(example["chosen_input_ids"]), len(example["rejected_input_ids"]))


__all__ = [
    "build_preference_dataset",
    "encode_pair",
    "split_implicit_prompt",
    "DataCollatorForPreference",
    "PreferenceStream",
    "load_preference_source",
    "PREFERENCE_TRUNCATIONS",
]
