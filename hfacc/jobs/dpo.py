"""Preference optimization (DPO and its variants) with exact accumulation per pair: the job of ``hfacc dpo``.

    hfacc dpo                                                # embedded default: offline, runs on a CPU
    accelerate launch recipes/dpo.py                         # the same job, as a recipe script
    accelerate launch recipes/dpo.py --model_name_or_path my-sft-model --dataset_name pairs.jsonl --loss_type ipo
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/dpo.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/dpo_tiny_default.yaml supplies the defaults. The
run starts from the SFT recipe's output (outputs/sft-tiny, written by `accelerate launch recipes/sft.py`) if it is
there, else runs a short SFT itself; builds preference pairs from that model's own mistakes on the embedded tasks
(chosen: the right answer; rejected: its wrong greedy answer, or a wrong sampled one where the greedy one is right;
prompts it always answers right get no pair); trains with the DPO objective and an NLL term on the chosen answers;
and prints the held-out reward accuracy and exact match before -> after. Rows of a dataset given with
--dataset_name have TRL's columns (prompt, chosen, rejected; see hfacc.build_preference_dataset). Writes the model,
tokenizer, metrics.json and loss_curve.png to --output_dir; user errors end in one message and exit code 2.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import set_seed

from ..data.preference import (
    PREFERENCE_TRUNCATIONS,
    DataCollatorForPreference,
    build_preference_dataset,
    load_preference_source,
)
from ..generation.evaluation import exact_match_by_group, exact_match_on_conversations, generate_answers
from ..generation.rollout import SamplingSettings, get_prompt_ids, sample_completions
from ..generation.vllm_engine import VLLMArguments, build_generation_engine, check_vllm_settings
from ..models.loading import ModelArguments, get_tokenizer, load_causal_lm, load_model_and_tokenizer
from ..models.reference import precompute_reference_logps
from ..objectives.preference import LOSS_TYPES, DPOObjective
from ..ops.precision import get_training_autocast
from ..runtime.config import ConfigError, get_default_config, parse_args
from ..training.arguments import TokenWeightedArguments
from ..training.checkpoint import check_run_before_loading, get_data_settings
from .console import answers_on_every_rank, describe_run, run_recipe, setup_console, use_console, write
from .report import save_loss_curve, write_json

logger = logging.getLogger(__name__)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_CONFIG = RECIPES / "configs" / "dpo_tiny_default.yaml"
SFT_DEFAULT_CONFIG = RECIPES / "configs" / "tiny_default.yaml"


@dataclass
class PreferenceJobArguments:
    """What the preference jobs (``hfacc dpo``, ``reward``, ``kto``) share: their data (the user's, or pairs of the
    embedded tasks from an SFT start) and their held-out checks."""

    sft_model_dir: str = field(
        default="outputs/sft-tiny",
        metadata={
            "help": "Embedded default: start from the SFT recipe's output here; if it is missing, run a short "
            "SFT first."
        },
    )
    sft_max_steps: int = field(default=200, metadata={"help": "Embedded default: optimizer steps of that short SFT."})
    sft_num_examples: int = field(
        default=7200, metadata={"help": "Embedded default: conversations of that short SFT."}
    )
    num_embedded_prompts: int = field(
        default=2000,
        metadata={
            "help": "Embedded default: prompts the starting model answers (train + held out); each one it answers "
            "wrong becomes a pair (chosen: the right answer; rejected: its own wrong one)."
        },
    )
    num_rejected_samples: int = field(
        default=2,
        metadata={
            "help": "Embedded default: answers sampled per prompt besides the greedy one; where the greedy answer "
            "is right, a wrong sample is the rejected one (0: greedy mistakes only)."
        },
    )
    rejected_temperature: float = field(
        default=1.0, metadata={"help": "Embedded default: the temperature of those samples."}
    )
    num_exact_match_examples: int = field(
        default=200, metadata={"help": "Held-out prompts answered greedily before and after training (0: skip)."}
    )
    max_new_tokens: int = field(default=40, metadata={"help": "Longest generated answer (pairs and exact match)."})
    max_length: int | None = field(default=1024, metadata={"help": "Longest sequence (prompt and answer) in tokens."})
    truncation: str = field(
        default="right",
        metadata={
            "help": "Longer sequences: 'right' cuts the answer's end, 'left' the prompt's start, 'drop', 'error'.",
            "choices": list(PREFERENCE_TRUNCATIONS),
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Preference data (prompt/chosen/rejected): hub dataset, local .json/.jsonl/.csv/.parquet "
            "file or save_to_disk directory. None: pairs built from the embedded tasks."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_eval_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on. None: hold out eval_fraction of the training split."}
    )
    eval_fraction: float = field(default=0.1, metadata={"help": "Share held out for evaluation (no eval split)."})
    max_examples: int | None = field(default=None, metadata={"help": "Use at most this many training pairs."})
    torch_threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads for torch (0: torch's default). Tiny models on a few, or shared, cores train "
            "faster on one: synchronizing threads costs more than they compute."
        },
    )

    def __post_init__(self):
        if self.truncation not in PREFERENCE_TRUNCATIONS:
            raise ValueError(f"truncation={self.truncation!r}: use one of {list(PREFERENCE_TRUNCATIONS)}.")
        if self.num_embedded_prompts < 20:
            raise ValueError(f"num_embedded_prompts={self.num_embedded_prompts}: it must be >= 20.")
        if self.num_rejected_samples < 0:
            raise ValueError(f"num_rejected_samples={self.num_rejected_samples}: it must be >= 0 (0: greedy only).")
        if not self.rejected_temperature > 0:
            raise ValueError(f"rejected_temperature={self.rejected_temperature}: it must be > 0.")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction={self.eval_fraction}: it must be between 0 and 1.")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads={self.torch_threads}: it must be >= 0 (0: torch's default).")


@dataclass
class ReferenceJobArguments(PreferenceJobArguments):
    """The reference model of the jobs whose loss compares the policy with one (DPO, KTO)."""

    ref_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "The reference model. None: a frozen copy of the policy as training starts (PEFT: its base)."
        },
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs of every pair once before training (a progress bar), so "
            "no reference model is held while training."
        },
    )
    precompute_ref_batch_size: int = field(default=16, metadata={"help": "Pairs per batch of that precomputation."})


@dataclass
class DPOArguments(ReferenceJobArguments, VLLMArguments):
    """The preference objective and the job's own settings (TRL's names where TRL has them); ``use_vllm`` (and the
    engine's :class:`hfacc.generation.vllm_engine.VLLMArguments`) answers the held-out prompts with vLLM."""

    beta: float = field(default=0.1, metadata={"help": "The loss's temperature (DPO's beta; IPO's tau)."})
    loss_type: str = field(
        default="sigmoid",
        metadata={
            "help": "Preference loss: sigmoid (DPO), ipo, hinge, robust, simpo (reference-free).",
            "choices": list(LOSS_TYPES),
        },
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "sigmoid: conservative DPO's eps; robust: probability of a flipped label (< 0.5); simpo."},
    )
    nll_weight: float = field(
        default=0.0,
        metadata={"help": "Weight of the chosen answers' cross-entropy (per chosen token of the window; RPO style)."},
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO's target reward margin gamma."})

    def __post_init__(self):
        check_vllm_settings(self)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: use one of {list(LOSS_TYPES)}.")
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta}: it must be > 0.")
        if self.nll_weight < 0:
            raise ValueError(f"nll_weight={self.nll_weight}: it must be >= 0 (0: no NLL term).")
        super().__post_init__()
        if self.loss_type == "simpo" and (self.ref_model_name_or_path or self.precompute_ref_log_probs):
            raise ValueError(
                "loss_type='simpo' is reference-free: drop ref_model_name_or_path / precompute_ref_log_probs."
            )


def main(dpo_args: DPOArguments, model_args: ModelArguments, args: TokenWeightedArguments):
    start = time.perf_counter()
    if dpo_args.torch_threads:
        torch.set_num_threads(dpo_args.torch_threads)  # the short SFT, pair building and DPO all run in this process
    setup_console(args)
    set_seed(args.seed)
    # The objective reads --label_smoothing (TRL's DPOConfig name): never both.
    refuse_label_smoothing(args, "DPO", "set --label_smoothing (conservative DPO's eps, robust's flip rate) instead")
    check_run_before_loading(args, dpo_args)  # before a model loads or a short SFT runs
    embedded = model_args.model_name_or_path is None
    if embedded:
        model, tokenizer, started_from = load_sft_start(dpo_args, model_args, args)
    else:
        model, tokenizer = load_model_and_tokenizer(model_args, seed=args.seed)
        started_from = model_args.model_name_or_path
    raw_train, raw_eval, held_out = load_preference_rows(dpo_args, model, tokenizer, args, embedded)
    # Pairs only: unpaired (KTO) rows are refused by name, not tokenized into rows the pairs' collator cannot read.
    options = dict(max_length=dpo_args.max_length, truncation=dpo_args.truncation, unpaired=False)
    with args.main_process_first(desc="dataset tokenization"):
        train_ds = build_preference_dataset(raw_train, tokenizer, **options)
        eval_ds = build_preference_dataset(raw_eval, tokenizer, **options)
    ref_model = None
    if dpo_args.ref_model_name_or_path:
        ref_model = load_causal_lm(dpo_args.ref_model_name_or_path, dtype=model_args.dtype)
    if dpo_args.precompute_ref_log_probs:
        reference = ref_model if ref_model is not None else model  # the policy before training: the reference
        pad = tokenizer.pad_token_id
        size = dpo_args.precompute_ref_batch_size
        # In the precision training will compute the policy in (bf16=True: its autocast), so that r = 0 at the start.
        options = dict(
            pad_token_id=pad, batch_size=size, device=args.device, mixed_precision=get_training_autocast(args)
        )
        train_ds = precompute_reference_logps(train_ds, reference, **options)
        eval_ds = precompute_reference_logps(eval_ds, reference, **options)
        ref_model = None
    objective = DPOObjective(
        beta=dpo_args.beta,
        loss_type=dpo_args.loss_type,
        label_smoothing=dpo_args.label_smoothing,
        nll_weight=dpo_args.nll_weight,
        ref_model=ref_model,
        gamma=dpo_args.simpo_gamma,
    )
    from ..training.trainer import TokenWeightedTrainer  # the Trainer (and datasets): what only a run needs

    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=DataCollatorForPreference(tokenizer.pad_token_id),
        processing_class=tokenizer,
        objective=objective,
        data_settings=get_data_settings(dpo_args),  # part of the run's identity in its checkpoints
    )
    use_console(trainer)
    if trainer.is_world_process_zero():
        write(
            f"model  {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, from {started_from}"
        )
        write(describe_run(model, args))
        write(f"data   {len(train_ds):,} training / {len(eval_ds):,} held-out pairs")
        write(describe_batch(args, "pairs"))
        write(
            f"loss   {dpo_args.loss_type}, beta {dpo_args.beta}"
            + (f", nll_weight {dpo_args.nll_weight}" if dpo_args.nll_weight else "")
        )
    conversations = held_out[: dpo_args.num_exact_match_examples]
    engine = None
    if conversations and dpo_args.use_vllm:  # every process builds its engine together; the main one answers
        policy = trainer.accelerator.unwrap_model(trainer.model)
        engine = build_generation_engine(dpo_args, policy, tokenizer, trainer.accelerator, seed=args.seed)
    exact_before = exact_match(trainer, tokenizer, conversations, dpo_args, "before training", engine)
    before, train_result, after = train_between_evaluations(trainer, args.resume_from_checkpoint)
    step = trainer.state.global_step
    if engine is not None:  # the trained weights (on every process: a sharded policy is gathered for the copy)
        engine.update(trainer.accelerator.unwrap_model(trainer.model), version=step)
    exact_after = exact_match(trainer, tokenizer, conversations, dpo_args, "after training", engine)
    trainer.save_model()
    metrics = {
        "train": train_result.metrics,
        "started_from": str(started_from),
        "loss_type": dpo_args.loss_type,
        "eval_loss_before": before["eval_loss"],
        "eval_loss_after": after["eval_loss"],
        "reward_accuracy_before": before.get("eval_rewards/accuracies"),
        "reward_accuracy_after": after.get("eval_rewards/accuracies"),
        "reward_margin_after": after.get("eval_rewards/margins"),
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
            title=f"hfacc DPO ({dpo_args.loss_type})",
            ylabel="preference loss per pair",
        )
        write(format_summary(metrics, args.output_dir))
    return metrics


def describe_batch(args: TokenWeightedArguments, unit: str) -> str:
    """The console's ``batch`` line: a micro-batch (``unit``s, or a token budget) x accumulation x processes."""
    micro = (
        f"up to {args.max_tokens_per_batch:,} tokens"
        if args.max_tokens_per_batch
        else f"{args.per_device_train_batch_size} {unit}"
    )
    return f"batch  {micro} x {args.gradient_accumulation_steps} micro-batches x {args.world_size} process(es)"


def train_between_evaluations(trainer, resume):
    """``(eval before, train result, eval after)``: the held-out metrics before and after ``trainer.train``; after:
    the evaluation the Trainer ran at its last step (eval_strategy "steps"), or one now."""
    before = trainer.evaluate()
    train_result = trainer.train(resume_from_checkpoint=resume)
    step = trainer.state.global_step
    final = [h for h in trainer.state.log_history if "eval_loss" in h and h["step"] == step and step > 0]
    return before, train_result, final[-1] if final else trainer.evaluate()


def refuse_label_smoothing(args: TokenWeightedArguments, job: str, fix: str = "leave it 0") -> None:
    """transformers' ``label_smoothing_factor`` smooths a cross-entropy the preference jobs do not compute: a
    ConfigError before any training, not a setting silently ignored."""
    if args.label_smoothing_factor:
        raise ConfigError(
            f"label_smoothing_factor={args.label_smoothing_factor} is transformers' cross-entropy smoothing, which "
            f"the {job} job does not read; {fix}."
        )


def load_preference_rows(job_args: PreferenceJobArguments, model, tokenizer, args, embedded: bool):
    """``(train rows, eval rows, held-out conversations)``: the rows of ``--dataset_name``, or for the embedded
    default pairs of the embedded tasks built with ``model`` (the SFT start: its own wrong answers are rejected)."""
    if job_args.dataset_name is None:
        if not embedded:
            raise ConfigError(
                "--dataset_name is needed with --model_name_or_path (pairs of prompt, chosen, rejected)."
            )
        with args.main_process_first(desc="building preference pairs"):
            return build_embedded_pairs(model, tokenizer, job_args, seed=args.seed)
    raw_train, raw_eval = load_preference_source(
        job_args.dataset_name,
        config=job_args.dataset_config,
        split=job_args.dataset_train_split,
        eval_split=job_args.dataset_eval_split,
        eval_fraction=job_args.eval_fraction,
        max_examples=job_args.max_examples,
        seed=args.seed,
    )
    return raw_train, raw_eval, conversations_of(raw_eval)


def exact_match(trainer, tokenizer, conversations, dpo_args, when: str, engine=None):
    """``(score, samples, by task)`` of greedy answers to held-out ``conversations`` (rank 0's; None: skipped, and on
    the other ranks), answered by ``engine`` (vLLM, holding the policy's weights) when given. Under ZeRO-3 every rank
    answers with the main one (:func:`hfacc.jobs.console.answers_on_every_rank`)."""
    main = trainer.is_world_process_zero()
    if not conversations or not (main or answers_on_every_rank(trainer, engine)):
        return None
    on = " (vLLM)" if engine is not None else ""
    if main:
        write(f"exact match {when}: answering {len(conversations)} held-out prompts greedily{on}")
    score, samples = exact_match_on_conversations(
        trainer.model,
        tokenizer,
        [c["messages"] for c in conversations],
        max_new_tokens=dpo_args.max_new_tokens,
        engine=engine,
    )
    if not main:
        return None
    tasks = [c.get("task") or "all" for c in conversations]
    rows = [
        {"prompt": p[-1]["content"], "reference": r, "answer": a, "task": t}
        for (p, r, a), t in zip(samples, tasks, strict=True)
    ]
    return score, rows, exact_match_by_group(tasks, samples)


def format_summary(metrics: dict, output_dir: str) -> str:
    lines = [
        "",
        "=== hfacc DPO summary ===",
        f"started from         {metrics['started_from']}",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']}, loss {metrics['loss_type']})",
        f"eval loss            {metrics['eval_loss_before']:.3f} -> {metrics['eval_loss_after']:.3f}",
    ]
    if metrics.get("reward_accuracy_after") is not None:
        lines.append(
            f"reward accuracy      {metrics['reward_accuracy_before']:.3f} -> {metrics['reward_accuracy_after']:.3f}"
            f"  (held-out pairs; margin {metrics['reward_margin_after']:.3f})"
        )
    lines += exact_match_lines(metrics)
    lines += [f"wall time            {metrics['wall_time_s']} s", f"outputs              {output_dir}", ""]
    return "\n".join(lines)


def exact_match_lines(metrics: dict) -> list[str]:
    """The summary's exact-match lines (before -> after, by task), if the run measured it."""
    if "exact_match_before" not in metrics:
        return []
    lines = [
        f"exact match          {metrics['exact_match_before']:.3f} -> {metrics['exact_match_after']:.3f} on "
        f"{len(metrics['samples'])} held-out prompts"
    ]
    by_task = sorted(metrics["exact_match_by_task_after"].items(), key=lambda kv: -kv[1])
    if by_task and by_task != [("all", metrics["exact_match_after"])]:
        lines.append("  by task: " + ", ".join(f"{task} {score:.2f}" for task, score in by_task))
    return lines


# ---- the embedded default: an SFT start and pairs from its own answers -----------------------------------------
def load_sft_start(dpo_args: PreferenceJobArguments, model_args: ModelArguments, args: TokenWeightedArguments):
    """``(model, tokenizer, where from)``: the SFT recipe's output if it is there, else a short SFT run now."""
    directory = Path(dpo_args.sft_model_dir)
    if not (directory / "model.safetensors").is_file():
        directory = Path(args.output_dir) / "sft"
        if args.process_index == 0:
            write(f"no SFT model at {dpo_args.sft_model_dir}: a short SFT first ({dpo_args.sft_max_steps} steps)")
        run_short_sft(dpo_args, model_args, args, directory)
        PartialState().wait_for_everyone()  # rank 0 writes the model; the others read it next
    model, tokenizer = load_causal_lm(str(directory), dtype="float32"), get_tokenizer(str(directory))
    return model, tokenizer, str(directory)


def run_short_sft(
    dpo_args: PreferenceJobArguments, model_args: ModelArguments, args: TokenWeightedArguments, directory: Path
):
    """The SFT recipe's embedded default (recipes/configs/tiny_default.yaml), shortened to ``sft_max_steps``."""
    from ..data.sft import DataArguments
    from .sft import SFT_ARGUMENTS
    from .sft import main as sft_main

    overrides = [
        "--output_dir", str(directory), "--max_steps", str(dpo_args.sft_max_steps), "--save_strategy", "no",
        "--eval_strategy", "no", "--num_exact_match_examples", "0", "--seed", str(args.seed),
        "--embedded_hidden_size", str(model_args.embedded_hidden_size),
        "--embedded_num_layers", str(model_args.embedded_num_layers), "--log_level", args.log_level,
        "--disable_tqdm", str(args.disable_tqdm), "--warmup_steps", str(min(50, dpo_args.sft_max_steps // 5)),
        "--use_cpu", str(args.use_cpu), "--num_embedded_examples", str(dpo_args.sft_num_examples),
    ]  # fmt: skip
    settings = parse_args(SFT_ARGUMENTS, overrides, default_config=SFT_DEFAULT_CONFIG)
    assert isinstance(settings[2], DataArguments)
    sft_main(*settings)


def plausible_wrong_answer(answer: str, task: str, rng: random.Random) -> str:
    """A near miss of ``answer``: the last number off by one for sums, else one word dropped or two letters swapped.

    >>> plausible_wrong_answer("9 + 4 = 13", "arithmetic", random.Random(0))
    '9 + 4 = 14'
    """
    words = answer.split(" ")
    if task == "arithmetic" and words[-1].lstrip("-").isdigit():
        return " ".join(words[:-1] + [str(int(words[-1]) + rng.choice((-1, 1)))])
    if len(words) > 1:
        del words[rng.randrange(len(words))]
        return " ".join(words)
    if len(answer) > 1:
        i = rng.randrange(len(answer) - 1)
        swapped = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        if swapped != answer:
            return swapped
    return answer + answer[-1:]


def build_embedded_pairs(model, tokenizer, dpo_args: PreferenceJobArguments, seed: int = 0):
    """``(train rows, eval rows, held-out conversations)`` of preference pairs from the starting model's mistakes.

    Prompts come from the embedded instruction data (seeded apart from the SFT recipe's). The model answers each
    greedily and ``num_rejected_samples`` times sampled (at ``rejected_temperature``, seeded); a prompt gets a pair
    when one of those answers is wrong: chosen the right answer, rejected the greedy one if it is wrong (the mistake
    that costs exact match), else the first wrong sample (a mistake the model still gives weight to). A prompt the
    model always answers right teaches nothing and gets no pair: a made-up near miss there lowered a mostly right
    model (held-out exact match 0.78 -> 0.69 from the full SFT output). The held-out conversations are all the
    held-out prompts, answered right or not, so exact match is measured on the task mix, not on the mistakes.
    """
    import datasets

    from ..data.embedded import generate_instruction_examples

    examples = generate_instruction_examples(dpo_args.num_embedded_prompts, seed=seed + 1)
    prompts = [e["messages"][:-1] for e in examples]
    greedy = generate_answers(model, tokenizer, prompts, max_new_tokens=dpo_args.max_new_tokens, batch_size=64)
    sampled = sample_answers(model, tokenizer, prompts, dpo_args, seed=seed)
    k = dpo_args.num_rejected_samples
    rows, counts = [], {"greedy": 0, "sampled": 0, "right": 0}
    for i, example in enumerate(examples):
        right = example["messages"][-1]["content"]
        wrong = [a for a in [greedy[i], *sampled[i * k : (i + 1) * k]] if a and a != right]
        if not wrong:
            counts["right"] += 1
            rows.append(None)
            continue
        counts["greedy" if wrong[0] == greedy[i] else "sampled"] += 1
        rows.append(
            {
                "prompt": prompts[i],
                "chosen": [{"role": "assistant", "content": right}],
                "rejected": [{"role": "assistant", "content": wrong[0]}],
                "task": example["task"],
            }
        )
    held = max(1, int(len(examples) * dpo_args.eval_fraction))
    train, evaluation = [r for r in rows[held:] if r], [r for r in rows[:held] if r]
    if len(train) < 8 or not evaluation:
        raise ConfigError(
            f"the starting model answers {counts['right']} of {len(examples)} embedded prompts right every time: "
            f"{len(train)} training and {len(evaluation)} held-out pairs of its mistakes are too few to train on. "
            "Raise --num_embedded_prompts or --num_rejected_samples, or give pairs with --dataset_name."
        )
    logger.warning(
        "hfacc: %d preference pairs from the starting model's own mistakes on %d embedded prompts (rejected: %d "
        "greedy answers, %d sampled ones); %d prompts it answered right every time have none.",
        len(train) + len(evaluation),
        len(examples),
        counts["greedy"],
        counts["sampled"],
        counts["right"],
    )
    held_out = [{"messages": e["messages"], "task": e["task"]} for e in examples[:held]]
    return datasets.Dataset.from_list(train), datasets.Dataset.from_list(evaluation), held_out


def sample_answers(model, tokenizer, prompts, dpo_args: PreferenceJobArguments, seed: int = 0) -> list[str]:
    """``num_rejected_samples`` sampled answers per prompt (prompt-major), seeded apart from training's RNG."""
    k = dpo_args.num_rejected_samples
    if not k:
        return []
    settings = SamplingSettings(dpo_args.max_new_tokens, dpo_args.rejected_temperature)
    ids = [get_prompt_ids(tokenizer, p) for p in prompts for _ in range(k)]
    answers = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        for i in range(0, len(ids), 256):
            completions, _ = sample_completions(model, tokenizer, ids[i : i + 256], settings)
            answers += tokenizer.batch_decode(completions, skip_special_tokens=True)
    return [a.strip() for a in answers]


def build_example_pairs(data_args, tokenizer, count: int, seed: int = 0, unpaired: bool = False):
    """``count`` tokenized pairs for ``hfacc verify --objective dpo`` (and ``reward``): the first rows of
    ``data_args.dataset_name`` (prompt/chosen/rejected), or pairs of the embedded tasks (the right answer against a
    plausible wrong one); ``unpaired`` (``--objective kto``): those rows unpaired, each with its KL row."""
    import datasets

    options = dict(max_length=data_args.max_length, unpaired=unpaired)
    if data_args.dataset_name is not None:
        raw, _ = load_preference_source(
            data_args.dataset_name,
            config=data_args.dataset_config,
            split=data_args.dataset_train_split,
            eval_fraction=0.5,
            seed=seed,
            max_examples=2 * count,
        )
        return build_preference_dataset(raw.select(range(min(count, len(raw)))), tokenizer, **options)
    from ..data.embedded import generate_instruction_examples

    rng = random.Random(seed)
    rows = []
    for example in generate_instruction_examples(count, seed=seed):
        right = example["messages"][-1]["content"]
        wrong = plausible_wrong_answer(right, example["task"], rng)
        rows.append(
            {
                "prompt": example["messages"][:-1],
                "chosen": [{"role": "assistant", "content": right}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return build_preference_dataset(datasets.Dataset.from_list(rows), tokenizer, **options)


def conversations_of(raw_eval) -> list[dict]:
    """Held-out conversations for exact match from conversational pairs (prompt + chosen); none for text pairs."""
    out = []
    for row in raw_eval:
        prompt, chosen = row.get("prompt"), row.get("chosen")
        if isinstance(prompt, list) and isinstance(chosen, list) and len(chosen) == 1:
            out.append({"messages": list(prompt) + list(chosen), "task": row.get("task")})
    return out


def default_config(argv: Sequence[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return get_default_config(argv, DEFAULT_CONFIG)


# The job's settings: `hfacc dpo` and recipes/dpo.py read them.
DPO_ARGUMENTS = (DPOArguments, ModelArguments, TokenWeightedArguments)


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse the command line (YAML + flags) and run :func:`main`: ``hfacc dpo`` and ``recipes/dpo.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_recipe(main, DPO_ARGUMENTS, default_config(argv), argv=argv, prog=prog)
