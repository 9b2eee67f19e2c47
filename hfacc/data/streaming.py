"""Streaming SFT data: rows tokenized and masked as they are read, sharded over ranks, resumable exactly.

:func:`build_sft_stream` (what :func:`hfacc.data.sft.build_sft_dataset` returns for a ``datasets.IterableDataset``)
keeps nothing but the source and the settings: each row goes through the same :func:`hfacc.data.formats.encode_row` as
the map-style path when it is read. :class:`StreamBatches` (built by the trainer) turns this rank's share of the stream
into collated micro-batches, from a bounded buffer: consecutive examples, micro-batches cut to a token budget, or
packed rows. Every micro-batch carries the stream's position *after* it, so a checkpoint stores the position of the
last micro-batch the trainer consumed, whatever the data loader has read ahead.

Why ``datasets.distributed.split_dataset_by_node`` and not accelerate's dispatching (the stock Trainer's default for
an iterable dataset, ``DataLoaderDispatcher``): dispatching has rank 0 read, tokenize and collate the micro-batches
of every rank, then broadcast them, so tokenization does not scale with the ranks (measured in benchmarks/README.md),
and it concatenates the ranks' micro-batches, which fails on dynamically padded batches of different lengths and on
token-budget micro-batches of different sizes. Split by node, each rank reads its own shards (or every
``world_size``-th row of a single-shard stream) and tokenizes only its own rows; no example goes to two ranks and
none is skipped, and the stream's state is per rank.

A finite stream does not end training: ``max_steps`` decides. When a rank's share ends, that rank starts it again
(the next epoch, ``set_epoch`` reshuffles a shuffled source) and says so once; the ranks never wait for each other.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..ops.loss import IGNORE_INDEX
from ..runtime.distributed import all_ranks_agree
from .batching import pack_examples
from .formats import FORMAT_COLUMNS, FORMATS, TRUNCATIONS, DataError, _is_conversation, detect_format, encode_row
from .multimodal import IMAGE_COLUMN
from .sources import SOURCE_ROW, describe_read_failure
from .vision import encode_vision_row, get_chat_template, get_text_tokenizer, is_vision_processor

logger = logging.getLogger(__name__)

STATE_KEY = "_stream_state"  # the key of a micro-batch that holds the stream's position after it
STATE_FILE = "stream_state_rank{rank}.json"


def build_sft_stream(
    source,
    tokenizer,
    *,
    max_length: int | None = 1024,
    format: str = "auto",
    last_turn_only: bool = False,
    truncation: str = "right",
    buffer_size: int = 1000,
    data_files: list | None = None,
) -> SFTStream:
    """``source`` (a ``datasets.IterableDataset`` of raw rows), tokenized and masked lazily as training reads it.

    Same formats, masking, truncation and errors as :func:`hfacc.data.sft.build_sft_dataset`; the format is read off
    the first row when the stream does not know its columns (a generator). Nothing is tokenized here but that row.
    ``data_files``: the local files the stream reads, so that a broken line is named when reading fails.
    """
    if format not in ("auto", *FORMATS):
        raise DataError(f"format={format!r} is not supported; use 'auto' or one of {list(FORMATS)}.")
    if truncation not in TRUNCATIONS:
        raise DataError(f"truncation={truncation!r} is not supported; use one of {list(TRUNCATIONS)}.")
    if max_length is not None and max_length < 2:
        raise DataError(f"max_length={max_length}: an example needs at least 2 tokens to have a target.")
    if buffer_size < 1:
        raise DataError(f"stream_buffer_size={buffer_size}: it must be >= 1.")
    first = read_row(iter(source.take(1)), data_files)
    if first is None:
        raise DataError("The streamed dataset is empty.")
    columns = source.column_names or list(first)
    if format == "auto":
        format = detect_format(columns)
    missing = [c for c in FORMAT_COLUMNS[format] if c not in columns]
    if missing:
        raise DataError(f"format={format!r} needs the column(s) {missing}; the stream has {list(columns)}.")
    chat = format == "messages" or (format == "prompt_completion" and _is_conversation(first["prompt"]))
    # A vision-language processor (hfacc.data.vision): its template renders, its tokenizer tokenizes.
    vision, processor, tokenizer = is_vision_processor(tokenizer), tokenizer, get_text_tokenizer(tokenizer)
    if chat and not (get_chat_template(processor) if vision else getattr(tokenizer, "chat_template", None)):
        raise DataError(
            "Chat data needs a tokenizer with a chat template, and this one has none. Use the tokenizer of an "
            "instruct/chat model, or set one: tokenizer.chat_template = '<jinja template>'."
        )
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no eos_token; set tokenizer.eos_token so completions can end.")
    stream = SFTStream(source, processor, format, max_length, last_turn_only, truncation, buffer_size)
    stream.data_files = list(data_files or [])
    return stream


def read_row(rows: Iterator, data_files: list | None) -> Mapping[str, Any] | None:
    """The next row of a stream (None at its end); a failure to read a local file is a DataError naming the line."""
    try:
        return next(rows, None)
    except DataError:
        raise
    except Exception as err:  # datasets' JSON and CSV readers name no line (or a line of their own chunk)
        if not data_files:
            raise
        raise DataError(describe_read_failure(data_files, err)) from err


class SFTStream(torch.utils.data.IterableDataset):
    """Tokenized, masked SFT examples of a streamed source, encoded as they are read (see :func:`build_sft_stream`).

    Iterating yields ``{"input_ids", "attention_mask", "labels"}`` for the whole stream, one pass. Training uses
    :class:`StreamBatches`, which shards it over ranks and keeps its position.

    Args:
        source: a ``datasets.IterableDataset`` of raw rows.
        pack_length: when set, micro-batches hold rows of this many tokens packed from the buffer.
        buffer_size: examples read ahead to cut token-budget micro-batches or to pack (bounds memory).
    """

    def __init__(self, source, tokenizer, format, max_length, last_turn_only, truncation, buffer_size=1000):
        self.source, self.tokenizer, self.format = source, tokenizer, format
        self.max_length, self.last_turn_only, self.truncation = max_length, last_turn_only, truncation
        self.buffer_size = buffer_size
        self.pack_length: int | None = None
        # datasets shares a skip()/take() out among the shards when a rank reads whole shards (skip(3) over 2 ranks
        # skips 1 or 2 rows of each), so held-out rows would be trained and others skipped: such a stream is split
        # row by row, where they apply to the stream as a whole.
        self.split_by_rows = False
        self.data_files: list = []  # the local files read, to name a broken line (build_sft_stream sets them)
        self.dropped = self.truncated = 0

    def __repr__(self) -> str:
        return f"SFTStream(format={self.format!r}, max_length={self.max_length}, source={type(self.source).__name__})"

    def encode(self, row: Mapping[str, Any], where: str) -> dict[str, list[int]] | None:
        """One raw row as a training example; None (counted) when it has no target or is dropped as too long."""
        images, image_end = None, 0
        if is_vision_processor(self.tokenizer):  # image chat: the example keeps its image references
            ids, labels, _, _, images, image_end = encode_vision_row(
                self.tokenizer, row, where, self.format, last_turn_only=self.last_turn_only
            )
        else:
            ids, labels, _, _ = encode_row(self.tokenizer, row, where, self.format, last_turn_only=self.last_turn_only)
        if self.max_length is not None and len(ids) > self.max_length:
            if self.truncation == "error":
                raise DataError(
                    f"row {where}: {len(ids)} tokens exceed max_length={self.max_length}. Raise max_length, or set "
                    "truncation='right' (cut the end) or 'drop'."
                )
            self.truncated += 1
            if self.truncation == "drop":
                return self._drop(where, f"it has {len(ids)} tokens, more than max_length={self.max_length}")
            if image_end > self.max_length:  # the model needs all of an image's tokens or none
                return self._drop(where, f"max_length={self.max_length} would cut through an image's tokens")
            if _worth_saying(self.truncated):  # as the map-style path counts them, without a total to give
                logger.warning(
                    "hfacc: row %s has %d tokens, more than max_length=%d: its end is cut (%d rows so far).",
                    where,
                    len(ids),
                    self.max_length,
                    self.truncated,
                )
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        if not any(y != IGNORE_INDEX for y in labels[1:]):
            return self._drop(where, "it has no target token (after truncation)")
        example = {"input_ids": list(ids), "attention_mask": [1] * len(ids), "labels": labels}
        if images is not None:
            example[IMAGE_COLUMN] = images  # decoded by hfacc.DataCollatorForVisionLM when the batch is made
        return example

    def _drop(self, where: str, why: str) -> None:
        self.dropped += 1
        if _worth_saying(self.dropped):  # the map-style path counts them too
            logger.warning("hfacc: row %s was dropped: %s (%d dropped so far).", where, why, self.dropped)
        return None

    def first_rows(self, count: int) -> list[Mapping[str, Any]]:
        """The stream's first ``count`` raw rows, read again from its start: what identifies a streamed run's data
        (:func:`hfacc.training.checkpoint.get_dataset_identity`; with the tokenization settings and the chat
        template beside them). Not encoded: that would count and say their truncations a second time."""
        rows, it = [], iter(self.source)
        while len(rows) < count and (row := read_row(it, self.data_files)) is not None:
            rows.append(row)  # a file that cannot be read is the DataError naming its line, as in training
        return rows

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        for i, row in enumerate(self.source):
            example = self.encode(row, _where(row, i, 0, 1, 0))
            if example is not None:
                yield example


def _worth_saying(count: int) -> bool:
    """Say the 1st, 10th, 100th, 1000th, then every 10,000th: a stream has no end to give one total at."""
    return count in (1, 10, 100, 1000) or count % 10_000 == 0


def _where(row: Mapping[str, Any], local: int, rank: int, world: int, epoch: int, by_shards: bool = False) -> str:
    """The row's position in words: in the source (``_source_row``) or in the stream, for an error message."""
    if SOURCE_ROW in row:
        index = f"{row[SOURCE_ROW]}"
    elif by_shards:  # each rank reads whole shards: only the rank knows where it is
        index = f"{local} of the shards read by rank {rank}"
    else:  # every world-th row: the rank's k-th row is row k * world + rank of the stream
        index = f"{local * world + rank} of the stream"
    return index + (f" (epoch {epoch + 1})" if epoch else "")


class StreamBatches(torch.utils.data.IterableDataset):
    """This rank's collated micro-batches from an :class:`SFTStream`, each with the stream's position after it.

    The stream is read in buffers: of ``batch_size`` examples (one micro-batch, in stream order), or, with
    ``max_tokens`` or packing, of ``stream.buffer_size`` examples cut into micro-batches of at most ``max_tokens``
    padded tokens (sorted by length, their order shuffled, seeded by the buffer's place in the stream) or packed
    into rows of ``stream.pack_length`` tokens. A position is ``{epoch, source state at the buffer's start, rows
    read before it, micro-batches of the buffer done}``: resuming loads the source state, reads the one buffer
    again and skips what was done, so it costs one buffer, never a pass over the stream from its start.

    Args:
        stream: the tokenized stream.
        collator: turns a list of examples into a batch (e.g. :class:`hfacc.DataCollatorForCausalLM`).
        batch_size: examples (or packed rows) per micro-batch; with ``max_tokens``, the most per micro-batch (0: any).
        max_tokens: most padded tokens (rows x longest row) per micro-batch (0: ``batch_size`` examples).
        seed: seed of the micro-batch order within a buffer.
        rank, world_size: this process among the data-parallel ranks.
    """

    def __init__(
        self, stream: SFTStream, collator: Callable, *, batch_size=1, max_tokens=0, seed=0, rank=0, world_size=1
    ):
        from datasets.distributed import split_dataset_by_node

        self.stream, self.collator = stream, collator
        self.batch_size, self.max_tokens, self.seed = batch_size, max_tokens, seed
        self.rank, self.world_size = rank, world_size
        # split_dataset_by_node gives each rank whole shards when their number divides by the world size, else
        # every world_size-th row (each rank reads the rest and throws it away before tokenizing). It also makes a
        # fresh dataset object for each pass: a state loaded into one would apply to every later iteration.
        self.by_shards = world_size > 1 and stream.source.n_shards % world_size == 0 and not stream.split_by_rows
        strategy = "shards" if self.by_shards else "examples"
        self.split = lambda: split_dataset_by_node(stream.source, rank, world_size, strategy=strategy)
        self.start: dict[str, Any] | None = None  # where to resume, from a checkpoint
        self.restarts_said = False

    @property
    def reorders(self) -> bool:
        return bool(self.max_tokens or self.stream.pack_length)

    def state_dict(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.start)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next iteration where ``state`` (a micro-batch's ``STATE_KEY``) says; check it is this stream's."""
        if state.get("world_size") != self.world_size or state.get("rank") != self.rank:
            raise DataError(
                f"The checkpoint's stream position is for rank {state.get('rank')} of {state.get('world_size')} "
                f"processes; this run has {self.world_size}. Resume a streaming run with as many processes as it had."
            )
        self.start = copy.deepcopy(state)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self.start or {}
        epoch, source_state, rows = start.get("epoch", 0), start.get("source"), start.get("rows", 0)
        done = start.get("done", 0)
        while True:
            source = self.split()
            source.set_epoch(epoch)
            if source_state is not None:
                source.load_state_dict(source_state)
            # A pass read from its start that yields nothing never will: every row dropped (or none there). A pass
            # resumed part-way may just have nothing left; the next one, from the start, tells.
            whole = source_state is None and rows == 0
            it, exhausted, produced = iter(source), False, False
            while not exhausted:
                examples, read = [], 0
                size = self.stream.buffer_size if self.reorders else self.batch_size
                while len(examples) < size:
                    row = read_row(it, self.stream.data_files)
                    if row is None:
                        exhausted = True
                        break
                    where = _where(row, rows + read, self.rank, self.world_size, epoch, self.by_shards)
                    example = self.stream.encode(row, where)
                    read += 1
                    if example is not None:
                        examples.append(example)
                # After the buffer's last micro-batch the position is the next buffer's start: a resume there
                # tokenizes nothing twice. Elsewhere it is this buffer's start and the micro-batches done.
                after = source.state_dict() if not exhausted else None
                end = {"epoch": epoch, "source": after, "rows": rows + read, "done": 0}
                if exhausted:
                    end = {"epoch": epoch + 1, "source": None, "rows": 0, "done": 0}
                cut = self._cut(examples, epoch, rows)
                for i, batch in enumerate(cut):
                    produced = True
                    if i < done:
                        continue
                    position = {"epoch": epoch, "source": source_state, "rows": rows, "done": i + 1}
                    if i == len(cut) - 1:
                        position = dict(end)
                    position.update(rank=self.rank, world_size=self.world_size)
                    yield {**self.collator(batch), STATE_KEY: position}
                done, rows, source_state = 0, rows + read, after
            if not produced and whole:
                what = f"all {rows} of its rows were dropped" if rows else "it has no row"
                raise DataError(
                    f"rank {self.rank}'s share of the stream holds no usable example: {what} (no target token, or "
                    f"longer than max_length={self.stream.max_length} with truncation='drop'; {self.world_size} "
                    f"process(es), {self.stream.source.n_shards} shard(s)). Check the masking (hfacc show-mask) "
                    "or raise max_length."
                )
            epoch, rows = epoch + 1, 0
            if not self.restarts_said:
                self.restarts_said = True
                logger.warning(
                    "hfacc: rank %d read its whole share of the stream; it starts again (epoch %d). Training stops at "
                    "max_steps.",
                    self.rank,
                    epoch + 1,
                )

    def _cut(self, examples: list[dict], epoch: int, rows: int) -> list[list[dict]]:
        """The buffer's micro-batches, the same on every read of the same buffer (resume depends on it)."""
        if not examples:
            return []
        if self.stream.pack_length:
            examples = pack_examples(examples, self.stream.pack_length)
        if not self.max_tokens:
            return [examples[i : i + self.batch_size] for i in range(0, len(examples), self.batch_size)]
        measure = getattr(self.collator, "example_length", None) or (lambda e: len(e["input_ids"]))
        lengths = [measure(e) for e in examples]  # a preference pair takes two rows (its collator says so)
        order = sorted(range(len(examples)), key=lambda i: -lengths[i])
        batches, current, longest = [], [], 0
        for i in order:
            length = lengths[i]
            full = self.batch_size and len(current) >= self.batch_size
            if current and (max(longest, length) * (len(current) + 1) > self.max_tokens or full):
                batches.append(current)
                current, longest = [], 0
            current.append(examples[i])
            longest = max(longest, length)
        batches.append(current)
        # Sorted micro-batches go from long to short; shuffled, a window mixes lengths (same seed on a re-read).
        random.Random(f"{self.seed}-{self.rank}-{epoch}-{rows}").shuffle(batches)
        return batches


def save_stream_state(batches: StreamBatches, position: dict[str, Any] | None, checkpoint: str | Path) -> None:
    """Write this rank's stream position (after the last consumed micro-batch) into ``checkpoint``."""
    if position is None:
        return
    Path(checkpoint).mkdir(parents=True, exist_ok=True)  # another rank may not have made it yet
    (Path(checkpoint) / STATE_FILE.format(rank=batches.rank)).write_text(json.dumps(position))


def load_stream_state(batches: StreamBatches, checkpoint: str | Path) -> bool:
    """Make ``batches`` start where ``checkpoint`` left this rank; False when the checkpoint has no position."""
    path = Path(checkpoint) / STATE_FILE.format(rank=batches.rank)
    if not path.is_file():
        return False
    batches.load_state_dict(json.loads(path.read_text()))
    return True


def holds_stream_state(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` was saved by a streaming run (it holds a position in the stream)."""
    return any(Path(checkpoint).glob(STATE_FILE.format(rank="*")))


def check_stream_training(args) -> None:
    """A stream has no length: training needs ``max_steps`` (the Trainer would stop with a less helpful error)."""
    if args is not None and args.max_steps <= 0:
        raise DataError(
            "Streaming data has no length, so the number of steps cannot come from num_train_epochs: set max_steps "
            "(recipe: --max_steps N; N optimizer steps of per_device_train_batch_size x gradient_accumulation_steps "
            "x processes examples)."
        )


def take_stream_position(batches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Remove the stream positions from ``batches`` (the model must not see them); return the last one."""
    position = None
    for batch in batches:
        if isinstance(batch, dict) and STATE_KEY in batch:
            position = batch.pop(STATE_KEY)
    return position


def identity(batch):
    """The data loader's collate function: :class:`StreamBatches` yields collated micro-batches already."""
    return batch


def build_stream_loader(stream: SFTStream, collator, args, resume: str | None) -> tuple[Any, StreamBatches]:
    """``(loader, batches)``: this rank's micro-batches of ``stream``, sharded here, not by accelerate.

    Not for ``accelerator.prepare``: for an iterable dataset it would either dispatch (rank 0 reads for every rank)
    or shard it again; the Trainer puts each batch on the device itself (``_prepare_inputs``). ``resume``: a
    checkpoint whose saved position the stream continues from.
    """
    batches = StreamBatches(
        stream,
        collator,
        batch_size=args.per_device_train_batch_size,
        max_tokens=args.max_tokens_per_batch,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        rank=args.process_index,
        world_size=args.world_size,
    )
    if resume is not None and not load_stream_state(batches, resume):
        raise DataError(
            f"{resume} holds no stream position for rank {batches.rank}: it was not saved by a streaming run of "
            "hfacc. Resume it without --streaming, or start afresh."
        )
    if args.dataloader_num_workers:
        # Each worker would hold a copy of the stream and read all of it: every example several times.
        logger.warning(
            "hfacc: a stream is read in the training process; dataloader_num_workers=%d is not used for it.",
            args.dataloader_num_workers,
        )
    return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=identity), batches


def read_stream_window(epoch_iterator: Iterator, num_batches: int, accelerator) -> list:
    """The window's micro-batches of a stream; a bad row stops every rank, each with one message.

    A bad row is found by the one rank that reads it. Raising there alone would leave the others waiting in the
    window's count all-reduce until they time out or die with a traceback, so the ranks first agree (one tiny
    collective per window, only for streams on several ranks).
    """
    from itertools import islice

    error, batch_samples = None, []
    try:
        batch_samples = list(islice(epoch_iterator, num_batches))
    except DataError as err:
        error = err
    if not all_ranks_agree(error is None, accelerator):
        raise error or DataError(
            "another process stopped on a bad row of the stream (its message names the row); stopping too."
        )
    return batch_samples
