"""KTO on unpaired preference rows with exact accumulation: the row as the unit, the reference point the step's.

    accelerate launch recipes/kto.py                       # embedded default: offline, runs on a CPU
    accelerate launch recipes/kto.py --model_name_or_path my-sft-model --dataset_name rows.jsonl
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/kto.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/kto_tiny_default.yaml supplies the defaults: it
starts from the SFT recipe's output (outputs/sft-tiny) if it is there, else runs a short SFT itself, answers the
embedded prompts with that model, makes its answers unpaired rows (a right one desirable, a mistake undesirable) and
trains with KTO. Any setting can be given on the command line; it overrides the YAML. Writes the model, tokenizer,
metrics.json and loss_curve.png to --output_dir; a user error ends in one message and exit code 2.

The job itself (KTOArguments and main) lives in hfacc/jobs/kto.py, so `hfacc kto` runs the same one.
"""

import sys

from hfacc.jobs.kto import DEFAULT_CONFIG, KTO_ARGUMENTS, KTOArguments, cli, default_config, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
