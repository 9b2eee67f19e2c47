"""GRPOTrainer: the online step is PolicyGradientObjective on the rollout it sampled (1 and 2 ranks); a generation
serving two optimizer steps divides each by its own units; failing reward functions are named with their row.

The two-rank cases (fixed rollouts with unequal completion lengths per rank, every loss type, beta, layout; and the
online first step) run in one launch of tests/policy_gradient_check.py.
"""

import json
import logging
import math
import subprocess
import sys

import pytest
import torch

from hfacc import DataCollatorForCausalLM, GRPOArguments, PolicyGradientObjective
from hfacc.data.embedded import TASKS
from hfacc.generation.rollout import RewardFunctionError, compute_advantages, group_advantages, score_completions
from hfacc.generation.vllm_engine import is_vllm_available
from hfacc.ops.loss import WindowCounts
from tests.grpo_setup import build_policy, build_prompts, rollout_rows, run_grpo
from tests.helpers import ROOT, flat_grad, free_port, relative_error
from tests.rollouts import reference_gradient, reference_sgd_steps


def objective_gradient(model, rows, objective, pad_token_id):
    """PolicyGradientObjective on the whole rollout as one micro-batch (one window, one rank), full logits."""
    model.zero_grad()
    batch = DataCollatorForCausalLM(pad_token_id)(rows)
    _, sums = objective(model, batch)
    units = tuple(objective.count(batch).tolist())
    objective.loss(sums, WindowCounts(units[0], units[1], 1, units)).backward()
    grad = flat_grad(model)
    model.zero_grad()
    return grad


@pytest.mark.parametrize(
    "settings",
    [{"loss_type": "token"}, {"loss_type": "sequence", "beta": 0.05, "temperature": 0.8}],
    ids=["dapo", "grpo"],
)
def test_the_first_step_is_the_objective_on_the_rollout_it_sampled(tmp_path, settings):
    trainer, capture, start = run_grpo(tmp_path, **settings)
    rows = rollout_rows(capture.rollouts[0])
    assert len(rows) == 8 and all("old_logps" not in r for r in rows)  # one generation per step: ratio 1
    args = trainer.args
    objective = PolicyGradientObjective(
        args.loss_type, args.epsilon, beta=0.0, max_completion_length=args.max_completion_length,
        temperature=args.temperature,
    )  # fmt: skip
    pad = trainer.processing_class.pad_token_id
    got = capture.grads[0]
    assert relative_error(got, objective_gradient(start, rows, objective, pad)) <= 1e-6
    # The hand-written reference (plain torch); at the first step the reference is the policy itself, so beta's
    # term (k3 KL, and its gradient) is exactly zero.
    want, _ = reference_gradient(start, rows, objective.loss_type, eps=0.2, eps_high=0.2, temperature=args.temperature)
    assert relative_error(got, want) <= 1e-6 and want.norm() > 0
    logged = trainer.state.log_history[0]
    rewards = capture.rollouts[0].total
    assert logged["reward"] == pytest.approx(rewards.mean().item())
    assert logged["reward_std"] == pytest.approx(rewards.std().item())
    assert logged["rewards/brevity/mean"] == pytest.approx(rewards.mean().item())
    lengths = capture.rollouts[0].completion_lengths
    assert logged["completions/mean_length"] == pytest.approx(sum(lengths) / 8)
    assert (logged["completions/min_length"], logged["completions/max_length"]) == (min(lengths), max(lengths))
    assert logged["num_completion_tokens"] == sum(lengths) and logged["num_completions"] == 8
    assert logged["clip_ratio/region_mean"] == 0  # ratio 1 everywhere
    for key in ("generation_time", "training_time", "generation_tokens_per_second", "completion_tokens_per_second"):
        assert logged[key] > 0, key
    assert ("kl" in logged) == ("beta" in settings)


def test_a_generation_for_two_steps_divides_each_by_its_own_units(tmp_path):
    """steps_per_generation = 2 x GA: the second optimizer step trains on completions sampled before the first, with
    their old log-probs, at the updated weights, normalized by the tokens *it* consumes (TRL's 'true DAPO' was
    mis-scaled 0.5x-4x here until trl#6024)."""
    trainer, capture, start = run_grpo(
        tmp_path, steps=2, steps_per_generation=4, optim="sgd", lr_scheduler_type="constant", learning_rate=0.1
    )
    rollout = capture.rollouts[0]
    assert capture.rollouts[1].rows == rollout.rows  # one rollout for both steps
    rows = rollout_rows(rollout)
    assert len(rows) == 16 and all(len(r["old_logps"]) == len(r["input_ids"]) for r in rows)
    want = reference_sgd_steps(start, [rows[:8], rows[8:]], "token", 0.1, eps=0.2, eps_high=0.2)
    for got, expected in zip(capture.grads, want, strict=True):
        assert relative_error(got, expected) <= 1e-6
    second = trainer.state.log_history[1]
    assert "reward" not in second  # no generation in the second step's interval
    # The first step moved the policy away from the sampler's: the second step's ratios leave the clip range.
    assert second["num_completions"] == 8 and second["clip_ratio/region_mean"] > 0.1


def test_a_resumed_run_goes_on_with_the_prompts_after_its_checkpoint(tmp_path, caplog):
    """Checkpoint at step 2 of 4 (a generation per step): the resumed run samples only steps 3 and 4's generations,
    from the same prompts, with the checkpoint's RNG: the same completions and the same weights as the run that went
    on (1e-6), and it says that no rollout is sampled again. (Before, its prompts started again at the epoch's first.)"""
    settings = dict(steps=4, save_strategy="steps", save_steps=2, learning_rate=1e-2, train_sampling_strategy="random")
    full, whole, _ = run_grpo(tmp_path, **settings)
    caplog.set_level(logging.WARNING, logger="hfacc")
    resumed, again, _ = run_grpo(tmp_path, resume_from_checkpoint=str(tmp_path / "checkpoint-2"), **settings)
    assert len(again.rollouts) == 2  # steps 3 and 4: generations 1 and 2 are not sampled again
    for mine, theirs in zip(again.rollouts, whole.rollouts[2:], strict=True):
        assert [r["input_ids"] for r in mine.rows] == [r["input_ids"] for r in theirs.rows]
    for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert relative_error(a.detach().flatten(), b.detach().flatten()) <= 1e-6
    said = [r.getMessage() for r in caplog.records if "resumed at step 2" in r.getMessage()]
    assert len(said) == 1 and "generation 3 of" in said[0] and "no rollout is sampled again" in said[0], said


def test_a_resumed_run_says_which_rollout_it_samples_again(tmp_path, caplog):
    """One generation serves two steps: a checkpoint after step 1 cuts it. Its rollout is not in the checkpoint, so
    the resumed run samples those prompts again, from the resumed policy, trains the rollout's last 2 micro-batches as
    step 2, and says so."""
    settings = dict(
        steps=2, steps_per_generation=4, save_strategy="steps", save_steps=1, train_sampling_strategy="random"
    )
    _, whole, _ = run_grpo(tmp_path, **settings)
    caplog.set_level(logging.WARNING, logger="hfacc")
    resumed, again, _ = run_grpo(tmp_path, resume_from_checkpoint=str(tmp_path / "checkpoint-1"), **settings)
    assert resumed.state.global_step == 2 and len(again.rollouts) == 1
    prompts = sorted(str(r["input_ids"][: r["labels"].count(-100)]) for r in again.rollouts[0].rows)
    assert prompts == sorted(str(r["input_ids"][: r["labels"].count(-100)]) for r in whole.rollouts[0].rows)
    said = [r.getMessage() for r in caplog.records if "resumed at step 1" in r.getMessage()]
    assert len(said) == 1, said
    assert "cut generation 1 of" in said[0] and "after 2 of its 4 micro-batches" in said[0]
    assert "sampled again" in said[0] and "last 2 micro-batches of the new rollout are trained" in said[0]


def test_a_reward_function_that_fails_is_named_with_its_row(tmp_path):
    prompts = build_prompts()
    target = prompts[1]["answer"]  # the first generation batch holds rows 0 and 1 (sequential order)
    assert prompts[0]["answer"] != target

    def picky(prompts, completions, answer, **kwargs):
        for a in answer:
            if a == target:
                raise KeyError("no rule for this answer")
        return [0.0] * len(completions)

    with pytest.raises(
        RewardFunctionError, match=r"reward function 'picky' raised KeyError.*row 1 of the prompts dataset"
    ):
        run_grpo(tmp_path, reward_funcs=(picky,), train_sampling_strategy="sequential")


def short(prompts, completions):
    return [0.0, 1.0]


def nan(prompts, completions):
    return [0.0, math.nan, 1.0]


def test_reward_functions_that_return_the_wrong_thing_are_named():
    prompts, completions = ["a", "b", "c"], ["x", "y", "z"]
    with pytest.raises(RewardFunctionError, match=r"'short' returned 2 rewards for 3 completions"):
        score_completions([short], prompts, completions)
    with pytest.raises(RewardFunctionError, match=r"'nan' returned nan for row 7 \(prompt 'b'"):
        score_completions([nan], prompts, completions, row_names=["row 5", "row 7", "row 9"])
    rewards = score_completions(
        [lambda p, c, **kw: [1, 2, 3], lambda p, c, k: [float(x) for x in k]], prompts, completions, {"k": [4, 5, 6]}
    )
    assert rewards.tolist() == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 1.0])
    a = group_advantages(rewards, 2, "none")
    assert a.tolist() == [0.5, -0.5, 0.0, 0.0, 1.0, -1.0]
    scaled = group_advantages(rewards, 2, "group")
    assert scaled[0].item() == pytest.approx(0.5 / (2**0.5 / 2 + 1e-4)) and scaled[2] == 0
    assert group_advantages(rewards, 2, "batch")[4].item() == pytest.approx(1.0 / (rewards.std().item() + 1e-4))


def test_each_advantage_estimator_by_hand():
    """RLOO's leave-one-out baseline, REINFORCE++'s batch normalization, GDPO's per-reward normalization before the
    sum, written out for 2 groups of 3 and 2 reward functions."""
    rewards = torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [3.0, 0.0], [1.0, 1.0], [2.0, 1.0]], dtype=torch.float64
    )
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    r = rewards @ w
    g = r.view(2, 3)
    loo = (g - (g.sum(1, keepdim=True) - g) / 2).flatten()
    assert torch.allclose(compute_advantages(rewards, 3, w, advantage_estimator="rloo"), loo)
    whitened = (loo - loo.mean()) / (loo.std() + 1e-4)
    got = compute_advantages(rewards, 3, w, advantage_estimator="rloo", normalize_advantages=True)
    assert torch.allclose(got, whitened)
    centered = (g - g.mean(1, keepdim=True)).flatten()
    got = compute_advantages(rewards, 3, w, advantage_estimator="reinforce_pp")
    assert torch.allclose(got, (centered - centered.mean()) / (centered.std() + 1e-4))
    x = rewards.view(2, 3, 2)
    z = ((x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-4)).reshape(6, 2) @ w
    got = compute_advantages(rewards, 3, w, multi_objective_aggregation="normalize_then_sum")
    assert torch.allclose(got, (z - z.mean()) / (z.std() + 1e-4))
    assert torch.allclose(compute_advantages(rewards, 3, w), group_advantages(r, 3))  # the default: GRPO's
    with pytest.raises(ValueError, match="use it with advantage_estimator='grpo'"):
        compute_advantages(rewards, 3, w, advantage_estimator="rloo", multi_objective_aggregation="normalize_then_sum")


@pytest.mark.parametrize(
    "settings, per_rank_exact",
    [
        ({"advantage_estimator": "rloo"}, True),  # a group statistic, and groups never span ranks
        ({"advantage_estimator": "grpo", "scale_rewards": "group"}, True),
        ({"advantage_estimator": "rloo", "normalize_advantages": True}, False),
        ({"advantage_estimator": "reinforce_pp"}, False),
        ({"multi_objective_aggregation": "normalize_then_sum"}, False),
        ({"advantage_estimator": "grpo", "scale_rewards": "batch"}, False),
    ],
)
def test_batch_statistics_are_the_whole_generations_and_a_ranks_own_are_not(settings, per_rank_exact):
    """Two ranks of 4 groups of 4: advantages from every rank's rewards, sliced, are the generation batch's; a
    rank's own rewards (the per-rank baseline) give other advantages wherever a statistic is over the batch."""
    generator = torch.Generator().manual_seed(3)
    rewards = torch.rand(32, 2, generator=generator, dtype=torch.float64)
    rewards[16:] *= 3  # the ranks' rewards differ in scale, as different prompts' do
    whole = compute_advantages(rewards, 4, **settings)
    per_rank = torch.cat([compute_advantages(rewards[k * 16 : (k + 1) * 16], 4, **settings) for k in range(2)])
    assert torch.allclose(per_rank, whole, atol=1e-12) == per_rank_exact, settings


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"vllm_gpu_memory_utilization": 0.0}, r"vllm_gpu_memory_utilization=0.0: .* in \(0, 1\]"),
        ({"vllm_gpu_memory_utilization": 1.5}, r"vllm_gpu_memory_utilization=1.5"),
        ({"vllm_tensor_parallel_size": 2}, r"vllm_tensor_parallel_size=2: this process has a CPU \(one device\)"),
        ({"vllm_enable_sleep_mode": True}, "vLLM has no sleep mode on a CPU"),
        ({"vllm_mode": "server", "vllm_server_port": 0}, "vllm_server_port=0: a port is between 1 and 65535"),
        ({"vllm_mode": "server", "max_staleness": -1}, "max_staleness=-1: optimizer steps, >= 0"),
        ({"vllm_max_model_length": 8}, r"vllm_max_model_length=8 is shorter than a prompt .* >= 257"),
        (
            {"vllm_max_model_length": 300, "max_prompt_length": 64},
            r"shorter than max_prompt_length \+ max_completion_length = 64 \+ 256: .* >= 320",
        ),
        ({"vllm_importance_sampling_mode": "tis"}, "vllm_importance_sampling_mode='tis'"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0}, "must be below"),
    ],
)
def test_vllm_settings_are_checked_before_training(tmp_path, settings, message):
    """Each bad vLLM setting is one named error when the settings are made, on a machine without vLLM too."""
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True)
    with pytest.raises(ValueError, match=message):
        GRPOArguments(**values, use_vllm=True, **settings)
    if not any(k.startswith("vllm_importance") for k in settings):  # unused without use_vllm: not refused
        GRPOArguments(**values, **settings)


@pytest.mark.skipif(is_vllm_available(), reason="vLLM is installed here: the error is for environments without it")
def test_use_vllm_without_vllm_is_one_named_error(tmp_path):
    with pytest.raises(ValueError, match=r"use_vllm=True needs vLLM, which is not installed .*docs/vllm.md"):
        GRPOArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_vllm=True)


def test_trls_former_cap_sets_the_upper_bound(tmp_path):
    args = GRPOArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, vllm_importance_sampling_cap=2.0
    )
    assert args.vllm_importance_sampling_clip_max == 2.0


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"num_generations": 3}, "must hold whole groups of num_generations=3"),
        ({"num_generations": 1}, "num_generations=1"),
        ({"loss_type": "bnpo"}, "loss_type='bnpo'"),
        ({"normalization": "sequence"}, "set loss_type='sequence'"),
        ({"beta": -1.0}, "beta=-1.0"),  # the loss's own checks, where the settings are made
        ({"epsilon": -1.0}, "epsilon=-1.0"),
        ({"loss_type": "cispo"}, "loss_type='cispo' caps the ratio at epsilon_high"),
        ({"loss_type": "cispo", "epsilon_high": 0.28}, "epsilon_high=0.28: set --epsilon_high above 1"),
        ({"importance_sampling_level": "sequence_token"}, "importance_sampling_level='sequence_token'"),
        ({"advantage_estimator": "ppo"}, "advantage_estimator='ppo'"),
        ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation='mean'"),
        ({"advantage_estimator": "rloo", "multi_objective_aggregation": "normalize_then_sum"}, "set advantage_"),
    ],
)
def test_settings_are_checked(tmp_path, settings, message):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, use_cpu=True)
    with pytest.raises(ValueError, match=message):
        GRPOArguments(**{**values, **settings})


# ---- two ranks, one launch --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("pg") / "results.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    launch += ["--main_process_port", str(free_port()), "tests/policy_gradient_check.py", str(out)]
    proc = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_two_ranks_with_unequal_completion_lengths(two_ranks):
    assert two_ranks["world_size"] == 2
    rank0, rank1 = two_ranks["local_tokens"]
    assert rank0 > 4 * rank1
    assert len(two_ranks["cases"]) >= 13
    for name, case in two_ranks["cases"].items():
        assert case["grad_error"] <= 1e-6, name
    assert two_ranks["negative_control"] > 0.05  # per-micro-batch means over the ranks: not the big batch


@pytest.mark.distributed
def test_the_online_first_step_on_two_ranks(two_ranks):
    online = two_ranks["online"]
    assert online["rows_per_rank"] == [8, 8] and online["prompts_differ"]
    for name, error in online["errors"].items():
        assert error <= 1e-6, name
    assert len(online["errors"]) == 5  # token, sequence, and GDPO / REINFORCE++ / normalized RLOO with a variant
    for name, error in online["advantage_errors"].items():
        assert error <= 1e-9, name  # each rank's advantages: the whole generation's, both ranks' rewards
        assert online["per_rank_advantage_errors"][name] > 1e-3, name  # negative control: a rank's own rewards


@pytest.mark.distributed
def test_verify_on_two_ranks(two_ranks):
    verify = two_ranks["verify"]
    assert verify["passed"] and verify["world_size"] == 2
    assert max(e for by in verify["errors"].values() for errs in by.values() for e in errs) <= 1e-6
    assert verify["micro_batch"]["token"] > 0.01  # the comparison it prints can see a wrong normalizer


def test_hfacc_verify_objective_grpo(capsys):
    """`hfacc verify --objective grpo`: a rollout of the embedded model, each optimizer step of spg = GA and 2 x GA
    against its big batch, every loss type; and the per-micro-batch normalization it prints for comparison."""
    from hfacc.cli import main as cli_main

    argv = [
        "verify",
        "--objective",
        "grpo",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
    ]
    argv += ["--embedded_hidden_size", "32", "--embedded_num_layers", "1", "--json_path", "/dev/null"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "steps_per_generation 2 (= GA) and 4 (= 2 x GA" in out
    for loss_type in ("token", "sequence", "dr_grpo", "cispo", "sapo"):
        assert f"  {loss_type}" in out


def test_hfacc_verify_takes_the_variant(capsys):
    """`hfacc verify --objective grpo --importance_sampling_level sequence --advantage_estimator reinforce_pp
    --loss_type sequence`: GSPO on REINFORCE++ advantages, spg = GA and 2 x GA, against the big batch."""
    from hfacc.cli import main as cli_main

    argv = [
        "verify",
        "--objective",
        "grpo",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
    ]
    argv += ["--loss_type", "sequence", "--importance_sampling_level", "sequence"]
    argv += ["--advantage_estimator", "reinforce_pp", "--embedded_hidden_size", "32", "--embedded_num_layers", "1"]
    assert cli_main(argv + ["--json_path", "/dev/null"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "importance_sampling_level 'sequence', advantages reinforce_pp" in out
    assert "  sequence" in out and "  token" not in out


@pytest.mark.slow
def test_the_recipe_runs_offline_and_reports_before_and_after(tmp_path, capsys):
    """`hfacc grpo` (= recipes/grpo.py) on the embedded default, shortened: no SFT output, so a short SFT first; then
    again from that SFT output. It writes the model, metrics.json and the reward curve, and prints the summary."""
    from hfacc.cli import main as cli_main

    out = tmp_path / "grpo"
    short = ["--max_steps", "2", "--num_train_prompts", "32", "--num_eval_prompts", "4", "--logging_steps", "1"]
    short += ["--per_device_train_batch_size", "8", "--num_generations", "4", "--disable_tqdm", "true"]
    argv = [
        "grpo",
        *short,
        "--sft_output_dir",
        str(tmp_path / "none"),
        "--sft_max_steps",
        "2",
        "--output_dir",
        str(out),
    ]
    argv += ["--sft_num_examples", "160", "--embedded_hidden_size", "64", "--num_probe_prompts", "2"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "no SFT model at" in printed and "=== hfacc GRPO summary ===" in printed
    assert "where the policy's samples disagree (share of 2 probe groups with reward variance: " in printed
    assert "held-out exact match" in printed and "held-out reward" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["policy"].startswith("a short SFT of 2 steps")
    assert metrics["tasks"] and set(metrics["tasks"]) <= set(metrics["before"]["exact_match_by_task"]) | set(TASKS)
    assert (
        set(metrics["before"]) >= {"reward", "exact_match", "exact_match_by_task"}
        and "exact_match" in metrics["after"]
    )
    assert metrics["generation_time_s"] > 0 and metrics["training_time_s"] > 0
    for name in ("model.safetensors", "tokenizer.json", "reward_curve.png", "sft/model.safetensors"):
        assert (out / name).is_file(), name
    again = tmp_path / "again"
    argv = ["grpo", *short, "--max_steps", "1", "--sft_output_dir", str(out / "sft"), "--output_dir", str(again)]
    argv += ["--tasks", "spell", "words"]  # given: no probe
    assert cli_main(argv + ["--logging_steps", "5"]) == 0  # its one step ends before the first logging step
    metrics = json.loads((again / "metrics.json").read_text())
    assert metrics["policy"] == f"from {out / 'sft'}" and metrics["tasks"] == ["spell", "words"]
    assert metrics["generation_time_s"] > 0 and metrics["training_time_s"] > 0  # the whole run's, logged or not


def test_tasks_auto_picks_the_tasks_where_the_policys_samples_disagree(monkeypatch, capsys):
    """A group whose samples all score the same carries no gradient: the full SFT output answers reverse and
    countdown the same way every time, so GRPO on them (the recipe's `tasks: [reverse]` of before) learned nothing.
    The probe's groups decide; with none varied enough, the task with the most is taken; given tasks stay."""
    from types import SimpleNamespace

    from hfacc.jobs import grpo

    job, args = (
        grpo.GRPOJobArguments(tasks=["auto"], num_probe_prompts=4, max_auto_tasks=6),
        GRPOArguments(output_dir="unused", num_generations=2, per_device_train_batch_size=2, use_cpu=True),
    )
    varied = {"arithmetic": 4, "countdown": 0, "repeat": 1, "reverse": 0, "spell": 3, "words": 2}  # of 4 groups

    def probe(model, tokenizer, rows, funcs, *, num_generations, **kwargs):
        assert num_generations == 2 and [r["task"] for r in rows] == [t for t in sorted(varied) for _ in range(4)]
        groups = [[0.0, 1.0] if k < varied[t] else [1.0, 1.0] for t in sorted(varied) for k in range(4)]
        return SimpleNamespace(total=torch.tensor(groups).flatten())

    monkeypatch.setattr(grpo, "build_rollout", probe)
    picked = grpo.pick_tasks(job, None, None, [], args)
    assert picked.tasks == ["arithmetic", "repeat", "spell", "words"]  # a quarter of the groups vary, or more
    assert "tasks  arithmetic, repeat, spell, words: where the policy's samples disagree" in capsys.readouterr().out
    job = grpo.GRPOJobArguments(tasks=["auto"], num_probe_prompts=4, max_auto_tasks=2)
    assert grpo.pick_tasks(job, None, None, [], args).tasks == ["arithmetic", "spell"]  # the two most varied
    job = grpo.GRPOJobArguments(tasks=["auto"], num_probe_prompts=4, min_varied_groups=1.0)
    assert grpo.pick_tasks(job, None, None, [], args).tasks == ["arithmetic"]  # only it has every group varied
    varied.update(arithmetic=0)
    assert grpo.pick_tasks(job, None, None, [], args).tasks == ["spell"]  # none has: the most
    given = grpo.GRPOJobArguments(tasks=["reverse"])
    assert grpo.pick_tasks(given, None, None, [], args) is given
    with pytest.raises(ValueError, match="or 'auto' alone"):
        grpo.GRPOJobArguments(tasks=["auto", "spell"])


def test_the_recipe_and_hfacc_grpo_share_one_definition_of_the_settings():
    import hfacc.jobs.grpo
    from tests.helpers import load_recipe, recipe_types

    recipe = load_recipe("grpo")
    assert recipe.main is hfacc.jobs.grpo.main and recipe_types(recipe) == list(hfacc.jobs.grpo.GRPO_ARGUMENTS)


@pytest.mark.parametrize("flags", [["--beta", "-1"], ["--reward_weights", "1", "2"]])
def test_hfacc_grpo_refuses_bad_settings_before_any_training(flags, tmp_path, capsys):
    """One ``error:`` line, exit 2, before the job's short SFT (a minute): not a traceback once it is done."""
    from hfacc.jobs.console import run_recipe
    from hfacc.jobs.grpo import GRPO_ARGUMENTS, main

    argv = ["--output_dir", str(tmp_path), "--sft_output_dir", str(tmp_path / "none"), *flags]
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(main, GRPO_ARGUMENTS, argv=argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "sft").exists()


def test_each_rank_samples_its_own_completions_reproducibly():
    """The transformers engine draws under each rank's seed: two ranks' seeds give two samples of the same prompts
    (not one sample twice), the same seed gives the same completions again (a resumed run's generation too), and the
    run's global torch stream is left where it was. (Before, the seed was ignored and every rank, seeded alike, drew
    the same completions.)"""
    from hfacc.generation.engine import SamplingSettings, TransformersEngine, get_sampling_seed

    model, tokenizer = build_policy()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine, settings = TransformersEngine(model, tokenizer), SamplingSettings(max_completion_length=8)
    torch.manual_seed(0)  # every rank's global generator starts alike
    state = torch.get_rng_state()
    rank0, rank1 = (engine.sample([prompt] * 8, settings, seed=get_sampling_seed(42, 1, r)) for r in (0, 1))
    assert torch.equal(torch.get_rng_state(), state)  # dropout and shuffling draw on as without sampling
    assert rank0.completion_ids != rank1.completion_ids
    torch.manual_seed(123)  # another global state: the seed alone decides the draw
    again = engine.sample([prompt] * 8, settings, seed=get_sampling_seed(42, 1, 0))
    assert again.completion_ids == rank0.completion_ids
    assert get_sampling_seed(42, 2, 0) != get_sampling_seed(42, 1, 0)  # each generation draws afresh
