"""SFT datasets with loss masking: prompt/completion, multi-turn chat (assistant turns only), plain text.

Each builder returns token ids and ``labels`` with -100 wherever no loss is wanted. Chat data is rendered by the
tokenizer's own chat template with every field the template reads (``tool_calls``, ``tool_call_id``, ``name``,
reasoning as ``reasoning_content``/``thinking``, content given as text parts) and the row's ``tools``; the
assistant's characters are read off that one rendering (:mod:`hfacc.chat` says how, and why it is right), and
offsets map them to tokens. The tokens are exactly those the template renders for the whole conversation.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat import ChatTemplateError, get_assistant_spans
from .loss import IGNORE_INDEX, count_example_targets

logger = logging.getLogger(__name__)

FORMATS = ("prompt_completion", "messages", "text")
FORMAT_COLUMNS = {"prompt_completion": ("prompt", "completion"), "messages": ("messages",), "text": ("text",)}
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
# Names datasets give a message's reasoning. Both names templates read are filled from whichever is given, as
# transformers does (Qwen3, GLM-4, DeepSeek-R1 read ``reasoning_content``; GPT-OSS, LFM2.5 read ``thinking``).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
TRUNCATIONS = ("right", "drop", "error")


class DataError(ValueError):
    """A row of the dataset cannot be used; the message names the row, the field and the fix."""


def detect_format(column_names: Sequence[str]) -> str:
    """The dataset format from its columns; a clear error, with a guess at misspellings, when none fits."""
    columns = set(column_names)
    for name in ("messages", "prompt_completion", "text"):
        if set(FORMAT_COLUMNS[name]) <= columns:
            return name
    if "conversations" in columns:
        raise DataError(
            "The dataset has a 'conversations' column; hfacc reads chat data from 'messages' (a list of "
            "{role, content}). Rename it: dataset = dataset.rename_column('conversations', 'messages') (ShareGPT "
            "'from'/'value' keys must become 'role'/'content')."
        )
    hints = []
    for expected in ("messages", "prompt", "completion", "text"):
        close = difflib.get_close_matches(expected, list(columns), n=1, cutoff=0.75)
        if close and expected not in columns:
            hints.append(f"'{close[0]}' -> '{expected}'")
    hint = f" Did you mean: {', '.join(hints)}? Rename with dataset.rename_column(old, new)." if hints else ""
    raise DataError(
        f"Cannot tell the dataset format from its columns {sorted(columns)}. hfacc expects 'messages' (chat), "
        f"'prompt' + 'completion', or 'text'.{hint}"
    )


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
        tokenizer: a fast tokenizer; chat data needs its ``chat_template``.
        max_length: longest example in tokens (``None``: no limit).
        format: ``"auto"`` (from the columns) or one of ``"messages"``, ``"prompt_completion"``, ``"text"``.
        last_turn_only: for chat data, train on the last assistant turn only (default: every assistant turn).
        truncation: what to do with an example longer than ``max_length``: ``"right"`` cuts its end, ``"drop"``
            removes it, ``"error"`` stops. Either way the count is reported in one log line.
        num_proc: processes for ``datasets.map``.

    Returns:
        A ``datasets.Dataset`` with ``input_ids``, ``attention_mask`` and ``labels``. Loss goes to the completion
        and its EOS (prompt/completion), to the assistant turns with their end-of-turn tokens (chat), or to every
        token (text). Examples left without a target are dropped, counted in one warning.

    >>> ds = datasets.Dataset.from_list([{"prompt": "2+2=", "completion": "4"}])   # doctest: +SKIP
    >>> build_sft_dataset(ds, tokenizer)[0]["labels"]                               # doctest: +SKIP
    [-100, -100, -100, 19, 2]
    """
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
    needs_template = format == "messages" or (format == "prompt_completion" and _is_conversation(dataset[0]["prompt"]))
    if needs_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "Chat data needs a tokenizer with a chat template, and this one has none. Use the tokenizer of an "
            "instruct/chat model, or set one: tokenizer.chat_template = '<jinja template>' (see "
            "https://huggingface.co/docs/transformers/chat_templating)."
        )
    if tokenizer.eos_token_id is None:
        raise DataError("The tokenizer has no eos_token; set tokenizer.eos_token so completions can end.")

    def encode(row: Mapping[str, Any], index: int) -> dict[str, Any]:
        index = row.get(SOURCE_ROW, index)
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
        keep = not (too_long and truncation == "drop") and num_targets > 0
        return {
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": labels,
            "_too_long": too_long,
            "_keep": keep,
            "_masking": method,
            "_unclosed": unclosed,
        }

    encoded = dataset.map(
        encode,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Tokenizing ({format})",
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
    return kept.remove_columns(["_too_long", "_keep", "_masking", "_unclosed"])


def encode_row(
    tokenizer, row: Mapping[str, Any], index: Any, format: str, *, last_turn_only: bool = False
) -> tuple[list[int], list[int], str, int]:
    """One row of ``format`` as ``(input_ids, labels, masking method, turns left without an end marker)``.

    The method is empty for text and string prompt/completion rows, else how :mod:`hfacc.chat` found the answers.
    """
    if format == "text":
        return (*tokenize_text(tokenizer, _string(row, "text", index)), "", 0)
    tools = normalize_tools(row.get("tools"), index)
    if format == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if _is_conversation(prompt) or _is_conversation(completion):
            prompt_messages = normalize_messages(prompt, index, "prompt", need_assistant=False)
            completion_messages = normalize_messages(completion, index, "completion", need_assistant=True)
            messages = prompt_messages + completion_messages
            first = len(prompt_messages)
            trainable = [i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"]
            return _encode_conversation(tokenizer, messages, trainable, index, tools)
        return (*_tokenize_strings(tokenizer, prompt, completion, index), "", 0)
    messages = normalize_messages(row["messages"], index, "messages", need_assistant=True)
    trainable = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return _encode_conversation(tokenizer, messages, trainable[-1:] if last_turn_only else trainable, index, tools)


def log_masking(methods: Sequence[str], unclosed: Sequence[int]) -> None:
    """The build summary's masking lines: rows counted by how their answers were found, and open turns."""
    counts = Counter(m for m in methods if m)
    if counts:
        logger.info("hfacc: chat rows masked by %s.", ", ".join(f"{m} ({n} rows)" for m, n in counts.most_common()))
    if counts.get("prefix renders"):
        logger.warning(
            "hfacc: %d chat rows were masked from prefix renders: the chat template's loops cannot be traced (it "
            "iterates over indices or renders inside a macro). The masks were checked, but {%% generation %%} "
            "markers in the template would make them certain.",
            counts["prefix renders"],
        )
    if sum(unclosed):
        logger.warning(
            "hfacc: %d assistant turns end without an end-of-turn token to train: the chat template ends a turn "
            "with the next message's role marker, and these turns end their conversation. A model trained on them "
            "does not learn to stop there; end such conversations with a user message, or use a template that "
            "closes assistant turns.",
            sum(unclosed),
        )


def tokenize_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Every token is a target (continued pretraining), EOS appended."""
    ids = _with_eos(tokenizer(text, add_special_tokens=True)["input_ids"], tokenizer.eos_token_id)
    return ids, list(ids)


def tokenize_prompt_completion(
    tokenizer, prompt: Any, completion: Any, index: Any = 0, *, tools: Any = None
) -> tuple[list[int], list[int]]:
    """Loss on the completion and its EOS only.

    Strings are tokenized separately and concatenated, so no token straddles the boundary; the prompt gets the
    tokenizer's special tokens (BOS), the completion EOS. Lists of messages go through the chat template, with
    the assistant turns of the completion trained.
    """
    if _is_conversation(prompt) or _is_conversation(completion):
        row = {"prompt": prompt, "completion": completion, "tools": tools}
        return encode_row(tokenizer, row, index, "prompt_completion")[:2]
    return _tokenize_strings(tokenizer, prompt, completion, index)


def _tokenize_strings(tokenizer, prompt: Any, completion: Any, index: Any) -> tuple[list[int], list[int]]:
    # Not folded into tokenize_prompt_completion: that calls encode_row, which calls this, and a call cycle stops
    # datasets from hashing the map function (its cache would be lost).
    prompt = _string({"prompt": prompt}, "prompt", index, allow_empty=True)
    completion = _string({"completion": completion}, "completion", index)
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if prompt_ids and prompt_ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id != tokenizer.bos_token_id:
        prompt_ids = prompt_ids[:-1]  # tokenizers that append EOS to every text: the prompt does not end there
    completion_ids = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def tokenize_messages(
    tokenizer, messages: Any, index: Any = 0, *, last_turn_only: bool = False, tools: Any = None
) -> tuple[list[int], list[int]]:
    """Loss on the assistant turns (each with its end-of-turn token), or on the last one only.

    ``tools`` (a list of JSON schemas, or a JSON string of one) is passed to the chat template.
    """
    row = {"messages": messages, "tools": tools}
    return encode_row(tokenizer, row, index, "messages", last_turn_only=last_turn_only)[:2]


def _encode_conversation(tokenizer, messages, trainable, index, tools):
    try:
        found = get_assistant_spans(tokenizer, messages, trainable, tools)
    except ChatTemplateError as err:
        raise DataError(f"row {index}: {err}") from err
    encoding = tokenizer(found.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    labels = [IGNORE_INDEX] * len(ids)
    spans, s = sorted(found.spans), 0
    for t, (a, b) in enumerate(offsets):
        # A token is trained when it *ends* inside an answer span: a token that straddles the header/answer
        # boundary produces answer text, a newline after the end-of-turn token does not.
        while s < len(spans) and spans[s][1] < b:
            s += 1
        if s == len(spans):
            break
        if b > a and spans[s][0] < b:
            labels[t] = ids[t]
    return list(ids), labels, found.method, found.unclosed


def normalize_messages(value: Any, index: Any, field: str, need_assistant: bool) -> list[dict]:
    """Check a conversation and return it as plain dicts with every field a chat template may read.

    Kept: ``role``, ``content`` (a string, or a list of ``{"type": "text", "text": ...}`` parts), ``tool_calls``,
    ``tool_call_id``, ``name``, reasoning, and any other field. Values that are None are dropped at every level
    (Arrow fills the fields one row lacks with None, and templates test for presence), as are empty ``tool_calls``.
    Reasoning given under any of :data:`REASONING_FIELDS` is passed as both ``reasoning_content`` and ``thinking``.
    A non-text content part (image, audio, ...) is an error: hfacc trains on text only.
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(
            f"row {index}, field '{field}': expected a non-empty list of {{'role', 'content'}} messages, got "
            f"{type(value).__name__}."
        )
    messages = []
    for j, m in enumerate(value):
        where = f"row {index}, field '{field}', message {j}"
        if not isinstance(m, Mapping) or "role" not in m:
            raise DataError(f"{where}: expected a dict with 'role' and 'content', got {m!r:.80}.")
        m = _drop_none(m)
        if m["role"] not in ROLES:
            raise DataError(f"{where}: unknown role {m['role']!r}; use one of {list(ROLES)}.")
        if "tool_calls" in m:
            _check_tool_calls(m["tool_calls"], where)
            if not m["tool_calls"]:
                del m["tool_calls"]
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise DataError(f"{where}: the reasoning must be a string, got {type(reasoning).__name__}.")
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if "content" in m:
            _check_content(m["content"], where)
        elif not (m["role"] == "assistant" and ("tool_calls" in m or reasoning is not None)):
            raise DataError(
                f"{where}: expected a dict with 'role' and 'content', got {m!r:.80} (only an assistant message "
                "with 'tool_calls' or reasoning may leave out 'content')."
            )
        messages.append(m)
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"row {index}, field '{field}': the conversation has no assistant message to train on.")
    return messages


def normalize_tools(value: Any, index: Any) -> list[dict] | None:
    """The row's ``tools``: a list of JSON schemas (or a JSON string of one) for the template; None if empty."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as err:
            raise DataError(
                f"row {index}, field 'tools': not valid JSON ({err}). Give a list of JSON schemas, or a JSON string "
                "of one."
            ) from err
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, Mapping) for t in value):
        raise DataError(
            f"row {index}, field 'tools': expected a list of JSON schemas (dicts such as {{'type': 'function', "
            f"'function': {{'name': ..., 'parameters': ...}}}}), got {value!r:.80}."
        )
    return [_drop_none(t) for t in value] or None


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, (list, tuple)):
        raise DataError(
            f"{where}: 'content' must be a string, got {type(content).__name__} (or a list of "
            "{'type': 'text', 'text': ...} parts)."
        )
    for p, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind is not None and kind != "text":
            raise DataError(
                f"{where}, content part {p}: a part of type {kind!r}. hfacc trains on text only (multimodal "
                "training is not supported yet); remove the non-text parts or the row."
            )
        raise DataError(f"{where}, content part {p}: expected {{'type': 'text', 'text': <string>}}, got {part!r:.80}.")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, (list, tuple)):
        raise DataError(f"{where}: 'tool_calls' must be a list of tool calls, got {type(calls).__name__}.")
    for c, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise DataError(
                f"{where}, tool call {c}: expected {{'type': 'function', 'function': {{'name': <string>, "
                f"'arguments': <dict or JSON string>}}}}, got {call!r:.100}."
            )
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (Mapping, str)):
            raise DataError(
                f"{where}, tool call {c}: 'arguments' must be a dict or a JSON string, got {type(arguments).__name__}."
            )


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value


def _string(row: Mapping[str, Any], field: str, index: int, allow_empty: bool = False) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise DataError(
            f"row {index}, field '{field}': expected a string, got {type(value).__name__} ({value!r:.60})."
        )
    if not allow_empty and not value.strip():
        raise DataError(f"row {index}, field '{field}': it is empty; remove the row or fill it in.")
    return value


def _is_conversation(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], Mapping)


def _with_eos(ids: list[int], eos: int) -> list[int]:
    ids = list(ids)
    return ids if ids and ids[-1] == eos else ids + [eos]


def render_mask(tokenizer, input_ids: Sequence[int], labels: Sequence[int], color: bool = True) -> str:
    """The example as text, trained tokens highlighted: green with ``color``, else wrapped in ``[[ ]]``.

    A trained token is one whose label is not -100 (the token the previous position learns to predict).
    """
    pieces, trained_run = [], None
    for token, label in zip(input_ids, labels, strict=True):
        trained = label != IGNORE_INDEX
        text = tokenizer.decode([token], skip_special_tokens=False)
        if trained != trained_run:
            if trained_run:
                pieces.append("\x1b[0m" if color else "]]")
            if trained:
                pieces.append("\x1b[1;32m" if color else "[[")
            trained_run = trained
        pieces.append(text)
    if trained_run:
        pieces.append("\x1b[0m" if color else "]]")
    return "".join(pieces)


SOURCE_ROW = "_source_row"
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_sft_source(
    name_or_path: str | None,
    *,
    config: str | None = None,
    split: str = "train",
    eval_split: str | None = None,
    eval_fraction: float = 0.05,
    max_examples: int | None = None,
    seed: int = 0,
    num_embedded: int = 4000,
):
    """Load raw SFT data and return ``(train, eval)`` ``datasets.Dataset`` s.

    ``name_or_path`` is a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file, a directory written by
    ``Dataset.save_to_disk``, a hub dataset name, or ``None`` for the embedded instruction dataset. Without an
    ``eval_split``, a seeded ``eval_fraction`` of the examples is held out.
    """
    import datasets

    if name_or_path is None:
        from .embedded import generate_instruction_examples

        data = datasets.Dataset.from_list(generate_instruction_examples(num_embedded, seed=seed))
        held_out = None
    else:
        path = Path(name_or_path)
        if path.suffix in LOCAL_FORMATS:
            if not path.is_file():
                raise DataError(f"dataset {name_or_path}: no such file.")
            if path.suffix in (".json", ".jsonl"):
                # Check the rows as written, before Arrow unifies types (it turns "4" into 4 when another row
                # holds a number), so an error names the row and line that is really wrong.
                validate_json_file(path)
            try:
                data = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
            except Exception as err:  # pyarrow errors name neither the row nor the fix
                raise DataError(
                    f"{path} cannot be read as {LOCAL_FORMATS[path.suffix]}: {err}. Check that every row is valid "
                    "and that each column has one type throughout."
                ) from err
            held_out = None
        elif path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            loaded = datasets.load_from_disk(str(path))
            data, held_out = _pick_splits(loaded, split, eval_split, name_or_path)
        else:
            loaded = datasets.load_dataset(name_or_path, config)
            data, held_out = _pick_splits(loaded, split, eval_split, name_or_path)
    if max_examples is not None:
        data = data.select(range(min(max_examples, len(data))))
    # Errors found later (in build_sft_dataset) name the row of the source, not of a shuffled split.
    data = data.add_column(SOURCE_ROW, list(range(len(data))))
    if held_out is not None:
        held_out = held_out.add_column(SOURCE_ROW, list(range(len(held_out))))
    if held_out is None:
        if not 0 < eval_fraction < 1:
            raise DataError(
                f"eval_fraction={eval_fraction}: it must be between 0 and 1 (exclusive) without eval_split."
            )
        parts = data.train_test_split(test_size=eval_fraction, seed=seed)
        data, held_out = parts["train"], parts["test"]
    return data, held_out


def validate_json_file(path: str | Path) -> None:
    """Parse a .json/.jsonl file with Python's json and check every row's fields; DataError names row and line."""
    path = Path(path)
    records: list[tuple[str, Any]] = []
    if path.suffix == ".jsonl":
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append((f"{len(records)} (line {number} of {path.name})", json.loads(line)))
                except ValueError as err:
                    raise DataError(f"{path}: line {number} is not valid JSON ({err}).") from err
    else:
        try:
            data = json.loads(path.read_text())
        except ValueError as err:
            raise DataError(f"{path} is not valid JSON ({err}).") from err
        rows = data if isinstance(data, list) else next((v for v in data.values() if isinstance(v, list)), None)
        if rows is None:
            raise DataError(f"{path}: expected a list of rows (or an object holding one).")
        records = [(f"{i} of {path.name}", row) for i, row in enumerate(rows)]
    if not records:
        raise DataError(f"{path} holds no rows.")
    for label, row in records:
        if not isinstance(row, Mapping):
            raise DataError(f"row {label}: expected an object with named fields, got {type(row).__name__}.")
    format = detect_format(list(records[0][1]))
    for label, row in records:
        missing = [c for c in FORMAT_COLUMNS[format] if c not in row]
        if missing:
            raise DataError(f"row {label}: no field {missing[0]!r}, which the other rows ({format} format) have.")
        if format == "messages":
            normalize_messages(row["messages"], label, "messages", need_assistant=True)
            normalize_tools(row.get("tools"), label)
        elif format == "text":
            _string(row, "text", label)
        elif _is_conversation(row["prompt"]) or _is_conversation(row["completion"]):
            normalize_messages(row["prompt"], label, "prompt", need_assistant=False)
            normalize_messages(row["completion"], label, "completion", need_assistant=True)
            normalize_tools(row.get("tools"), label)
        else:
            _string(row, "prompt", label, allow_empty=True)
            _string(row, "completion", label)


def _pick_splits(loaded, split, eval_split, name):
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded, None
    if split not in loaded:
        raise DataError(f"dataset {name} has no split {split!r}; it has {list(loaded)}. Set dataset_train_split.")
    if eval_split is not None and eval_split not in loaded:
        raise DataError(f"dataset {name} has no split {eval_split!r}; it has {list(loaded)}. Set dataset_eval_split.")
    return loaded[split], (loaded[eval_split] if eval_split else None)


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

    def sft_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`build_sft_dataset` these settings stand for."""
        return dict(
            max_length=self.max_length,
            format=self.dataset_format,
            last_turn_only=self.last_turn_only,
            truncation=self.truncation,
        )


def build_datasets(args: DataArguments, tokenizer, seed: int = 0):
    """``(train, eval, raw_eval)``: tokenized, masked train/eval datasets and the raw held-out rows."""
    raw_train, raw_eval = load_sft_source(
        args.dataset_name,
        config=args.dataset_config,
        split=args.dataset_train_split,
        eval_split=args.dataset_eval_split,
        eval_fraction=args.eval_fraction,
        max_examples=args.max_examples,
        seed=seed,
        num_embedded=args.num_embedded_examples,
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


def example_rows(args: DataArguments, count: int, start: int = 0, seed: int = 0):
    """The raw rows behind :func:`build_examples` (a ``datasets.Dataset``)."""
    rows = max(2 * (start + count), 16)
    raw, _ = load_sft_source(
        args.dataset_name,
        config=args.dataset_config,
        split=args.dataset_train_split,
        eval_fraction=0.5,
        seed=seed,
        num_embedded=rows,
        max_examples=rows,
    )
    return raw.select(range(min(start, len(raw)), min(len(raw), start + count)))


def describe_row(row: Mapping[str, Any]) -> str:
    """One line on what a chat row holds: its messages with their tool calls, reasoning and parts, and its tools.

    >>> describe_row({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "",
    ...     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]})
    'messages: user, assistant [tool call get_weather(city)]'
    """
    conversation = [
        m for key in ("prompt", "completion", "messages") if _is_conversation(row.get(key)) for m in row[key]
    ]
    if not conversation:
        return ""
    parts = []
    for m in conversation:
        m = _drop_none(m)
        notes = []
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            arguments = fn.get("arguments")
            names = ", ".join(arguments) if isinstance(arguments, Mapping) else "..."
            notes.append(f"tool call {fn.get('name')}({names})")
        reasoning = next((m[k] for k in REASONING_FIELDS if isinstance(m.get(k), str)), None)
        if reasoning is not None:
            notes.append(f"reasoning {len(reasoning)} chars")
        if isinstance(m.get("content"), list):
            notes.append(f"{len(m['content'])} content parts")
        parts.append(m.get("role", "?") + (f" [{'; '.join(notes)}]" if notes else ""))
    line = "messages: " + ", ".join(parts)
    try:
        tools = normalize_tools(row.get("tools"), 0)
    except DataError:
        tools = None
    if tools:
        line += "; tools: " + ", ".join(str(t.get("function", t).get("name")) for t in tools)
    return line
