"""Launch a shipped accelerate config and check hfacc on its engine; rank 0 writes what it measured to OUT.json.

    accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes 2 --mixed_precision no \
        tests/engine_check.py ENGINE OUT.json [--bf16]

ENGINE is single, ddp, fsdp2, zero2 or zero3; tests/test_engines.py launches each on CPU processes (gloo) and
asserts on OUT.json; benchmarks/engines.py runs the same on GPUs in bf16 and prints a table.

Every case starts from the same initial weights on every rank and computes the one-big-batch reference from all the
examples (plain torch, no hfacc). Each rank then trains on its share: the ranks see very different token counts.
Engines shard gradients (ZeRO, FSDP2), so the Trainer cases take one SGD step at a huge learning rate and recover
the applied gradient as (weights before - weights after) / lr, exact to fp32 rounding whatever the engine kept where;
the loss is the one the Trainer logged. The loop cases (FSDP2 applied with torch's fully_shard, for CPU processes,
where accelerate does not apply FSDP) read the sharded gradients directly.
"""

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForCausalLM,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    accumulation_window,
    build_tiny_llama,
    iter_windows,
)
from hfacc.objectives import CausalLMObjective  # noqa: E402
from hfacc.objectives.causal_lm import check_fused_loss  # noqa: E402
from hfacc.runtime.distributed import all_ranks_agree  # noqa: E402
from tests.distributed_check import imbalanced_examples  # noqa: E402
from tests.helpers import full_batch_causal_lm, make_examples, relative_error, train_args  # noqa: E402

# The vocabulary differs from the hidden size (64), so a [V, H] weight cannot pass for its transpose or a shard.
VOCAB = 96
POISON = VOCAB - 1  # never in the data (tokens < 64) unless put there: the embedding then returns NaN
LR = 1e4  # lr * gradient dwarfs the weights, so (before - after) / lr keeps the gradient's fp32 digits
CUDA = torch.cuda.is_available()
BF16 = "--bf16" in sys.argv
COLLATE = DataCollatorForCausalLM(pad_token_id=0)
TMP = Path(tempfile.mkdtemp())


def build_model(tied=False):
    return build_tiny_llama(vocab_size=VOCAB, tie_word_embeddings=tied)


class WarningLog(logging.Handler):
    """hfacc's warnings of this rank."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        logging.getLogger("hfacc").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


class HeadSpy:
    """The output projection's weight while the head's forward ran (the fused loss reads it there), and after."""

    def __init__(self, model):
        self.head = model.get_output_embeddings()
        self.seen = []
        self.head.register_forward_hook(self.hook)  # before the engine's own: it sees the weight as the forward did

    def hook(self, module, inputs, output):
        if torch.is_grad_enabled() and module.training:  # training micro-batches (the start-up checks run in eval)
            w = module.weight
            self.seen.append({"weight": _describe(w), "output_dim": output.dim()})

    def summary(self):
        return {"in_forward": self.seen[:1], "forwards": len(self.seen), "outside": _describe(self.head.weight)}


def gather_lists(items):
    """Every rank's list, concatenated in rank order (a collective)."""
    if not dist.is_initialized():
        return list(items)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(items))
    return [x for rank in everyone for x in rank]


def _describe(w):
    from torch.distributed.tensor import DTensor

    local = w.to_local() if isinstance(w, DTensor) else w
    described = {"type": type(w).__name__, "shape": list(w.shape), "local_numel": local.numel()}
    if hasattr(w, "ds_id"):  # DeepSpeed ZeRO-3: shape is the local one, ds_shape the full one
        described.update(ds_shape=list(w.ds_shape), ds_persist=bool(w.ds_persist), ds_status=str(w.ds_status))
    return described


def full_parameters(model):
    """All weights as one fp32 CPU vector, gathered from wherever the engine keeps them (a collective)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params):  # DeepSpeed ZeRO-3 / ZeRO-1, 2
        from deepspeed.utils import safe_get_full_fp32_param

        full = [safe_get_full_fp32_param(p) for p in params]  # ZeRO's fp32 master weights, not the bf16 copies
    else:
        full = [p.full_tensor() if isinstance(p, DTensor) else p for p in params]
    return torch.cat([p.detach().float().cpu().flatten() for p in full])


def engine_weights_case(model) -> dict:
    """What a vLLM engine would be given (hfacc.generation.vllm_engine.get_engine_weights, a collective): every name
    and shape of the architecture, and exactly the values of the full parameters, however the engine shards them."""
    from hfacc.generation.vllm_engine import check_engine_weights, get_engine_weights, get_expected_weights
    from hfacc.ops.model_io import get_base_model

    weights = get_engine_weights(model)
    check_engine_weights(weights, get_expected_weights(model))
    by_name = dict(weights)
    names = [n for n, _ in get_base_model(model).named_parameters()]
    copied = torch.cat([by_name[n].detach().float().cpu().flatten() for n in names])
    return {"tensors": len(weights), "error": (copied - full_parameters(model)).abs().max().item()}


def partition_everything(args):
    """ZeRO-3 keeps parameters below 1e5 elements whole on every rank (stage3_param_persistence_threshold): all of a
    tiny model's. Real models' output projections are far above it; so are this test's, with the threshold at 0."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0


def trainer_case(examples, *, bs, ga, tied=False, fused=True, evaluate_first=False, **overrides):
    """One optimizer step of TokenWeightedTrainer on the launched engine; errors against the big batch.
    ``evaluate_first``: ``evaluate()`` before ``train()``, as the jobs do (under ZeRO-1/2 stock has no engine for it)."""
    model = build_model(tied)
    reference, token_loss, accuracy = full_batch_causal_lm(model, examples)
    before = torch.cat([p.detach().float().flatten().clone() for p in model.parameters()])
    spy = HeadSpy(model)
    args = train_args(
        TMP,
        bs,
        ga,
        args_class=TokenWeightedArguments,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        fused_loss=fused,
        loss_chunk_size=16,
        ddp_timeout=120,  # a collective that never completes fails in 2 minutes instead of hanging the suite
        use_cpu=not CUDA,
        bf16=BF16,
        **overrides,
    )
    partition_everything(args)
    trainer = TokenWeightedTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=COLLATE
    )
    evaluated = trainer.evaluate(Dataset.from_list(examples[:2]))["eval_loss"] if evaluate_first else None
    trainer.train()
    applied = (before - full_parameters(trainer.model)) / LR
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    return applied, {
        "grad_error": relative_error(applied, reference),
        "loss_error": abs(log["loss"] - token_loss) / token_loss,
        "accuracy_error": abs(log["token_accuracy"] - accuracy),
        "fused": trainer.objective.fused,
        "steps": trainer.state.global_step,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "world_size": trainer.accelerator.num_processes,
        "head": spy.summary(),
        "engine_weights": engine_weights_case(trainer.model),
        "evaluated_first": evaluated,
    }


def fsdp2_loop_case(accelerator, examples, *, reshard=True, tied=False, head_unit=False, fused=True):
    """FSDP2 applied directly with torch's fully_shard (as accelerate's TRANSFORMER_BASED_WRAP does: each decoder
    layer, then the root), trained through hfacc's hand-written-loop helper with the (fused) causal-LM objective."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = accelerator.device
    model = build_model(tied)
    reference, token_loss, _ = full_batch_causal_lm(model, examples)
    model.to(device)
    spy = HeadSpy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if BF16 else None
    shard = {"reshard_after_forward": reshard, **({"mp_policy": policy} if policy else {})}
    for layer in model.model.layers:
        fully_shard(layer, **shard)
    if head_unit:  # the head as its own FSDP unit: only its own hooks gather its weight
        fully_shard(model.lm_head, **shard)
    fully_shard(model, **shard)
    objective = CausalLMObjective(chunk_size=16)
    mine = examples[accelerator.process_index :: accelerator.num_processes]
    batches = [{k: v.to(device) for k, v in COLLATE([e]).items()} for e in mine]
    if fused:
        problem = check_fused_loss(objective, model, batches[0])
        objective.fused = all_ranks_agree(problem is None, accelerator)
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for window in iter_windows(batches, len(batches)):
        for mb in accumulation_window(accelerator, model, window, objective=objective):
            with mb.sync():
                _, sums = objective(model, mb.batch)
                accelerator.backward(mb.scale(sums))
            loss_sum += sums.loss.detach().double()
    dist.all_reduce(loss_sum)
    grad = torch.cat([p.grad.full_tensor().float().cpu().flatten() for p in model.parameters()])
    return grad, {
        "grad_error": relative_error(grad, reference),
        "loss_error": abs(loss_sum.item() / mb.window.num_targets - token_loss) / token_loss,
        "fused": objective.fused,
        "head": spy.summary(),
        "engine_weights": engine_weights_case(model),
    }


class CaptureWeights(TrainerCallback):
    """The full weights after every optimizer step (gathered on all ranks)."""

    def __init__(self, model):
        self.model, self.after = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after.append(full_parameters(self.model))


def nonfinite_case():
    """Four windows of 2 micro-batches per rank: clean, NaN on rank 1's second micro-batch, no targets, clean."""
    examples = make_examples(16, seed=7)
    # Rank r gets examples r, r + 2, r + 4, ...: window w holds examples 4w + r and 4w + 2 + r.
    examples[7]["input_ids"][1] = POISON
    for e in examples[8:12]:
        e["labels"] = [-100] * len(e["labels"])
    model = build_model()
    model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, out: out * float("nan") if (inputs[0] == POISON).any() else out
    )
    args = train_args(
        TMP,
        1,
        2,
        args_class=TokenWeightedArguments,
        learning_rate=0.1,
        weight_decay=0.1,  # a step with a zero gradient would still move the weights: an empty window shows
        optim="sgd",
        lr_scheduler_type="constant",
        ddp_timeout=120,
        use_cpu=not CUDA,
        bf16=BF16,
    )
    partition_everything(args)
    log = WarningLog()
    trainer = TokenWeightedTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=COLLATE
    )
    capture = CaptureWeights(model)
    trainer.add_callback(capture)
    trainer.train()
    w = capture.after
    logging.getLogger("hfacc").removeHandler(log)
    return {
        "steps": trainer.state.global_step,
        "skipped_steps": trainer.state.log_history[-1]["train_skipped_steps"],
        "empty_windows": trainer.meter.empty_windows,
        "unchanged_by_nan_window": torch.equal(w[1], w[0]),
        "unchanged_by_empty_window": torch.equal(w[2], w[0]),
        "changed_by_last_window": not torch.equal(w[3], w[2]),
        "all_finite": all(bool(torch.isfinite(x).all()) for x in w),
        "warnings": gather_lists(log.messages),
    }


def overflow_check_off_case():
    """The ZeRO-2 config with DeepSpeed's inf/NaN check off (compute_grad_norm: false): hfacc must refuse to start."""
    args = train_args(TMP, 1, 2, args_class=TokenWeightedArguments, optim="sgd", use_cpu=not CUDA)
    args.deepspeed_plugin.deepspeed_config["zero_optimization"]["compute_grad_norm"] = False
    trainer = TokenWeightedTrainer(
        model=build_model(), args=args, train_dataset=Dataset.from_list(make_examples(4)), data_collator=COLLATE
    )
    try:
        trainer.train()
    except ValueError as err:
        return str(err)
    return None


def dpo_trainer_run(policy, pairs, objective, collate):
    """One optimizer step of TokenWeightedTrainer with a preference objective: ``(applied update, trainer)``."""
    before = torch.cat([p.detach().float().flatten().clone() for p in policy.parameters()])
    args = train_args(
        TMP,
        1,
        4,
        args_class=TokenWeightedArguments,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        ddp_timeout=120,
        use_cpu=not CUDA,
        bf16=BF16,
    )
    partition_everything(args)
    trainer = TokenWeightedTrainer(
        model=policy, args=args, train_dataset=Dataset.from_list(pairs), data_collator=collate, objective=objective
    )
    trainer.train()
    return (before - full_parameters(trainer.model)) / LR, trainer


def main(engine: str, out_path: str) -> None:
    examples = imbalanced_examples()
    results = {"engine": engine, "cases": {}, "bf16": BF16, "cuda": CUDA}
    cases = results["cases"]
    applied = {}

    def run(name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        vector, cases[name] = fn(*args, **kwargs)
        applied[name] = vector
        print(f"engine_check: {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    if engine == "single":
        run("trainer bs2 ga4 fused", trainer_case, examples, bs=2, ga=4)
    elif engine == "ddp":
        run("trainer bs1 ga4 fused", trainer_case, examples, bs=1, ga=4)
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = (rank, int(os.environ.get("GROUP_RANK", -1)), int(os.environ.get("LOCAL_RANK", -1)))
        results["ranks"] = gather_lists([where])  # (global rank, machine rank, local rank) of every process
    elif engine in ("zero2", "zero3"):
        run("trainer bs1 ga4 fused", trainer_case, examples, bs=1, ga=4)
        # evaluate() first, as the jobs do: `hfacc sft` stopped there under ZeRO-2 (stock asks for an inference
        # engine, ZeRO-3 only) and under ZeRO-3 (stock's inference engine left train() none to step with).
        run("trainer bs1 ga4 plain", trainer_case, examples, bs=1, ga=4, fused=False, evaluate_first=True)
        if engine == "zero3":
            run("trainer bs1 ga4 fused tied", trainer_case, examples, bs=1, ga=4, tied=True)
            from tests.preference_check import zero3_cases  # DPO: the reference partitioned like the policy

            results["preference"] = zero3_cases(dpo_trainer_run)
            from tests.distillation_check import zero3_cases as distillation_zero3_cases  # the teacher partitioned

            results["distillation"] = distillation_zero3_cases(dpo_trainer_run)
        results["fused_vs_plain"] = relative_error(applied["trainer bs1 ga4 fused"], applied["trainer bs1 ga4 plain"])
        results["zero_stage"] = int(engine[-1])
        results["nonfinite"] = nonfinite_case()
        if engine == "zero2":
            results["overflow_check_off"] = overflow_check_off_case()
    elif engine == "fsdp2":
        from accelerate import Accelerator

        log = WarningLog()
        if CUDA:  # accelerate applies FSDP2 itself: the Trainer path
            run("trainer bs1 ga4 fused", trainer_case, examples, bs=1, ga=4)
            run("trainer bs1 ga4 fused tied", trainer_case, examples, bs=1, ga=4, tied=True)
            run("trainer bs1 ga4 plain", trainer_case, examples, bs=1, ga=4, fused=False)
            os.environ["FSDP_RESHARD_AFTER_FORWARD"] = "false"  # the shard-grad-op flavour
            run("trainer bs1 ga4 fused shard-grad-op", trainer_case, examples, bs=1, ga=4)
        else:  # accelerate trains CPU processes with DDP instead, and hfacc says so
            run("trainer on cpu (ddp)", trainer_case, examples, bs=1, ga=4)
        results["warnings"] = gather_lists(log.messages)
        accelerator = Accelerator(cpu=not CUDA)
        if not dist.is_initialized():  # one process (the benchmark on 1 GPU): fully_shard still wants a group
            port = os.environ.get("MASTER_PORT", "29512")
            dist.init_process_group(
                "nccl" if CUDA else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
        run("loop full-shard fused", fsdp2_loop_case, accelerator, examples)
        run("loop full-shard plain", fsdp2_loop_case, accelerator, examples, fused=False)
        run("loop shard-grad-op fused", fsdp2_loop_case, accelerator, examples, reshard=False)
        run("loop full-shard fused tied", fsdp2_loop_case, accelerator, examples, tied=True)
        run("loop full-shard fused head-unit", fsdp2_loop_case, accelerator, examples, head_unit=True)
        results["fused_vs_plain"] = relative_error(applied["loop full-shard fused"], applied["loop full-shard plain"])
        from tests.preference_check import fsdp2_case  # DPO: the reference sharded like the policy

        results["preference"] = {
            "fsdp2 loop copy": fsdp2_case(accelerator, VOCAB),
            "fsdp2 loop given": fsdp2_case(accelerator, VOCAB, given=True),
        }
        from tests.distillation_check import fsdp2_case as distillation_fsdp2_case  # the teacher sharded like it

        results["distillation"] = distillation_fsdp2_case(accelerator)
    else:
        raise SystemExit(f"unknown engine {engine!r}")

    results["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=2))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # a rank that exits with the group alive can abort the others


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
