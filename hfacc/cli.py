"""The ``hfacc`` command: ``hfacc sft``, ``dpo``, ``reward``, ``kto``, ``grpo``, ``distill``, ``verify`` and ``show-mask``.

hfacc sft                                      # the job of `accelerate launch recipes/sft.py` (hfacc/jobs/sft.py)
hfacc dpo                                      # the job of `accelerate launch recipes/dpo.py` (hfacc/jobs/dpo.py)
hfacc reward                                   # the job of `accelerate launch recipes/reward.py` (hfacc/jobs/reward.py)
hfacc kto                                      # the job of `accelerate launch recipes/kto.py` (hfacc/jobs/kto.py)
hfacc grpo                                     # the job of `accelerate launch recipes/grpo.py` (hfacc/jobs/grpo.py)
hfacc distill                                  # the job of recipes/distill.py (hfacc/jobs/distill.py)
hfacc verify                                   # embedded tiny Llama and data: PASS/FAIL in seconds
hfacc verify --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name my.jsonl --gradient_accumulation_steps 8
hfacc verify --config recipes/configs/smollm2-135m_full.yaml
hfacc verify --objective dpo                   # preference pairs (--dataset_name: rows of prompt, chosen, rejected)
hfacc verify --objective distill --teacher_model_name_or_path my-teacher   # distillation from your teacher
hfacc verify --objective reward                # a reward model on pairs (--model_name_or_path: loaded with num_labels=1)
hfacc verify --objective kto                   # unpaired rows with their KL rows (pairs are unpaired)
accelerate launch --config_file accelerate_configs/ddp.yaml -m hfacc.cli verify    # the distributed path
hfacc show-mask --dataset_name my.jsonl --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --count 3

Exit codes: 0 done (verify: PASS), 1 verify FAIL, 2 a user error (one message; --debug or HFACC_DEBUG=1 shows the
traceback).
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import sys
from dataclasses import dataclass, field

COMMANDS = {
    "sft": "fine-tune with loss masking and exact accumulation (the job of recipes/sft.py)",
    "dpo": "preference optimization (DPO, IPO, SimPO, ...), exact per pair (the job of recipes/dpo.py)",
    "reward": "a reward model (Bradley-Terry), exact per pair (the job of recipes/reward.py)",
    "kto": "KTO on unpaired rows, exact with the step's reference point (the job of recipes/kto.py)",
    "grpo": "online RL (GRPO, DAPO, Dr. GRPO) with exact accumulation (the job of recipes/grpo.py)",
    "distill": "knowledge distillation, exact per student token (the job of recipes/distill.py)",
    "vllm-serve": "a vLLM server for vllm_mode='server' trainers (as trl vllm-serve; docs/vllm.md)",
    "verify": "check that accumulation equals one big batch for a model and data",
    "show-mask": "print examples with the tokens that carry loss highlighted",
}


@dataclass
class ShowMaskArguments:
    """Settings of ``hfacc show-mask``."""

    index: int = field(default=0, metadata={"help": "First example to show."})
    count: int = field(default=2, metadata={"help": "How many examples to show."})
    color: bool = field(default=True, metadata={"help": "Highlight with ANSI colors (False: wrap in [[ ]])."})


JOBS = ("sft", "dpo", "reward", "kto", "grpo", "distill")  # each one's `cli` is in hfacc/jobs/<name>.py


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"hfacc {sys.modules[__package__].__version__}")  # the package is imported: cli.py is in it
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hfacc <command> [--help] [--config FILE.yaml] [--setting VALUE ...]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:10s} {text}")
        print("\nhfacc <command> --help lists the command's settings; hfacc --version prints the version.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:  # one line, not the list: the list is --help
        close = difflib.get_close_matches(command, list(COMMANDS), n=1, cutoff=0.6)
        hint = f" Did you mean '{close[0]}'?" if close else f" Commands: {', '.join(COMMANDS)}."
        print(f"error: hfacc has no command '{command}'.{hint} (hfacc --help lists them)", file=sys.stderr)
        return 2
    if command == "vllm-serve":  # replaces this process with vLLM's server
        from .jobs.vllm_serve import cli

        return cli(rest, prog="hfacc vllm-serve")
    if command in JOBS:  # the recipe's own entry point: it sets up its console and its user errors itself
        job = importlib.import_module(f".jobs.{command}", __package__)
        return job.cli(rest, prog=f"hfacc {command}")
    from .jobs.console import pop_debug_flag, setup_console, user_errors

    setup_console()  # warnings as plain lines; no bars for the handful of rows these commands tokenize
    debug, rest = pop_debug_flag(rest)
    with user_errors(debug) as guard:
        return {"verify": run_verify, "show-mask": run_show_mask}[command](rest, guard)


def run_verify(argv: list[str], guard) -> int:
    import torch
    from accelerate import Accelerator

    from .data.collator import DataCollatorForCausalLM
    from .data.sft import DataArguments, build_examples
    from .data.vision import DataCollatorForVisionLM, is_vision_processor
    from .jobs.distill import DistillJobArguments
    from .jobs.sft import SFTArguments
    from .models.loading import ModelArguments, load_model_and_tokenizer
    from .runtime.config import ConfigError, parse_args
    from .training.arguments import TokenWeightedArguments
    from .training.distill_trainer import DistillationArguments
    from .verify.equivalence import (
        DistillVerifyArguments,
        VerifyArguments,
        build_verify_distillation,
        verify_accumulation,
    )

    verify_args, model_args, data_args, distill_args = guard.settings = parse_args(
        [VerifyArguments, ModelArguments, DataArguments, DistillVerifyArguments],
        argv,
        # a recipe config's training keys are not verify's
        ignore_types=(TokenWeightedArguments, SFTArguments, DistillJobArguments, DistillationArguments),
        prog="hfacc verify",
    )
    if verify_args.sp_size > 1:  # accelerate reads its ParallelismConfig from the launch's environment
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
            raise ConfigError(
                f"--sp_size {verify_args.sp_size} needs a DeepSpeed launch: accelerate launch --config_file "
                "accelerate_configs/deepspeed_ulysses.yaml -m hfacc.cli verify"
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        os.environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_SP_BACKEND="deepspeed")
        os.environ["PARALLELISM_CONFIG_SP_SIZE"] = str(verify_args.sp_size)
        os.environ["PARALLELISM_CONFIG_DP_SHARD_SIZE"] = str(max(world // verify_args.sp_size, 1))
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    sp_size = verify_args.sp_size or getattr(accelerator.parallelism_config, "sp_size", 1) or 1
    if sp_size > 1:
        return _verify_sequence_parallel(verify_args, model_args, data_args, accelerator, sp_size)
    objective = verify_args.objective
    if objective == "reward" and model_args.model_name_or_path is not None:  # a reward model: one score per sequence
        from .models.loading import load_reward_model, load_tokenizer

        tokenizer = load_tokenizer(model_args)
        model = load_reward_model(
            model_args.model_name_or_path,
            trust_remote_code=model_args.trust_remote_code,
            dtype=model_args.dtype,
            revision=model_args.model_revision,
            pad_token_id=tokenizer.pad_token_id,
        )
    else:
        model, tokenizer = load_model_and_tokenizer(model_args, seed=verify_args.seed)
        if objective == "reward":  # the embedded tiny Llama's backbone with a score head
            from .models.loading import as_reward_model

            model = as_reward_model(model, tokenizer.pad_token_id, seed=verify_args.seed)
    need = (
        verify_args.per_device_train_batch_size * verify_args.gradient_accumulation_steps * accelerator.num_processes
    )
    # Extra rows: some may be dropped (no target left after truncation).
    if objective in ("dpo", "reward", "kto"):  # preference pairs (unpaired for KTO): the user's or embedded ones
        from .data.preference import DataCollatorForPreference, DataCollatorForUnpairedPreference
        from .jobs.dpo import build_example_pairs

        count = max(2 * need, 32)
        examples = build_example_pairs(data_args, tokenizer, count, seed=verify_args.seed, unpaired=objective == "kto")
        pad = tokenizer.pad_token_id
        collate = DataCollatorForUnpairedPreference(pad) if objective == "kto" else DataCollatorForPreference(pad)
        if objective == "kto":  # a reference unlike the policy, so the window's reference point is above 0
            from .verify.equivalence import build_verify_kto

            verify_args.objective = build_verify_kto(model, verify_args.seed)
    else:
        examples = build_examples(data_args, tokenizer, count=max(2 * need, 32), seed=verify_args.seed)
        if verify_args.objective == "grpo":  # a fixed rollout of the model on the data's prompts
            return _verify_policy_gradient(verify_args, model, tokenizer, examples, accelerator)
        if verify_args.objective == "distill":  # the objective of the user's teacher and settings
            verify_args.objective = build_verify_distillation(distill_args, model_args, tokenizer, verify_args.seed)
        if is_vision_processor(tokenizer):  # a vision-language model's processor: images decoded per micro-batch
            collate = DataCollatorForVisionLM(tokenizer)
        else:
            collate = DataCollatorForCausalLM(tokenizer.pad_token_id)
    report = verify_accumulation(
        model,
        [examples[i] for i in range(min(len(examples), need))],
        collate,
        micro_batch_size=verify_args.per_device_train_batch_size,
        gradient_accumulation_steps=verify_args.gradient_accumulation_steps,
        normalization=verify_args.normalization,
        objective=verify_args.objective,
        tolerance=verify_args.tolerance,
        path=verify_args.path,
        precisions=verify_args.precisions,
        num_worst=verify_args.num_worst,
        accelerator=accelerator,
        seed=verify_args.seed,
        fused_loss=verify_args.fused_loss,
    )
    return _finish_verify(report, verify_args, accelerator)


def _verify_sequence_parallel(verify_args, model_args, data_args, accelerator, sp_size) -> int:
    from .data.collator import DataCollatorForCausalLM
    from .data.sft import build_examples
    from .models.loading import load_model_and_tokenizer
    from .runtime.config import ConfigError
    from .verify.sequence_parallel import verify_sequence_parallel

    steps = verify_args.gradient_accumulation_steps
    if verify_args.objective not in ("auto", "causal_lm") or steps % sp_size:
        raise ConfigError(
            f"verify with sp_size={sp_size} checks SFT (--objective causal_lm) with --gradient_accumulation_steps a "
            f"multiple of {sp_size} (each rank's batch runs as {sp_size} shards); got --objective "
            f"{verify_args.objective} --gradient_accumulation_steps {steps}."
        )
    model, tokenizer = load_model_and_tokenizer(model_args, seed=verify_args.seed)
    need = verify_args.per_device_train_batch_size * steps // sp_size * accelerator.num_processes
    examples = build_examples(data_args, tokenizer, count=max(2 * need, 32), seed=verify_args.seed)
    report = verify_sequence_parallel(
        model,
        [examples[i] for i in range(need)],
        DataCollatorForCausalLM(tokenizer.pad_token_id),
        micro_batch_size=verify_args.per_device_train_batch_size,
        gradient_accumulation_steps=steps,
        accelerator=accelerator,
        tolerance=verify_args.tolerance,
    )
    return _finish_verify(report, verify_args, accelerator)


def _verify_policy_gradient(verify_args, model, tokenizer, examples, accelerator) -> int:
    from .verify.equivalence import verify_policy_gradient

    # Each example's prompt: its tokens before the first target (the completion is sampled from the model).
    prompts = []
    for example in examples:
        first = next((i for i, y in enumerate(example["labels"]) if y != -100), len(example["labels"]))
        prompts.append(list(example["input_ids"][: max(first, 1)]))
    report = verify_policy_gradient(
        model,
        tokenizer,
        prompts,
        micro_batch_size=verify_args.per_device_train_batch_size,
        gradient_accumulation_steps=verify_args.gradient_accumulation_steps,
        tolerance=verify_args.tolerance,
        accelerator=accelerator,
        seed=verify_args.seed,
        fused_loss=verify_args.fused_loss,
        loss_types=None if verify_args.loss_type is None else [verify_args.loss_type],
        importance_sampling_level=verify_args.importance_sampling_level,
        advantage_estimator=verify_args.advantage_estimator,
        multi_objective_aggregation=verify_args.multi_objective_aggregation,
        multi_turn=verify_args.multi_turn,
    )
    return _finish_verify(report, verify_args, accelerator)


def _finish_verify(report, verify_args, accelerator) -> int:
    """Print ``report`` (and write its JSON) on the main process, stop every rank together; 0 if it passed."""
    if accelerator.is_main_process:
        print(report.format(), flush=True)
        if verify_args.json_path:
            with open(verify_args.json_path, "w") as f:
                json.dump(report.to_dict(), f, indent=2, default=str)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0 if report.passed else 1


def run_show_mask(argv: list[str], guard) -> int:
    import datasets

    from .data.formats import DataError, describe_row, detect_format, encode_row, render_mask
    from .data.sft import DataArguments, build_sft_dataset, example_rows
    from .data.sources import SOURCE_ROW
    from .data.vision import encode_vision_row, is_vision_processor, render_vision_mask
    from .models.loading import ModelArguments, load_tokenizer
    from .ops.loss import count_example_targets
    from .runtime.config import ConfigError, parse_args

    show, model_args, data_args = guard.settings = parse_args(
        [ShowMaskArguments, ModelArguments, DataArguments], argv, prog="hfacc show-mask"
    )
    tokenizer = load_tokenizer(model_args)  # the mask needs no model (a folder may hold only the tokenizer)
    legend = "\x1b[1;32mgreen\x1b[0m" if show.color else "[[ ]]"
    vision = is_vision_processor(tokenizer)  # a vision-language model's processor
    images = " Image tokens are shown as [image: N tokens] (never trained)." if vision else ""
    print(f"Tokens that carry loss are {legend}; everything else has label -100.{images}\n")
    options = data_args.sft_options()
    rows = example_rows(data_args, count=show.count, start=show.index, in_order=True)
    if not len(rows):
        raise ConfigError(f"--index {show.index}: the data has fewer rows; choose an index below its row count.")
    for row in rows:
        # One row at a time, built exactly as training builds it, with what it holds and how it was masked.
        fmt = detect_format([c for c in row if c != SOURCE_ROW]) if options["format"] == "auto" else options["format"]
        encode = encode_vision_row if vision else encode_row
        method = encode(tokenizer, row, row[SOURCE_ROW], fmt, last_turn_only=options["last_turn_only"])[2]
        header = f"--- example {row[SOURCE_ROW]}"
        try:
            example = build_sft_dataset(datasets.Dataset.from_list([row]), tokenizer, **options)[0]
        except DataError as err:  # no target left after truncation, or too long with truncation='drop'
            print(f"{header}: not trained ({err}) ---\n")
            continue
        targets = count_example_targets(example["labels"])
        print(
            f"{header}: {len(example['input_ids'])} tokens, {targets} targets"
            + (f"; masked by {method}" if method else "")
            + " ---"
        )
        if describe_row(row):
            print(describe_row(row))
        render = render_vision_mask if vision else render_mask
        print(render(tokenizer, example["input_ids"], example["labels"], color=show.color))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
