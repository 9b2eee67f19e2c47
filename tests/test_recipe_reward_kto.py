"""recipes/reward.py and recipes/kto.py end to end on their embedded defaults, shortened: the reward job runs a short
SFT first and trains the SFT model as a reward model; the KTO job starts from that SFT output with precomputed
reference log-probs; `hfacc reward` / `hfacc kto` are the same jobs; a reward model it wrote is a GRPO reward."""

import json

import pytest

from hfacc.runtime.config import parse_args
from tests.helpers import load_recipe, recipe_types

pytestmark = pytest.mark.slow

SHORT = [
    "--sft_max_steps", "3", "--sft_num_examples", "120", "--num_embedded_prompts", "40", "--max_steps", "3",
    "--embedded_hidden_size", "64", "--embedded_num_layers", "1", "--max_new_tokens", "6",
    "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--eval_steps", "3",
    "--logging_steps", "1", "--warmup_steps", "0", "--disable_tqdm", "true",
]  # fmt: skip


def run_in_process(recipe, *argv):
    module = load_recipe(recipe)
    settings = parse_args(recipe_types(module), ["--config", str(module.DEFAULT_CONFIG), *SHORT, *argv])
    return module.main(*settings)


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward")
    metrics = run_in_process("reward", "--output_dir", str(out), "--sft_model_dir", str(out / "no-sft-here"))
    return out, metrics


def test_the_reward_default_runs_a_short_sft_then_trains_a_reward_model(reward_run):
    out, metrics = reward_run
    for name in ("model.safetensors", "tokenizer.json", "metrics.json", "loss_curve.png"):
        assert (out / name).is_file(), name
    assert (out / "sft" / "model.safetensors").is_file()  # the short SFT it ran first
    saved = json.loads((out / "metrics.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert saved["started_from"] == str(out / "sft") and saved["steps"] == 3
    assert 0 <= saved["pair_accuracy_before"] <= 1 and 0 <= saved["pair_accuracy_after"] <= 1
    assert saved["train"]["train_num_pairs"] == 3 * 8 and saved["held_out_pairs"] >= 1
    assert metrics["eval_loss_after"] != metrics["eval_loss_before"]


def test_the_kto_default_starts_from_the_sft_output_with_precomputed_reference_log_probs(
    reward_run, tmp_path, monkeypatch
):
    from hfacc.data.embedded import generate_instruction_examples
    from hfacc.jobs import kto

    # A 3-step SFT model answers no prompt right (nor much at all), and KTO's rows are its own answers (right ones
    # desirable): its greedy answers are replaced, by the right one on every other prompt and a wrong "0" elsewhere.
    right = [e["messages"][-1]["content"] for e in generate_instruction_examples(40, seed=1)]
    monkeypatch.setattr(kto, "generate_answers", lambda *a, **k: [r if i % 2 else "0" for i, r in enumerate(right)])
    sft = reward_run[0] / "sft"
    metrics = run_in_process("kto", "--output_dir", str(tmp_path), "--sft_model_dir", str(sft),
                             "--precompute_ref_log_probs", "true", "--num_exact_match_examples", "4")  # fmt: skip
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["started_from"] == str(sft) and not (tmp_path / "sft").exists()
    assert saved["steps"] == 3 and saved["train"]["train_num_examples"] == 3 * 8
    assert saved["kl_after"] >= 0 and 0 <= saved["exact_match_after"] <= 1 and len(saved["samples"]) == 4
    assert saved["reward_margin_after"] is not None and metrics["eval_loss_after"] != metrics["eval_loss_before"]


def test_the_reward_model_it_wrote_scores_grpo_completions(reward_run):
    from hfacc.generation.rewards import get_reward_funcs

    (score,) = get_reward_funcs([str(reward_run[0])])
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2
    rewards = score(prompts, [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]])
    assert len(rewards) == 2 and rewards[0] != rewards[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["reward", "--center_rewards_coefficient", "-1"], "error: center_rewards_coefficient=-1.0: it must be >= 0."),
        (["kto", "--beta", "0"], "error: beta=0.0: it must be > 0."),
        (["kto", "--desirable_weight", "0"], "error: desirable_weight=0.0: it must be > 0."),
    ],
)
def test_hfacc_reward_and_kto_are_the_recipes_jobs(argv, message, capsys):
    """`hfacc reward` / `hfacc kto` parse the recipes' settings (the default YAML included): a bad one is one error
    line, exit code 2, before any training."""
    from hfacc.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
