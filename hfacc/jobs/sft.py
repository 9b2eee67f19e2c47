"""Supervised fine-tuning with loss masking and exact gradient accumulation: the job of ``hfacc sft``.

    hfacc sft                                                # embedded default: offline, runs on a CPU
    hfacc sft --config recipes/configs/qwen2.5-0.5b-instruct_lora.yaml
    accelerate launch recipes/sft.py                         # the same job, as a recipe script
    accelerate launch --config_file accelerate_configs/ddp.yaml -m hfacc.cli sft   # two processes

With neither --config nor --model_name_or_path, recipes/configs/tiny_default.yaml supplies the defaults: a tiny
Llama and a tokenizer built here, trained on generated instructions. Any setting can be given on the command line
(`--learning_rate 1e-4`); they override the YAML. Writes the model, tokenizer, metrics.json and loss_curve.png to
--output_dir. The console shows one progress bar, a line per evaluation and a summary (`--log_level info`: all
detail); a user error ends in one message and exit code 2 (`--debug` or HFACC_DEBUG=1: with its traceback).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformers import set_seed

from ..data.collator import DataCollatorForCausalLM
from ..data.sft import DataArguments, build_datasets
from ..data.vision import DataCollatorForVisionLM, exact_match_on_vision_rows, is_vision_processor
from ..generation.evaluation import exact_match_by_group, exact_match_on_conversations
from ..generation.vllm_engine import VLLMArguments, build_generation_engine, check_vllm_settings
from ..models.loading import ModelArguments, load_model_and_tokenizer
from ..runtime.config import ConfigError, get_default_config
from ..training.arguments import TokenWeightedArguments
from ..training.checkpoint import check_run_before_loading, get_data_settings
from .console import answers_on_every_rank, describe_run, run_recipe, setup_console, use_console, write
from .report import save_loss_curve, write_json

# The shipped configs live with the recipe; this module runs from a clone of the repository or an editable install.
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "tiny_default.yaml"


@dataclass
class SFTArguments(VLLMArguments):
    """Settings of the SFT job beyond the model, the data and the Trainer; ``use_vllm`` (and the engine's
    :class:`hfacc.generation.vllm_engine.VLLMArguments`) answers the held-out prompts with vLLM."""

    num_exact_match_examples: int = field(
        default=64, metadata={"help": "Held-out conversations answered greedily for exact match (0: skip)."}
    )
    max_new_tokens: int = field(default=48, metadata={"help": "Longest generated answer for exact match."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Round padded lengths up to this."})

    def __post_init__(self):
        check_vllm_settings(self)


def main(sft_args: SFTArguments, model_args: ModelArguments, data_args: DataArguments, args: TokenWeightedArguments):
    start = time.perf_counter()
    setup_console(args)  # quiet by default; --log_level info for all detail
    set_seed(args.seed)
    # A bad checkpoint, another run's, or an output directory this run may not write into fails now, before the
    # model loads; the trainer checks again with the rows, and resolves the checkpoint itself.
    check_run_before_loading(args, data_args, streaming=data_args.streaming)
    model, tokenizer = load_model_and_tokenizer(model_args, seed=args.seed)
    if sft_args.use_vllm and is_vision_processor(tokenizer):
        raise ConfigError(
            "--use_vllm answers text prompts; a vision-language model's held-out answers (with their images) use "
            "transformers' generate: drop --use_vllm."
        )
    with args.main_process_first(desc="dataset tokenization"):
        train_ds, eval_ds, raw_eval = build_datasets(data_args, tokenizer, seed=args.seed)
    if is_vision_processor(tokenizer):  # a vision-language model: its processor decodes the images per batch
        collator = DataCollatorForVisionLM(tokenizer, pad_to_multiple_of=sft_args.pad_to_multiple_of)
    else:
        collator = DataCollatorForCausalLM(tokenizer.pad_token_id, pad_to_multiple_of=sft_args.pad_to_multiple_of)
    from ..training.trainer import TokenWeightedTrainer  # the Trainer (and datasets): what only a run needs

    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collator,
        processing_class=tokenizer,
        data_settings=get_data_settings(data_args),  # part of the run's identity in its checkpoints
    )
    use_console(trainer)  # one progress bar and compact lines instead of the Trainer's printed dicts
    if trainer.is_world_process_zero():
        micro = f"{args.per_device_train_batch_size} sequences"
        if args.max_tokens_per_batch:
            micro = f"up to {args.max_tokens_per_batch:,} tokens"
        write(f"model  {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        write(describe_run(model, args))
        size = f"{len(train_ds):,}" if hasattr(train_ds, "__len__") else "streamed"  # a stream has no length
        write(f"data   {size} training / {len(eval_ds):,} held-out examples")
        write(f"batch  {micro} x {args.gradient_accumulation_steps} micro-batches x {args.world_size} process(es)")
    before = trainer.evaluate()
    # As given ("last", a path, or None with auto-resume): the trainer takes only this run's checkpoints.
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    # With eval_strategy "steps" the Trainer has just evaluated the last step; evaluate only if it did not.
    step = trainer.state.global_step
    final = [h for h in trainer.state.log_history if "eval_loss" in h and h["step"] == step and step > 0]
    after = final[-1] if final else trainer.evaluate()
    trainer.save_model()

    metrics = {
        "train": train_result.metrics,
        "eval_loss_before": before["eval_loss"],
        "eval_loss_after": after["eval_loss"],
        "eval_token_accuracy_after": after.get("eval_token_accuracy"),
        "steps": trainer.state.global_step,
        "world_size": args.world_size,
    }
    answering = bool(sft_args.num_exact_match_examples) and "messages" in raw_eval.column_names
    engine = None
    if answering and sft_args.use_vllm:  # every process builds its engine together; the main one answers
        policy = trainer.accelerator.unwrap_model(trainer.model)
        engine = build_generation_engine(sft_args, policy, tokenizer, trainer.accelerator, seed=args.seed)
    if answering and (answers_on_every_rank(trainer, engine) or trainer.is_world_process_zero()):
        count = min(sft_args.num_exact_match_examples, len(raw_eval))
        on = " (vLLM)" if engine is not None else ""
        if trainer.is_world_process_zero():
            write(f"exact match: answering {count} held-out prompts greedily{on}")
        if is_vision_processor(tokenizer):  # with each prompt's images
            score, samples = exact_match_on_vision_rows(
                trainer.model, tokenizer, raw_eval.select(range(count)), max_new_tokens=sft_args.max_new_tokens
            )
        else:
            score, samples = exact_match_on_conversations(
                trainer.model,
                tokenizer,
                raw_eval["messages"][:count],
                max_new_tokens=sft_args.max_new_tokens,
                engine=engine,
            )
    if trainer.is_world_process_zero():
        if answering:
            metrics["exact_match"] = score
            metrics["samples"] = [
                {
                    "prompt": " / ".join(_text(m["content"]) for m in p if m["role"] == "user"),
                    "reference": r,
                    "answer": a,
                }
                for p, r, a in samples
            ]
            if "task" in raw_eval.column_names:  # the embedded data names its tasks: which ones were learned
                tasks = raw_eval["task"][: len(samples)]
                metrics["exact_match_by_task"] = exact_match_by_group(tasks, samples)
                for sample, task in zip(metrics["samples"], tasks, strict=True):
                    sample["task"] = task
        metrics["wall_time_s"] = round(time.perf_counter() - start, 1)
        write_json(metrics, Path(args.output_dir) / "metrics.json")
        save_loss_curve(trainer.state.log_history, Path(args.output_dir) / "loss_curve.png")
        write(format_summary(metrics, args.output_dir))
    return metrics


def _text(content) -> str:
    """A message's content as one line: its text, and ``<image>`` for each image part."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p.get("type") == "text" else "<image>" for p in content)


def format_summary(metrics: dict, output_dir: str) -> str:
    lines = [
        "",
        "=== hfacc SFT summary ===",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']})",
        f"eval loss            {metrics['eval_loss_before']:.3f} -> {metrics['eval_loss_after']:.3f}",
    ]
    if metrics.get("eval_token_accuracy_after") is not None:
        lines.append(f"eval token accuracy  {metrics['eval_token_accuracy_after']:.3f}")
    if "exact_match" in metrics:
        lines.append(
            f"exact match          {metrics['exact_match']:.3f} on {len(metrics['samples'])} held-out prompts"
        )
        by_task = sorted(metrics.get("exact_match_by_task", {}).items(), key=lambda kv: -kv[1])
        if by_task:
            lines.append("  by task: " + ", ".join(f"{task} {score:.2f}" for task, score in by_task))
        # One answer per task (or the first few): what the model now does, right or wrong.
        first = {}
        for i, s in enumerate(metrics["samples"]):
            first.setdefault(s.get("task", i), s)
        for s in list(first.values())[:8]:
            mark = "ok " if s["answer"] == s["reference"] else "bad"
            wrong = "" if s["answer"] == s["reference"] else f"  (want {s['reference']!r})"
            lines.append(f"  {mark} {s['prompt']!r} -> {s['answer']!r}{wrong}")
    lines += [f"wall time            {metrics['wall_time_s']} s", f"outputs              {output_dir}", ""]
    return "\n".join(lines)


def default_config(argv: Sequence[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return get_default_config(argv, DEFAULT_CONFIG)


# What the job's settings are: `hfacc sft`, the recipe and `hfacc verify --config` (which skips SFTArguments) read them.
SFT_ARGUMENTS = (SFTArguments, ModelArguments, DataArguments, TokenWeightedArguments)


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse the command line (YAML + flags) and run :func:`main`: ``hfacc sft`` and ``recipes/sft.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_recipe(main, SFT_ARGUMENTS, default_config(argv), argv=argv, prog=prog)
