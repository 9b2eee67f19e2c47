"""Distillation cases run inside the multi-process launches that exist already (no launch of their own):
tests/distributed_check.py (DDP, 2 ranks) calls :func:`ddp_cases`; tests/engine_check.py calls :func:`zero3_cases`
under DeepSpeed ZeRO-3 and :func:`fsdp2_case` with torch's ``fully_shard``.

The ranks hold uneven tokens: long completions at even places (rank 0), short ones at odd places (rank 1). Every case
compares the update with the hand-written big batch of all examples (tests/distillation_reference.py: plain torch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from datasets import Dataset

from hfacc import (
    DataCollatorForCausalLM,
    DistillationArguments,
    DistillationObjective,
    DistillationTrainer,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_default_tokenizer,
    generate_instruction_examples,
    precompute_teacher_logprobs,
)
from tests.distillation_reference import big_batch, make_student, make_teacher, uneven_examples
from tests.helpers import CaptureGradients, relative_error, train_args

COLLATE = DataCollatorForCausalLM(pad_token_id=0)

# (name, beta, temperature, ce_weight, source, bs, GA, padding-free)
DDP_CASES = [
    ("teacher beta0.5 t2 ce bs1 ga4 pf", 0.5, 2.0, 0.5, "teacher", 1, 4, True),
    ("topk beta0 bs2 ga2 padded", 0.0, 1.0, 0.0, "topk", 2, 2, False),
    ("teacher beta1 bs2 ga2 padded", 1.0, 1.0, 0.0, "teacher", 2, 2, False),
]


def ddp_cases(tmp) -> dict:
    """The trainer on 2 DDP ranks with uneven tokens (a teacher model and stored top-K), and on-policy distillation
    with lmbda 0.5 (each rank samples for its own prompts; the reference is the big batch of both ranks' rows)."""
    examples = uneven_examples()
    teacher = make_teacher()
    stored = precompute_teacher_logprobs(Dataset.from_list(examples), teacher, top_k=8, show_progress=False)
    out = {}
    for name, beta, temperature, ce_weight, source, bs, ga, padding_free in DDP_CASES:
        student = make_student()
        top_k = 8 if source == "topk" else None
        want, loss, _ = big_batch(
            make_student(), teacher, examples, beta=beta, temperature=temperature, ce_weight=ce_weight, top_k=top_k
        )
        capture = CaptureGradients(student)
        args = train_args(tmp, bs, ga, args_class=TokenWeightedArguments, padding_free=padding_free, ddp_timeout=120)
        objective = DistillationObjective(teacher if source == "teacher" else None, beta, temperature, ce_weight)
        trainer = TokenWeightedTrainer(
            model=student,
            args=args,
            train_dataset=stored if source == "topk" else Dataset.from_list(examples),
            data_collator=COLLATE,
            objective=objective,
            callbacks=[capture],
        )
        trainer.train()
        log = trainer.state.log_history[0]
        out[name] = {
            "grad_error": relative_error(capture.grads[0], want),
            "steps": len(capture.grads),
            "loss_error": abs(log["loss"] - loss) / loss,
            "num_targets": log["num_targets"],
            "fused": bool(objective.fused),
            "padding_free": trainer.padding_free,
        }
    out["local_targets"] = [sum(sum(1 for y in e["labels"][1:] if y != -100) for e in examples[r::2]) for r in (0, 1)]
    # Evaluation over 7 examples on 2 ranks (accelerate repeats one to fill the last batch): every target once.
    seven = examples[:7]
    _, loss, agreement = big_batch(make_student(), teacher, seven, beta=0.5, temperature=1.0, ce_weight=0.0)
    args = train_args(tmp, 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=2, ddp_timeout=120)
    metrics = TokenWeightedTrainer(
        model=make_student(), args=args, eval_dataset=Dataset.from_list(seven), data_collator=COLLATE,
        objective=DistillationObjective(teacher, beta=0.5),
    ).evaluate()  # fmt: skip
    out["evaluation"] = {
        "loss_error": abs(metrics["eval_loss"] - loss) / loss,
        "agreement_error": abs(metrics["eval_teacher_agreement"] - agreement),
        "num_targets": metrics["eval_num_targets"],
        "want_targets": sum(sum(1 for y in e["labels"][1:] if y != -100) for e in seven),
    }
    out["on-policy lmbda0.5"] = on_policy_case(tmp)
    return out


def on_policy_case(tmp) -> dict:
    """Two optimizer steps of DistillationTrainer (lmbda 0.5, bs 2 x GA 2 prompts per rank); each step's update
    against the big batch of the rows both ranks trained in it."""
    tokenizer = build_default_tokenizer()
    prompts = Dataset.from_list(
        [{"prompt": e["messages"][:-1], "completion": e["messages"][-1:]} for e in generate_instruction_examples(16)]
    )
    student, teacher = make_student(vocab=len(tokenizer)), make_teacher(rows=len(tokenizer))
    capture = CaptureGradients(student)
    args = train_args(
        tmp, 2, 2, args_class=DistillationArguments, lmbda=0.5, beta=0.5, max_completion_length=8, max_steps=2,
        ddp_timeout=120, seed=3,
    )  # fmt: skip
    trainer = DistillationTrainer(
        student, teacher, args, train_dataset=prompts, processing_class=tokenizer, callbacks=[capture]
    )
    recorded, make = [], trainer.generate_micro_batches

    def record(indices, generation=0):
        batches = make(indices, generation)
        recorded.append(list(trainer.last_rows))
        return batches

    trainer.generate_micro_batches = record
    trainer.train()
    errors = []
    for step, rows in enumerate(recorded):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        step_rows = [r for part in everyone for r in part]
        want, _, _ = big_batch(
            make_student(vocab=len(tokenizer)), teacher, step_rows, beta=0.5, temperature=1.0, ce_weight=0.0,
            vocab=len(tokenizer),
        )  # fmt: skip
        errors.append(relative_error(capture.grads[step], want))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "grad_errors": errors,
        "on_policy_fraction": [h["on_policy_fraction"] for h in logs],
        "num_targets": [h["num_targets"] for h in logs],
    }


# ---- sharded engines: the teacher sharded like the student ------------------------------------------------------
def fsdp2_case(accelerator) -> dict:
    """FSDP2 applied with ``fully_shard`` (each decoder layer, then the root) on the student, trained through hfacc's
    loop helper; the teacher (another architecture: 2 layers, hidden 48) sharded by hfacc on its decoder layers and
    root, with the student's mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hfacc import accumulation_window, iter_windows
    from hfacc.setup.model_setup import build_model_setup

    examples = uneven_examples()
    student, teacher = make_student(), make_teacher()
    want, _, _ = big_batch(make_student(), teacher, examples, beta=0.5, temperature=2.0, ce_weight=0.5)
    student.to(accelerator.device)
    for layer in student.model.layers:
        fully_shard(layer)
    fully_shard(student)
    objective = DistillationObjective(teacher, beta=0.5, temperature=2.0, ce_weight=0.5, chunk_size=16)
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = examples[rank::world]  # rank 0: the long completions; both ranks as many micro-batches (collectives)
    batches = [{k: v.to(accelerator.device) for k, v in COLLATE(mine[i : i + 2]).items()} for i in (0, 2)]
    setup = build_model_setup(student, batches[0], accelerator, objective=objective, padding_free=False)
    module = objective.teacher.module
    head = module.get_output_embeddings().weight
    student.train()
    for window in iter_windows(batches, len(batches)):
        for mb in accumulation_window(accelerator, student, window, objective=objective):
            with mb.sync():
                _, sums = objective(student, mb.batch)
                accelerator.backward(mb.scale(sums))
    grad = torch.cat([p.grad.full_tensor().float().cpu().flatten() for p in student.parameters()])
    return {
        "grad_error": relative_error(grad, want),
        "fused": objective.fused and setup.loss_path == "fused",
        "teacher_fused": bool(objective.teacher.fused),
        "teacher_sharded": all(isinstance(p, DTensor) for p in module.parameters()),
        "teacher_layers_sharded": sum(type(m).__name__.startswith("FSDP") for m in module.model.layers),
        "teacher_head_local_numel": head.to_local().numel(),
        "teacher_head_numel": head.numel(),
    }


def zero3_cases(run_trainer_case) -> dict:
    """Under ZeRO-3, the teacher partitioned like the student; the trainer's applied update measured by
    ``run_trainer_case(student, examples, objective, collate)`` (tests/engine_check.py)."""
    examples = uneven_examples(vocab=96)
    student, teacher = make_student(vocab=96), make_teacher(rows=96)
    want, loss, _ = big_batch(
        make_student(vocab=96), teacher, examples, beta=1.0, temperature=2.0, ce_weight=0.5, vocab=96
    )
    objective = DistillationObjective(teacher, beta=1.0, temperature=2.0, ce_weight=0.5, chunk_size=16)
    applied, trainer = run_trainer_case(student, examples, objective, COLLATE)
    module = objective.teacher.module
    return {
        "distill teacher": {
            "grad_error": relative_error(applied, want),
            "loss_error": abs(trainer.state.log_history[0]["loss"] - loss) / loss,
            "fused": bool(objective.fused),
            "teacher_fused": bool(objective.teacher.fused),
            "teacher_partitioned": all(hasattr(p, "ds_shape") for p in module.parameters()),
            "teacher_partition_numel": sum(p.ds_tensor.numel() for p in module.parameters()),
            "teacher_numel": sum(p.ds_numel for p in module.parameters()),
            "padding_free": trainer.padding_free,  # the teacher runs on the student's padding-free rows
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
    }
