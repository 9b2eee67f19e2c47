"""Supervised fine-tuning with loss masking and exact gradient accumulation.

    accelerate launch recipes/sft.py                       # embedded default: offline, CPU, about 2 minutes
    accelerate launch recipes/sft.py --config recipes/configs/qwen2.5-0.5b-instruct_lora.yaml
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sft.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/tiny_default.yaml supplies the defaults: a tiny
Llama and a tokenizer built here, trained on generated instructions. Any setting can be given on the command line
(`--learning_rate 1e-4`); they override the YAML. Writes the model, tokenizer, metrics.json and loss_curve.png to
--output_dir.
"""

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import set_seed

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer
from hfacc.config import parse_args
from hfacc.data import DataArguments, build_datasets
from hfacc.evaluation import exact_match_on_conversations
from hfacc.modeling import ModelArguments, load_model_and_tokenizer
from hfacc.report import save_loss_curve, write_json

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_default.yaml"
logger = logging.getLogger("hfacc.recipes.sft")


@dataclass
class SFTArguments:
    """Settings of this recipe beyond the model, the data and the Trainer."""

    num_exact_match_examples: int = field(
        default=64, metadata={"help": "Held-out conversations answered greedily for exact match (0: skip)."}
    )
    max_new_tokens: int = field(default=48, metadata={"help": "Longest generated answer for exact match."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Round padded lengths up to this."})


def main(sft_args: SFTArguments, model_args: ModelArguments, data_args: DataArguments, args: TokenWeightedArguments):
    start = time.perf_counter()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    set_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(model_args, seed=args.seed)
    with args.main_process_first(desc="dataset tokenization"):
        train_ds, eval_ds, raw_eval = build_datasets(data_args, tokenizer, seed=args.seed)
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id, pad_to_multiple_of=sft_args.pad_to_multiple_of),
        processing_class=tokenizer,
    )
    before = trainer.evaluate()
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # "last": newest complete one
    after = trainer.evaluate()
    trainer.save_model()

    metrics = {
        "train": train_result.metrics,
        "eval_loss_before": before["eval_loss"],
        "eval_loss_after": after["eval_loss"],
        "eval_token_accuracy_after": after.get("eval_token_accuracy"),
        "steps": trainer.state.global_step,
        "world_size": args.world_size,
    }
    if trainer.is_world_process_zero():
        if sft_args.num_exact_match_examples and "messages" in raw_eval.column_names:
            conversations = raw_eval["messages"][: sft_args.num_exact_match_examples]
            score, samples = exact_match_on_conversations(
                trainer.model, tokenizer, conversations, max_new_tokens=sft_args.max_new_tokens
            )
            metrics["exact_match"] = score
            metrics["samples"] = [{"prompt": p[-1]["content"], "reference": r, "answer": a} for p, r, a in samples[:8]]
            if "task" in raw_eval.column_names:  # the embedded data names its tasks: which ones were learned
                metrics["exact_match_by_task"] = exact_match_by_task(raw_eval["task"], samples)
        metrics["wall_time_s"] = round(time.perf_counter() - start, 1)
        write_json(metrics, Path(args.output_dir) / "metrics.json")
        save_loss_curve(trainer.state.log_history, Path(args.output_dir) / "loss_curve.png")
        print_summary(metrics, args.output_dir)
    return metrics


def print_summary(metrics: dict, output_dir: str) -> None:
    lines = [
        "",
        "=== hfacc SFT summary ===",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']})",
        f"eval loss            {metrics['eval_loss_before']:.3f} -> {metrics['eval_loss_after']:.3f}"
        f"  ({metrics['eval_loss_after'] / metrics['eval_loss_before']:.2f}x)",
    ]
    if metrics.get("eval_token_accuracy_after") is not None:
        lines.append(f"eval token accuracy  {metrics['eval_token_accuracy_after']:.3f}")
    if "exact_match" in metrics:
        lines.append(f"exact match          {metrics['exact_match']:.3f} on held-out prompts")
        by_task = metrics.get("exact_match_by_task", {})
        if by_task:
            lines.append(
                "  by task: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_task.items(), key=lambda x: -x[1]))
            )
        lines += [f"  {s['prompt']!r} -> {s['answer']!r} (want {s['reference']!r})" for s in metrics["samples"][:4]]
    lines += [f"wall time            {metrics['wall_time_s']} s", f"outputs              {output_dir}", ""]
    print("\n".join(lines), flush=True)


def exact_match_by_task(tasks: list[str], samples: list) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for task, (_, reference, answer) in zip(tasks, samples, strict=False):
        hits.setdefault(task, []).append(answer == reference)
    return {task: sum(v) / len(v) for task, v in hits.items()}


def default_config(argv: list[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return None if any(a.startswith("--model_name_or_path") for a in argv) else DEFAULT_CONFIG


if __name__ == "__main__":
    parsed = parse_args(
        [SFTArguments, ModelArguments, DataArguments, TokenWeightedArguments], default_config=default_config(sys.argv)
    )
    main(*parsed)
