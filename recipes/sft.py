"""Supervised fine-tuning with loss masking and exact gradient accumulation.

    accelerate launch recipes/sft.py                       # embedded default: offline, runs on a CPU
    accelerate launch recipes/sft.py --config recipes/configs/qwen2.5-0.5b-instruct_lora.yaml
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sft.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/tiny_default.yaml supplies the defaults: a tiny
Llama and a tokenizer built here, trained on generated instructions. Any setting can be given on the command line
(`--learning_rate 1e-4`); they override the YAML. Writes the model, tokenizer, metrics.json and loss_curve.png to
--output_dir. The console shows one progress bar, a line per evaluation and a summary (`--log_level info`: all
detail); a user error ends in one message and exit code 2 (`--debug` or HFACC_DEBUG=1: with its traceback).

The job itself (its settings, SFTArguments, and main) lives in hfacc/jobs/sft.py, so `hfacc sft` runs the same one.
"""

import sys

from hfacc.jobs.sft import DEFAULT_CONFIG, SFT_ARGUMENTS, SFTArguments, cli, default_config, main  # noqa: F401 (tests use them)

if __name__ == "__main__":
    sys.exit(cli())
