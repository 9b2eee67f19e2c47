"""Two CPU ranks (gloo) for multi-turn rows, in one launch:

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/tools_check.py OUT.json

1. The fixed multi-turn trajectories of tests/test_tools.py (uneven tool results) through TokenWeightedTrainer on
   two ranks (micro-batches of 2, GA 2: each rank trains its own 4 trajectories, their policy tokens unequal),
   padded and padding-free, token and sequence loss: the gradient after the all-reduce against the hand-written big
   batch of all 8 over the policy's tokens, computed on every rank.
2. GRPOTrainer with a Python tool on the generate path: each rank samples its own prompts; the first step against
   the big batch of both ranks' rows; the tool metrics summed over both ranks.

Rank 0 writes the errors to OUT.json; tests/test_tools.py asserts on them.
"""

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfacc import (  # noqa: E402
    GRPOArguments,
    GRPOTrainer,
    PolicyGradientObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
)
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.grpo_setup import CaptureSteps, build_policy, build_prompts  # noqa: E402
from tests.helpers import relative_error, run_trainer, train_args  # noqa: E402
from tests.test_tools import (  # noqa: E402
    BUDGET,
    EPS,
    EPS_HIGH,
    FirstTurnCalls,
    build_fixed,
    collate,
    multiply,
    reference_gradient,
    reference_gradient_eps,
)


def main(out_path: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    _, model, rows, positions, _, _ = build_fixed()
    results = {"cases": {}}
    # Sequential order, bs 2 x GA 2 per rank: rank r takes micro-batches r, r + 2 (rows 4r'.. of the global batches).
    for loss_type in ("token", "sequence"):
        want = reference_gradient(model, rows, positions, loss_type)
        for padding_free in (True, False):
            args = train_args(tmp, 2, 2, args_class=TokenWeightedArguments, padding_free=padding_free, ddp_timeout=120)
            objective = PolicyGradientObjective(loss_type, EPS, EPS_HIGH, max_completion_length=BUDGET)
            trainer, capture = run_trainer(TokenWeightedTrainer, model, rows, args, collate, objective=objective)
            results["world_size"] = trainer.args.world_size
            name = f"{loss_type} {'padding-free' if padding_free else 'padded'}"
            results["cases"][name] = relative_error(capture.grads[0], want)
    mine = [len(p) for i, p in enumerate(positions) if (i // 2) % 2 == trainer.accelerator.process_index]
    local = [None, None]
    dist.all_gather_object(local, sum(mine))
    results["local_policy_tokens"] = local

    # GRPOTrainer with a tool on both ranks.
    policy, tokenizer = build_policy()
    start = copy.deepcopy(policy)

    def brevity(prompts, completions, **kwargs):
        return [1.0 / (1 + len(c[-1]["content"])) for c in completions]

    args = GRPOArguments(
        output_dir=str(tmp / "grpo"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=100, max_steps=1, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, max_grad_norm=0.0,
        max_tool_calling_iterations=1, ddp_timeout=120,
    )  # fmt: skip
    trainer = GRPOTrainer(
        policy, brevity, args, train_dataset=build_prompts(), processing_class=tokenizer, tools=[multiply],
        engine=FirstTurnCalls(policy, tokenizer),
    )  # fmt: skip
    capture = CaptureSteps(trainer)
    trainer.add_callback(capture)
    trainer.train()
    rollout = capture.rollouts[0]
    gathered = [None, None]
    dist.all_gather_object(gathered, ([dict(r) for r in rollout.rows], rollout.turns))
    both = gathered[0][0] + gathered[1][0]
    spans = [[i for i, y in enumerate(r["labels"]) if y != -100] for r in both]
    want = reference_gradient_eps(start, both, spans)
    logged = trainer.state.log_history[0]
    results["online"] = {
        "error": relative_error(capture.grads[0], want),
        "prompts_differ": gathered[0][0][0]["input_ids"] != gathered[1][0][0]["input_ids"],
        "call_frequency": logged["tools/call_frequency"],
        "mean_turns": logged["tools/mean_turns"],
        "turns_both": sum(gathered[0][1]) + sum(gathered[1][1]),
        "num_completion_tokens": logged["num_completion_tokens"],
        "policy_tokens_both": sum(len(s) for s in spans),
    }
    if trainer.accelerator.is_main_process:
        Path(out_path).write_text(json.dumps(results, indent=2))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
