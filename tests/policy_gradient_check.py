"""Two CPU ranks (gloo) for the policy-gradient objective and GRPOTrainer, many configurations in one launch:

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/policy_gradient_check.py OUT.json

1. Fixed rollouts through TokenWeightedTrainer with very unequal completion lengths per rank (rank 0 gets the rows
   of 10-14 completion tokens, rank 1 those of 1-3; micro-batches of 2, so padding-free packs two completions): every loss type, beta 0 and 0.1, padded and padding-free, and
   one rollout over two SGD steps (steps_per_generation = 2 x GA). The gradient after DDP's all-reduce is compared
   with the hand-written big batch of all ranks' rows (tests/rollouts.py), computed on every rank.
   The variants (GSPO, CISPO, SAPO) the same way, padded and padding-free.
2. GRPOTrainer's first optimizer step: each rank samples its own prompts; the reference is the big batch of both
   ranks' rollouts. Also with GDPO, REINFORCE++ and normalized RLOO advantages (each with a loss variant): each
   rank's advantages are those of both ranks' rewards together, and a rank's own rewards would give others.

Rank 0 writes the measured errors to OUT.json; tests/test_grpo.py asserts on them.
"""

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForCausalLM,
    PolicyGradientObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_tiny_llama,
)
from tests.grpo_setup import brevity, digits, rollout_rows, run_grpo  # noqa: E402
from tests.helpers import VOCAB, relative_error, run_trainer, train_args  # noqa: E402
from tests.rollouts import make_rollout, reference_gradient, reference_sgd_steps  # noqa: E402

EPS, EPS_HIGH, BETA, L = 0.2, 0.28, 0.1, 16
ADVANTAGE_KEYS = ("advantage_estimator", "multi_objective_aggregation", "normalize_advantages", "scale_rewards")
# (name, objective settings, hand-written reference settings) on fixed rollouts.
VARIANTS = [
    (
        "gspo",
        dict(loss_type="sequence", epsilon=0.03, epsilon_high=0.04, importance_sampling_level="sequence", beta=BETA),
        dict(loss_type="sequence", eps=0.03, eps_high=0.04, level="sequence", beta=BETA),
    ),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.3), dict(loss_type="cispo", eps_high=1.3)),
    ("sapo", dict(loss_type="sapo"), dict(loss_type="sapo")),
]
# (name, GRPOArguments, reference settings, reward functions) online: each advantage estimator with a loss variant.
ONLINE_VARIANTS = [
    (
        "gdpo sapo",
        dict(multi_objective_aggregation="normalize_then_sum", loss_type="sapo"),
        dict(loss_type="sapo"),
        (brevity, digits),
    ),
    (
        "reinforce_pp cispo",
        dict(advantage_estimator="reinforce_pp", loss_type="cispo", epsilon_high=5.0),
        dict(loss_type="cispo", eps_high=5.0),
        (brevity,),
    ),
    (
        "rloo normalized gspo",
        dict(
            advantage_estimator="rloo",
            normalize_advantages=True,
            loss_type="sequence",
            importance_sampling_level="sequence",
            epsilon=3e-4,
            epsilon_high=4e-4,
        ),
        dict(loss_type="sequence", level="sequence", eps=3e-4, eps_high=4e-4),
        (brevity,),
    ),
]


def unequal_rollout(model, n=8, seed=0):
    """Rows in pairs, long completions then short ones (L L S S L L ...): at bs 2 over two ranks in sequential order,
    rank 0 gets every long one and rank 1 every short one; the ranks' token counts differ ~5x."""
    long = make_rollout(model, n=n // 2, seed=seed, completion_lengths=(10, 14))
    short = make_rollout(model, n=n // 2, seed=seed + 1, completion_lengths=(1, 3))
    return [row for i in range(0, n // 2, 2) for row in (*long[i : i + 2], *short[i : i + 2])]


def main(out_path: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    collate = DataCollatorForCausalLM(pad_token_id=0)
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    ref = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=3)
    rows = unequal_rollout(model)
    results = {"cases": {}}
    per_rank = [[r for i, r in enumerate(rows) if (i // 2) % 2 == k] for k in range(2)]
    results["local_tokens"] = [sum(sum(1 for y in r["labels"][1:] if y != -100) for r in mine) for mine in per_rank]

    def args(bs, ga, **overrides):
        return train_args(tmp, bs, ga, args_class=TokenWeightedArguments, ddp_timeout=120, **overrides)

    def objective(loss_type, beta):
        return PolicyGradientObjective(loss_type, EPS, EPS_HIGH, beta, ref_model=ref, max_completion_length=L)

    for loss_type in ("token", "sequence", "dr_grpo"):
        for beta in (0.0, BETA):
            want, _ = reference_gradient(
                model, rows, loss_type, eps=EPS, eps_high=EPS_HIGH, beta=beta, ref_model=ref, max_completion_length=L
            )
            for padding_free in (True, False):
                trainer, capture = run_trainer(
                    TokenWeightedTrainer,
                    model,
                    rows,
                    args(2, 2, padding_free=padding_free),
                    collate,
                    objective=objective(loss_type, beta),
                )
                assert trainer.padding_free == padding_free
                name = f"{loss_type} beta={beta} {'padding-free' if padding_free else 'padded'}"
                results["cases"][name] = {"grad_error": relative_error(capture.grads[0], want)}
                results["world_size"] = trainer.args.world_size

    # The variants (GSPO's ratio per completion, CISPO, SAPO) over the unequal ranks, padded and padding-free.
    for name, settings, reference in VARIANTS:
        want, _ = reference_gradient(model, rows, **reference, ref_model=ref, max_completion_length=L)
        for padding_free in (True, False):
            trainer, capture = run_trainer(
                TokenWeightedTrainer,
                model,
                rows,
                args(2, 2, padding_free=padding_free),
                collate,
                objective=PolicyGradientObjective(**settings, ref_model=ref, max_completion_length=L),
            )
            layout = "padding-free" if padding_free else "padded"
            results["cases"][f"{name} {layout}"] = {"grad_error": relative_error(capture.grads[0], want)}

    # The per-micro-batch mean (TRL's bnpo: each micro-batch over its own tokens, / GA), over the ranks too.
    want, _ = reference_gradient(model, rows, "token", eps=EPS, eps_high=EPS_HIGH)
    _, capture = run_trainer(
        TokenWeightedTrainer,
        model,
        rows,
        args(2, 2, normalization="micro_batch"),
        collate,
        objective=objective("token", 0.0),
    )
    results["negative_control"] = relative_error(capture.grads[0], want)

    # One rollout of 16 over two SGD steps of 2 x 2 per rank: each step over its own tokens, all ranks.
    rows16 = unequal_rollout(model, n=16, seed=2)
    start = copy.deepcopy(model.state_dict())
    # Step s consumes rows 8s..8s+7 of the sequential order (4 per rank).
    want = reference_sgd_steps(model, [rows16[:8], rows16[8:]], "sequence", 0.5, eps=EPS, eps_high=EPS_HIGH)
    model.load_state_dict(start)
    sgd = dict(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0)
    _, capture = run_trainer(
        TokenWeightedTrainer, model, rows16, args(2, 2, **sgd), collate, objective=objective("sequence", 0.0)
    )
    model.load_state_dict(start)
    for step, (got, expected) in enumerate(zip(capture.grads, want, strict=True)):
        results["cases"][f"steps_per_generation = 2 x GA, step {step + 1}"] = {
            "grad_error": relative_error(got, expected)
        }

    # GRPOTrainer on both ranks: each samples its own prompts; the first step is the big batch of both rollouts.
    online = {"errors": {}, "advantage_errors": {}, "per_rank_advantage_errors": {}}
    for loss_type in ("token", "sequence"):
        trainer, capture, policy = run_grpo(tmp / loss_type, loss_type=loss_type)
        mine = rollout_rows(capture.rollouts[0])
        gathered = [None, None]
        dist.all_gather_object(gathered, mine)
        online["rows_per_rank"] = [len(g) for g in gathered]
        online["prompts_differ"] = gathered[0][0]["input_ids"] != gathered[1][0]["input_ids"] or any(
            a["input_ids"] != b["input_ids"] for a, b in zip(gathered[0], gathered[1], strict=True)
        )
        want, _ = reference_gradient(policy, gathered[0] + gathered[1], loss_type, eps=0.2, eps_high=0.2)
        online["errors"][loss_type] = relative_error(capture.grads[0], want)
    # The advantage estimators online: batch statistics over both ranks' rewards, gathered before any backward.
    from hfacc.generation.rollout import compute_advantages

    for name, settings, reference, funcs in ONLINE_VARIANTS:
        trainer, capture, policy = run_grpo(tmp / name.replace(" ", "_"), reward_funcs=funcs, **settings)
        rollout, rank = capture.rollouts[0], trainer.accelerator.process_index
        gathered = [None, None]
        dist.all_gather_object(gathered, (rollout_rows(rollout), rollout.rewards))
        picked = {k: settings[k] for k in ADVANTAGE_KEYS if k in settings}
        whole = compute_advantages(torch.cat([g[1] for g in gathered]), 4, **picked)
        n = len(rollout.rows)
        mine = sorted(whole[rank * n : (rank + 1) * n].tolist())
        got = sorted(float(r["advantages"]) for r in rollout.rows)
        own = sorted(compute_advantages(rollout.rewards, 4, **picked).tolist())  # the per-rank baseline
        want, _ = reference_gradient(policy, gathered[0][0] + gathered[1][0], **reference)
        online["errors"][name] = relative_error(capture.grads[0], want)
        online["advantage_errors"][name] = max(abs(a - b) for a, b in zip(got, mine, strict=True))
        online["per_rank_advantage_errors"][name] = max(abs(a - b) for a, b in zip(own, mine, strict=True))
    results["online"] = online

    # hfacc verify --objective grpo on both ranks: a rollout of the policy, each step vs its big batch.
    from hfacc.verify.equivalence import verify_policy_gradient
    from tests.grpo_setup import build_policy, build_prompts

    accelerator = Accelerator(cpu=True)
    policy, tokenizer = build_policy()
    prompts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in build_prompts()["prompt"]
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    report = verify_policy_gradient(
        policy, tokenizer, ids, micro_batch_size=2, gradient_accumulation_steps=2, accelerator=accelerator
    )
    results["verify"] = {
        "passed": report.passed,
        "errors": report.errors,
        "micro_batch": report.micro_batch_errors,
        "world_size": report.rollout["world_size"],
    }
    if accelerator.is_main_process:
        Path(out_path).write_text(json.dumps(results, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
