"""recipes/sft.py end to end on the embedded default: one process in-process, two processes, and resume."""

import json
import logging
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from hfacc.runtime.config import parse_args
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


def test_hfacc_sft_runs_the_recipes_job(tmp_path, capsys):
    """`hfacc sft` is the recipe's job: same settings (the default YAML included), same numbers."""
    from hfacc.cli import main as cli_main

    extra = ["--max_steps", "2", "--save_strategy", "no", "--num_exact_match_examples", "0"]
    recipe = run_in_process(tmp_path / "recipe", *extra)
    assert cli_main(["sft", *SHORT, *extra, "--output_dir", str(tmp_path / "cli")]) == 0
    assert "hfacc SFT summary" in capsys.readouterr().out
    command = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    for key in ("eval_loss_before", "eval_loss_after", "steps"):
        assert command[key] == recipe[key], key
    assert command["train"]["train_loss"] == recipe["train"]["train_loss"]


REQUEUED = ["--auto_resume_from_checkpoints", "true"]  # the command a scheduler relaunches after each preemption


def same_weights(a_dir, b_dir) -> None:
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    for name in a:
        diff = ((a[name].double() - b[name].double()).norm() / a[name].double().norm().clamp(min=1e-12)).item()
        assert diff <= 1e-6, name


def test_resumed_run_ends_with_the_same_weights(tmp_path, caplog):
    full = tmp_path / "full"
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        run_in_process(full, *REQUEUED)  # the job's first launch: nothing to resume, so it starts afresh
    assert f"no complete checkpoint of this run in {full}: starting afresh" in caplog.text
    # An interrupted run: only checkpoint-2 survived. Resuming must continue from step 2, not restart.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    metrics = run_in_process(resumed, "--resume_from_checkpoint", "last")
    assert metrics["steps"] == 4
    same_weights(full, resumed)
    history = json.loads((resumed / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint, 3-4 new
    # The same command requeued after the job ended: from checkpoint-4, nothing trained, the same weights.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        run_in_process(full, *REQUEUED)
    assert f"resuming from {full / 'checkpoint-4'} (step 4)" in caplog.text
    assert "the run is finished, nothing was trained" in caplog.text
    same_weights(full, resumed)


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


def test_trains_on_a_tool_calling_dataset_with_a_qwen_style_template(tmp_path, caplog):
    """The main job on chat data as today's datasets hold it: tool calls, tool results and a tools column (JSON
    strings), under Qwen2.5's template, with the embedded tiny Llama sized to that tokenizer."""
    from tests.chat_corpus import save_qwen_style_tokenizer, tool_calling_rows

    rows = tool_calling_rows(48)
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_qwen_style_tokenizer(rows, tmp_path / "tokenizer")
    out = tmp_path / "run"
    module = load_recipe()
    argv = [
        "--config", str(module.DEFAULT_CONFIG), "--output_dir", str(out), "--dataset_name", str(data),
        "--tokenizer_name_or_path", str(tmp_path / "tokenizer"), "--embedded_hidden_size", "64",
        "--embedded_num_layers", "1", "--max_length", "1024", "--max_steps", "4", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2", "--eval_steps", "4", "--save_steps", "4", "--logging_steps", "1",
        "--num_exact_match_examples", "0", "--warmup_steps", "0", "--disable_tqdm", "true", "--log_level", "info",
    ]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hfacc"):
        metrics = module.main(*parse_args(recipe_types(module), argv))
    assert "chat rows masked by the template's message segments" in caplog.text
    assert metrics["steps"] == 4 and metrics["train"]["train_num_targets"] > 0
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
