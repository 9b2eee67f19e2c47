"""Knowledge distillation with exact accumulation per student token: from a teacher model, stored top-K log-probs,
or on-policy.

    accelerate launch recipes/distill.py                   # embedded default: offline, runs on a CPU
    accelerate launch recipes/distill.py --teacher_model_name_or_path my-teacher --model_name_or_path my-student
    accelerate launch recipes/distill.py --precompute_teacher_logprobs true --teacher_top_k 32
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/distill.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/distill_tiny_default.yaml supplies the defaults: the
teacher is the SFT recipe's output (outputs/sft-tiny) when it exists, else a short SFT of a bigger embedded model
runs first; the student is the tiny default, untrained; the data are the embedded conversations. It prints the
held-out exact match of the teacher and of the student before -> after and writes the student, tokenizer,
metrics.json and loss_curve.png to --output_dir.

The job itself (its settings, DistillJobArguments, and main) lives in hfacc/jobs/distill.py, so `hfacc distill` runs
the same one.
"""

import sys

from hfacc.jobs.distill import DEFAULT_CONFIG, DISTILL_ARGUMENTS, DistillJobArguments, cli, default_config, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(cli())
