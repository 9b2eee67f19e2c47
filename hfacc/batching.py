"""Less padding: micro-batches built to a token budget, and packing of several sequences per row.

Both change which examples share a micro-batch, and how many. Under hfacc that changes nothing in the result:
the window's loss is normalized by its global target count, not by the number of micro-batches or sequences, so a
window is the same big batch however it was cut.
"""

from __future__ import annotations

import bisect
import inspect
import logging
import random
from collections.abc import Iterator, Sequence

import datasets
import torch
from torch.utils.data import DataLoader, Sampler

from .loss import IGNORE_INDEX, get_sequence_starts
from .multimodal import IMAGE_COLUMN, check_image_layout, get_image_inputs, unpack_rows, with_packed_positions

logger = logging.getLogger(__name__)


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
    (:func:`hfacc.loss.shift_labels`); the label of each sequence's first token is set to -100 all the same, so the
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
    # Examples with images (hfacc.vision) keep them, in order: a row's images are its sequences' images.
    images = any(e.get(IMAGE_COLUMN) for e in examples)
    packed = []
    for members in best_fit_decreasing(lengths, max_length):
        ids, labels, positions, pictures = [], [], [], []
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
        packed.append({"input_ids": ids, "labels": labels, "position_ids": positions})
        if images:
            packed[-1][IMAGE_COLUMN] = pictures
    return packed


def pack_dataset(dataset, max_length: int):
    """:func:`pack_examples` for a ``datasets.Dataset`` with ``input_ids`` and ``labels``; logs the row count."""
    import datasets

    columns = [c for c in ("input_ids", "labels", IMAGE_COLUMN) if c in dataset.column_names]
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
    """The longest ``input_ids`` of a map-style ``datasets.Dataset`` (read from Arrow, no row decoded), else 0."""
    if not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names or len(dataset) == 0:
        return 0
    import pyarrow.compute as pc

    # The rows the dataset holds (a select()/shuffle() view included), as Arrow batches: no Python row is built.
    rows = dataset.select_columns("input_ids").with_format("arrow").iter(batch_size=65536)
    return max(int(pc.max(pc.list_value_length(batch["input_ids"])).as_py() or 0) for batch in rows)


def is_packed(batch) -> bool:
    """Whether a batch holds packed rows: ``position_ids`` and no ``attention_mask``."""
    return batch.get("position_ids") is not None and batch.get("attention_mask") is None


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


def get_tolerance(dtype: torch.dtype) -> float:
    """The bound of hfacc's layout checks (packed rows here, padding-free micro-batches in :mod:`hfacc.padding_free`):
    1e-6 relative in fp32, the promise on gradients; as many rounding units (8 eps) in half precision: 6.6e-2 in
    bf16, 8.2e-3 in fp16."""
    return 1e-6 * torch.finfo(dtype).eps / torch.finfo(torch.float32).eps


@torch.no_grad()
def check_packing(model, batch, tolerance: float | None = None) -> str | None:
    """Run the first packed row both packed and one sequence at a time; None if every sequence's logits match.

    A model or attention implementation that lets packed sequences attend to each other, or a layer that runs
    across them (LFM2's short convolution, Jamba's Mamba scan), would silently train on the wrong context. A model
    whose forward takes no ``position_ids`` (Bloom) cannot tell them apart at all; it is refused without a run. The
    comparison is each sequence's relative L2 difference, in fp32, within :func:`get_tolerance` (1e-6 for fp32
    weights: a fresh LFM2 leaks by ~1e-5, under the 1e-4 this check once allowed).
    """
    from .model_io import get_base_model, get_logits

    problem = position_ids_problem(get_base_model(model))
    if problem:
        return problem
    if get_image_inputs(batch):  # rows with images: all of them, against their sequences padded (hfacc.multimodal)
        return check_image_layout(model, unpack_rows(batch), batch, tolerance)
    if tolerance is None:
        tolerance = get_tolerance(next(model.parameters()).dtype)
    was_training = model.training
    model.eval()
    try:
        positions = batch["position_ids"][:1]
        ids = batch["input_ids"][:1]
        inputs = with_packed_positions(model, {"input_ids": ids, "position_ids": positions})  # mrope models
        packed = get_logits(model(**inputs, use_cache=False)).double()
        starts = get_sequence_starts(positions[0]).nonzero().flatten().tolist() + [positions.shape[1]]
        worst = 0.0
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            alone = get_logits(model(input_ids=ids[:, a:b], use_cache=False)).double()
            difference = ((packed[:, a:b] - alone).norm() / alone.norm().clamp(min=1e-30)).item()
            worst = max(worst, difference) if difference == difference else float("nan")
    finally:
        model.train(was_training)
    if not worst <= tolerance:
        return (
            f"packed sequences are not kept apart by this model/attention implementation (logits differ by "
            f"{worst:.1e} relative, over {tolerance:.0e})"
        )
    return None


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
    if isinstance(dataset, datasets.Dataset):
        return [len(x) for x in dataset["input_ids"]]
    return [len(e["input_ids"]) for e in dataset]


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
