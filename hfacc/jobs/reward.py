"""Reward modelling (Bradley-Terry) with exact accumulation per pair: the job of ``hfacc reward``.

    hfacc reward                                             # embedded default: offline, runs on a CPU
    accelerate launch recipes/reward.py                      # the same job, as a recipe script
    accelerate launch recipes/reward.py --model_name_or_path my-sft-model --dataset_name pairs.jsonl
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/reward.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/reward_tiny_default.yaml supplies the defaults. The
run starts from the SFT recipe's output (outputs/sft-tiny) if it is there, else runs a short SFT itself; builds
preference pairs from the embedded tasks as the DPO job does (chosen: the right answer; rejected: the SFT model's own
wrong greedy answer, or a near miss); loads the SFT model as a reward model (its backbone, a new score head:
``AutoModelForSequenceClassification`` with ``num_labels=1``); trains it with :class:`hfacc.RewardObjective`; and
prints the held-out pair accuracy before -> after. A ``margin`` column of the data is used. Writes the reward model,
tokenizer, metrics.json and loss_curve.png to --output_dir (``hfacc grpo --reward_funcs <that directory>`` scores
with it); user errors end in one message and exit code 2.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import set_seed

from ..data.preference import DataCollatorForPreference, build_preference_dataset
from ..models.loading import ModelArguments, apply_lora_settings, load_reward_model, load_tokenizer
from ..objectives.reward import RewardObjective
from ..runtime.config import get_default_config
from ..training.arguments import TokenWeightedArguments
from ..training.checkpoint import check_run_before_loading, get_data_settings
from .console import describe_run, run_recipe, setup_console, use_console, write
from .dpo import (
    RECIPES,
    PreferenceJobArguments,
    describe_batch,
    load_preference_rows,
    load_sft_start,
    refuse_label_smoothing,
    train_between_evaluations,
)
from .report import save_loss_curve, write_json

DEFAULT_CONFIG = RECIPES / "configs" / "reward_tiny_default.yaml"


@dataclass
class RewardArguments(PreferenceJobArguments):
    """The reward objective and the job's own settings (TRL's ``RewardConfig`` names)."""

    center_rewards_coefficient: float | None = field(
        default=None,
        metadata={"help": "Weight of (r_chosen + r_rejected)^2 per pair: keeps the scores centred (None: none)."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.center_rewards_coefficient is not None and not self.center_rewards_coefficient >= 0:
            raise ValueError(f"center_rewards_coefficient={self.center_rewards_coefficient}: it must be >= 0.")


def main(reward_args: RewardArguments, model_args: ModelArguments, args: TokenWeightedArguments):
    start = time.perf_counter()
    if reward_args.torch_threads:
        torch.set_num_threads(reward_args.torch_threads)  # the short SFT, pair building and training, one process
    setup_console(args)
    set_seed(args.seed)
    refuse_label_smoothing(args, "reward model")
    check_run_before_loading(args, reward_args)  # before a model loads or a short SFT runs
    embedded = model_args.model_name_or_path is None
    if embedded:  # the SFT start answers the embedded prompts (its wrong answers are the rejected ones)
        policy, tokenizer, started_from = load_sft_start(reward_args, model_args, args)
    else:
        policy, tokenizer, started_from = None, load_tokenizer(model_args), model_args.model_name_or_path
    raw_train, raw_eval, _ = load_preference_rows(reward_args, policy, tokenizer, args, embedded)
    del policy
    with torch.random.fork_rng(devices=[]):  # the new score head is the same whatever ran before (a short SFT or not)
        torch.manual_seed(args.seed)
        model = load_reward_model(
            str(started_from),
            trust_remote_code=model_args.trust_remote_code,
            dtype=model_args.dtype if not embedded else "float32",
            revision=model_args.model_revision,
            attn_implementation=model_args.attn_implementation,
            pad_token_id=tokenizer.pad_token_id,
        )
    model = apply_lora_settings(model, model_args, task_type="SEQ_CLS")  # --use_lora: the score head trains whole
    # Pairs only: unpaired (KTO) rows are refused by name, not tokenized into rows the pairs' collator cannot read.
    options = dict(max_length=reward_args.max_length, truncation=reward_args.truncation, unpaired=False)
    with args.main_process_first(desc="dataset tokenization"):
        train_ds = build_preference_dataset(raw_train, tokenizer, **options)
        eval_ds = build_preference_dataset(raw_eval, tokenizer, **options)
    from ..training.trainer import TokenWeightedTrainer  # the Trainer (and datasets): what only a run needs

    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForPreference(tokenizer.pad_token_id),
        processing_class=tokenizer,
        objective=RewardObjective(reward_args.center_rewards_coefficient),
        data_settings=get_data_settings(reward_args),  # part of the run's identity in its checkpoints
    )
    use_console(trainer)
    if trainer.is_world_process_zero():
        size = sum(p.numel() for p in model.parameters()) / 1e6
        write(f"model  {type(model).__name__} (num_labels=1), {size:.1f}M parameters, from {started_from}")
        write(describe_run(model, args))
        margins = " (with margins)" if "margin" in train_ds.column_names else ""
        write(f"data   {len(train_ds):,} training / {len(eval_ds):,} held-out pairs{margins}")
        write(describe_batch(args, "pairs"))
        centering = reward_args.center_rewards_coefficient
        write("loss   Bradley-Terry" + (f", center_rewards_coefficient {centering}" if centering else ""))
    before, train_result, after = train_between_evaluations(trainer, args.resume_from_checkpoint)
    step = trainer.state.global_step
    trainer.save_model()
    metrics = {
        "train": train_result.metrics,
        "started_from": str(started_from),
        "eval_loss_before": before["eval_loss"],
        "eval_loss_after": after["eval_loss"],
        "pair_accuracy_before": before.get("eval_accuracy"),
        "pair_accuracy_after": after.get("eval_accuracy"),
        "margin_after": after.get("eval_margin"),
        "held_out_pairs": after.get("eval_num_pairs"),
        "steps": step,
        "world_size": args.world_size,
    }
    if trainer.is_world_process_zero():
        metrics["wall_time_s"] = round(time.perf_counter() - start, 1)
        write_json(metrics, Path(args.output_dir) / "metrics.json")
        save_loss_curve(
            trainer.state.log_history,
            Path(args.output_dir) / "loss_curve.png",
            title="hfacc reward model (Bradley-Terry)",
            ylabel="loss per pair",
        )
        write(format_summary(metrics, args.output_dir))
    return metrics


def format_summary(metrics: dict, output_dir: str) -> str:
    lines = [
        "",
        "=== hfacc reward model summary ===",
        f"started from         {metrics['started_from']}",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']})",
        f"eval loss            {metrics['eval_loss_before']:.3f} -> {metrics['eval_loss_after']:.3f}",
    ]
    if metrics.get("pair_accuracy_after") is not None:
        lines.append(
            f"pair accuracy        {metrics['pair_accuracy_before']:.3f} -> {metrics['pair_accuracy_after']:.3f}"
            f"  ({metrics['held_out_pairs']} held-out pairs; margin {metrics['margin_after']:.3f})"
        )
    lines += [f"wall time            {metrics['wall_time_s']} s", f"outputs              {output_dir}", ""]
    return "\n".join(lines)


def default_config(argv: Sequence[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return get_default_config(argv, DEFAULT_CONFIG)


# The job's settings: `hfacc reward` and recipes/reward.py read them.
REWARD_ARGUMENTS = (RewardArguments, ModelArguments, TokenWeightedArguments)


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse the command line (YAML + flags) and run :func:`main`: ``hfacc reward`` and ``recipes/reward.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_recipe(main, REWARD_ARGUMENTS, default_config(argv), argv=argv, prog=prog)
