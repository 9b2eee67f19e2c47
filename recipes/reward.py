"""A reward model (Bradley-Terry) with exact accumulation per pair.

    accelerate launch recipes/reward.py                    # embedded default: offline, runs on a CPU
    accelerate launch recipes/reward.py --model_name_or_path my-sft-model --dataset_name pairs.jsonl
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/reward.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/reward_tiny_default.yaml supplies the defaults: it
starts from the SFT recipe's output (outputs/sft-tiny) if it is there, else runs a short SFT itself, builds pairs
from the embedded tasks as the DPO recipe does, and trains the SFT model as a reward model (a new score head). Any
setting can be given on the command line; it overrides the YAML. Writes the reward model, tokenizer, metrics.json
and loss_curve.png to --output_dir; a user error ends in one message and exit code 2.

The job itself (RewardArguments and main) lives in hfacc/jobs/reward.py, so `hfacc reward` runs the same one.
"""

import sys

from hfacc.jobs.reward import DEFAULT_CONFIG, REWARD_ARGUMENTS, RewardArguments, cli, default_config, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
