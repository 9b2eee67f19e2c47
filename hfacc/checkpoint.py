"""Checkpoints that are either complete or ignored: a completion marker written last, atomically.

The Trainer writes a checkpoint as many files. A crash in the middle leaves a directory that looks like a
checkpoint and is not one. hfacc writes ``checkpoint_complete.json`` (file names and sizes) after everything else,
through a temporary file and an atomic rename, and only resumes from checkpoints that have it and still match it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .config import ConfigError

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def mark_checkpoint_complete(checkpoint: str | Path) -> Path:
    """Record every file of ``checkpoint`` with its size, atomically (temp file + ``os.replace``)."""
    checkpoint = Path(checkpoint)
    files = {
        str(p.relative_to(checkpoint)): p.stat().st_size
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")
    }
    tmp = checkpoint / f"{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, checkpoint / MARKER)
    return checkpoint / MARKER


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed from, or None if it is complete."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return "it does not exist"
    marker = checkpoint / MARKER
    if not marker.is_file():
        if (checkpoint / "trainer_state.json").is_file():
            return None  # written by a stock Trainer: its last file is there, the best that can be checked
        return f"it has no {MARKER} and no trainer_state.json: the run stopped while writing it"
    recorded = json.loads(marker.read_text())["files"]
    for name, size in recorded.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def get_last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest checkpoint in ``output_dir`` that is complete; incomplete newer ones are named in a warning."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    steps = sorted(
        ((int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))),
        reverse=True,
    )
    for _, path in steps:
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        logger.warning("hfacc: skipping %s: %s.", path, problem)
    return None


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str | Path) -> str | None:
    """``True``/``"last"`` -> the newest complete checkpoint; a path -> itself if complete, else a ConfigError."""
    if resume_from_checkpoint in (None, False, ""):
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint in ("last", "true", "True"):
        found = get_last_complete_checkpoint(output_dir)
        if found is None:
            raise ConfigError(f"resume_from_checkpoint: no complete checkpoint in {output_dir}.")
        return found
    problem = checkpoint_problem(resume_from_checkpoint)
    if problem is not None:
        found = get_last_complete_checkpoint(Path(resume_from_checkpoint).parent)
        hint = f" The newest complete one is {found}." if found else ""
        raise ConfigError(f"Cannot resume from {resume_from_checkpoint}: {problem}.{hint}")
    return str(resume_from_checkpoint)


__all__ = [
    "mark_checkpoint_complete",
    "checkpoint_problem",
    "get_last_complete_checkpoint",
    "resolve_checkpoint",
    "rotate_checkpoints",
]


def get_checkpoint_dir(run_dir: str, step: int) -> str:
    """The folder the Trainer saves the checkpoint of optimizer step ``step`` in."""
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def complete_checkpoint(run_dir: str, state, save_total_limit: int | None) -> None:
    """Mark the checkpoint of ``state.global_step`` complete, then rotate old ones (never before: a crash
    mid-save must not cost the last good checkpoint)."""
    mark_checkpoint_complete(get_checkpoint_dir(run_dir, state.global_step))
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=save_total_limit,
        best_model_checkpoint=state.best_model_checkpoint,
        use_mtime=True,
    )
