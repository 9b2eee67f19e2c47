"""Knowledge distillation with exact accumulation per student token: the job of ``hfacc distill``.

    hfacc distill                                            # embedded default: offline, runs on a CPU
    accelerate launch recipes/distill.py                     # the same job, as a recipe script
    hfacc distill --teacher_model_name_or_path my-teacher --model_name_or_path my-student --dataset_name chats.jsonl
    hfacc distill --precompute_teacher_logprobs true --teacher_top_k 32   # train from stored top-K log-probs
    hfacc distill --lmbda 0.5 --max_completion_length 32    # on-policy: half the micro-batches the student samples
    hfacc distill --teacher_model_name_or_path my-teacher --model_name_or_path my-student --dataset_name prompts.jsonl \
        --lmbda 1                                            # on-policy from your prompts (or SFT rows' prompts)
    hfacc distill --use_teacher_server true --teacher_model_server_url http://127.0.0.1:8001 --loss_top_k 20 \
        --lmbda 1                                            # the teacher on a vLLM server (hfacc vllm-serve)

With neither --config nor --model_name_or_path, recipes/configs/distill_tiny_default.yaml supplies the defaults. The
teacher is the SFT recipe's output (outputs/sft-tiny, written by `hfacc sft`) when it is there, else a short SFT of a
*bigger* embedded model runs first (into OUTPUT_DIR/teacher); the student is the tiny default, untrained; the data are
the embedded conversations (the SFT recipe's, with its held-out split). With ``lmbda > 0`` the rows give the prompts
(:func:`get_on_policy_prompts`: a ``prompt`` column, or a chat row's conversation up to its last assistant turn) and
the student samples the completions of that share of the micro-batches. It prints the held-out exact match of the
teacher and of the student before and after, and writes the student, tokenizer, metrics.json and loss_curve.png to
--output_dir. Any setting can be given on the command line; a user error ends in one message and exit code 2.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import set_seed

from ..data.collator import DataCollatorForCausalLM
from ..data.formats import DataError, normalize_messages
from ..data.sft import DataArguments, build_datasets
from ..data.sources import SOURCE_ROW, load_sft_source
from ..generation.evaluation import exact_match_by_group, exact_match_on_conversations
from ..generation.vllm_engine import wait_for_servers
from ..models.loading import ModelArguments, load_causal_lm, load_model_and_tokenizer
from ..models.teacher import check_teacher_tokenizer, precompute_teacher_logprobs
from ..objectives.distillation import DistillationObjective
from ..ops.precision import get_training_autocast
from ..runtime.config import ConfigError, get_default_config
from ..training.checkpoint import check_run_before_loading, get_data_settings
from ..training.distill_trainer import DistillationArguments, DistillationTrainer
from ..training.trainer import TokenWeightedTrainer
from .console import describe_run, run_recipe, setup_console, use_console, write
from .grpo import run_short_sft
from .report import save_loss_curve, write_json

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "distill_tiny_default.yaml"


@dataclass
class DistillJobArguments:
    """The teacher and the job's own settings (the loss's are :class:`hfacc.DistillationArguments`': beta,
    temperature, ce_weight, lmbda)."""

    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "The teacher: hub id or local directory of a causal LM with the student's tokenizer. None: the "
            "SFT recipe's output at teacher_sft_dir, else a short SFT of a bigger embedded model first."
        },
    )
    teacher_sft_dir: str = field(
        default="outputs/sft-tiny", metadata={"help": "Without a teacher named: the SFT output to use as teacher."}
    )
    teacher_sft_max_steps: int = field(
        default=300, metadata={"help": "Optimizer steps of the short SFT that makes a teacher when there is none."}
    )
    teacher_hidden_size: int = field(default=320, metadata={"help": "Hidden size of that embedded teacher."})
    teacher_num_layers: int = field(default=2, metadata={"help": "Layers of that embedded teacher."})
    precompute_teacher_logprobs: bool = field(
        default=False,
        metadata={
            "help": "Store the teacher's top-K log-probs of every training row once (a progress bar), and train "
            "from them: no teacher in memory while training."
        },
    )
    teacher_top_k: int = field(default=32, metadata={"help": "K of the stored top-K log-probs."})
    precompute_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where the precomputation writes its blocks (resumable); None: OUTPUT_DIR/teacher_logprobs."
        },
    )
    num_exact_match_examples: int = field(
        default=200, metadata={"help": "Held-out conversations answered greedily for exact match (0: skip)."}
    )
    max_new_tokens: int = field(default=48, metadata={"help": "Longest generated answer for exact match."})
    torch_threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads for torch (0: torch's default). Tiny models on a few, or shared, cores train "
            "faster on one: synchronizing threads costs more than they compute."
        },
    )

    def __post_init__(self):
        for name in ("teacher_sft_max_steps", "teacher_hidden_size", "teacher_num_layers", "teacher_top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: it must be >= 1.")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads={self.torch_threads}: it must be >= 0 (0: torch's default).")


def main(job: DistillJobArguments, model_args: ModelArguments, data_args: DataArguments, args: DistillationArguments):
    start = time.perf_counter()
    if job.torch_threads:
        torch.set_num_threads(job.torch_threads)  # the short SFT, the precomputation and training all run here
    setup_console(args)
    set_seed(args.seed)
    if args.lmbda > 0:
        check_on_policy_settings(job, data_args, args)
    # Before the models load (or a teacher's short SFT runs): a refusal then costs seconds.
    check_run_before_loading(args, data_args, streaming=data_args.streaming)
    wait_for_servers(args)  # the teacher's or the student's vLLM server not up: its one line now, not after loading
    student, tokenizer = load_model_and_tokenizer(model_args, seed=args.seed)
    if job.precompute_teacher_logprobs and job.teacher_top_k > len(tokenizer):  # before the teacher loads or trains
        raise ConfigError(
            f"teacher_top_k={job.teacher_top_k} exceeds the vocabulary ({len(tokenizer)} tokens): a row cannot store "
            f"more log-probs than there are tokens. Set --teacher_top_k {len(tokenizer)} or lower."
        )
    if args.use_teacher_server:  # the teacher is on its vLLM server: nothing to load or train here
        check_served_teacher_settings(job, args)
        teacher, teacher_source = None, f"served at {args.teacher_model_server_url} (top-{args.loss_top_k})"
    else:
        teacher, teacher_source = load_teacher(job, model_args, data_args, args, tokenizer)
    with args.main_process_first(desc="dataset tokenization"):
        if args.lmbda > 0:  # prompts (and the dataset's completions for the share 1 - lmbda), tokenized as sampled
            raw_train, raw_eval = load_sft_source(
                data_args.dataset_name, config=data_args.dataset_config, split=data_args.dataset_train_split,
                eval_split=data_args.dataset_eval_split, eval_fraction=data_args.eval_fraction,
                max_examples=data_args.max_examples, seed=args.seed, num_embedded=data_args.num_embedded_examples,
                prompts=True,
            )  # fmt: skip
            train_ds, eval_ds = get_on_policy_prompts(raw_train, args.lmbda), raw_eval
        else:
            train_ds, eval_ds, raw_eval = build_datasets(data_args, tokenizer, seed=args.seed)
    teacher_in_memory = teacher
    if job.precompute_teacher_logprobs:
        cache = job.precompute_cache_dir or str(Path(args.output_dir) / "teacher_logprobs")
        options = dict(top_k=job.teacher_top_k, pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
        options["mixed_precision"] = get_training_autocast(args)  # as a live teacher would compute beside the student
        teacher.to(args.device)
        train_ds = precompute_teacher_logprobs(train_ds, teacher, device=args.device, cache_dir=cache, **options)
        eval_ds = precompute_teacher_logprobs(eval_ds, teacher, device=args.device, **options, show_progress=False)
        teacher_in_memory = None  # trained from the stored columns
    main_process = args.process_index == 0
    held_out = list(raw_eval.select(range(min(job.num_exact_match_examples, len(raw_eval)))))
    held_out = [row for row in held_out if isinstance(row.get("messages"), list)]  # chat rows: a last answer to match
    teacher_exact = None
    if main_process and teacher is not None:  # a served teacher answers no prompts of ours
        teacher_exact = exact_match(teacher, tokenizer, held_out, job, "of the teacher")
    before = exact_match(student, tokenizer, held_out, job, "of the student before") if main_process else None
    data = get_data_settings(data_args)  # part of the run's identity in its checkpoints
    if args.lmbda > 0:
        trainer = DistillationTrainer(
            student, teacher_in_memory, args, train_dataset=train_ds, processing_class=tokenizer, data_settings=data,
        )  # fmt: skip
    else:
        objective = DistillationObjective(
            teacher_in_memory, beta=args.beta, temperature=args.temperature, ce_weight=args.ce_weight
        )
        trainer = TokenWeightedTrainer(
            model=student, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
            data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id), processing_class=tokenizer,
            objective=objective, data_settings=data,
        )  # fmt: skip
    use_console(trainer)
    if trainer.is_world_process_zero():
        size = lambda m: sum(p.numel() for p in m.parameters()) / 1e6  # noqa: E731
        if teacher is None:
            write(f"teacher {teacher_source}")
        else:
            write(f"teacher {type(teacher).__name__}, {size(teacher):.1f}M parameters, {teacher_source}")
        write(f"student {type(student).__name__}, {size(student):.1f}M parameters")
        write(describe_run(student, args))
        rows = "prompts" if args.lmbda > 0 else "examples"
        write(f"data    {len(train_ds):,} training {rows} / {len(eval_ds):,} held-out rows")
        where = f"stored top-{job.teacher_top_k}" if job.precompute_teacher_logprobs else "the teacher model"
        where = f"the served teacher's top-{args.loss_top_k}" if args.use_teacher_server else where
        on_policy = f", lmbda {args.lmbda} (on-policy)" if args.lmbda > 0 else ""
        write(
            f"loss    beta {args.beta}, temperature {args.temperature}, ce_weight {args.ce_weight}, from {where}"
            f"{on_policy}; {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} micro-batches x "
            f"{args.world_size} process(es)"
        )
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    after = exact_match(trainer.model, tokenizer, held_out, job, "of the student after") if main_process else None
    history = trainer.state.log_history
    metrics = {
        "train": train_result.metrics,
        "teacher": teacher_source,
        "steps": trainer.state.global_step,
        "world_size": args.world_size,
        "stored_top_k": job.teacher_top_k if job.precompute_teacher_logprobs else None,
        "final_divergence": next((h["divergence"] for h in reversed(history) if "divergence" in h), None),
    }
    if trainer.is_world_process_zero():
        if teacher_exact is not None:
            metrics["exact_match_teacher"] = teacher_exact[0]
        if before is not None:
            metrics["exact_match_before"], metrics["exact_match_after"] = before[0], after[0]
            metrics["exact_match_by_task_after"], metrics["samples"] = after[2], after[1]
        metrics["wall_time_s"] = round(time.perf_counter() - start, 1)
        write_json(metrics, Path(args.output_dir) / "metrics.json")
        save_loss_curve(
            history, Path(args.output_dir) / "loss_curve.png", title="hfacc distillation",
            ylabel="loss per student token",
        )  # fmt: skip
        write(format_summary(metrics, args.output_dir))
    return metrics


def check_served_teacher_settings(job: DistillJobArguments, args: DistillationArguments) -> None:
    """A served teacher (``--use_teacher_server``) with a setting that would bring a teacher of its own: one line."""
    if job.teacher_model_name_or_path is not None:
        raise ConfigError(
            f"--use_teacher_server true and --teacher_model_name_or_path {job.teacher_model_name_or_path}: the teacher "
            "is the one on teacher_model_server_url. Drop one of the two."
        )
    if job.precompute_teacher_logprobs:
        raise ConfigError(
            "--use_teacher_server true and --precompute_teacher_logprobs true: the served teacher scores each step's "
            "rows as they are made; precomputing needs the teacher here (--teacher_model_name_or_path)."
        )
    if args.lmbda <= 0:
        raise ConfigError(
            f"--use_teacher_server true with --lmbda {args.lmbda}: the served teacher scores the rows of on-policy "
            "distillation (DistillationTrainer). Set --lmbda above 0, or run the teacher here "
            "(--teacher_model_name_or_path) for distillation on the dataset's completions alone."
        )


def load_teacher(
    job: DistillJobArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    args: DistillationArguments,
    tokenizer=None,
):
    """``(teacher, where from)``: the model named, the SFT recipe's output, or a short SFT of a bigger embedded model
    run here first (the SFT recipe's data and schedule, cut to ``teacher_sft_max_steps``). A teacher from a folder
    or the Hub whose tokenizer is not the student's is a ConfigError before anything trains."""
    if job.teacher_model_name_or_path is not None:
        check_teacher_tokenizer(job.teacher_model_name_or_path, tokenizer)
        return load_causal_lm(job.teacher_model_name_or_path), f"from {job.teacher_model_name_or_path}"
    if model_args.model_name_or_path is not None:
        raise ConfigError(
            "--model_name_or_path names a student: name its teacher with --teacher_model_name_or_path (a model with "
            "the student's tokenizer)."
        )
    directory = Path(job.teacher_sft_dir)
    if (directory / "config.json").is_file():
        check_teacher_tokenizer(str(directory), tokenizer)
        return load_causal_lm(str(directory), dtype="float32"), f"from {directory}"
    directory = Path(args.output_dir) / "teacher"
    if args.process_index == 0:
        write(
            f"no SFT model at {job.teacher_sft_dir} (hfacc sft makes one): a short SFT of a bigger embedded model "
            f"first ({job.teacher_hidden_size} hidden x {job.teacher_num_layers} layers, {job.teacher_sft_max_steps} "
            "steps)"
        )
    bigger = dataclasses.replace(
        model_args, embedded_hidden_size=job.teacher_hidden_size, embedded_num_layers=job.teacher_num_layers
    )
    examples = data_args.num_embedded_examples if data_args.dataset_name is None else None
    run_short_sft(directory, job.teacher_sft_max_steps, args, examples, model_args=bigger)
    source = f"a short SFT of {job.teacher_sft_max_steps} steps (no {job.teacher_sft_dir})"
    return load_causal_lm(str(directory), dtype="float32"), source


def check_on_policy_settings(job: DistillJobArguments, data_args: DataArguments, args: DistillationArguments):
    """What on-policy distillation (``lmbda > 0``) cannot take, each one line before anything loads."""
    if job.precompute_teacher_logprobs:
        raise ConfigError(
            f"precompute_teacher_logprobs with lmbda={args.lmbda}: stored top-K log-probs are the teacher's on the "
            "dataset's completions, and on-policy micro-batches train on the student's samples, which need the "
            "teacher itself. Set --lmbda 0 (offline distillation from the stored columns), or leave "
            "--precompute_teacher_logprobs off."
        )
    if data_args.streaming:
        raise ConfigError(
            f"streaming with lmbda={args.lmbda}: on-policy distillation draws its prompts from a map-style dataset. "
            "Leave --streaming off, or set --lmbda 0."
        )


def get_on_policy_prompts(raw, lmbda: float):
    """The rows of ``raw`` as :class:`hfacc.DistillationTrainer`'s prompts: a ``prompt`` column, and a ``completion``
    column for the share ``1 - lmbda`` of micro-batches the student does not sample.

    Rows with a ``prompt`` column (with or without ``completion``) are taken as they are; chat rows (``messages``)
    give their conversation up to their last assistant turn as the prompt and that turn as the completion (turns
    after it are left out). How the prompts were taken is said once, at WARNING. Text rows have no prompt to take.
    """
    import datasets

    columns = set(raw.column_names)
    share = f"the share 1 - lmbda = {1 - lmbda:g} of micro-batches the student does not sample"
    if "prompt" in columns:
        if "completion" not in columns:
            if lmbda < 1:
                raise ConfigError(
                    f"lmbda={lmbda}: {share} trains on the dataset's completions, and its rows have a 'prompt' "
                    "but no 'completion'. Add a 'completion' column, or set --lmbda 1 (the student samples every "
                    "completion)."
                )
            return raw.select_columns(["prompt"])
        use = f"its 'completion' is trained in {share}" if lmbda < 1 else "the 'completion' column is not trained"
        logger.warning(
            f"on-policy distillation (lmbda {lmbda:g}) of prompt/completion rows: each row's 'prompt' is the prompt "
            f"the student completes; {use}."
        )
        return raw.select_columns(["prompt", "completion"])
    if "messages" not in columns:
        raise ConfigError(
            f"lmbda={lmbda}: on-policy distillation needs prompts, and the dataset's columns "
            f"{sorted(columns - {SOURCE_ROW})} hold none: give a 'prompt' column (with a 'completion' for lmbda < 1) "
            "or chat rows ('messages'), or set --lmbda 0 (offline distillation of the rows as they are)."
        )
    rows = []
    for i, row in enumerate(raw):
        index = row.get(SOURCE_ROW, i)
        messages = normalize_messages(row["messages"], index, "messages", need_assistant=True)
        last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
        if last == 0:
            raise DataError(
                f"row {index}, field 'messages': the conversation starts with its only assistant turn, so there is "
                "no prompt before it to sample a completion for. Give the row a user turn first, or remove it."
            )
        rows.append({"prompt": messages[:last], "completion": messages[last : last + 1]})
    use = (
        f"the student samples the answer in the share lmbda = {lmbda:g} of micro-batches, and that last assistant "
        "turn is the completion in the others"
        if lmbda < 1
        else "the student samples every answer, and the rows' own answers are not trained"
    )
    logger.warning(
        f"on-policy distillation (lmbda {lmbda:g}) of chat rows: each row's prompt is its conversation up to its "
        f"last assistant turn (that turn and any after it left out, the chat template's generation prompt added); "
        f"{use}."
    )
    return datasets.Dataset.from_list(rows)


def exact_match(model, tokenizer, held_out, job: DistillJobArguments, which: str):
    """``(score, samples, by task)`` of greedy answers to the held-out conversations ``held_out`` (rows with
    ``messages`` and, for the embedded data, ``task``); None: skipped."""
    if not held_out:
        return None
    write(f"exact match {which}: answering {len(held_out)} held-out prompts greedily")
    conversations = [row["messages"] for row in held_out]
    score, samples = exact_match_on_conversations(model, tokenizer, conversations, max_new_tokens=job.max_new_tokens)
    tasks = [row.get("task") or "all" for row in held_out]
    rows = [
        {"prompt": p[-1]["content"], "reference": r, "answer": a, "task": t}
        for (p, r, a), t in zip(samples, tasks, strict=True)
    ]
    return score, rows[:8], exact_match_by_group(tasks, samples)


def format_summary(metrics: dict, output_dir: str) -> str:
    lines = [
        "",
        "=== hfacc distillation summary ===",
        f"teacher              {metrics['teacher']}",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']})",
    ]
    if metrics.get("final_divergence") is not None:
        lines.append(f"divergence           {metrics['final_divergence']:.3f} per student token (last logged)")
    if "exact_match_after" in metrics:
        teacher = metrics.get("exact_match_teacher")  # none for a served teacher
        lines.append(
            f"exact match          {'' if teacher is None else f'teacher {teacher:.3f}; '}student "
            f"{metrics['exact_match_before']:.3f} -> {metrics['exact_match_after']:.3f} (held-out, greedy)"
        )
        by_task = sorted(metrics["exact_match_by_task_after"].items(), key=lambda kv: -kv[1])
        lines.append("  student by task: " + ", ".join(f"{task} {score:.2f}" for task, score in by_task))
    lines += [f"wall time            {metrics.get('wall_time_s')} s", f"outputs              {output_dir}", ""]
    return "\n".join(lines)


def default_config(argv: Sequence[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return get_default_config(argv, DEFAULT_CONFIG)


DISTILL_ARGUMENTS = (DistillJobArguments, ModelArguments, DataArguments, DistillationArguments)


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse the command line (YAML + flags) and run :func:`main`: ``hfacc distill`` and ``recipes/distill.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_recipe(main, DISTILL_ARGUMENTS, default_config(argv), argv=argv, prog=prog)


__all__ = ["DistillJobArguments", "DISTILL_ARGUMENTS", "main", "cli", "default_config", "DEFAULT_CONFIG"]
