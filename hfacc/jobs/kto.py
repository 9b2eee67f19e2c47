"""KTO on unpaired preference rows, exact per row with the step's reference point: the job of ``hfacc kto``.

    hfacc kto                                                # embedded default: offline, runs on a CPU
    accelerate launch recipes/kto.py                         # the same job, as a recipe script
    accelerate launch recipes/kto.py --model_name_or_path my-sft-model --dataset_name rows.jsonl
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/kto.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/kto_tiny_default.yaml supplies the defaults. The run
starts from the SFT recipe's output (outputs/sft-tiny) if it is there, else runs a short SFT itself; answers the
embedded prompts with that model and makes each of its answers an unpaired row (a right one desirable, a mistake
undesirable), each row with its KL row (its prompt, another row's completion); trains with
:class:`hfacc.KTOObjective`; and prints the held-out reward margin and exact match before -> after. Rows of a
dataset given with --dataset_name have TRL's columns: unpaired (prompt, completion, label) or pairs (prompt, chosen,
rejected). Writes the model, tokenizer, metrics.json and loss_curve.png to --output_dir; user errors end in one
message and exit code 2.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import set_seed

from ..data.preference import DataCollatorForUnpairedPreference, build_preference_dataset
from ..generation.evaluation import generate_answers
from ..models.loading import ModelArguments, load_causal_lm, load_model_and_tokenizer
from ..models.reference import precompute_reference_logps
from ..objectives.kto import KTOObjective
from ..ops.precision import get_training_autocast
from ..runtime.config import ConfigError, get_default_config
from ..training.arguments import TokenWeightedArguments
from ..training.checkpoint import check_run_before_loading, get_data_settings
from .console import describe_run, run_recipe, setup_console, use_console, write
from .dpo import (
    RECIPES,
    ReferenceJobArguments,
    describe_batch,
    exact_match,
    exact_match_lines,
    load_preference_rows,
    load_sft_start,
    refuse_label_smoothing,
    sample_answers,
    train_between_evaluations,
)
from .report import save_loss_curve, write_json

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = RECIPES / "configs" / "kto_tiny_default.yaml"


@dataclass
class KTOArguments(ReferenceJobArguments):
    """The KTO objective and the job's own settings (TRL's ``KTOConfig`` names)."""

    beta: float = field(default=0.1, metadata={"help": "The temperature of the implicit reward beta * log-ratio."})
    desirable_weight: float = field(default=1.0, metadata={"help": "Weight of the desirable rows' losses."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of the undesirable rows' losses."})

    def __post_init__(self):
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta}: it must be > 0.")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: it must be > 0.")


def main(kto_args: KTOArguments, model_args: ModelArguments, args: TokenWeightedArguments):
    start = time.perf_counter()
    if kto_args.torch_threads:
        torch.set_num_threads(kto_args.torch_threads)  # the short SFT, row building and KTO all run in this process
    setup_console(args)
    set_seed(args.seed)
    refuse_label_smoothing(args, "KTO")
    check_run_before_loading(args, kto_args)  # before a model loads or a short SFT runs
    embedded = model_args.model_name_or_path is None
    if embedded:
        model, tokenizer, started_from = load_sft_start(kto_args, model_args, args)
    else:
        model, tokenizer = load_model_and_tokenizer(model_args, seed=args.seed)
        started_from = model_args.model_name_or_path
    if embedded and kto_args.dataset_name is None:
        with args.main_process_first(desc="building unpaired rows"):
            raw_train, raw_eval, held_out = build_embedded_rows(model, tokenizer, kto_args, seed=args.seed)
    else:
        raw_train, raw_eval, held_out = load_preference_rows(kto_args, model, tokenizer, args, embedded)
    options = dict(max_length=kto_args.max_length, truncation=kto_args.truncation, unpaired=True)
    with args.main_process_first(desc="dataset tokenization"):
        train_ds = build_preference_dataset(raw_train, tokenizer, **options)
        eval_ds = build_preference_dataset(raw_eval, tokenizer, **options)
    warn_about_weights(train_ds["label"], kto_args.desirable_weight, kto_args.undesirable_weight)
    ref_model = None
    if kto_args.ref_model_name_or_path:
        ref_model = load_causal_lm(kto_args.ref_model_name_or_path, dtype=model_args.dtype)
    if kto_args.precompute_ref_log_probs:
        reference = ref_model if ref_model is not None else model  # the policy before training: the reference
        pad, size = tokenizer.pad_token_id, kto_args.precompute_ref_batch_size
        # In the precision training will compute the policy in (bf16=True: its autocast), so that r = 0 at the start.
        options = dict(
            pad_token_id=pad, batch_size=size, device=args.device, mixed_precision=get_training_autocast(args)
        )
        train_ds = precompute_reference_logps(train_ds, reference, **options)
        eval_ds = precompute_reference_logps(eval_ds, reference, **options)
        ref_model = None
    objective = KTOObjective(
        beta=kto_args.beta,
        desirable_weight=kto_args.desirable_weight,
        undesirable_weight=kto_args.undesirable_weight,
        ref_model=ref_model,
    )
    from ..training.trainer import TokenWeightedTrainer  # the Trainer (and datasets): what only a run needs

    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForUnpairedPreference(tokenizer.pad_token_id),
        processing_class=tokenizer,
        objective=objective,
        data_settings=get_data_settings(kto_args),  # part of the run's identity in its checkpoints
    )
    use_console(trainer)
    if trainer.is_world_process_zero():
        size = sum(p.numel() for p in model.parameters()) / 1e6
        write(f"model  {type(model).__name__}, {size:.1f}M parameters, from {started_from}")
        write(describe_run(model, args))
        desirable = sum(train_ds["label"])
        write(f"data   {len(train_ds):,} training rows ({desirable:,} desirable) / {len(eval_ds):,} held-out rows")
        write(describe_batch(args, "rows"))
        write(f"loss   KTO, beta {kto_args.beta}, weights {kto_args.desirable_weight} / {kto_args.undesirable_weight}")
    conversations = held_out[: kto_args.num_exact_match_examples]
    exact_before = exact_match(trainer, tokenizer, conversations, kto_args, "before training")
    before, train_result, after = train_between_evaluations(trainer, args.resume_from_checkpoint)
    step = trainer.state.global_step
    exact_after = exact_match(trainer, tokenizer, conversations, kto_args, "after training")
    trainer.save_model()
    metrics = {
        "train": train_result.metrics,
        "started_from": str(started_from),
        "eval_loss_before": before["eval_loss"],
        "eval_loss_after": after["eval_loss"],
        "reward_margin_before": before.get("eval_rewards/margins"),
        "reward_margin_after": after.get("eval_rewards/margins"),
        "kl_after": after.get("eval_kl"),
        "steps": step,
        "world_size": args.world_size,
    }
    if trainer.is_world_process_zero():
        if exact_before is not None:
            metrics["exact_match_before"], metrics["exact_match_after"] = exact_before[0], exact_after[0]
            metrics["exact_match_by_task_after"] = exact_after[2]
            metrics["samples"] = exact_after[1]
        metrics["wall_time_s"] = round(time.perf_counter() - start, 1)
        write_json(metrics, Path(args.output_dir) / "metrics.json")
        save_loss_curve(
            trainer.state.log_history,
            Path(args.output_dir) / "loss_curve.png",
            title="hfacc KTO",
            ylabel="KTO loss per row",
        )
        write(format_summary(metrics, args.output_dir))
    return metrics


def build_embedded_rows(model, tokenizer, kto_args: KTOArguments, seed: int = 0):
    """``(train rows, eval rows, held-out conversations)`` of unpaired rows from the starting model's own answers.

    The prompts, greedy answers and samples are the DPO job's (:func:`hfacc.jobs.dpo.build_embedded_pairs`): each
    prompt answered greedily and ``num_rejected_samples`` times sampled. Every distinct answer the model gave is a row,
    desirable where it is the right answer and undesirable where it is not: KTO raises what the model already answers
    right and lowers its own mistakes. The right answer is never added where the model did not give it: the pairs of
    (right answer, own mistake) that the DPO job trains on, unpaired, lowered the full SFT output's held-out exact
    match (0.78 -> 0.70; docs/reward_models_and_kto.md). The held-out conversations are all the held-out prompts.
    """
    import datasets

    from ..data.embedded import generate_instruction_examples

    examples = generate_instruction_examples(kto_args.num_embedded_prompts, seed=seed + 1)
    prompts = [e["messages"][:-1] for e in examples]
    greedy = generate_answers(model, tokenizer, prompts, max_new_tokens=kto_args.max_new_tokens, batch_size=64)
    sampled = sample_answers(model, tokenizer, prompts, kto_args, seed=seed)
    k = kto_args.num_rejected_samples
    held = max(1, int(len(examples) * kto_args.eval_fraction))
    train, evaluation = [], []
    for i, example in enumerate(examples):
        right = example["messages"][-1]["content"]
        for answer in dict.fromkeys(a for a in [greedy[i], *sampled[i * k : (i + 1) * k]] if a):  # distinct, in order
            row = {
                "prompt": prompts[i],
                "completion": [{"role": "assistant", "content": answer}],
                "label": answer == right,
                "task": example["task"],
            }
            (evaluation if i < held else train).append(row)
    desirable = sum(r["label"] for r in train)
    if desirable == 0 or desirable == len(train) or not evaluation:
        raise ConfigError(
            f"the starting model's answers to {len(examples) - held} embedded training prompts gave {desirable} right "
            f"and {len(train) - desirable} wrong ones: KTO's own-answer rows need both. Raise --num_embedded_prompts "
            "or --num_rejected_samples, or give rows with --dataset_name."
        )
    logger.warning(
        "hfacc: %d unpaired rows from the starting model's own answers to %d embedded prompts (the greedy one and %d "
        "sampled per prompt, each distinct answer once): %d right ones desirable, %d mistakes undesirable.",
        len(train) + len(evaluation),
        len(examples),
        k,
        desirable + sum(r["label"] for r in evaluation),
        len(train) + len(evaluation) - desirable - sum(r["label"] for r in evaluation),
    )
    held_out = [{"messages": e["messages"], "task": e["task"]} for e in examples[:held]]
    return datasets.Dataset.from_list(train), datasets.Dataset.from_list(evaluation), held_out


def warn_about_weights(labels: Sequence[bool], desirable_weight: float, undesirable_weight: float) -> None:
    """KTO's paper (eq. 8) advises ``w_D * n_D / (w_U * n_U)`` in [1, 4/3]; said at WARNING where the data and the
    weights are far from it, with the weights that would fit (as TRL's KTOTrainer does)."""
    desirable = max(sum(bool(y) for y in labels), 1)
    undesirable = max(len(labels) - desirable, 1)
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    if not 1 <= ratio <= 4 / 3:
        low, high = undesirable * undesirable_weight / desirable, undesirable * undesirable_weight / desirable * 4 / 3
        logger.warning(
            "hfacc: %d desirable and %d undesirable rows with weights %s / %s: KTO's paper advises "
            "desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3], here %.2f; e.g. "
            "desirable_weight in [%.2f, %.2f].",
            desirable,
            undesirable,
            desirable_weight,
            undesirable_weight,
            ratio,
            low,
            high,
        )


def format_summary(metrics: dict, output_dir: str) -> str:
    lines = [
        "",
        "=== hfacc KTO summary ===",
        f"started from         {metrics['started_from']}",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']})",
        f"eval loss            {metrics['eval_loss_before']:.3f} -> {metrics['eval_loss_after']:.3f}",
    ]
    if metrics.get("reward_margin_after") is not None:
        lines.append(
            f"reward margin        {metrics['reward_margin_before']:.3f} -> {metrics['reward_margin_after']:.3f}"
            f"  (held-out rows: desirable minus undesirable; kl {metrics['kl_after']:.3f})"
        )
    lines += exact_match_lines(metrics)
    lines += [f"wall time            {metrics['wall_time_s']} s", f"outputs              {output_dir}", ""]
    return "\n".join(lines)


def default_config(argv: Sequence[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return get_default_config(argv, DEFAULT_CONFIG)


# The job's settings: `hfacc kto` and recipes/kto.py read them.
KTO_ARGUMENTS = (KTOArguments, ModelArguments, TokenWeightedArguments)


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse the command line (YAML + flags) and run :func:`main`: ``hfacc kto`` and ``recipes/kto.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_recipe(main, KTO_ARGUMENTS, default_config(argv), argv=argv, prog=prog)
