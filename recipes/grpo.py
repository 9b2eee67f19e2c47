"""Online RL (GRPO, DAPO, Dr. GRPO) with exact accumulation: each optimizer step divides by what it consumes.

    accelerate launch recipes/grpo.py                      # embedded default: offline, runs on a CPU
    accelerate launch recipes/grpo.py --loss_type sequence --beta 0.04 --max_steps 100
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/grpo.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/tiny_grpo.yaml supplies the defaults: the policy is
the SFT recipe's output (outputs/sft-tiny) when it exists, else a short SFT runs first; the embedded tasks are the
prompts and the reward is the answer's correctness. It prints the held-out reward and exact match before -> after
and writes the model, tokenizer, metrics.json and reward_curve.png to --output_dir.

The job itself (its settings, GRPOJobArguments, and main) lives in hfacc/jobs/grpo.py, so `hfacc grpo` runs the same
one.
"""

import sys

from hfacc.jobs.grpo import DEFAULT_CONFIG, GRPO_ARGUMENTS, GRPOJobArguments, cli, default_config, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
