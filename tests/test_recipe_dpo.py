"""recipes/dpo.py end to end on the embedded default, shortened: a short SFT first, then a second run that starts
from that SFT output with precomputed reference log-probs; `hfacc dpo` is the same job."""

import json

import pytest

from hfacc.runtime.config import parse_args
from tests.helpers import load_recipe, recipe_types

pytestmark = pytest.mark.slow

SHORT = [
    "--sft_max_steps", "3", "--sft_num_examples", "120", "--num_embedded_prompts", "40", "--max_steps", "3",
    "--embedded_hidden_size", "64", "--embedded_num_layers", "1", "--num_exact_match_examples", "4",
    "--max_new_tokens", "6", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
    "--eval_steps", "3", "--logging_steps", "1", "--warmup_steps", "0", "--disable_tqdm", "true",
]  # fmt: skip


def run_in_process(*argv):
    module = load_recipe("dpo")
    settings = parse_args(recipe_types(module), ["--config", str(module.DEFAULT_CONFIG), *SHORT, *argv])
    return module.main(*settings)


def test_the_default_runs_a_short_sft_then_dpo_and_a_second_run_starts_from_it(tmp_path):
    first = tmp_path / "dpo"
    metrics = run_in_process("--output_dir", str(first), "--sft_model_dir", str(tmp_path / "no-sft-here"))
    for name in ("model.safetensors", "tokenizer.json", "metrics.json", "loss_curve.png"):
        assert (first / name).is_file(), name
    assert (first / "sft" / "model.safetensors").is_file()  # the short SFT it ran first
    saved = json.loads((first / "metrics.json").read_text())
    assert saved["started_from"] == str(first / "sft") and saved["steps"] == 3
    assert 0 <= saved["reward_accuracy_after"] <= 1 and 0 <= saved["exact_match_after"] <= 1
    assert len(saved["samples"]) == 4 and saved["train"]["train_num_pairs"] == 3 * 8
    assert metrics["eval_loss_after"] != metrics["eval_loss_before"]

    second = tmp_path / "again"
    metrics = run_in_process(
        "--output_dir", str(second), "--sft_model_dir", str(first / "sft"), "--precompute_ref_log_probs", "true",
        "--loss_type", "ipo",
    )  # fmt: skip
    assert metrics["started_from"] == str(first / "sft") and not (second / "sft").exists()
    assert metrics["loss_type"] == "ipo" and metrics["steps"] == 3


def test_hfacc_dpo_is_the_recipes_job(capsys):
    """`hfacc dpo` parses the recipe's settings (the default YAML included): a bad one is one error line, code 2."""
    from hfacc.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["dpo", "--beta", "0"])
    assert exit_info.value.code == 2
    assert "error: beta=0.0: it must be > 0." in capsys.readouterr().err


def test_hfacc_dpo_refuses_transformers_label_smoothing_before_any_training(tmp_path, capsys):
    """--label_smoothing_factor (transformers' cross-entropy smoothing) is not the DPO loss's --label_smoothing: the
    job refuses it at once, before its short SFT, instead of training without the smoothing the user asked for."""
    from hfacc.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["dpo", "--output_dir", str(tmp_path), "--sft_model_dir", str(tmp_path / "none")]
                 + ["--label_smoothing_factor", "0.1"])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: label_smoothing_factor=0.1" in err and "--label_smoothing" in err
    assert not (tmp_path / "sft").exists()
