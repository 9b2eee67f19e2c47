"""Less padding: micro-batches built to a token budget, and packing of several sequences per row.

Both change which examples share a micro-batch, and how many. Under hfacc that changes nothing in the result:
the window's loss is normalized by its global target count, not by the number of micro-batches or sequences, so a
window is the same big batch however it was cut.
"""

from __future__ import annotations

import bisect
import logging
import random
import sys
from collections.abc import Iterator, Sequence

from torch.utils.data import DataLoader, Sampler

from ..ops.loss import IGNORE_INDEX
from .collator import TEACHER_COLUMNS
from .multimodal import IMAGE_COLUMN

logger = logging.getLogger(__name__)


def is_map_dataset(dataset) -> bool:
    """Whether ``dataset`` is a map-style ``datasets.Dataset``, without importing ``datasets`` (a second to import:
    ``hfacc <command> --help`` needs none of it); an object of that class exists only once it is imported."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.Dataset)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Micro-batches whose padded size (rows x longest row) stays within ``max_tokens``.

    Examples are sorted by length and cut greedily into micro-batches (as fairseq's ``batch_by_size`` does), so a
    micro-batch holds sequences of similar length: little padding, bounded memory. With ``group_size`` > 0 the
    sorting happens within random groups of that many examples, drawn anew every epoch: more padding, but
    micro-batches mix examples that sorting would keep apart (when lengths go with content, e.g. one task per
    length, fully sorted micro-batches make each optimizer step see fewer kinds of example). The order of the
    micro-batches is shuffled every epoch, seeded by ``seed`` and the epoch, so a resumed run sees the same order,
    and every epoch has the same number of micro-batches, as the Trainer requires (epochs that would cut more or
    fewer are evened out by splitting the fullest micro-batches or merging the smallest).

    Args:
        lengths: length of every example in tokens.
        max_tokens: most padded tokens per micro-batch. A longer example gets a micro-batch of its own.
        max_batch_size: most sequences per micro-batch (0: no limit).
        shuffle: shuffle examples and micro-batches every epoch.
        seed: seed of the shuffles.
        group_size: examples per length-sorting group (0: sort the whole dataset once; fixed composition).

    >>> sampler = TokenBudgetBatchSampler([5, 9, 3, 8, 4], max_tokens=16, shuffle=False)
    >>> list(sampler)  # lengths 9 | 8 + 5 | 4 + 3: at most 16 padded tokens each
    [[1], [3, 0], [4, 2]]
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        max_batch_size: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        group_size: int = 0,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: it must be >= 1.")
        if group_size < 0:
            raise ValueError(f"group_size={group_size}: it must be >= 0 (0 sorts the whole dataset).")
        self.lengths = list(lengths)
        self.max_tokens, self.max_batch_size, self.shuffle, self.seed = max_tokens, max_batch_size, shuffle, seed
        self.group_size = group_size
        self.epoch = 0
        oversized = sum(n > max_tokens for n in self.lengths)
        if oversized:
            logger.warning(
                "hfacc: %d example(s) are longer than max_tokens_per_batch=%d; each gets a micro-batch of its own.",
                oversized,
                max_tokens,
            )
        first = self._cut(0)
        self.num_batches = len(first)
        self.padded_tokens = sum(self._padded(b) for b in first)
        self.real_tokens = sum(self.lengths)

    def _padded(self, batch: list[int]) -> int:
        return max(self.lengths[i] for i in batch) * len(batch)

    def _cut(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed * 1_000_003 + epoch)
        if self.shuffle:
            rng.shuffle(order)
        size = self.group_size or len(order) or 1
        batches: list[list[int]] = []
        for g in range(0, len(order), size):
            group = sorted(order[g : g + size], key=lambda i: -self.lengths[i])
            current, longest = [], 0
            for i in group:
                grown = max(longest, self.lengths[i]) * (len(current) + 1)
                full = self.max_batch_size and len(current) >= self.max_batch_size
                if current and (grown > self.max_tokens or full):
                    batches.append(current)
                    current, longest = [], 0
                current.append(i)
                longest = max(longest, self.lengths[i])
            if current:
                batches.append(current)
        return batches

    def _even_out(self, batches: list[list[int]]) -> list[list[int]]:
        """Split the fullest or merge the smallest micro-batches until there are ``num_batches``."""
        while len(batches) < self.num_batches:
            k = max(range(len(batches)), key=lambda j: len(batches[j]))
            if len(batches[k]) < 2:
                break
            half = len(batches[k]) // 2
            batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
        while len(batches) > self.num_batches:
            batches.sort(key=self._padded)
            batches[0:2] = [batches[0] + batches[1]]
        return batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._even_out(self._cut(self.epoch))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch + 1).shuffle(batches)
        yield from batches

    def __len__(self) -> int:
        return self.num_batches

    @property
    def padding_fraction(self) -> float:
        return 1 - self.real_tokens / max(self.padded_tokens, 1)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``, longest first, each into the fullest bin
    it fits (best-fit decreasing: within 22 % of the fewest bins). Empty items are left out; an item longer than
    ``capacity`` gets a bin of its own.

    >>> best_fit_decreasing([3, 4, 1, 0], 4)
    [[1], [0, 2]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    spaces: list[tuple[int, int]] = []  # (remaining space, bin id), sorted: the best fit is the first that fits
    bins: list[list[int]] = []
    for i in order:
        length = lengths[i]
        if length == 0:
            continue
        k = bisect.bisect_left(spaces, (length, -1))
        if k < len(spaces):
            space, row = spaces.pop(k)
            bins[row].append(i)
            bisect.insort(spaces, (space - length, row))
        else:
            bins.append([i])
            bisect.insort(spaces, (max(capacity - length, 0), len(bins) - 1))
    return bins


def pack_examples(examples: Sequence[dict], max_length: int) -> list[dict]:
    """Pack tokenized examples into rows of at most ``max_length`` tokens, best-fit decreasing.

    Each row gets ``position_ids`` that restart at 0 for every sequence, which is how transformers (5.x) tells
    packed sequences apart: with no ``attention_mask`` and no cache, it builds a block-diagonal causal mask (sdpa,
    eager) or uses variable-length kernels (flash attention). hfacc's targets never cross a sequence boundary
    (:func:`hfacc.ops.loss.shift_labels`); the label of each sequence's first token is set to -100 all the same, so the
    rows stay right for a trainer that shifts labels across the whole row. So the targets are exactly those of the
    unpacked examples. Empty examples carry no token and no target: they are left out, as TRL's BFD packing does.

    >>> rows = pack_examples([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}], 8)
    >>> rows[0]["input_ids"], rows[0]["labels"], rows[0]["position_ids"]
    ([1, 2, 3, 4, 5], [-100, 2, 3, -100, 5], [0, 1, 2, 0, 1])
    """
    if max_length < 1:
        raise ValueError(f"max_length={max_length}: it must be >= 1.")
    lengths = [len(e["input_ids"]) for e in examples]
    for i, length in enumerate(lengths):
        if length > max_length:
            raise ValueError(f"example {i} has {length} tokens, more than the packing length {max_length}.")
    # Examples with images (hfacc.data.vision) keep them, in order: a row's images are its sequences' images.
    images = any(e.get(IMAGE_COLUMN) for e in examples)
    # Per-token columns (stored teacher log-probs of distillation) are laid out with their tokens.
    per_token = [c for c in TEACHER_COLUMNS if examples and all(e.get(c) is not None for e in examples)]
    packed = []
    for members in best_fit_decreasing(lengths, max_length):
        ids, labels, positions, pictures = [], [], [], []
        extra = {c: [] for c in per_token}
        for i in members:
            seq = list(examples[i]["input_ids"])
            given = examples[i].get("labels")
            lab = list(seq if given is None else given)
            if len(lab) != len(seq):
                raise ValueError(f"example {i}: {len(seq)} input_ids but {len(lab)} labels; they must be as long.")
            ids += seq
            labels += [IGNORE_INDEX] + lab[1:]
            positions += list(range(len(seq)))
            pictures += list(examples[i].get(IMAGE_COLUMN) or [])
            for c in per_token:
                extra[c] += list(examples[i][c])
        packed.append({"input_ids": ids, "labels": labels, "position_ids": positions, **extra})
        if images:
            packed[-1][IMAGE_COLUMN] = pictures
    return packed


def pack_dataset(dataset, max_length: int):
    """:func:`pack_examples` for a ``datasets.Dataset`` with ``input_ids`` and ``labels``; logs the row count."""
    import datasets

    columns = [c for c in ("input_ids", "labels", IMAGE_COLUMN, *TEACHER_COLUMNS) if c in dataset.column_names]
    rows = pack_examples(dataset.select_columns(columns).to_list(), max_length)
    tokens = sum(len(r["input_ids"]) for r in rows)
    logger.info(
        "hfacc: packed %d examples into %d rows of <= %d tokens (%.1f %% full).",
        len(dataset),
        len(rows),
        max_length,
        100 * tokens / max(len(rows) * max_length, 1),
    )
    if IMAGE_COLUMN in columns:  # image references stay references (never decoded pixels in Arrow)
        features = datasets.Features(
            {**dataset.features.copy(), "position_ids": datasets.List(datasets.Value("int64"))}
        )
        return datasets.Dataset.from_list(rows, features=datasets.Features({c: features[c] for c in rows[0]}))
    return datasets.Dataset.from_list(rows)


def get_longest_sequence(dataset) -> int:
    """The longest ``input_ids`` of a map-style ``datasets.Dataset`` (read from Arrow, no row decoded), else 0.

    Preference pairs and unpaired rows count too (``chosen_input_ids``, ``rejected_input_ids``,
    ``completion_input_ids``, ``kl_input_ids``: every ``*_input_ids`` column). Without them the padding-free row
    length came from the first micro-batch alone, so a resumed run, whose first micro-batch is another, laid out
    later rows otherwise than the uninterrupted run (rel 5e-9 on 2 ranks instead of bit for bit).
    """
    if not is_map_dataset(dataset) or len(dataset) == 0:
        return 0
    columns = [c for c in dataset.column_names if c == "input_ids" or c.endswith("_input_ids")]
    if not columns:
        return 0
    import pyarrow.compute as pc

    # The rows the dataset holds (a select()/shuffle() view included), as Arrow batches: no Python row is built.
    rows = dataset.select_columns(columns).with_format("arrow").iter(batch_size=65536)
    return max(int(pc.max(pc.list_value_length(batch[c])).as_py() or 0) for batch in rows for c in columns)


def is_packed(batch) -> bool:
    """Whether a batch holds packed rows: ``position_ids`` and no ``attention_mask``."""
    return batch.get("position_ids") is not None and batch.get("attention_mask") is None


def build_token_budget_loader(dataset, collator, args) -> DataLoader:
    """A DataLoader of micro-batches of at most ``args.max_tokens_per_batch`` padded tokens each
    (:class:`TokenBudgetBatchSampler`), with the Trainer's loader settings (workers, pinning, seed)."""
    budget = args.max_tokens_per_batch
    sampler = TokenBudgetBatchSampler(
        get_example_lengths(dataset, collator),
        budget,
        shuffle=args.train_sampling_strategy != "sequential",
        seed=args.data_seed if args.data_seed is not None else args.seed,
        group_size=args.length_group_size,
    )
    logger.info(
        "hfacc: %d micro-batches of <= %d padded tokens per epoch (%.1f %% padding).",
        len(sampler),
        budget,
        100 * sampler.padding_fraction,
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
    )


def get_example_lengths(dataset, collator=None) -> list[int]:
    """Tokens each example takes in a padded micro-batch: ``collator.example_length(example)`` where the collator
    says (a preference pair is two rows), else the length of its ``input_ids``."""
    measure = getattr(getattr(collator, "data_collator", collator), "example_length", None)
    if measure is not None:
        return [measure(e) for e in dataset]
    if is_map_dataset(dataset):
        return [len(x) for x in dataset["input_ids"]]
    return [len(e["input_ids"]) for e in dataset]
