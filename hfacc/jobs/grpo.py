"""Online RL (GRPO, DAPO, Dr. GRPO) with exact accumulation: the job of ``hfacc grpo`` and ``recipes/grpo.py``.

    hfacc grpo                                   # embedded default: offline, runs on a CPU
    accelerate launch recipes/grpo.py            # the same job, as a recipe script
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/grpo.py   # two processes

With neither --config nor --model_name_or_path, recipes/configs/tiny_grpo.yaml supplies the defaults: the policy is
the SFT recipe's output (outputs/sft-tiny) when it exists, else a short SFT run first; the prompts are the embedded
tasks; the reward is the correctness of the answer (exact match, plus partial credit by similarity). It prints the
held-out reward and exact match before -> after, and writes the model, tokenizer, metrics.json and
reward_curve.png to --output_dir. Any setting can be given on the command line; a user error ends in one message
and exit code 2 (`--debug` or HFACC_DEBUG=1: with its traceback).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import set_seed

from ..data.formats import DataError
from ..generation.engine import TransformersEngine
from ..generation.evaluation import exact_match_by_group, generate_answers
from ..generation.rewards import completion_text, get_reward_funcs
from ..generation.rollout import SamplingSettings, build_rollout, is_conversational
from ..generation.tools import get_tool_schemas
from ..generation.vllm_engine import wait_for_servers
from ..models.loading import ModelArguments, load_model_and_tokenizer
from ..runtime.config import get_default_config, parse_args
from ..training.checkpoint import check_run_before_loading, get_data_settings
from ..training.grpo_trainer import GRPOArguments, GRPOTrainer, check_reward_weights
from .console import describe_run, run_recipe, setup_console, use_console, write
from .report import save_reward_curve, write_json

# The shipped configs live with the recipes; this module runs from a clone of the repository or an editable install.
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "tiny_grpo.yaml"


@dataclass
class GRPOJobArguments:
    """Settings of the GRPO job beyond the model and the trainer (:class:`hfacc.GRPOArguments`)."""

    sft_output_dir: str = field(
        default="outputs/sft-tiny",
        metadata={
            "help": "Without --model_name_or_path: start from this SFT recipe output if it exists; otherwise a short "
            "SFT (sft_max_steps) runs first, into OUTPUT_DIR/sft."
        },
    )
    sft_max_steps: int = field(default=320, metadata={"help": "Optimizer steps of that short SFT."})
    sft_num_examples: int | None = field(
        default=None, metadata={"help": "Embedded conversations the short SFT tokenizes (None: the SFT recipe's)."}
    )
    sft_direct_fraction: float = field(
        default=0.3,
        metadata={
            "help": "embedded_dataset 'tools': the share of the short SFT's conversations that answer at once, "
            "without the tool (wrong: the model cannot multiply); the others call multiply and copy its result."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Prompts: a local .json/.jsonl/.csv/.parquet file, save_to_disk directory or hub dataset with a "
            "'prompt' column (text or chat messages) and the columns the rewards read ('answer'). None: the "
            "embedded tasks."
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name to train on."})
    num_train_prompts: int = field(default=1024, metadata={"help": "Prompts to train on (at most)."})
    num_eval_prompts: int = field(
        default=200, metadata={"help": "Held-out prompts scored before and after, sampled and greedily (0: skip)."}
    )
    tasks: list[str] | None = field(
        default=None,
        metadata={
            "help": "Embedded tasks to train and evaluate on (None: all six). 'auto': those where the starting "
            "policy's samples still disagree (groups with reward variance), measured on probe prompts and said."
        },
    )
    num_probe_prompts: int = field(
        default=16, metadata={"help": "tasks 'auto': prompts per task sampled num_generations times to measure that."}
    )
    min_varied_groups: float = field(
        default=0.25,
        metadata={
            "help": "tasks 'auto': pick the tasks where at least this share of probe groups has reward variance "
            "(none does: the one with the most)."
        },
    )
    max_auto_tasks: int = field(
        default=1,
        metadata={
            "help": "tasks 'auto': at most this many, those whose groups vary most (on the 1.3M-parameter embedded "
            "model, one task at a time learns; a mix of tasks drifts)."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["correctness"],
        metadata={"help": "Reward functions: built-in 'correctness', 'similarity', or 'module:function'."},
    )
    embedded_dataset: str = field(
        default="instructions",
        metadata={
            "help": "Without --dataset_name: 'instructions' (the six embedded tasks) or 'tools' (3-digit products "
            "with a multiply tool: the short SFT trains on its tool-call conversations, the prompts are its "
            "questions, the tool is hfacc.data.embedded_tools:multiply unless --tools names others).",
            "choices": ["instructions", "tools"],
        },
    )
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Python functions the policy may call, as 'module:function' (type hints and a docstring with "
            "an Args: section each): multi-turn rollouts, docs/tools_and_environments.md. Chat prompts only."
        },
    )

    def __post_init__(self):
        if self.sft_max_steps < 1:
            raise ValueError(f"sft_max_steps={self.sft_max_steps}: it must be >= 1.")
        if not 0.0 <= self.sft_direct_fraction <= 1.0:
            raise ValueError(f"sft_direct_fraction={self.sft_direct_fraction}: it is a share, in [0, 1].")
        if self.num_train_prompts < 1 or self.num_eval_prompts < 0:
            raise ValueError("num_train_prompts must be >= 1 and num_eval_prompts >= 0.")
        if self.tasks is not None and self.tasks != [AUTO_TASKS]:
            from ..data.embedded import TASKS

            unknown = sorted(set(self.tasks) - set(TASKS))
            if unknown:
                raise ValueError(
                    f"tasks: unknown {unknown}; the embedded tasks are {sorted(TASKS)}, or '{AUTO_TASKS}' alone."
                )
        if self.num_probe_prompts < 1 or self.max_auto_tasks < 1 or not 0 <= self.min_varied_groups <= 1:
            raise ValueError("num_probe_prompts and max_auto_tasks must be >= 1, min_varied_groups in [0, 1].")
        if self.embedded_dataset not in ("instructions", "tools"):
            raise ValueError(f"embedded_dataset={self.embedded_dataset!r}: use 'instructions' or 'tools'.")

    @property
    def tool_task(self) -> bool:
        """The embedded tool task (its prompts, its short SFT, its tool)."""
        return self.dataset_name is None and self.embedded_dataset == "tools"


def get_job_tools(job: GRPOJobArguments) -> list:
    """The functions of ``--tools`` (``module:function``), or the embedded tool task's ``multiply``; none else."""
    from ..generation.rewards import import_function

    if job.tools:
        return [import_function(name, "tool") for name in job.tools]
    if job.tool_task:
        from ..data.embedded_tools import multiply

        return [multiply]
    return []


def main(job: GRPOJobArguments, model_args: ModelArguments, args: GRPOArguments) -> dict[str, Any]:
    start = time.perf_counter()
    setup_console(args)
    set_seed(args.seed)
    funcs = get_reward_funcs(job.reward_funcs)  # a bad name or weight is an error now, not after a short SFT
    check_reward_weights(args.reward_weights, funcs)
    # The prompts as asked for (tasks 'auto', not the tasks it picks): the same on every launch of this run.
    data = get_data_settings(job, args)
    check_run_before_loading(args, job, args)  # before the policy loads or a short SFT runs
    wait_for_servers(args)  # a vLLM server that is not up: its one line now, not after a short SFT
    tools = get_job_tools(job)
    if tools:
        get_tool_schemas(tools)  # a tool without a schema is an error now, not after a short SFT
    model, tokenizer, source = load_policy(job, model_args, args)
    job = pick_tasks(job, model, tokenizer, funcs, args)  # tasks 'auto': where the policy's samples disagree
    train_prompts, eval_prompts = build_prompts(job, args.seed)
    main_process = args.process_index == 0
    trainer = GRPOTrainer(
        model,
        funcs,
        args,
        train_dataset=train_prompts,
        processing_class=tokenizer,
        tools=tools or None,
        data_settings=data,
    )
    sampler = trainer.tool_sampler
    # With vLLM the held-out prompts are answered by the trainer's engine too (built here, on every process at once).
    engine = trainer.engine if args.use_vllm else None
    before = (
        evaluate_policy(model, tokenizer, eval_prompts, funcs, args, engine=engine, tool_sampler=sampler)
        if main_process
        else None
    )
    use_console(trainer)
    if main_process:
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        write(
            f"policy {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {source}"
        )
        write(describe_run(model, args))
        write(
            f"data   {len(train_prompts):,} prompts / {len(eval_prompts):,} held out; rewards {', '.join(job.reward_funcs)}"
            + (f"; tools {', '.join(sampler.tools)}" if sampler is not None else "")
        )
        write(
            f"batch  {per_step} completions per step ({args.num_generations} per prompt) x {args.world_size} "
            f"process(es); loss_type {args.loss_type!r}; sampled with "
            + ("vLLM (colocate: an engine in each process)" if args.use_vllm else "transformers generate")
        )
        if before is not None:
            em = f"  exact match {before['exact_match']:.3f}" if "exact_match" in before else ""
            calls = f"  tool calls {before['tool_call_frequency']:.2f}" if "tool_call_frequency" in before else ""
            write(f"eval   before: reward {before['reward']:.3f}{em}{calls}  ({len(eval_prompts)} held-out prompts)")
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if engine is not None:  # the trained weights (on every process: a sharded policy is gathered for the copy)
        engine.update(trainer.accelerator.unwrap_model(trainer.model), version=trainer.state.global_step)
    after = (
        evaluate_policy(trainer.model, tokenizer, eval_prompts, funcs, args, engine=engine, tool_sampler=sampler)
        if main_process
        else None
    )
    trainer.save_model()
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    tool_logs = [h for h in history if "tools/call_frequency" in h]
    metrics = {
        "train": result.metrics,
        "steps": trainer.state.global_step,
        "world_size": args.world_size,
        "policy": source,
        "tasks": job.tasks,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        # With tools, TRL's metrics of the first and last logged interval: calls per trajectory, failures per call.
        "train_tools_first": _tool_rates(tool_logs[0]) if tool_logs else None,
        "train_tools_last": _tool_rates(tool_logs[-1]) if tool_logs else None,
        # The whole run's, not the logged intervals' sum (steps after the last logging step count too): generation
        # on this process, training the rest of train()'s runtime.
        "generation_time_s": round(trainer.generation_seconds, 3),
        "training_time_s": round(result.metrics["train_runtime"] - trainer.generation_seconds, 3),
    }
    if main_process:
        if before is not None:
            metrics["before"], metrics["after"] = before, after
        metrics["wall_time_s"] = round(time.perf_counter() - start, 1)
        write_json(metrics, Path(args.output_dir) / "metrics.json")
        save_reward_curve(history, Path(args.output_dir) / "reward_curve.png")
        write(format_summary(metrics, args.output_dir))
    return metrics


def _tool_rates(logs: dict) -> dict[str, float]:
    return {k.split("/")[1]: logs[k] for k in ("tools/call_frequency", "tools/failure_frequency", "tools/mean_turns")}


def load_policy(job: GRPOJobArguments, model_args: ModelArguments, args: GRPOArguments):
    """``(model, tokenizer, where from)``: the model named, the SFT recipe's output, or a short SFT run here."""
    if model_args.model_name_or_path is None:
        sft_dir = Path(job.sft_output_dir)
        if (sft_dir / "config.json").is_file():
            source = f"from {sft_dir}"
        else:
            sft_dir = Path(args.output_dir) / "sft"
            source = f"a short SFT of {job.sft_max_steps} steps (no {job.sft_output_dir})"
            if args.process_index == 0:
                write(f"no SFT model at {job.sft_output_dir} (recipes/sft.py makes one): a short SFT first")
            run_short_sft(sft_dir, job.sft_max_steps, args, job.sft_num_examples, model_args, job.embedded_dataset,
                          job.sft_direct_fraction)  # fmt: skip
        model_args = dataclasses.replace(model_args, model_name_or_path=str(sft_dir))
    else:
        source = f"from {model_args.model_name_or_path}"
    model, tokenizer = load_model_and_tokenizer(model_args, seed=args.seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer, source


def run_short_sft(
    output_dir: Path,
    steps: int,
    args: GRPOArguments,
    num_examples: int | None = None,
    model_args=None,
    embedded_dataset: str = "instructions",
    direct_fraction: float = 0.3,
) -> None:
    """The SFT recipe's job, cut to ``steps`` optimizer steps (its cosine schedule included), saved to ``output_dir``;
    the embedded model sized by ``model_args`` (``--embedded_hidden_size``, ``--embedded_num_layers``), trained on
    the ``embedded_dataset`` (the tool task: its tool-call conversations, ``direct_fraction`` of them answering without
    the tool, at the learning rate the GRPO job gives)."""
    from .sft import DEFAULT_CONFIG as SFT_CONFIG
    from .sft import SFT_ARGUMENTS
    from .sft import main as sft_main

    argv = [
        "--config", str(SFT_CONFIG), "--output_dir", str(output_dir), "--max_steps", str(steps),
        "--warmup_steps", str(min(50, steps // 10)), "--eval_strategy", "no", "--save_strategy", "no",
        "--num_exact_match_examples", "0", "--logging_steps", "40", "--seed", str(args.seed),
        "--disable_tqdm", str(args.disable_tqdm), "--log_level", args.log_level,
    ]  # fmt: skip
    if num_examples is not None:
        argv += ["--num_embedded_examples", str(num_examples)]
    if embedded_dataset != "instructions":
        argv += ["--embedded_dataset", embedded_dataset, "--learning_rate", str(TOOL_SFT_LEARNING_RATE)]
        # One micro-batch of 16 rows: the same update as the SFT recipe's 8 x 2 (exact accumulation), and on a CPU
        # half the time per step (the tool task's SFT is long: the copy of the digits appears late).
        argv += ["--tool_direct_fraction", str(direct_fraction)]
        argv += ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"]
    if model_args is not None:
        argv += ["--embedded_hidden_size", str(model_args.embedded_hidden_size)]
        argv += ["--embedded_num_layers", str(model_args.embedded_num_layers)]
    sft_main(*parse_args(SFT_ARGUMENTS, argv))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank loads what rank 0 saved


def build_prompts(job: GRPOJobArguments, seed: int):
    """``(train, held-out)`` prompt datasets: the user's (a 'prompt' column), or the embedded tasks' conversations
    without their last answer (the 'answer' column, which the correctness reward reads)."""
    import datasets

    if job.tool_task:
        from ..data.embedded_tools import generate_tool_prompt_rows

        train = datasets.Dataset.from_list(generate_tool_prompt_rows(job.num_train_prompts, 1000 + seed))
        held_out = generate_tool_prompt_rows(job.num_eval_prompts, 2000 + seed)
        return train, datasets.Dataset.from_list(held_out) if held_out else train.select([])
    if job.dataset_name is not None:
        data = _load_prompts(job.dataset_name, job.dataset_train_split)
        if "prompt" not in data.column_names:
            raise DataError(f"dataset {job.dataset_name}: no 'prompt' column (it has {data.column_names}).")
        held = min(job.num_eval_prompts, len(data) // 5)
        parts = data.train_test_split(test_size=held, seed=seed) if held else {"train": data, "test": data.select([])}
        train = parts["train"].select(range(min(job.num_train_prompts, len(parts["train"]))))
        return train, parts["test"]
    train = datasets.Dataset.from_list(embedded_prompt_rows(job.num_train_prompts, 1000 + seed, job.tasks))
    held_out = embedded_prompt_rows(job.num_eval_prompts, 2000 + seed, job.tasks)
    return train, datasets.Dataset.from_list(held_out) if held_out else train.select([])


def embedded_prompt_rows(n: int, data_seed: int, tasks: Sequence[str] | None) -> list[dict]:
    """``n`` prompt rows (prompt, answer, task) of the embedded ``tasks`` (None: all), the same for the same seed."""
    from ..data.embedded import generate_instruction_examples

    out, chunk = [], 0
    while len(out) < n and chunk < 100:  # the tasks asked for, drawn until there are n of them
        for example in generate_instruction_examples(4 * n, seed=data_seed + 7919 * chunk):
            if tasks is None or example["task"] in tasks:
                messages = example["messages"]
                out.append({"prompt": messages[:-1], "answer": messages[-1]["content"], "task": example["task"]})
        chunk += 1
    return out[:n]


AUTO_TASKS = "auto"
# The short SFT of the tool task (a model of hidden size 64 in recipes/configs/tiny_grpo_tools.yaml): at the SFT
# recipe's 2e-3 the copy of the digits (question -> call, result -> answer) was not learned in 600 steps; at 5e-3 it
# was, after a plateau of about 350 steps.
TOOL_SFT_LEARNING_RATE = 5e-3


def pick_tasks(job: GRPOJobArguments, model, tokenizer, funcs, args: GRPOArguments) -> GRPOJobArguments:
    """``job`` with ``tasks`` decided, for ``tasks: [auto]`` (else ``job`` itself): the embedded tasks on which the
    starting policy's samples still disagree.

    GRPO learns from a group's reward variance: a group whose ``num_generations`` samples all score the same has
    zero advantage and no gradient. A policy that already solves a task (the full SFT output on ``reverse``), or
    never does, gives such groups only. So ``num_probe_prompts`` prompts per task (seeded apart from the training and
    held-out prompts) are sampled as training samples them and scored with the job's rewards; the tasks where at
    least ``min_varied_groups`` of the groups vary are kept, the ``max_auto_tasks`` that vary most (none: the one
    with the most), and the choice is said.
    """
    if job.tasks != [AUTO_TASKS] or job.dataset_name is not None:
        return job
    if job.tool_task:
        return dataclasses.replace(job, tasks=None)  # one task
    from ..data.embedded import TASKS

    names = sorted(TASKS)
    rows = [row for task in names for row in embedded_prompt_rows(job.num_probe_prompts, 3000 + args.seed, [task])]
    settings = SamplingSettings(args.max_completion_length, args.temperature, args.top_p, args.top_k)
    with torch.random.fork_rng(devices=[]):  # every rank draws the same samples, and training's RNG is untouched
        torch.manual_seed(args.seed + 2)
        rollout = build_rollout(model, tokenizer, rows, funcs, num_generations=args.num_generations,
                                settings=settings, reward_weights=args.reward_weights,
                                max_prompt_length=args.max_prompt_length)  # fmt: skip
    varied = rollout.total.view(len(rows), args.num_generations).std(dim=1) > 0
    share = {t: varied[i * job.num_probe_prompts : (i + 1) * job.num_probe_prompts].float().mean().item()
             for i, t in enumerate(names)}  # fmt: skip
    ranked = sorted(names, key=lambda t: -share[t])  # most varied first; ties in name order
    picked = sorted([t for t in ranked if share[t] >= job.min_varied_groups][: job.max_auto_tasks] or ranked[:1])
    said = ", ".join(f"{t} {share[t]:.2f}" for t in ranked)
    if args.process_index == 0:
        write(
            f"tasks  {', '.join(picked)}: where the policy's samples disagree (share of {job.num_probe_prompts} probe "
            f"groups with reward variance: {said})"
        )
    return dataclasses.replace(job, tasks=picked)


def _load_prompts(name: str, split: str):
    import datasets

    from ..data.sources import LOCAL_FORMATS

    path = Path(name)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"dataset {name}: no such file.")
        return datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    return datasets.load_dataset(name, split=split)


def evaluate_policy(
    model, tokenizer, prompts, funcs, args: GRPOArguments, samples: int = 4, engine=None, tool_sampler=None
) -> dict[str, Any] | None:
    """The held-out prompts' mean reward over ``samples`` completions each, sampled as training samples them (same
    temperature, seeded), and the exact match of greedy answers (the SFT recipe's measure); sampled and answered by
    ``engine`` (vLLM, holding ``model``'s weights) when given, else by ``model.generate``. With ``tool_sampler``
    both are multi-turn, the tools run between turns (the greedy answer is the last assistant turn's), and the
    greedy trajectories' tool calls per prompt and failures per call are reported."""
    if len(prompts) == 0:
        return None
    rows = list(prompts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed + 1)
        settings = SamplingSettings(args.max_completion_length, args.temperature, args.top_p, args.top_k)
        rollout = build_rollout(engine or model, tokenizer, rows, funcs, num_generations=samples, settings=settings,
                                reward_weights=args.reward_weights, max_prompt_length=args.max_prompt_length,
                                seed=args.seed + 1, tool_sampler=tool_sampler)  # fmt: skip
    result = {"reward": rollout.total.mean().item(), "samples_per_prompt": samples}
    if tool_sampler is not None and "answer" in prompts.column_names:
        trajectories = tool_sampler.answer(engine or TransformersEngine(model, tokenizer), prompts["prompt"],
                                           args.max_completion_length)  # fmt: skip
        answers = [completion_text(t.messages).strip() for t in trajectories]
        calls = sum(t.tool_calls for t in trajectories)
        result["tool_call_frequency"] = calls / len(trajectories)
        result["tool_failure_frequency"] = sum(t.tool_failures for t in trajectories) / calls if calls else 0.0
        pairs = [(None, str(r).strip(), a) for r, a in zip(prompts["answer"], answers, strict=True)]
        result["exact_match"] = sum(r == a for _, r, a in pairs) / len(pairs)
        result["answers"] = [
            {"prompt": _last_user_turn(p), "reference": r, "answer": a, "tool_calls": t.tool_calls}
            for p, (_, r, a), t in zip(prompts["prompt"], pairs, trajectories, strict=True)
        ][:6]
    elif "answer" in prompts.column_names:
        conversations = [p if is_conversational(p) else [{"role": "user", "content": p}] for p in prompts["prompt"]]
        answers = generate_answers(
            model, tokenizer, conversations, max_new_tokens=args.max_completion_length, engine=engine
        )
        pairs = [(None, str(r).strip(), a) for r, a in zip(prompts["answer"], answers, strict=True)]
        result["exact_match"] = sum(r == a for _, r, a in pairs) / len(pairs)
        if "task" in prompts.column_names:
            result["exact_match_by_task"] = exact_match_by_group(prompts["task"], pairs)
        result["answers"] = [
            {"prompt": _last_user_turn(p), "reference": r, "answer": a}
            for p, (_, r, a) in zip(prompts["prompt"], pairs, strict=True)
        ][:6]
    return result


def _last_user_turn(prompt: Any) -> str:
    if not is_conversational(prompt):
        return str(prompt)
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def format_summary(metrics: dict, output_dir: str) -> str:
    lines = [
        "",
        "=== hfacc GRPO summary ===",
        f"optimizer steps      {metrics['steps']}  (world size {metrics['world_size']})",
    ]
    lines.append(f"policy               {metrics['policy']}")
    if metrics.get("train_reward_first") is not None:
        lines.append(
            f"train reward         {metrics['train_reward_first']:.3f} -> {metrics['train_reward_last']:.3f} (sampled)"
        )
    before, after = metrics.get("before"), metrics.get("after")
    if before and after:
        n = before["samples_per_prompt"]
        lines.append(
            f"held-out reward      {before['reward']:.3f} -> {after['reward']:.3f} (mean of {n} samples per prompt)"
        )
        if "exact_match" in before:
            tools = " with tools" if "tool_call_frequency" in before else ""
            lines.append(
                f"held-out exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f} (greedy{tools})"
            )
        if "tool_call_frequency" in before:
            lines.append(
                f"held-out tool calls  {before['tool_call_frequency']:.2f} -> {after['tool_call_frequency']:.2f} per "
                f"prompt, failures {before['tool_failure_frequency']:.2f} -> {after['tool_failure_frequency']:.2f} "
                "per call (greedy)"
            )
        by_task = after.get("exact_match_by_task", {})
        if by_task:
            was = before.get("exact_match_by_task", {})
            lines.append(
                "  by task: " + ", ".join(f"{t} {was.get(t, 0):.2f}->{s:.2f}" for t, s in sorted(by_task.items()))
            )
    first, last = metrics.get("train_tools_first"), metrics.get("train_tools_last")
    if first and last:
        lines.append(
            f"train tool calls     {first['call_frequency']:.2f} -> {last['call_frequency']:.2f} per completion, "
            f"failures {first['failure_frequency']:.2f} -> {last['failure_frequency']:.2f} per call, turns "
            f"{first['mean_turns']:.2f} -> {last['mean_turns']:.2f} (sampled; tools/call_frequency, "
            "tools/failure_frequency, tools/mean_turns)"
        )
    lines += [
        f"time                 generation {metrics['generation_time_s']:.1f} s, training {metrics['training_time_s']:.1f} s",
        f"wall time            {metrics.get('wall_time_s')} s",
        f"outputs              {output_dir}",
        "",
    ]
    return "\n".join(lines)


def default_config(argv: Sequence[str]) -> Path | None:
    """The tiny default YAML applies only when the user names neither a config nor a model."""
    return get_default_config(argv, DEFAULT_CONFIG)


GRPO_ARGUMENTS = (GRPOJobArguments, ModelArguments, GRPOArguments)


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse the command line (YAML + flags) and run :func:`main`: ``hfacc grpo`` and ``recipes/grpo.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_recipe(main, GRPO_ARGUMENTS, default_config(argv), argv=argv, prog=prog)


__all__ = ["GRPOJobArguments", "GRPO_ARGUMENTS", "main", "cli", "default_config", "DEFAULT_CONFIG"]
