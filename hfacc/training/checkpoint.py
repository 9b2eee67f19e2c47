"""Checkpoints that are either complete or ignored, and runs that never continue another run's checkpoints.

The Trainer writes a checkpoint as many files, from every rank. A crash in the middle leaves a directory that looks
like a checkpoint and is not one. hfacc writes ``checkpoint_complete.json`` after everything else, through a
temporary file and an atomic rename: every file with its size and a sha256 of its bytes, the settings of the run
that saved it, and hfacc's own counters. A checkpoint counts as complete only when that marker says so and every
file still matches it.

The hashes are taken while the files are written (:mod:`hfacc.training.hashing`), not by reading them back; what no
hashing writer saw is small and hashed from disk, or, past 16 MiB (FSDP's distributed checkpoint), recorded by size
only. Resuming reads every file once to check it.

An output directory that an hfacc run wrote into holds ``hfacc_run.json``; there a checkpoint without a marker is
one that was cut short, never a stock Trainer checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..data.collator import TEACHER_COLUMNS
from ..data.preference import KTO_REFERENCE_COLUMNS, REFERENCE_COLUMNS
from ..runtime.config import ConfigError
from .hashing import hash_file

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
RUN_RECORD = "hfacc_run.json"  # in the output directory: an hfacc run writes here
MARKER_FORMAT = 2  # 1: sizes only (hfacc before content hashes)
SMALL_FILE = 16 * 2**20  # a file no hashing writer saw is hashed from disk up to this size, else recorded by size
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

# The settings that make two runs the same run: what shapes every step from the first one. Not max_steps or
# num_train_epochs (a resume may extend a run), logging, evaluation or saving. The number of processes is one: on
# another number the global batch and the examples the resumed epoch skips are others (the Trainer skips its
# micro-batches per process), so the resumed run is neither the saved run nor a new one.
RUN_SETTINGS = (
    "seed",
    "data_seed",
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "weight_decay",
    "optim",
    "optim_args",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "dataloader_drop_last",
    "train_sampling_strategy",
    "label_smoothing_factor",
    "neftune_noise_alpha",
    "bf16",
    "fp16",
    "normalization",
    "objective",
    "max_tokens_per_batch",
    "length_group_size",
)
# The embedded default's own settings: they do not apply to a named dataset, so are not compared with one.
EMBEDDED_SETTINGS = (
    "num_embedded_examples",
    "embedded_dataset",
    "tool_direct_fraction",
    "num_embedded_prompts",
    "num_rejected_samples",
    "rejected_temperature",
    "tasks",
)
# What decides which rows a run trains on and how, recorded as ``data.<name>`` beside RUN_SETTINGS: the data source
# (dataset, config, split, how many rows, the embedded default's size), its preprocessing (max_length, truncation,
# packing, the chat template), and for GRPO the prompts (how many, which embedded tasks, max_prompt_length). Each job
# passes the fields its settings have (get_data_settings); the trainer adds the training set itself
# (get_dataset_identity). Two runs that differ only here train on other rows; one must not continue the other's
# checkpoint. Streaming is a setting of its own (RUN_SETTINGS' streaming). docs/reliability.md has the table.
DATA_SETTINGS = (
    "dataset_name",
    "dataset_config",
    "dataset_train_split",
    "max_examples",
    *EMBEDDED_SETTINGS,
    "num_train_prompts",
    "dataset_format",
    "max_length",
    "max_prompt_length",
    "truncation",
    "last_turn_only",
    "packing",
)
# Columns a model computed (a reference's log-probs, a teacher's top-K): not the data. Their last bits may differ
# between two launches of the same run (another GPU kernel), which would refuse the run's own requeue.
MODEL_COLUMNS = (*REFERENCE_COLUMNS, *KTO_REFERENCE_COLUMNS, *TEACHER_COLUMNS)
DATA_PREFIX = "data."
# Settings a resume takes from the checkpoint whatever this run says: the saved optimizer and scheduler states
# restore them (torch's load_state_dict keeps the saved param_groups; the scheduler its base_lrs).
RESTORED_SETTINGS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


# ---- what a checkpoint records ----------------------------------------------------------------------------------
def get_run_settings(args, streaming: bool, data: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings that identify a run (:data:`RUN_SETTINGS`), its number of processes, whether it streams its
    data, and what identifies its data (``data``, from :func:`get_data_settings` and :func:`get_dataset_identity`,
    recorded as ``data.<name>``), as JSON values."""
    values = {f.name: _json_value(getattr(args, f.name)) for f in dataclasses.fields(args) if f.name in RUN_SETTINGS}
    values["world_size"] = args.world_size
    values["streaming"] = streaming
    values.update({DATA_PREFIX + k: _json_value(v) for k, v in (data or {}).items()})
    return values


def get_data_settings(*sources) -> dict[str, Any]:
    """The fields of ``sources`` (a job's settings dataclasses, e.g. :class:`hfacc.data.sft.DataArguments`) that
    decide which rows a run trains on and how (:data:`DATA_SETTINGS`); those they lack are left out, and the embedded
    default's (:data:`EMBEDDED_SETTINGS`) with a named dataset, and the name of local data (a file or folder): the
    same file named by a relative or an absolute path, or from another directory, is the same run's; its rows
    (:func:`get_dataset_identity`) tell other data apart."""
    values: dict[str, Any] = {}
    for source in sources:
        names = {f.name for f in dataclasses.fields(source)} if dataclasses.is_dataclass(source) else set()
        values.update({k: _json_value(getattr(source, k)) for k in DATA_SETTINGS if k in names})
    if values.get("dataset_name") is not None:
        for name in EMBEDDED_SETTINGS:
            values.pop(name, None)
        if Path(values["dataset_name"]).exists():  # local data: its rows identify it, not how the path is spelled
            values.pop("dataset_name")
    return values


def get_dataset_identity(dataset, processing_class=None, rows: int = 16) -> dict[str, Any]:
    """What identifies the training set itself, where it is cheap: its number of rows and a sha256 of its first
    ``rows`` rows and its last one as they are fed to the collator (after tokenization, truncation and packing); of a
    stream (:class:`hfacc.data.streaming.SFTStream`), a sha256 of its first ``rows`` raw rows (their tokenization
    is the data settings' and the chat template's); and one of the tokenizer's chat template. Columns a model computed (:data:`MODEL_COLUMNS`) are left out.

    Not datasets' ``_fingerprint``: it is random wherever a map's function cannot be hashed (datasets says so once),
    so the same run's requeue would read as another run. Rows edited in the middle of a dataset of the same size are
    not seen (docs/reliability.md)."""
    values: dict[str, Any] = {}
    size = None
    if dataset is not None and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        with contextlib.suppress(TypeError):
            size = len(dataset)
    if size is not None:
        values["num_rows"] = size
        values["rows_sha256"] = _rows_sha256(dataset[i] for i in sorted({*range(min(rows, size)), size - 1} - {-1}))
    elif hasattr(dataset, "first_rows"):  # a stream: its first rows (it has no length)
        values["first_rows_sha256"] = _rows_sha256(dataset.first_rows(rows))
    template = getattr(processing_class, "chat_template", None)
    if isinstance(template, str):
        values["chat_template"] = hashlib.sha256(template.encode()).hexdigest()[:16]
    return values


def _rows_sha256(rows) -> str:
    digest = hashlib.sha256()
    for row in rows:
        row = {k: v for k, v in row.items() if k not in MODEL_COLUMNS} if isinstance(row, Mapping) else row
        digest.update(json.dumps(_plain(row), sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _plain(value: Any) -> Any:
    """``value`` as JSON (tensors and arrays as lists); what has no stable text (an image) as its type's name."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    return type(value).__name__


def _has_data_identity(run: Mapping[str, Any]) -> bool:
    return any(k.startswith(DATA_PREFIX) for k in run)


def _without_data(run: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if not k.startswith(DATA_PREFIX)}


def _json_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def describe_run_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """``learning_rate 0.001 there, 0.002 here; seed 1 there, 2 here`` (the settings that differ)."""
    keys = [k for k in current if k in saved and saved[k] != current[k]]
    return "; ".join(f"{k} {saved[k]!r} there, {current[k]!r} here" for k in keys)


def read_marker(checkpoint: str | Path) -> dict[str, Any] | None:
    """The marker of ``checkpoint`` as written, or None without one; ValueError when it is damaged."""
    path = Path(checkpoint) / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"its {MARKER} is damaged (not JSON: {err})") from None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, (int, dict)) for v in files.values()):
        raise ValueError(f"its {MARKER} is damaged (no list of files)")
    return marker


# ---- the marker ---------------------------------------------------------------------------------------------------
def mark_checkpoint_complete(checkpoint: str | Path, digests: Mapping[str, str] | None = None, **record: Any) -> Path:
    """Record every file of ``checkpoint`` with its size and sha256, atomically (temp file + ``os.replace``).

    ``digests`` (``{path in the checkpoint: sha256}``) are the hashes taken while the files were written
    (:func:`hashing_writes`); other files are hashed from disk when small, else recorded by size only. ``record``
    adds fields (the run's settings, hfacc's counters).
    """
    checkpoint = Path(checkpoint)
    digests = digests or {}
    files = {}
    for path in sorted(checkpoint.rglob("*")):
        if not path.is_file() or path.name == MARKER or path.name.endswith(".tmp"):
            continue
        name, size = str(path.relative_to(checkpoint)), path.stat().st_size
        digest = digests.get(name)
        if digest is None and size <= SMALL_FILE:
            digest = hash_file(path)
        files[name] = {"bytes": size, "sha256": digest}
    tmp = checkpoint / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": MARKER_FORMAT, **record, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / MARKER)
    return checkpoint / MARKER


def unmark_checkpoint(checkpoint: str | Path) -> None:
    """Remove the marker of a checkpoint about to be written again: until marked anew, it is incomplete."""
    with contextlib.suppress(FileNotFoundError):
        (Path(checkpoint) / MARKER).unlink()


# A checkpoint checked in this process, and the state of its files then: not hashed twice (the recipe resolves the
# checkpoint before loading the model, the trainer again when it trains).
_verified: dict[str, tuple] = {}


def _file_states(checkpoint: Path) -> tuple:
    return tuple(
        (str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(checkpoint.rglob("*")) if p.is_file()
    )


def checkpoint_problem(checkpoint: str | Path, stock_ok: bool = True) -> str | None:
    """Why ``checkpoint`` cannot be resumed from, or None if it is complete.

    ``stock_ok``: whether a checkpoint without a marker may be a stock Trainer's (only where no hfacc run wrote).
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        return "it does not exist"
    if not checkpoint.is_dir():
        return "it is a file, not a checkpoint folder"
    try:
        marker = read_marker(checkpoint)
    except ValueError as err:
        return str(err)
    if marker is None:
        return _unmarked_problem(checkpoint, stock_ok)
    states = _file_states(checkpoint)
    if _verified.get(str(checkpoint.resolve())) == states:
        return None
    for name, entry in marker["files"].items():
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("bytes"), entry.get("sha256"))
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
        if digest is not None and hash_file(path) != digest:
            return f"{name} is not what was written (its sha256 differs): it was changed or damaged after the save"
    _verified[str(checkpoint.resolve())] = states
    return None


def _unmarked_problem(checkpoint: Path, stock_ok: bool) -> str | None:
    if any(_CHECKPOINT.match(p.name) for p in checkpoint.iterdir()):
        return "it is an output directory, not a checkpoint: name one of its checkpoint-N folders, or pass 'last'"
    state = checkpoint / "trainer_state.json"
    if not state.is_file():
        return f"it has no {MARKER} and no trainer_state.json: the run stopped while writing it"
    if not stock_ok:
        return (
            f"it has no {MARKER}: an hfacc run wrote into {checkpoint.parent}, and this checkpoint was cut short "
            "while it was being saved"
        )
    try:
        json.loads(state.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        return f"its trainer_state.json is not valid JSON ({err})"
    return None  # written by a stock Trainer: its last file is there, the best that can be checked


def hfacc_wrote_into(output_dir: str | Path) -> bool:
    """Whether an hfacc run wrote into ``output_dir`` (its run record, or a checkpoint with a marker)."""
    output_dir = Path(output_dir)
    return (output_dir / RUN_RECORD).is_file() or any((p / MARKER).is_file() for _, p in list_checkpoints(output_dir))


def _stock_ok(checkpoint: Path) -> bool:
    """Whether a checkpoint without a marker may be taken for a stock Trainer's: no hfacc run wrote next to it, or
    the hfacc run that did resumed from it."""
    output_dir = checkpoint.parent
    if not hfacc_wrote_into(output_dir):
        return True
    return checkpoint.name in _read_run_record(output_dir).get("stock_checkpoints", [])


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ``checkpoint-N`` folders of ``output_dir``, newest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = ((m, p) for p in output_dir.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir())
    return sorted(((int(m.group(1)), p) for m, p in found), reverse=True)


def get_last_complete_checkpoint(output_dir: str | Path, run: Mapping[str, Any] | None = None) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (of the run with settings ``run``, when given); the newer
    ones skipped are named in a warning, with why."""
    for _, path in list_checkpoints(output_dir):
        problem = checkpoint_problem(path, _stock_ok(path))
        if problem is None and run is not None:
            problem = _other_run(path, run)
        if problem is None:
            return str(path)
        logger.warning("hfacc: skipping %s: %s.", path, problem)
    return None


def _saved_run(checkpoint: Path) -> dict[str, Any] | None:
    """The settings of the run that saved ``checkpoint`` (None without a marker, or a damaged one)."""
    try:
        return (read_marker(checkpoint) or {}).get("run")
    except ValueError:
        return None


def _other_run(checkpoint: Path, run: Mapping[str, Any]) -> str | None:
    saved = _saved_run(checkpoint)
    if saved is None or saved == run:
        return None
    difference = describe_run_difference(saved, run)
    return f"it was saved by another run ({difference})" if difference else None


def resolve_checkpoint(
    resume_from_checkpoint: str | bool | None, output_dir: str | Path, run: Mapping[str, Any] | None = None
) -> str | None:
    """``True``/``"last"`` -> the newest complete checkpoint (of this run, given its settings ``run``); a path ->
    itself if complete, else a :class:`ConfigError` naming the problem and the newest complete one.

    A checkpoint of a streaming run is refused to a map-style one and the reverse; a named checkpoint saved with
    other settings is said at WARNING level (its run continues with this run's settings).
    """
    if resume_from_checkpoint in (None, False, ""):
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint in ("last", "true", "True"):
        found = get_last_complete_checkpoint(output_dir, run)
        if found is None:
            others = [p.name for _, p in list_checkpoints(output_dir) if run and _other_run(p, run)]
            if others:
                saved = _saved_run(Path(output_dir) / others[0]) or {}
                raise ConfigError(
                    f"resume_from_checkpoint: no checkpoint of this run in {output_dir}; {_names(others)} were "
                    f"saved by another run ({describe_run_difference(saved, run)}). To continue that run, "
                    "resume with its settings or name its checkpoint; to start afresh, choose a new --output_dir or "
                    f"pass --overwrite_output_dir true.{_data_fix(saved, run)}"
                )
            raise ConfigError(f"resume_from_checkpoint: no complete checkpoint in {output_dir}.")
        return found
    path = Path(resume_from_checkpoint)
    problem = checkpoint_problem(path, _stock_ok(path))
    if problem is not None:
        found = get_last_complete_checkpoint(path.parent) if path.parent.is_dir() else None
        hint = f" The newest complete one is {found}." if found and found != str(path) else ""
        raise ConfigError(f"Cannot resume from {resume_from_checkpoint}: {problem}.{hint}")
    saved = _saved_run(path)
    if run is not None and saved is not None and saved.get("streaming") != run.get("streaming"):
        kind = "a streaming run (--streaming true)" if saved.get("streaming") else "a map-style run"
        raise ConfigError(
            f"Cannot resume from {resume_from_checkpoint}: it was saved by {kind}; resume it the same way, with the "
            "same data, or start afresh in a new --output_dir."
        )
    difference = describe_run_difference(saved, run) if run is not None and saved is not None else ""
    if difference and str(path) not in _said:  # once (the recipe resolves it before the trainer does)
        _said.add(str(path))
        changed = [k for k in run if k in saved and saved[k] != run[k]]
        restored = [k for k in changed if k in RESTORED_SETTINGS]
        if len(restored) == len(changed):
            effect = (
                f"{', '.join(restored)} {'stays' if len(restored) == 1 else 'stay'} the checkpoint's (its "
                "optimizer and scheduler states restore them): "
                "the run goes on as it was saved"
            )
        else:
            effect = "it continues with this run's settings" + (
                f", except {', '.join(restored)}: those stay the checkpoint's (its optimizer and scheduler states "
                "restore them)"
                if restored
                else ""
            )
            effect += "; the result is neither the saved run's nor that of a run started afresh with these settings"
        logger.warning("hfacc: %s was saved with other settings (%s); %s.", path, difference, effect)
    return str(resume_from_checkpoint)


_said: set[str] = set()


# ---- the output directory ---------------------------------------------------------------------------------------
def _read_run_record(output_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((output_dir / RUN_RECORD).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def check_output_dir(
    output_dir: str | Path, run: Mapping[str, Any], resuming: bool, overwrite: bool = False, main: bool = True
) -> None:
    """Before a run writes into ``output_dir``: a ConfigError if it is a file or holds a file where a checkpoint
    goes; a new run (not ``resuming``) into a directory with another run's checkpoints is refused, or with
    ``overwrite`` those are deleted (by the ``main`` process), and said; the same run's are said."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir} is a file; name a directory (it is made if missing).")
    if not output_dir.is_dir():
        return
    for entry in output_dir.iterdir():
        if _CHECKPOINT.match(entry.name) and not entry.is_dir():
            raise ConfigError(
                f"{entry} is a file, where the Trainer saves the checkpoint of step {entry.name.split('-')[1]}. "
                "Move or delete it, or choose another --output_dir."
            )
    if resuming:
        return
    checkpoints = [p for _, p in list_checkpoints(output_dir)]
    if not checkpoints:
        return
    if overwrite:
        if main:
            for path in checkpoints:
                shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                (output_dir / RUN_RECORD).unlink()
        logger.warning(
            "hfacc: overwrite_output_dir: deleted the %d checkpoint(s) in %s.", len(checkpoints), output_dir
        )
        return
    others, same, unmarked = [], [], []
    others_marker: dict[str, Any] = {}
    for path in checkpoints:
        try:
            marker = read_marker(path)
        except ValueError:
            marker = None
        # No settings (an older hfacc's marker), or none of those both record differ: taken for this run's.
        difference = describe_run_difference(marker.get("run") or {}, run) if marker is not None else ""
        if marker is None:
            unmarked.append(path.name)
        elif difference:
            others.append((path.name, difference))
            others_marker = others_marker or marker.get("run") or {}
        else:
            same.append(path.name)
    if others:
        raise ConfigError(
            f"{output_dir} holds checkpoints of another run ({_names([n for n, _ in others])}: {others[0][1]}); a "
            "run started here would mix with them (--resume_from_checkpoint last could continue theirs). Choose a "
            "new --output_dir, pass --overwrite_output_dir true to delete them first, or resume that run with its "
            f"settings.{_data_fix(others_marker, run)}"
        )
    if same:
        logger.warning(
            "hfacc: %s holds checkpoints of a run with these settings (%s); this run starts from step 0 and replaces "
            "them as it saves. --resume_from_checkpoint last continues from the newest instead.",
            output_dir,
            _names(same),
        )
    if unmarked:
        logger.warning(
            "hfacc: %s holds checkpoint folders without hfacc's %s (%s): not this run's; resuming will not use them.",
            output_dir,
            MARKER,
            _names(unmarked),
        )


def _data_fix(saved: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    """The override, where what differs is the data: a deliberate change of data resumes with it."""
    changed = [k for k in run if k in saved and saved[k] != run[k]]
    if changed and all(k.startswith(DATA_PREFIX) for k in changed):
        return " To continue it on the changed data deliberately, pass --resume_with_changed_data true."
    return ""


def _names(names: list[str]) -> str:
    """``checkpoint-9, checkpoint-8, checkpoint-7 and 4 more``."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def write_run_record(output_dir: str | Path, run: Mapping[str, Any], stock_checkpoint: str | None = None) -> None:
    """Write ``hfacc_run.json`` into ``output_dir`` (made if missing): from now on a checkpoint without a marker there
    is an incomplete one. ``stock_checkpoint``: a stock Trainer checkpoint this run resumes from, which stays usable.
    A directory that cannot be written is a ConfigError, before training."""
    output_dir = Path(output_dir)
    stock = set(_read_run_record(output_dir).get("stock_checkpoints", []))
    if stock_checkpoint is not None:
        stock.add(Path(stock_checkpoint).name)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        tmp = output_dir / f"{RUN_RECORD}.tmp"
        tmp.write_text(json.dumps({"run": dict(run), "stock_checkpoints": sorted(stock)}, indent=1))
        os.replace(tmp, output_dir / RUN_RECORD)
    except OSError as err:
        raise ConfigError(
            f"cannot write to --output_dir {output_dir}: {err.strerror or err}. Choose a directory you can write to."
        ) from err


def get_auto_resume_checkpoint(output_dir: str | Path, run: Mapping[str, Any]) -> str | None:
    """``auto_resume_from_checkpoints``: the newest complete checkpoint of this run (settings ``run``) in
    ``output_dir``, or None to start afresh; which of the two is said at WARNING level, once per process.

    Another run's checkpoints are never taken: with none of this run's beside them, the new run is refused as any
    run into their directory is (:func:`check_output_dir`). Incomplete checkpoints are skipped, and named.
    """
    found = get_last_complete_checkpoint(output_dir, run)
    said = (str(output_dir), found)
    if said not in _said_auto:  # once: the recipe prepares the run before the trainer does
        _said_auto.add(said)
        if found is not None:
            logger.warning(
                "hfacc: auto_resume_from_checkpoints: resuming from %s (step %s), the newest complete checkpoint of "
                "this run in %s.",
                found,
                get_checkpoint_step(found),
                output_dir,
            )
        else:
            logger.warning(
                "hfacc: auto_resume_from_checkpoints: no complete checkpoint of this run in %s: starting afresh.",
                output_dir,
            )
    return found


_said_auto: set[tuple[str, str | None]] = set()


def prepare_run(args, run: Mapping[str, Any], resume_from_checkpoint, model=None) -> str | None:
    """What is checked before a run trains, on every rank (the main process writes): the checkpoint to resume
    (:func:`resolve_checkpoint`; none named and ``args.auto_resume_from_checkpoints``: this run's newest complete
    one, if any, :func:`get_auto_resume_checkpoint`) and its weights against ``model``, the output directory
    (:func:`check_output_dir`), and the run record (:func:`write_run_record`). Returns the checkpoint to resume
    from, or None."""
    full = run
    if getattr(args, "resume_with_changed_data", False) and _has_data_identity(run):
        run = _without_data(run)  # compared without its data; recorded with it
        if str(args.output_dir) not in _said_data:
            _said_data.add(str(args.output_dir))
            logger.warning(
                "hfacc: resume_with_changed_data: a checkpoint in %s is taken for this run's whatever data it was "
                "trained on; the result is neither the saved run's nor that of a run started afresh on this data.",
                args.output_dir,
            )
    if resume_from_checkpoint in (None, False, "") and args.auto_resume_from_checkpoints:
        resume_from_checkpoint = get_auto_resume_checkpoint(args.output_dir, run)
    checkpoint = resolve_checkpoint(resume_from_checkpoint, args.output_dir, run)
    check_output_dir(
        args.output_dir, run, checkpoint is not None, overwrite=args.overwrite_output_dir, main=args.should_save
    )
    saved = _saved_run(Path(checkpoint)) if checkpoint is not None else None
    if saved is not None and _has_data_identity(full) and not _has_data_identity(saved) and checkpoint not in _said:
        _said.add(checkpoint)
        logger.warning(
            "hfacc: %s was saved before hfacc recorded a run's data: taken for this run's without comparing its data "
            "(dataset, max_length, packing, rows); make sure it is the same.",
            checkpoint,
        )
    if checkpoint is not None and model is not None:
        check_checkpoint_weights(checkpoint, model)
    if args.should_save and args.save_strategy != "no":
        inside = checkpoint is not None and Path(checkpoint).parent.resolve() == Path(args.output_dir).resolve()
        stock = checkpoint if inside and not (Path(checkpoint) / MARKER).is_file() else None
        write_run_record(args.output_dir, full, stock)
    return checkpoint


_said_data: set[str] = set()


def check_run_before_loading(args, *data_sources, streaming: bool = False) -> None:
    """What a job checks before it loads its model and builds its rows, with the settings it has then (the training
    settings and ``data_sources``' data settings, :func:`get_data_settings`): a checkpoint that cannot be resumed, or
    another run's (auto-resume, ``last``), or an output directory a new run may not write into, is one ConfigError
    now, not after a model loaded or a short SFT ran. Nothing is said or written but the output directory, made as
    the stock Trainer makes it: the trainer checks again with the rows' identity (:func:`get_dataset_identity`) and
    says what it finds, once.

    The trainer resolves the checkpoint itself: a job passes it ``args.resume_from_checkpoint`` as given, never a
    path resolved here (a named checkpoint of other settings is only a WARNING, so another run's data resolved to
    one here would be continued)."""
    run = get_run_settings(args, streaming, get_data_settings(*data_sources))
    if getattr(args, "resume_with_changed_data", False):
        run = _without_data(run)
    remembered = [set(s) for s in (_said, _said_auto, _said_data)]
    disabled, logger.disabled = logger.disabled, True
    try:
        resume = args.resume_from_checkpoint
        if resume in (None, False, "") and args.auto_resume_from_checkpoints:
            resume = get_last_complete_checkpoint(args.output_dir, run)
        checkpoint = resolve_checkpoint(resume, args.output_dir, run)
        if not args.overwrite_output_dir:  # the trainer deletes them (and says so)
            check_output_dir(args.output_dir, run, checkpoint is not None, main=False)
    finally:
        logger.disabled = disabled
        for said, before in zip((_said, _said_auto, _said_data), remembered, strict=True):
            said.clear()
            said.update(before)
    # The stock Trainer makes the output directory when it is built, before hfacc's run record is written: one that
    # cannot be made is the named line now, not a PermissionError from transformers' __init__ (a made empty
    # directory is all this writes, and the Trainer would make it anyway).
    try:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot write to --output_dir {args.output_dir}: {err.strerror or err}. Choose a directory you can "
            "write to."
        ) from err


def get_checkpoint_step(checkpoint: str | Path) -> int | None:
    """The optimizer step ``checkpoint`` was saved at (its trainer_state.json), or None if it cannot be read."""
    try:
        return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def saved_weight_shapes(checkpoint: str | Path) -> dict[str, list[int]] | None:
    """``{name: shape}`` of the model weights in ``checkpoint`` (read from the safetensors headers only), or None
    when it holds none in transformers' file names (an adapter, a sharded engine's files)."""
    checkpoint = Path(checkpoint)
    index = checkpoint / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (checkpoint / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            return None
        shapes = {}
        for name in files:
            with open(checkpoint / name, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # damaged: the marker check names it, or loading does
    return shapes


def check_checkpoint_weights(checkpoint: str | Path, model) -> None:
    """A ConfigError when ``checkpoint``'s weights are another model's (other shapes, other layers).

    The Trainer loads them with ``strict=False``: missing or extra layers would only be a log line, and a model of
    another size a size-mismatch traceback. Tied weights (saved once) are not missing. Weights transformers saved
    under the model's checkpoints' original names (:func:`saved_under_original_names`) are the model's own: the
    trainer loads them through transformers' conversion (``TokenWeightedTrainer._load_from_checkpoint``).
    """
    saved = saved_weight_shapes(checkpoint)
    if saved is None or type(model).__name__.startswith("Peft"):
        return
    problem = _weights_problem(saved, model.state_dict())
    if problem is None or saved_under_original_names(checkpoint, model, saved):
        return
    raise ConfigError(
        f"Cannot resume from {checkpoint}: its weights are another model's: {problem}. Resume with the model it "
        "was saved with (the same --model_name_or_path and size settings), or start afresh in a new --output_dir."
    )


def saved_under_original_names(checkpoint: str | Path, model, saved: Mapping[str, list[int]] | None = None) -> bool:
    """Whether ``checkpoint`` holds ``model``'s weights under the names transformers saves them by, which are not
    the model's own (Qwen2-VL's ``model.layers.*`` for ``model.language_model.layers.*``, Gemma 3, LLaVA-NeXT, MoE
    experts one by one). The stock Trainer's resume loads by the model's own names, so not one of them would load
    and training would go on from untrained weights."""
    saved = saved_weight_shapes(checkpoint) if saved is None else saved
    if saved is None or type(model).__name__.startswith("Peft"):
        return False
    state = model.state_dict()
    if _weights_problem(saved, state) is None:
        return False
    layout = _saved_layout(model, state)
    return layout is not None and _weights_problem(saved, layout) is None


def _weights_problem(saved: Mapping[str, list[int]], state: Mapping[str, Any]) -> str | None:
    """Why weights of ``saved`` shapes do not fit the tensors ``state``, or None (tied tensors may be saved once)."""
    own = {k: list(v.shape) for k, v in state.items()}
    problem = next(
        (
            f"'{k}' has shape {shape} there and {own[k]} here"
            for k, shape in saved.items()
            if k in own and own[k] != shape
        ),
        None,
    )
    extra = [k for k in saved if k not in own]
    stored = {state[k].data_ptr() for k in saved if k in state}
    missing = [k for k in own if k not in saved and state[k].data_ptr() not in stored]
    if problem is None and extra:
        problem = f"it holds {len(extra)} weight(s) this model does not have ('{extra[0]}', ...)"
    if problem is None and missing:
        problem = f"it lacks {len(missing)} weight(s) of this model ('{missing[0]}', ...)"
    return problem


def _saved_layout(model, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The tensors ``save_pretrained`` writes for ``model`` (names and shapes, on the meta device: no copy), or
    None where transformers has no such conversion for it, or it fails."""
    try:
        import torch
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
        reverted = revert_weight_conversion(model, remove_tied_weights_from_state_dict(meta, model))
    except Exception:  # another transformers, or a conversion that needs the tensors' values
        return None
    return reverted if set(reverted) != set(state) else None


class CheckpointError(ConfigError):
    """A checkpoint that could not be written (full disk, a directory that went read-only, another rank's failure):
    shown as one message by the commands, like a bad setting."""


def describe_save_failure(err: BaseException | None, checkpoint: str | Path) -> Exception:
    """The error to raise when writing ``checkpoint`` failed with ``err`` (None: on another rank)."""
    import errno

    keep = (
        "The newest complete checkpoint stays as it was: --resume_from_checkpoint last resumes from it, and skips "
        f"the incomplete {Path(checkpoint).name}."
    )
    if err is None:
        return CheckpointError(
            f"another process failed to write its part of {checkpoint} (its message says why). {keep}"
        )
    chain, seen = [], err
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    codes = {getattr(e, "errno", None) for e in chain}
    text = " ".join(str(e) for e in chain)
    try:
        free = shutil.disk_usage(Path(checkpoint).parent).free
    except OSError:
        free = None
    if (
        errno.ENOSPC in codes
        or errno.EDQUOT in codes
        or "No space left" in text
        or "StorageFull" in text
        or (free is not None and free < 2**20 and ("unexpected pos" in text or "write failed" in text))
    ):
        return CheckpointError(
            f"no space left on the device while writing {checkpoint}. Free some space (or lower save_total_limit, "
            f"or save to another --output_dir). {keep}"
        )
    if errno.EROFS in codes or errno.EACCES in codes or isinstance(err, PermissionError):
        return CheckpointError(f"cannot write {checkpoint}: {err}. Choose an --output_dir you can write to. {keep}")
    return err if isinstance(err, Exception) else RuntimeError(str(err))


def get_checkpoint_dir(run_dir: str, step: int) -> str:
    """The folder the Trainer saves the checkpoint of optimizer step ``step`` in."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def complete_checkpoint(
    run_dir: str, state, save_total_limit: int | None, digests: Mapping[str, str] | None = None, **record: Any
) -> None:
    """Mark the checkpoint of ``state.global_step`` complete, then rotate old ones (never before: a crash
    mid-save must not cost the last good checkpoint)."""
    mark_checkpoint_complete(get_checkpoint_dir(run_dir, state.global_step), digests, step=state.global_step, **record)
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=save_total_limit,
        best_model_checkpoint=state.best_model_checkpoint,
        use_mtime=True,
    )


__all__ = [
    "MARKER",
    "RUN_RECORD",
    "CheckpointError",
    "check_checkpoint_weights",
    "saved_under_original_names",
    "check_output_dir",
    "check_run_before_loading",
    "checkpoint_problem",
    "complete_checkpoint",
    "get_auto_resume_checkpoint",
    "get_last_complete_checkpoint",
    "get_run_settings",
    "get_data_settings",
    "get_dataset_identity",
    "mark_checkpoint_complete",
    "prepare_run",
    "resolve_checkpoint",
    "rotate_checkpoints",
    "write_run_record",
]
