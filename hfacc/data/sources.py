"""Where SFT rows come from: a hub dataset, a local .json/.jsonl/.csv/.parquet file, a saved directory, or the
embedded default; and the train/held-out split."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .formats import (
    FORMAT_COLUMNS,
    DataError,
    _is_conversation,
    _string,
    detect_format,
    normalize_messages,
    normalize_tools,
)

logger = logging.getLogger(__name__)


SOURCE_ROW = "_source_row"


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_sft_source(
    name_or_path: str | None,
    *,
    config: str | None = None,
    split: str = "train",
    eval_split: str | None = None,
    eval_fraction: float = 0.05,
    hold_out: bool = True,
    max_examples: int | None = None,
    seed: int = 0,
    num_embedded: int = 4000,
    embedded: str = "instructions",
    prompts: bool = False,
    tool_direct_fraction: float = 0.3,
):
    """Load raw SFT data and return ``(train, eval)`` ``datasets.Dataset`` s.

    ``name_or_path`` is a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file, a directory written by
    ``Dataset.save_to_disk``, a hub dataset name, or ``None`` for the embedded dataset (``embedded``: generated
    ``"instructions"``, or ``"shapes"``, pictures with questions for a vision-language model, or ``"tools"``, of which
    ``tool_direct_fraction`` answer without the tool). Without an
    ``eval_split``, a seeded ``eval_fraction`` of the examples is held out; ``hold_out=False`` holds out none and
    keeps the rows in order (the eval dataset is empty). ``prompts``: rows of a ``prompt`` alone are accepted too
    (prompts to sample completions for: on-policy distillation).
    """
    import datasets

    if name_or_path is None:
        data = datasets.Dataset.from_list(generate_embedded_rows(embedded, num_embedded, seed, tool_direct_fraction))
        held_out = None
    else:
        path = Path(name_or_path)
        files = get_local_data_files(name_or_path)
        for file in files:
            if file.suffix in (".json", ".jsonl"):
                # Check the rows as written, before Arrow unifies types (it turns "4" into 4 when another row
                # holds a number), so an error names the row and line that is really wrong.
                validate_json_file(file, prompts=prompts)
        if path.suffix in LOCAL_FORMATS:
            if eval_split is not None or split != "train":  # a file is one split: the names would be ignored
                given = (
                    f"dataset_eval_split={eval_split!r}"
                    if eval_split is not None
                    else f"dataset_train_split={split!r}"
                )
                raise DataError(
                    f"{given}: dataset {name_or_path} is a single file, which has no splits. Leave it unset (the "
                    "evaluation rows are held out: eval_fraction), or give a folder or Hub dataset with splits."
                )
            try:
                data = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
            except Exception as err:  # pyarrow's and pandas' errors name neither the line nor the fix
                raise DataError(describe_read_failure(files, err, prompts)) from err
            held_out = None
        elif _is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            data, held_out = _pick_splits(loaded, split, eval_split, name_or_path)
        else:
            try:
                loaded = datasets.load_dataset(name_or_path, config)
            except Exception as err:
                if not files:  # a hub dataset: the console names what the Hub said
                    raise
                raise DataError(describe_read_failure(files, err, prompts)) from err
            data, held_out = _pick_splits(loaded, split, eval_split, name_or_path)
    if max_examples is not None:
        data = data.select(range(min(max_examples, len(data))))
    # Errors found later (in build_sft_dataset) name the row of the source, not of a shuffled split.
    data = data.add_column(SOURCE_ROW, list(range(len(data))))
    if held_out is not None:
        held_out = held_out.add_column(SOURCE_ROW, list(range(len(held_out))))
    if held_out is None and not hold_out:
        held_out = data.select([])  # every row, in its order (hfacc show-mask)
    if held_out is None:
        if not 0 < eval_fraction < 1:
            raise DataError(
                f"eval_fraction={eval_fraction}: it must be between 0 and 1 (exclusive) without eval_split."
            )
        try:
            parts = data.train_test_split(test_size=eval_fraction, seed=seed)
        except ValueError as err:  # datasets: "the resulting train set will be empty"
            raise DataError(
                f"dataset {name_or_path or '(embedded)'}: {len(data)} row(s), too few to hold out "
                f"eval_fraction={eval_fraction} of them for evaluation and train on the rest. Add rows, or give an "
                "eval_split."
            ) from err
        data, held_out = parts["train"], parts["test"]
    return data, held_out


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


# What a data file's name ends with, read or not (a folder of these, or one hfacc cannot read, is said by name).
DATA_SUFFIXES = (*LOCAL_FORMATS, ".txt", ".tsv", ".arrow", ".gz", ".zip", ".xlsx")


def looks_like_a_file(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is meant as a local path rather than a Hub id (``owner/name``): it starts like a path
    (``./``, ``../``, ``/``, ``~``), has more than one separator, ends with a data file's suffix or one close to it
    (``.jsnol``), or is close to the name of a file beside it (``prefs.jsonl`` for ``pref.jsonl``).

    >>> [looks_like_a_file(n) for n in ("trl-lib/ultrafeedback_binarized", "prefs.jsnol", "./data", "a/b/c")]
    [False, True, True, True]
    """
    path = Path(name_or_path)
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path:
        return True
    suffix = path.suffix.lower()
    if suffix and difflib.get_close_matches(suffix, DATA_SUFFIXES, n=1, cutoff=0.6):
        return True
    return get_close_file(path) is not None


def get_close_file(path: Path) -> str | None:
    """The file or folder beside ``path`` whose name is closest to its name (difflib, close matches only), else None."""
    folder = path.parent
    try:
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return None
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
    return str(folder / close[0]) if close else None


def get_local_data_files(name_or_path: str) -> list[Path]:
    """The local data files ``name_or_path`` stands for: itself (a .json/.jsonl/.csv/.parquet file), the data files
    of a folder (not a ``save_to_disk`` one), or none (a hub name). A DataError for what hfacc cannot read."""
    path = Path(name_or_path)
    if not path.exists() and looks_like_a_file(name_or_path):  # a mistyped file is no Hub dataset: say so here
        close = get_close_file(path)
        hint = f" Did you mean {close}?" if close else ""
        raise DataError(f"dataset {name_or_path}: no such file.{hint}")
    if path.suffix in LOCAL_FORMATS:
        return [path]
    if path.is_file():
        raise DataError(
            f"dataset {name_or_path}: hfacc reads .json, .jsonl, .csv and .parquet files (or a save_to_disk folder), "
            f"not {path.suffix or 'a file without an extension'}. Convert it, e.g. to one JSON object per line in a "
            ".jsonl file."
        )
    if not path.is_dir() or _is_saved_dataset(path):
        return []
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS and p.is_file())
    if not files:
        raise DataError(
            f"dataset {name_or_path}: the folder holds no .json, .jsonl, .csv or .parquet file, and is no save_to_disk "
            "folder either."
        )
    return files


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed row)`` of a .jsonl file; a DataError names the first line that is not UTF-8 or JSON."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}: line {number} is not valid UTF-8 ({err.reason} at byte {err.start}); save the file "
                    "as UTF-8."
                ) from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as err:
                raise DataError(f"{path}: line {number} is not valid JSON ({err}).") from err


def describe_read_failure(files: list[Path], err: BaseException, prompts: bool = False) -> str:
    """What is wrong in ``files`` when reading them failed with ``err`` (datasets' and pyarrow's messages name no
    line): the first line of a .json/.jsonl file that is not UTF-8 or JSON, or the CSV record that breaks, found by
    reading the files again with Python's own parsers (only on this failure path)."""
    for file in files:
        try:
            if file.suffix == ".jsonl":
                for _ in _json_lines(file):
                    pass
            elif file.suffix == ".json":
                validate_json_file(file, prompts=prompts)
            elif file.suffix == ".csv" and (problem := _csv_problem(file)):
                return f"{file}: {problem}."
        except DataError as found:
            return str(found)
    cause = err
    while cause.__cause__ or cause.__context__:
        cause = cause.__cause__ or cause.__context__
    where = files[0] if len(files) == 1 else f"{files[0].parent} ({len(files)} files)"
    return (
        f"{where} cannot be read: {str(cause).strip() or type(cause).__name__}. Check that every row is valid and that "
        "each column has one type throughout."
    )


def _csv_problem(path: Path) -> str | None:
    """The first record of a CSV file with an unbalanced quote or another number of fields than the header."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, strict=True)
            header = next(reader, None)
            if header is None:
                return "it is empty"
            start = reader.line_num + 1
            for record in reader:
                if len(record) != len(header):
                    return f"the record that starts on line {start} has {len(record)} fields, the header {len(header)}"
                start = reader.line_num + 1
    except csv.Error as err:
        return f"the record that starts on line {start} is malformed ({err}; a quote opened there is not closed?)"
    except UnicodeDecodeError as err:
        return f"it is not valid UTF-8 ({err.reason}); save it as UTF-8"
    return None


EMBEDDED_DATASETS = ("instructions", "shapes", "tools")


def generate_embedded_rows(kind: str, n: int, seed: int, tool_direct_fraction: float = 0.3) -> list[dict]:
    """The embedded dataset's rows: generated ``"instructions"`` (:mod:`hfacc.data.embedded`), ``"shapes"``
    (:mod:`hfacc.data.embedded_vision`) or ``"tools"`` (tool-call conversations, :mod:`hfacc.data.embedded_tools`,
    ``tool_direct_fraction`` of them answering without the tool)."""
    if kind == "shapes":
        from .embedded_vision import generate_shape_examples

        return generate_shape_examples(n, seed=seed)
    if kind == "tools":
        from .embedded_tools import generate_tool_examples

        return generate_tool_examples(n, seed=seed, direct_fraction=tool_direct_fraction)
    if kind != "instructions":
        raise DataError(f"embedded_dataset={kind!r}: use one of {list(EMBEDDED_DATASETS)}.")
    from .embedded import generate_instruction_examples

    return generate_instruction_examples(n, seed=seed)


def validate_json_file(path: str | Path, prompts: bool = False) -> None:
    """Parse a .json/.jsonl file with Python's json and check every row's fields; DataError names row and line.

    ``prompts``: rows with a ``prompt`` and no ``completion`` are prompts (text or chat messages), and are accepted.
    """
    path = Path(path)
    records: list[tuple[str, Any]] = []
    if path.suffix == ".jsonl":
        for number, line in _json_lines(path):
            records.append((f"{len(records)} (line {number} of {path.name})", line))
    else:
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise DataError(
                f"{path}: line {line} is not valid UTF-8 ({err.reason}); save the file as UTF-8."
            ) from None
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
    first = records[0][1]
    only_prompts = prompts and "prompt" in first and "completion" not in first and "messages" not in first
    format = "prompt" if only_prompts else detect_format(list(first))
    for label, row in records:
        missing = [c for c in FORMAT_COLUMNS.get(format, ("prompt",)) if c not in row]
        if missing:
            raise DataError(f"row {label}: no field {missing[0]!r}, which the other rows ({format} format) have.")
        if format == "prompt":
            if _is_conversation(row["prompt"]):
                normalize_messages(row["prompt"], label, "prompt", need_assistant=False)
            else:
                _string(row, "prompt", label)
            continue
        # Image parts are checked when the rows are tokenized, where it is known whether a processor reads them.
        if format == "messages":
            normalize_messages(row["messages"], label, "messages", need_assistant=True, allow_images=True)
            normalize_tools(row.get("tools"), label)
        elif format == "text":
            _string(row, "text", label)
        elif _is_conversation(row["prompt"]) or _is_conversation(row["completion"]):
            normalize_messages(row["prompt"], label, "prompt", need_assistant=False, allow_images=True)
            normalize_messages(row["completion"], label, "completion", need_assistant=True, allow_images=True)
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


def load_stream_source(args, seed: int = 0):
    """``(train, raw_eval)``: the training rows as a ``datasets.IterableDataset``, and the held-out rows as a
    ``datasets.Dataset`` (the first ``stream_eval_examples`` rows of ``dataset_eval_split``, or of the stream, which
    then trains on the rest).

    A local ``.json``/``.jsonl``/``.csv``/``.parquet`` file is streamed from disk, a hub name from the hub, a
    ``save_to_disk`` directory as an iterable view, ``None`` (the embedded data) from its generator.
    """
    import datasets

    name = args.dataset_name
    held_out = None
    if name is None:
        count, kind = args.num_embedded_examples, args.embedded_dataset

        def embedded_rows():
            yield from generate_embedded_rows(kind, count, seed, args.tool_direct_fraction)

        source = datasets.IterableDataset.from_generator(embedded_rows)
    else:
        path = Path(name)
        get_local_data_files(name)  # a file hfacc cannot read is said now
        if path.suffix in LOCAL_FORMATS:
            source = datasets.load_dataset(
                LOCAL_FORMATS[path.suffix], data_files=str(path), split="train", streaming=True
            )
        elif path.is_dir() and (path / "dataset_info.json").exists():
            source = datasets.load_from_disk(str(path)).to_iterable_dataset()
        else:
            source = datasets.load_dataset(name, args.dataset_config, split=args.dataset_train_split, streaming=True)
            if args.dataset_eval_split:
                held_out = datasets.load_dataset(
                    name, args.dataset_config, split=args.dataset_eval_split, streaming=True
                ).take(args.stream_eval_examples)
    if source.n_shards == 1:
        # One shard is split row by row across ranks, so an index taken before the split is the row's place in the
        # stream: errors name it, as the map-style path names rows.
        source = source.map(lambda row, i: {SOURCE_ROW: i}, with_indices=True)
    if held_out is None:
        held_out, source = source.take(args.stream_eval_examples), source.skip(args.stream_eval_examples)
    if args.max_examples is not None:
        source = source.take(args.max_examples)
    try:
        raw_eval = datasets.Dataset.from_list(list(held_out))
    except DataError:
        raise
    except Exception as err:  # a broken line among the held-out rows
        files = get_local_data_files(name) if name else []
        if not files:
            raise
        raise DataError(describe_read_failure(files, err)) from err
    if len(raw_eval) == 0:
        raise DataError(f"dataset {name or '(embedded)'}: the stream is empty; nothing to hold out or train on.")
    if not args.dataset_eval_split and len(raw_eval) < args.stream_eval_examples:
        raise DataError(
            f"dataset {name or '(embedded)'}: the stream has {len(raw_eval)} rows, all held out for evaluation "
            f"(stream_eval_examples={args.stream_eval_examples}): none is left to train on. Lower "
            "--stream_eval_examples, or give an evaluation split (--dataset_eval_split)."
        )
    return source, raw_eval
