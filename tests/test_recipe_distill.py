"""recipes/distill.py end to end on the embedded default, shortened: a short SFT of a bigger embedded teacher first,
then a second run from that teacher with stored top-K log-probs, and an on-policy one; `hfacc distill` is the same
job."""

import json

import pytest

from hfacc.runtime.config import parse_args
from tests.helpers import load_recipe, recipe_types

pytestmark = pytest.mark.slow

SHORT = [
    "--teacher_sft_max_steps", "3", "--teacher_hidden_size", "64", "--teacher_num_layers", "2",
    "--num_embedded_examples", "120", "--max_steps", "3", "--embedded_hidden_size", "32", "--embedded_num_layers", "1",
    "--num_exact_match_examples", "4", "--max_new_tokens", "6", "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--warmup_steps", "0", "--disable_tqdm", "true",
]  # fmt: skip


def run_in_process(*argv):
    module = load_recipe("distill")
    settings = parse_args(recipe_types(module), ["--config", str(module.DEFAULT_CONFIG), *SHORT, *argv])
    return module.main(*settings)


def test_the_default_makes_a_teacher_then_distills_and_a_second_run_starts_from_it(tmp_path):
    first = tmp_path / "distill"
    metrics = run_in_process("--output_dir", str(first), "--teacher_sft_dir", str(tmp_path / "no-sft-here"))
    for name in ("model.safetensors", "tokenizer.json", "metrics.json", "loss_curve.png"):
        assert (first / name).is_file(), name
    teacher = first / "teacher"
    assert json.loads((teacher / "config.json").read_text())["hidden_size"] == 64  # bigger than the student's 32
    saved = json.loads((first / "metrics.json").read_text())
    assert saved["steps"] == 3 and saved["teacher"].startswith("a short SFT of 3 steps")
    assert saved["train"]["train_num_targets"] > 0 and saved["final_divergence"] is not None
    for key in ("exact_match_teacher", "exact_match_before", "exact_match_after"):
        assert 0 <= saved[key] <= 1, key
    assert len(saved["samples"]) == 4

    second = tmp_path / "stored"
    metrics = run_in_process(
        "--output_dir", str(second), "--teacher_sft_dir", str(teacher), "--precompute_teacher_logprobs", "true",
        "--teacher_top_k", "8", "--beta", "1.0",
    )  # fmt: skip
    assert metrics["teacher"] == f"from {teacher}" and metrics["stored_top_k"] == 8
    assert not (second / "teacher").exists() and (second / "teacher_logprobs" / "fingerprint.txt").is_file()

    third = tmp_path / "on-policy"
    metrics = run_in_process(
        "--output_dir", str(third), "--teacher_sft_dir", str(teacher), "--lmbda", "0.5",
        "--max_completion_length", "6", "--num_exact_match_examples", "0",
    )  # fmt: skip
    assert metrics["steps"] == 3 and metrics["train"]["train_num_targets"] > 0


def test_hfacc_distill_is_the_recipes_job(capsys):
    """`hfacc distill` parses the recipe's settings (the default YAML included): a bad one is one error line."""
    from hfacc.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["distill", "--beta", "2"])
    assert exit_info.value.code == 2
    assert "error: beta=2.0: it must be in [0, 1]" in capsys.readouterr().err
