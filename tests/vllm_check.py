"""Two processes, each with its own colocated vLLM engine, train GRPO exactly: rank 0 writes what it measured.

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/vllm_check.py OUT.json

Each rank samples its own prompts with its own engine (seeded by its rank), both engines get the policy's weights
after every step, and each optimizer step's gradient (after DDP's all-reduce) is compared with the hand-written big
batch of both ranks' rollouts, at the weights the step started from. tests/test_vllm_processes.py asserts on OUT.json.
"""

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.grpo_setup import build_policy, rollout_rows, run_grpo  # noqa: E402
from tests.helpers import relative_error  # noqa: E402
from tests.rollouts import reference_gradient  # noqa: E402

STEPS = 2


def main(out_path: str) -> None:
    policy = build_policy(0, hidden_size=64, num_heads=2)
    trainer, capture, start = run_grpo(
        Path(tempfile.mkdtemp()), steps=STEPS, policy=policy, use_vllm=True, learning_rate=1e-2, ddp_timeout=300
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"world_size": world, "steps": [], "engine": trainer.engine.name, "syncs": trainer.engine.syncs}
    for step in range(STEPS):
        mine = rollout_rows(capture.rollouts[step])
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        model = copy.deepcopy(start)
        model.load_state_dict(capture.weights[step])
        rows = [row for rank_rows in gathered for row in rank_rows]
        want, _ = reference_gradient(model, rows, "token", eps=0.2, eps_high=0.2)
        results["steps"].append(
            {
                "grad_error": relative_error(capture.grads[step], want),
                "reference_norm": want.norm().item(),
                "rows_per_rank": [len(g) for g in gathered],
                "prompts_differ": gathered[0][0]["input_ids"] != gathered[1][0]["input_ids"],
                "weighted": all("importance_weights" in r for r in rows),
            }
        )
    history = trainer.state.log_history
    results["logp_difference_max"] = [h["sampling/sampling_logp_difference/max"] for h in history if "reward" in h]
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=2))
    dist.barrier()
    # The engines' shutdown at exit destroys the default process group itself: do not destroy it before (vLLM's groups
    # are sub-groups of it).


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
