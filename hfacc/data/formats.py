"""Rows to tokens with loss masking: the three formats (prompt/completion, chat, text), their checks and errors.

Each row becomes token ids and ``labels`` with -100 wherever no loss is wanted. Chat data is rendered by the
tokenizer's own chat template with every field the template reads (``tool_calls``, ``tool_call_id``, ``name``,
reasoning as ``reasoning_content``/``thinking``, content given as text parts) and the row's ``tools``; the
assistant's characters are read off that one rendering (:mod:`hfacc.data.chat` says how, and why it is right), and
offsets map them to tokens. The tokens are exactly those the template renders for the whole conversation.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..ops.loss import IGNORE_INDEX
from .chat import METHODS, ChatTemplateError, get_assistant_spans

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


def encode_row(
    tokenizer, row: Mapping[str, Any], index: Any, format: str, *, last_turn_only: bool = False
) -> tuple[list[int], list[int], str, int]:
    """One row of ``format`` as ``(input_ids, labels, masking method, turns left without an end marker)``.

    The method is empty for text and string prompt/completion rows, else how :mod:`hfacc.data.chat` found the answers.
    """
    if format == "text":
        return (*tokenize_text(tokenizer, _string(row, "text", index)), "", 0)
    if format == "prompt_completion" and not (_is_conversation(row["prompt"]) or _is_conversation(row["completion"])):
        return (*_tokenize_strings(tokenizer, row["prompt"], row["completion"], index), "", 0)
    messages, trainable, tools = get_conversation(row, index, format, last_turn_only=last_turn_only)
    return _encode_conversation(tokenizer, messages, trainable, index, tools)


def get_conversation(
    row: Mapping[str, Any], index: Any, format: str, *, last_turn_only: bool = False, allow_images: bool = False
) -> tuple[list[dict], list[int], list[dict] | None]:
    """A chat row's ``(messages, indices of the assistant turns to train, tools)``, checked.

    ``format`` is ``"messages"`` or a conversational ``"prompt_completion"`` (whose completion's assistant turns
    are trained). ``allow_images`` lets content parts be images (:mod:`hfacc.data.vision`).
    """
    tools = normalize_tools(row.get("tools"), index)
    if format == "prompt_completion":
        prompt_messages = normalize_messages(row["prompt"], index, "prompt", False, allow_images=allow_images)
        completion_messages = normalize_messages(
            row["completion"], index, "completion", True, allow_images=allow_images
        )
        messages = prompt_messages + completion_messages
        first = len(prompt_messages)
        return messages, [i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"], tools
    messages = normalize_messages(row["messages"], index, "messages", need_assistant=True, allow_images=allow_images)
    trainable = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return messages, trainable[-1:] if last_turn_only else trainable, tools


def log_masking(methods: Sequence[str], unclosed: Sequence[int]) -> None:
    """The build summary's masking lines: rows counted by how their answers were found, and open turns."""
    counts = Counter(m for m in methods if m)
    if counts:
        logger.info("hfacc: chat rows masked by %s.", ", ".join(f"{m} ({n} rows)" for m, n in counts.most_common()))
    from_prefixes = counts[METHODS["prefix"]] + counts[METHODS["segments_and_prefix"]]
    if from_prefixes:
        logger.warning(
            "hfacc: %d chat rows were masked from prefix renders (in whole or in part): the chat template writes "
            "assistant turns outside loops hfacc can trace (it iterates over indices, renders inside a macro, or "
            "writes a turn after its loop). The masks were checked, but {%% generation %%} markers in the template "
            "would make them certain.",
            from_prefixes,
        )
    if sum(unclosed):
        logger.warning(
            "hfacc: %d assistant turns end without an end-of-turn token to train: where they end, the chat template "
            "writes no special token (no end-of-turn marker of the turn, and none opening a next message or closing "
            "the conversation). A model trained on them does not learn to stop there. Templates that end a turn with "
            "the next message's role marker (GLM-4) leave a conversation's last turn open: end such conversations "
            "with a user message. Templates that end turns with plain text (ChatQA, AmberChat) have no token to "
            "train: use a template that closes assistant turns with a special token.",
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
    ids = encoding["input_ids"]
    return list(ids), get_span_labels(ids, encoding["offset_mapping"], found.spans), found.method, found.unclosed


def get_span_labels(ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]):
    """Labels of tokens (their character ``offsets``): the token id where it is trained, else -100.

    A token is trained when it *ends* inside an answer span: a token that straddles the header/answer boundary
    produces answer text, a newline after the end-of-turn token does not.
    """
    labels = [IGNORE_INDEX] * len(ids)
    spans, s = sorted(spans), 0
    for t, (a, b) in enumerate(offsets):
        while s < len(spans) and spans[s][1] < b:
            s += 1
        if s == len(spans):
            break
        if b > a and spans[s][0] < b:
            labels[t] = ids[t]
    return labels


def normalize_messages(
    value: Any, index: Any, field: str, need_assistant: bool, *, allow_images: bool = False
) -> list[dict]:
    """Check a conversation and return it as plain dicts with every field a chat template may read.

    Kept: ``role``, ``content`` (a string, or a list of ``{"type": "text", "text": ...}`` parts), ``tool_calls``,
    ``tool_call_id``, ``name``, reasoning, and any other field. Values that are None are dropped at every level
    (Arrow fills the fields one row lacks with None, and templates test for presence), as are empty ``tool_calls``.
    Reasoning given under any of :data:`REASONING_FIELDS` is passed as both ``reasoning_content`` and ``thinking``.
    A non-text content part (image, audio, ...) is an error, except image parts with ``allow_images`` (a
    vision-language processor, :mod:`hfacc.data.vision`).
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(
            f"row {index}, field '{field}': expected a non-empty list of {{'role', 'content'}} messages, got "
            f"{type(value).__name__}."
        )
    messages = []
    for j, m in enumerate(value):
        where = f"row {index}, field '{field}', message {j}"
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: expected a dict with 'role' and 'content', got {m!r:.80}.")
        if m.get("role") is None:  # missing, or None: Arrow fills the field a message lacks with None
            raise DataError(
                f"{where}: the message has no 'role' (got {dict(m)!r:.80}). Give every message a role, one of "
                f"{list(ROLES)}."
            )
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
            _check_content(m["content"], where, allow_images)
            if need_assistant and m["role"] == "assistant" and "tool_calls" not in m and reasoning is None:
                content = m["content"]
                text = content if isinstance(content, str) else "".join(p.get("text") or "" for p in content)
                if not text.strip():  # it would train the end-of-turn token alone, as an empty completion would
                    raise DataError(f"{where}: the assistant message is empty; remove the row or fill it in.")
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


def _check_content(content: Any, where: str, allow_images: bool = False) -> None:
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
        if kind in ("image", "image_url") and allow_images:
            continue
        if kind in ("image", "image_url"):
            raise DataError(
                f"{where}, content part {p}: an image, but the tokenizer (or processor) given has no image "
                "processor. Train a vision-language model with its processor: build_sft_dataset(dataset, processor), "
                "the processor from hfacc.get_processor(model name) or AutoProcessor (the recipe picks it from the "
                "model)."
            )
        if kind is not None and kind != "text":
            raise DataError(
                f"{where}, content part {p}: a part of type {kind!r}. hfacc trains on text and images only; remove "
                "the other parts or the row."
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
            images = sum(isinstance(p, Mapping) and p.get("type") in ("image", "image_url") for p in m["content"])
            notes.append(f"{len(m['content'])} content parts" + (f", {images} image(s)" if images else ""))
        parts.append(m.get("role", "?") + (f" [{'; '.join(notes)}]" if notes else ""))
    line = "messages: " + ", ".join(parts)
    try:
        tools = normalize_tools(row.get("tools"), 0)
    except DataError:
        tools = None
    if tools:
        line += "; tools: " + ", ".join(str(t.get("function", t).get("name")) for t in tools)
    return line
