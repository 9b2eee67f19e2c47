"""`report_to tensorboard` and `report_to trackio`: hfacc's exact metrics reach the trackers under their names.

One launch of tests/tracking_check.py trains a short SFT, DPO and GRPO run reporting to both (offline: TensorBoard
event files in the output directory, Trackio's local SQLite store); the test reads the files back and finds every
metric hfacc logs, by its name (the Trainer's callbacks write `train/<name>` and `eval/<name>`), at the step it was
logged, with the value in the run's log history. docs/tracking_and_hub.md lists the names.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# What each objective logs while training and evaluating (TRL's names where TRL has them).
EXPECTED = {
    "sft": {
        "train": ["loss", "token_accuracy", "target_tokens_per_second", "num_targets", "grad_norm", "learning_rate"],
        "eval": ["loss", "token_accuracy", "num_targets"],
    },
    "dpo": {
        "train": [
            "loss",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
            "nll_loss",
            "num_pairs",
            "pairs_per_second",
        ],
        "eval": ["loss", "rewards/accuracies", "rewards/margins", "num_pairs"],
    },
    "grpo": {
        "train": [
            "loss",
            "reward",
            "reward_std",
            "rewards/brevity/mean",
            "frac_reward_zero_std",
            "completions/mean_length",
            "completion_tokens_per_second",
            "num_completion_tokens",
            "entropy",
            "clip_ratio/region_mean",
        ],
        "eval": [],
    },
}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    out = tmp_path_factory.mktemp("tracking")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(out / "trackio"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "tests/tracking_check.py", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def logged(out: Path, run: str) -> dict[tuple[str, int], float]:
    """``{(tracker name, step): value}`` of what the Trainer logged (its log history), as the callbacks name it."""
    values = {}
    for entry in json.loads((out / run / "log_history.json").read_text()):
        for key, value in entry.items():
            if key in ("step", "epoch") or not isinstance(value, (int, float)):
                continue
            name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
            values[(name, entry["step"])] = value
    return values


def expected_names(run: str) -> list[str]:
    return [f"{kind}/{name}" for kind, names in EXPECTED[run].items() for name in names]


def tensorboard_scalars(out: Path, run: str) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directories = sorted((out / run / "runs").iterdir())
    assert len(directories) == 1, directories
    events = EventAccumulator(str(directories[0]), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}


def trackio_metrics(out: Path, run: str) -> dict[tuple[str, int], float]:
    """Read from Trackio's store (one SQLite file per project) as written: each row is one log's JSON."""
    store = out / "trackio" / "hfacc-tracking.db"
    assert store.is_file(), sorted(p.name for p in (out / "trackio").iterdir())
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT metrics FROM metrics WHERE run_name = ? ORDER BY id", (run,)).fetchall()
    values = {}
    for (blob,) in rows:
        metrics = json.loads(blob)
        step = metrics.pop("train/global_step")  # the Trainer's step; Trackio counts its own logs apart
        values.update({(name, step): value for name, value in metrics.items() if isinstance(value, (int, float))})
    return values


# What each tracker keeps: TensorBoard stores float32 scalars, Trackio the logged JSON values.
READERS = {"tensorboard": (tensorboard_scalars, 1e-6), "trackio": (trackio_metrics, 1e-12)}


@pytest.mark.parametrize("tracker", list(READERS))
@pytest.mark.parametrize("run", list(EXPECTED))
def test_the_trackers_files_hold_hfaccs_metrics_by_name(tracked, run, tracker):
    read, tolerance = READERS[tracker]
    logs, stored = logged(tracked, run), read(tracked, run)
    names = {name for name, _ in stored}
    missing = [name for name in expected_names(run) if name not in names]
    assert not missing, f"{run}: not in {tracker}'s files: {missing} (they hold {sorted(names)})"
    for (name, step), value in logs.items():
        if name in expected_names(run):
            assert stored[(name, step)] == pytest.approx(value, rel=tolerance, abs=1e-9), (run, name, step)


# ---- push_to_hub: what a job uploads ---------------------------------------------------------------------------
class FakeHub:
    """``transformers.trainer.hf_api()``'s answer: records each upload, with the files of the folder at that moment
    (after the Trainer's ignore patterns), and returns a finished upload."""

    def __init__(self):
        self.created, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        from types import SimpleNamespace

        self.created.append(repo_id)
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"someone/{repo_id}")

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
        import fnmatch
        from concurrent.futures import Future

        root = Path(folder_path)
        files = sorted(
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file() and not any(fnmatch.fnmatch(p.relative_to(root).parts[0], pat) for pat in ignore_patterns)
        )
        self.uploads.append({"repo_id": repo_id, "files": files, "message": kwargs.get("commit_message")})
        done = Future()
        done.set_result(None)
        return done


@pytest.mark.slow
def test_push_to_hub_uploads_the_jobs_output_directory(tmp_path, monkeypatch):
    """`hfacc sft --push_to_hub true --hub_model_id ...`: the Trainer's own push (no network here: its Hub client is
    a fake that records the files). The job's final save_model pushes the model, config, tokenizer with its chat
    template, training_args.bin, the model card and hfacc_run.json; never a checkpoint folder; metrics.json comes
    after the push. docs/tracking_and_hub.md says the same."""
    import transformers.trainer

    from hfacc.cli import main as cli_main
    from tests.test_recipe import SHORT

    hub = FakeHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    out = tmp_path / "run"
    argv = ["sft", *SHORT, "--max_steps", "2", "--output_dir", str(out), "--push_to_hub", "true"]
    assert cli_main([*argv, "--hub_model_id", "someone/hfacc-sft-tiny", "--hub_strategy", "end"]) == 0
    assert hub.created == ["someone/hfacc-sft-tiny"] and len(hub.uploads) == 1  # hub_strategy end: the final push
    pushed = hub.uploads[0]
    assert pushed["repo_id"] == "someone/hfacc-sft-tiny" and pushed["message"] == "Model save"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "chat_template.jinja", "training_args.bin", "README.md", "hfacc_run.json"):  # fmt: skip
        assert name in pushed["files"], (name, pushed["files"])
    assert not any(f.startswith("checkpoint-") for f in pushed["files"]) and (out / "checkpoint-2").is_dir()
    assert "metrics.json" not in pushed["files"] and (out / "metrics.json").is_file()
