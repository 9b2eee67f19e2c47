"""Preference optimization (DPO and its variants) with exact accumulation per pair.

    accelerate launch recipes/dpo.py                       # embedded default: offline, runs on a CPU
    accelerate launch recipes/dpo.py --model_name_or_path my-sft-model --dataset_name pairs.jsonl --loss_type ipo
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/dpo.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/dpo_tiny_default.yaml supplies the defaults: it
starts from the SFT recipe's output (outputs/sft-tiny) if it is there, else runs a short SFT itself, builds pairs
from that model's own mistakes on the embedded tasks (chosen: the right answer; rejected: its wrong greedy or
sampled answer) and trains. Any
setting can be given on the command line; it overrides the YAML. Writes the model, tokenizer, metrics.json and
loss_curve.png to --output_dir; a user error ends in one message and exit code 2.

The job itself (DPOArguments and main) lives in hfacc/jobs/dpo.py, so `hfacc dpo` runs the same one.
"""

import sys

from hfacc.jobs.dpo import DEFAULT_CONFIG, DPO_ARGUMENTS, DPOArguments, cli, default_config, main  # noqa: F401 (tests use them)

if __name__ == "__main__":
    sys.exit(cli())
