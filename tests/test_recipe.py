"""recipes/sft.py end to end on the embedded default: one process in-process, two processes, and resume."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from hfacc.config import parse_args
from tests.helpers import ROOT, free_port, load_recipe, recipe_types

pytestmark = pytest.mark.slow

SHORT = [
    "--max_steps",
    "4",
    "--num_embedded_examples",
    "240",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--eval_steps",
    "2",
    "--save_steps",
    "2",
    "--logging_steps",
    "1",
    "--num_exact_match_examples",
    "4",
    "--max_new_tokens",
    "8",
    "--disable_tqdm",
    "true",
    "--warmup_steps",
    "0",
]


def run_in_process(output_dir, *extra):
    module = load_recipe()
    parsed = parse_args(
        recipe_types(module), ["--config", str(module.DEFAULT_CONFIG), *SHORT, "--output_dir", str(output_dir), *extra]
    )
    return module.main(*parsed)


def test_one_process_writes_model_tokenizer_metrics_and_plot(tmp_path):
    out = tmp_path / "run"
    metrics = run_in_process(out)
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "metrics.json",
        "loss_curve.png",
    ):
        assert (out / name).is_file(), name
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["steps"] == 4 and saved["world_size"] == 1
    assert saved["eval_loss_after"] < saved["eval_loss_before"]
    assert 0.0 <= saved["exact_match"] <= 1.0 and len(saved["samples"]) == 4
    assert metrics["train"]["train_num_targets"] > 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_resumed_run_ends_with_the_same_weights(tmp_path):
    full = tmp_path / "full"
    run_in_process(full)
    # An interrupted run: only checkpoint-2 survived. Resuming must continue from step 2, not restart.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    metrics = run_in_process(resumed, "--resume_from_checkpoint", "last")
    assert metrics["steps"] == 4
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in a:
        diff = ((a[name].double() - b[name].double()).norm() / a[name].double().norm().clamp(min=1e-12)).item()
        assert diff <= 1e-6, name
    history = json.loads((resumed / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint, 3-4 new


@pytest.mark.distributed
def test_two_processes_through_the_ddp_config(tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/ddp.yaml",
        "--main_process_port",
        str(free_port()),
        "recipes/sft.py",
        *SHORT,
        "--output_dir",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["world_size"] == 2 and saved["steps"] == 4
    assert proc.stdout.count("=== hfacc SFT summary ===") == 1  # only rank 0 reports
