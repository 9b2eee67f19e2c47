"""SFT datasets: rows from a source (:mod:`hfacc.data.sources`), tokenized and masked (:mod:`hfacc.data.formats`),
map-style or streamed (:mod:`hfacc.data.streaming`), with the settings that choose them (``DataArguments``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ops.loss import count_example_targets
from .formats import (
    FORMAT_COLUMNS,
    FORMATS,
    TRUNCATIONS,
    DataError,
    _is_conversation,
    detect_format,
    encode_row,
    log_masking,
)
from .multimodal import IMAGE_COLUMN
from .sources import EMBEDDED_DATASETS, SOURCE_ROW, get_local_data_files, load_sft_source, load_stream_source
from .streaming import build_sft_stream
from .vision import encode_vision_row, get_chat_template, get_text_tokenizer, is_vision_processor

logger = logging.getLogger(__name__)


PARALLEL_ROWS = 10_000  # from this many rows on, map-style tokenization uses several processes by default


def build_sft_dataset(
    dataset,
    tokenizer,
    *,
    max_length: int | None = 1024,
    format: str = "auto",
    last_turn_only: bool = False,
    truncation: str = "right",
    num_proc: int | None = None,
):
    """Tokenize ``dataset`` for supervised fine-tuning, with -100 labels wherever no loss is wanted.

    Args:
        dataset: a ``datasets.Dataset`` with columns ``messages`` (list of ``{role, content}``), or ``prompt`` and
            ``completion`` (strings, or lists of messages), or ``text``.
        tokenizer: a fast tokenizer; chat data needs its ``chat_template``. Or a vision-language model's processor
            (``hfacc.get_processor``, ``AutoProcessor``), for conversations with images (:mod:`hfacc.data.vision`).
        max_length: longest example in tokens (``None``: no limit).
        format: ``"auto"`` (from the columns) or one of ``"messages"``, ``"prompt_completion"``, ``"text"``.
        last_turn_only: for chat data, train on the last assistant turn only (default: every assistant turn).
        truncation: what to do with an example longer than ``max_length``: ``"right"`` cuts its end, ``"drop"``
            removes it, ``"error"`` stops. Either way the count is reported in one log line.
        num_proc: processes for ``datasets.map`` (None: up to 8, one per core, from PARALLEL_ROWS rows on).

    A ``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``, a generator) is not read here: the
    result is an :class:`hfacc.data.streaming.SFTStream` that tokenizes and masks each row as training reads it.

    Returns:
        A ``datasets.Dataset`` with ``input_ids``, ``attention_mask`` and ``labels``. Loss goes to the completion
        and its EOS (prompt/completion), to the assistant turns with their end-of-turn tokens (chat), or to every
        token (text). Examples left without a target are dropped, counted in one warning. With a processor, also
        ``images``: references to each example's images (bytes or paths), decoded when batches are made
        (:class:`hfacc.DataCollatorForVisionLM`); image tokens are never targets.

    >>> ds = datasets.Dataset.from_list([{"prompt": "2+2=", "completion": "4"}])   # doctest: +SKIP
    >>> build_sft_dataset(ds, tokenizer)[0]["labels"]                               # doctest: +SKIP
    [-100, -100, -100, 19, 2]
    """
    if _is_stream(dataset):  # a streamed dataset: tokenized lazily, as training reads it
        return build_sft_stream(
            dataset,
            tokenizer,
            max_length=max_length,
            format=format,
            last_turn_only=last_turn_only,
            truncation=truncation,
        )
    if format == "auto":
        format = detect_format(dataset.column_names)
    if format not in FORMATS:
        raise DataError(f"format={format!r} is not supported; use 'auto' or one of {list(FORMATS)}.")
    missing = [c for c in FORMAT_COLUMNS[format] if c not in dataset.column_names]
    if missing:
        raise DataError(f"format={format!r} needs the column(s) {missing}; the dataset has {dataset.column_names}.")
    if truncation not in TRUNCATIONS:
        raise DataError(f"truncation={truncation!r} is not supported; use one of {list(TRUNCATIONS)}.")
    if max_length is not None and max_length < 2:
        raise DataError(f"max_length={max_length}: an example needs at least 2 tokens to have a target.")
    if len(dataset) == 0:
        raise DataError("The dataset is empty.")
    # A vision-language processor (hfacc.data.vision): its chat template renders, its tokenizer tokenizes, its images
    # are kept as references for the collator.
    vision, processor, tokenizer = is_vision_processor(tokenizer), tokenizer, get_text_tokenizer(tokenizer)
    if vision:
        dataset = _image_references_undecoded(dataset)
    needs_template = format == "messages" or (format == "prompt_completion" and _is_conversation(dataset[0]["prompt"]))
    if needs_template and not (get_chat_template(processor) if vision else getattr(tokenizer, "chat_template", None)):
        raise DataError(
            "Chat data needs a tokenizer with a chat template, and this one has none. Use the tokenizer of an "
            "instruct/chat model, or set one: tokenizer.chat_template = '<jinja template>' (see "
            "https://huggingface.co/docs/transformers/chat_templating)."
        )
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no eos_token; set tokenizer.eos_token so completions can end.")

    def encode(row: Mapping[str, Any], index: int) -> dict[str, Any]:
        index = row.get(SOURCE_ROW, index)
        images, image_end = None, 0
        if vision:
            ids, labels, method, unclosed, images, image_end = encode_vision_row(
                processor, row, index, format, last_turn_only=last_turn_only
            )
        else:
            ids, labels, method, unclosed = encode_row(tokenizer, row, index, format, last_turn_only=last_turn_only)
        too_long = max_length is not None and len(ids) > max_length
        if too_long and truncation == "error":
            raise DataError(
                f"row {index}: {len(ids)} tokens exceed max_length={max_length}. Raise max_length, or set "
                "truncation='right' (cut the end) or 'drop'."
            )
        if too_long and truncation == "right":
            ids, labels = ids[:max_length], labels[:max_length]
        num_targets = count_example_targets(labels)
        # A cut through an image's tokens would leave the model fewer tokens than the image's features: dropped.
        cut_image = too_long and truncation == "right" and image_end > max_length
        keep = not (too_long and truncation == "drop") and num_targets > 0 and not cut_image
        out = {
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": labels,
            "_too_long": too_long,
            "_keep": keep,
            "_masking": method,
            "_unclosed": unclosed,
        }
        if vision:
            out[IMAGE_COLUMN] = images
        return out

    if num_proc is None and len(dataset) >= PARALLEL_ROWS:
        num_proc = min(os.cpu_count() or 1, 8)
    num_proc = num_proc if num_proc and num_proc > 1 else None
    started = time.perf_counter()
    encoded = dataset.map(
        encode,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing ({format})",
    )
    logger.info(
        "hfacc: tokenized %d %s rows in %.1f s (%s).",
        len(dataset),
        format,
        time.perf_counter() - started,
        f"{num_proc} processes" if num_proc else "1 process",
    )
    too_long = sum(encoded["_too_long"])
    log_masking(encoded["_masking"], encoded["_unclosed"])
    kept = encoded.filter(lambda keep: keep, input_columns="_keep", num_proc=num_proc)
    dropped = len(encoded) - len(kept)
    if too_long:
        action = {"right": "truncated (their end is cut)", "drop": "dropped"}[truncation]
        logger.warning(
            "hfacc: %d of %d examples exceed max_length=%s and were %s.", too_long, len(encoded), max_length, action
        )
    if dropped:
        logger.warning(
            "hfacc: %d of %d examples have no target token (after truncation) or were too long, and were dropped.",
            dropped,
            len(encoded),
        )
    if len(kept) == 0:
        raise DataError(
            f"No example is left after tokenization ({len(encoded)} had no target token or were too long for "
            f"max_length={max_length}). Check the masking (hfacc show-mask) or raise max_length."
        )
    kept = kept.remove_columns(["_too_long", "_keep", "_masking", "_unclosed"])
    if vision:  # references, decoded by the collator when batches are made: never pixels in Arrow
        import datasets

        kept = kept.cast_column(IMAGE_COLUMN, datasets.List(datasets.Image(decode=False)))
    return kept


def _image_references_undecoded(dataset):
    """``dataset`` with its image columns read as references (bytes or path), not decoded: building the dataset
    reads each image's size from its header only."""
    import datasets

    for name, feature in dataset.features.items():
        inner = getattr(feature, "feature", feature)  # a list of images, or one image per row
        if isinstance(inner, datasets.Image) and inner.decode:
            undecoded = datasets.Image(decode=False)
            dataset = dataset.cast_column(name, datasets.List(undecoded) if inner is not feature else undecoded)
    return dataset


def _is_stream(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


@dataclass
class DataArguments:
    """Which data to train on and how to mask it."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset, local .json/.jsonl/.csv/.parquet file, or save_to_disk directory. None: "
            "the embedded instruction dataset (offline)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_eval_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on. None: hold out eval_fraction of the training split."}
    )
    eval_fraction: float = field(default=0.05, metadata={"help": "Share held out for evaluation (no eval split)."})
    max_examples: int | None = field(default=None, metadata={"help": "Use at most this many training examples."})
    num_embedded_examples: int = field(default=4000, metadata={"help": "Size of the embedded dataset."})
    embedded_dataset: str = field(
        default="instructions",
        metadata={
            "help": "The embedded dataset (no dataset_name): 'instructions' (six text skills), 'shapes' "
            "(pictures of shapes with questions, for a vision-language model) or 'tools' (3-digit products, "
            "most with a multiply tool call: the format hfacc grpo --embedded_dataset tools needs).",
            "choices": list(EMBEDDED_DATASETS),
        },
    )
    tool_direct_fraction: float = field(
        default=0.3,
        metadata={
            "help": "embedded_dataset 'tools': the share of conversations that answer at once, without the tool "
            "(the product itself, which a small model cannot compute); the others call multiply, copy its result."
        },
    )
    dataset_format: str = field(
        default="auto",
        metadata={
            "help": "'auto' (from the columns), 'messages', 'prompt_completion' or 'text'.",
            "choices": ["auto", *FORMATS],
        },
    )
    max_length: int | None = field(default=1024, metadata={"help": "Longest example in tokens."})
    truncation: str = field(
        default="right",
        metadata={
            "help": "Examples over max_length: 'right' (cut the end), 'drop', or 'error'.",
            "choices": list(TRUNCATIONS),
        },
    )
    last_turn_only: bool = field(
        default=False, metadata={"help": "Chat data: train on the last assistant turn only (default: all of them)."}
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Stream the dataset (hub or local file) instead of loading and tokenizing it all first: rows are "
            "tokenized as training reads them, sharded over the processes, and a resumed run continues exactly where "
            "the checkpoint left the stream. Needs max_steps. Evaluation holds out the first stream_eval_examples "
            "rows (or reads them from dataset_eval_split)."
        },
    )
    stream_buffer_size: int = field(
        default=1000,
        metadata={
            "help": "Streaming: examples read ahead to cut max_tokens_per_batch micro-batches or to pack (memory "
            "grows with it, not with the stream)."
        },
    )
    stream_eval_examples: int = field(
        default=200, metadata={"help": "Streaming: rows held out (never trained on) for evaluation."}
    )
    num_proc: int | None = field(
        default=None,
        metadata={
            "help": "Processes that tokenize a map-style dataset. None: one per core (up to 8) from 10,000 rows on, "
            "else one."
        },
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack training examples into rows of max_length tokens (best-fit decreasing), sequences "
            "kept apart by restarting position_ids; checked once against unpacked runs. Exact."
        },
    )

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: an example needs at least 2 tokens.")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples={self.max_examples}: it must be >= 1 (or unset).")
        if self.packing and self.max_length is None:
            raise ValueError("packing=True needs max_length: it is the length of the packed rows.")
        if not 0.0 <= self.tool_direct_fraction <= 1.0:
            raise ValueError(f"tool_direct_fraction={self.tool_direct_fraction}: it is a share, in [0, 1].")
        if self.stream_buffer_size < 1:
            raise ValueError(f"stream_buffer_size={self.stream_buffer_size}: it must be >= 1.")
        if self.stream_eval_examples < 1:
            raise ValueError(f"stream_eval_examples={self.stream_eval_examples}: it must be >= 1.")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"num_proc={self.num_proc}: it must be >= 1 (or unset: chosen from the size).")

    def sft_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`build_sft_dataset` these settings stand for."""
        return dict(
            max_length=self.max_length,
            format=self.dataset_format,
            last_turn_only=self.last_turn_only,
            truncation=self.truncation,
            num_proc=self.num_proc,
        )


def build_datasets(args: DataArguments, tokenizer, seed: int = 0):
    """``(train, eval, raw_eval)``: tokenized, masked train/eval datasets and the raw held-out rows."""
    if args.streaming:  # train is an hfacc.data.streaming.SFTStream, tokenized as it is read
        return build_stream_datasets(args, tokenizer, seed=seed)
    raw_train, raw_eval = load_sft_source(
        args.dataset_name,
        config=args.dataset_config,
        split=args.dataset_train_split,
        eval_split=args.dataset_eval_split,
        eval_fraction=args.eval_fraction,
        max_examples=args.max_examples,
        seed=seed,
        num_embedded=args.num_embedded_examples,
        embedded=args.embedded_dataset,
        tool_direct_fraction=args.tool_direct_fraction,
    )
    options = args.sft_options()
    train = build_sft_dataset(raw_train, tokenizer, **options)
    if args.packing:
        from .batching import pack_dataset

        train = pack_dataset(train, args.max_length)
    return train, build_sft_dataset(raw_eval, tokenizer, **options), raw_eval


def build_examples(args: DataArguments, tokenizer, count: int, start: int = 0, seed: int = 0):
    """Examples ``start .. start + count`` of the training data, tokenized and masked as training would do it.

    For tools that look at a few examples (``hfacc verify``, ``hfacc show-mask``): only about twice as many rows
    as needed are loaded (or generated), never the whole dataset.
    """
    return build_sft_dataset(example_rows(args, count, start, seed), tokenizer, **args.sft_options())


def example_rows(args: DataArguments, count: int, start: int = 0, seed: int = 0, in_order: bool = False):
    """The raw rows behind :func:`build_examples` (a ``datasets.Dataset``). ``in_order``: rows ``start ..
    start + count`` of the source itself, nothing held out (``hfacc show-mask``: example N is row N)."""
    rows = max(2 * (start + count), 16)
    raw, _ = load_sft_source(
        args.dataset_name,
        config=args.dataset_config,
        split=args.dataset_train_split,
        eval_fraction=0.5,
        hold_out=not in_order,
        seed=seed,
        num_embedded=rows,
        max_examples=rows,
        embedded=args.embedded_dataset,
        tool_direct_fraction=args.tool_direct_fraction,
    )
    return raw.select(list(range(start, min(len(raw), start + count))))


def build_stream_datasets(args, tokenizer, seed: int = 0):
    """:func:`build_datasets` for ``streaming=True``: ``(SFTStream, eval Dataset, raw eval rows)``."""
    raw_train, raw_eval = load_stream_source(args, seed=seed)
    options = args.sft_options()
    num_proc = options.pop("num_proc")
    files = get_local_data_files(args.dataset_name) if args.dataset_name else []
    train = build_sft_stream(raw_train, tokenizer, buffer_size=args.stream_buffer_size, data_files=files, **options)
    train.split_by_rows = True  # the held-out rows were skip()ped (and max_examples take()n): see SFTStream
    if args.packing:
        train.pack_length = args.max_length
    logger.info(
        "hfacc: streaming %s (%d shard(s)): rows are tokenized as training reads them; %d rows held out.",
        args.dataset_name or "the embedded data",
        raw_train.n_shards,
        len(raw_eval),
    )
    return train, build_sft_dataset(raw_eval, tokenizer, num_proc=num_proc, **options), raw_eval
