"""The shared-prompt layout of preference pairs: each pair's prompt computed once, then both answers after it.

A preference micro-batch (:class:`hfacc.DataCollatorForPreference`: ``[2B, T]``, the chosen rows then the rejected
ones) holds every pair's prompt twice, and both copies compute the same hidden states: attention is causal, so no
prompt token sees the answer that follows it. :func:`share_prompts` lays each pair out as one unit, ``[prompt]
[chosen answer][rejected answer]``, where the prompt is the two sequences' longest common prefix of tokens; a 4-D
attention mask lets each answer attend to the prompt and to itself (causally), never to the other answer, and its
``position_ids`` restart after the prompt (``p, p + 1, ...`` for both answers), so every token of each sequence sees
exactly the context and positions it has in its own forward. Units are packed best-fit decreasing into rows as wide
as the longest unit, as :func:`hfacc.data.padding_free.remove_padding` packs sequences (the rest of a row is a
filler unit of its own, at position 0, which nothing else attends to). On the benchmark of benchmarks/README.md the
prompts are a quarter of the tokens.

The mask is the model's to honour: transformers (5.x) takes a 4-D mask as given for sdpa (boolean, True: attend) and
eager attention (additive: 0 or the dtype's lowest value); variable-length kernels (flash attention) and flex
attention's block masks take none. Whether a model computes the layout as it computes each sequence alone is decided
once per model by running it (:func:`hfacc.setup.layout_check.check_shared_prompts`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from .batching import best_fit_decreasing

# What a shared-prompt batch adds beside the model's inputs (never given to the model): the flat index of the
# position each sequence is scored at, and of every padded position (-1: padding).
SCORE_INDEX, LAYOUT_INDEX = "score_index", "layout_index"


def share_prompts(
    batch: Mapping[str, Any],
    pad_token_id: int | None = None,
    mask_dtype: torch.dtype | None = None,
    max_row_length: int = 0,
    keep: Collection[str] = (),
    attention_width: int = 0,
    max_sequence_length: int = 0,
) -> dict[str, Any] | None:
    """``batch``'s pairs with each prompt once (the module doc); None when the batch cannot be laid out so.

    Args:
        batch: a padded ``[2B, T]`` preference micro-batch, pair ``i``'s chosen sequence in row ``i`` and its rejected
            one in row ``B + i`` (right or left padding: one run of real tokens per row).
        pad_token_id: the model's, for the position each sequence is scored at: its rightmost token that is not
            ``pad_token_id`` (its first when every token is), the rule of transformers' own pooling
            (:mod:`hfacc.ops.scores`); None: its last token.
        mask_dtype: None for a boolean mask (True: attend; sdpa), else an additive mask of that dtype (0 or its lowest
            value; eager attention).
        max_row_length: the longest row verified (0: no bound); a unit longer than it makes the batch None.
        keep: per-row entries (an objective's ``row_keys``: margins), kept as they are.
        attention_width: the row width at which a position's attention costs as much as the rest of its work
            (:func:`get_attention_width`); the rows' width is then the one of the least estimated cost,
            ``rows * W * (1 + W / attention_width)``: wider rows hold more units and less filler, but attend over
            more keys. 0: rows as wide as the longest unit.
        max_sequence_length: the longest sequence the layout computes as its own forward (0: no bound): the model's
            sliding window or attention chunk (:func:`get_attention_window`), which transformers does not lay over a
            4-D mask it is given; a sequence no longer than the window is not cut by it. A longer one makes the batch
            None.

    The result has ``input_ids`` and ``position_ids`` ``[rows, W]``, ``attention_mask`` ``[rows, 1, W, W]``,
    ``num_sequences`` (2B), ``score_index`` ``[2B]`` (the flat index into ``[rows * W]`` of the position each sequence
    is scored at) and ``layout_index`` ``[2B, T]`` (of every padded position, -1 at padding; a prompt token of both
    sequences has one). ``labels`` are dropped (a reward model reads none). None where the batch has an odd number of
    rows, no 2-D ``attention_mask``, a row whose real tokens are not one run, ``position_ids`` of its own, another
    per-token tensor (its values would have to agree on the prompt), or a unit longer than ``max_row_length``.

    >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 8, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    >>> laid = share_prompts(batch, pad_token_id=0)
    >>> laid["input_ids"], laid["position_ids"], laid["score_index"]
    (tensor([[5, 6, 7, 8]]), tensor([[0, 1, 2, 1]]), tensor([2, 3]))
    >>> laid["attention_mask"][0, 0].int()  # the rejected answer (8) sees the prompt (5), not the chosen one (6, 7)
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 0, 0, 1]], dtype=torch.int32)
    """
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    if not (torch.is_tensor(mask) and torch.is_tensor(ids) and mask.dim() == 2 and ids.shape == mask.shape):
        return None
    rows, width = ids.shape
    if rows % 2 or batch.get("position_ids") is not None:
        return None
    for key, value in batch.items():  # other per-token tensors would have to agree on the shared prompt
        if key in ("input_ids", "attention_mask", "labels") or key in keep or not torch.is_tensor(value):
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == (rows, width):
            return None
    # One host transfer: the layout depends on the tokens (where the two sequences of a pair part).
    real = mask.bool()
    starts = real.clone()
    starts[:, 1:] &= ~real[:, :-1]
    stats = torch.stack([real.sum(-1), starts.sum(-1), starts.long().argmax(-1)]).tolist()
    if any(runs != 1 for runs in stats[1]):
        return None  # an empty row, or holes in the mask
    if max_sequence_length and max(stats[0]) > max_sequence_length:
        return None  # the window would cut it padded, and cannot cut it under the layout's mask
    tokens = ids.tolist()
    sequences = [(f, tokens[r][f : f + n]) for r, (n, f) in enumerate(zip(stats[0], stats[2], strict=True))]
    pairs = rows // 2
    prompt = []
    for i in range(pairs):
        a, b = sequences[i][1], sequences[pairs + i][1]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prompt.append(n)
    units = [len(sequences[i][1]) + len(sequences[pairs + i][1]) - prompt[i] for i in range(pairs)]
    row_width = max(units)
    if max_row_length and row_width > max_row_length:
        return None
    laid_rows = best_fit_decreasing(units, row_width)
    if attention_width > 0 and len(laid_rows) > 1:
        row_width, laid_rows = _cheapest_rows(units, row_width, laid_rows, attention_width, max_row_length)
    filler_token = sequences[0][1][0]  # a real token, never padding (see remove_padding)
    flat_ids, flat_positions = [], []
    spans = []  # (row, start, end of the prompt, end of the chosen answer, end): each unit's, the filler's
    layout_index = [[-1] * width for _ in range(rows)]
    score_index = [0] * rows
    for row, members in enumerate(laid_rows):
        start = len(flat_ids)
        for i in members:
            p = prompt[i]
            chosen_first, chosen = sequences[i]
            rejected_first, rejected = sequences[pairs + i]
            base = len(flat_ids)
            # [prompt][chosen answer][rejected answer]: the layout position of each padded token
            layout_index[i][chosen_first : chosen_first + len(chosen)] = range(base, base + len(chosen))
            layout_index[pairs + i][rejected_first : rejected_first + p] = range(base, base + p)
            after = base + len(chosen)
            layout_index[pairs + i][rejected_first + p : rejected_first + len(rejected)] = range(
                after, after + len(rejected) - p
            )
            flat_ids += chosen + rejected[p:]
            flat_positions += list(range(len(chosen))) + list(range(p, len(rejected)))
            spans.append((row, base - start, base - start + p, after - start, len(flat_ids) - start))
            for r, (first, sequence) in ((i, sequences[i]), (pairs + i, sequences[pairs + i])):
                last = len(sequence) - 1  # the rightmost token that is not pad_token_id (the first if none is)
                while pad_token_id is not None and last >= 0 and sequence[last] == pad_token_id:
                    last -= 1
                score_index[r] = layout_index[r][first + max(last, 0)]
        fill = row_width - (len(flat_ids) - start)
        spans.append((row, row_width - fill, row_width, row_width, row_width))
        flat_ids += [filler_token] * fill
        # Position 0 throughout: a filler wider than the longest sequence (rows by cost) counting on would raise the
        # batch's largest position, which rotary embeddings that scale by it (longrope: Phi-3; dynamic) read.
        flat_positions += [0] * fill
    device = ids.device
    shape = (len(laid_rows), row_width)
    # Query q attends key k: the same unit, k not after q, and k in the prompt or in q's own answer. Written unit by
    # unit (a causal block, less the rejected answer's view of the chosen one): the work is the units' own squares.
    allowed = torch.zeros(shape[0], 1, row_width, row_width, dtype=torch.bool, device=device)
    causal = torch.ones(row_width, row_width, dtype=torch.bool, device=device).tril_()
    for row, a, p, c, e in spans:
        allowed[row, 0, a:e, a:e] = causal[: e - a, : e - a]
        allowed[row, 0, c:e, p:c] = False
    if mask_dtype is not None:
        allowed = torch.zeros(allowed.shape, dtype=mask_dtype, device=device).masked_fill_(
            ~allowed, torch.finfo(mask_dtype).min
        )
    out: dict[str, Any] = {k: v for k, v in batch.items() if k in keep or not torch.is_tensor(v)}
    out.update(
        input_ids=torch.tensor(flat_ids, dtype=ids.dtype, device=device).view(shape),
        position_ids=torch.tensor(flat_positions, device=device).view(shape),
        attention_mask=allowed,
        num_sequences=rows,
        score_index=torch.tensor(score_index, device=device),
        layout_index=torch.tensor(layout_index, device=device),
    )
    return out


def _cheapest_rows(units, width, rows, attention_width, max_row_length, candidates=64):
    """The row width (from the longest unit to all units in one row, ``candidates`` of them) and its rows of the
    least estimated cost ``rows * W * (1 + W / attention_width)``."""
    widest = sum(units) if not max_row_length else min(sum(units), max_row_length)
    best = (len(rows) * width * (1 + width / attention_width), width, rows)
    step = max(1, -(-(widest - width) // candidates))
    for w in range(width + step, widest + 1, step):
        laid = best_fit_decreasing(units, w)
        cost = len(laid) * w * (1 + w / attention_width)
        if cost < best[0]:
            best = (cost, w, laid)
    return best[1], best[2]


def get_attention_window(config) -> int:
    """The longest sequence a model attends over whole, from its (text) config: its sliding window
    (``sliding_window``: Mistral, Qwen2, Gemma 2/3, Phi-3, ...), attention chunk (``attention_chunk_size``: Llama 4)
    or local window (``window_size``: GPT-Neo), the smallest set; 0 where none is. transformers takes a 4-D mask as
    given, so under the shared-prompt layout's mask no window cuts a sequence, while padded it cuts one longer than
    the window (a key ``window`` or more positions back).

    >>> from transformers import MistralConfig
    >>> get_attention_window(MistralConfig(sliding_window=4096)), get_attention_window(MistralConfig(sliding_window=None))
    (4096, 0)
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    windows = [getattr(config, key, None) for key in ("sliding_window", "attention_chunk_size", "window_size")]
    windows = [w for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return min(windows, default=0)


def get_attention_width(config) -> int:
    """The row width at which one position's attention (its scores and weighted sum over W keys: ``2 * W * heads *
    head_dim`` multiply-adds per layer) costs as many multiply-adds as its projections and MLP, from a decoder's
    config; 0 where the config does not say (rows are then as wide as the longest unit).

    >>> from transformers import LlamaConfig
    >>> get_attention_width(LlamaConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4))
    2048
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    intermediate = getattr(config, "intermediate_size", 0) or 0
    if not (hidden and heads and intermediate):
        return 0
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    return (projections + mlp) // (2 * heads * head_dim)


__all__ = ["LAYOUT_INDEX", "SCORE_INDEX", "get_attention_width", "get_attention_window", "share_prompts"]
