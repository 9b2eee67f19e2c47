"""Preference cases run inside the multi-process launches that exist already (no launch of their own):
tests/distributed_check.py (DDP, 2 ranks) calls :func:`ddp_cases`; tests/engine_check.py calls
:func:`zero3_cases` under DeepSpeed ZeRO-3 and :func:`fsdp2_case` with torch's ``fully_shard``.

The ranks hold uneven pairs: 7 pairs, long answers at even places and short ones at odd places; accelerate repeats a
pair to fill the last batch, which hfacc cuts (a pair is two rows). Every case compares the update with the
hand-written big batch of all 7 pairs (tests/preference_reference.py: plain torch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from hfacc import DataCollatorForPreference, DPOObjective, TokenWeightedArguments, TokenWeightedTrainer
from tests.helpers import CaptureGradients, relative_error, train_args
from tests.preference_reference import (
    BETA,
    GAMMA,
    SMOOTHING,
    big_batch,
    imbalanced_pairs,
    reference_logps,
    sequence_logps,
)

COLLATE = DataCollatorForPreference(pad_token_id=0)


def objective_for(loss_type, nll_weight=0.0, ref_model=None):
    return DPOObjective(
        beta=BETA,
        loss_type=loss_type,
        label_smoothing=SMOOTHING,
        nll_weight=nll_weight,
        ref_model=ref_model,
        gamma=GAMMA,
    )


def tiny(seed, vocab=64):
    from hfacc import build_tiny_llama

    return build_tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=1, seed=seed)


# (name, loss type, nll weight, reference, bs, GA, padding-free, token budget)
DDP_CASES = [
    ("sigmoid copy bs2 ga2 pf nll", "sigmoid", 0.5, "copy", 2, 2, True, 0),
    ("ipo given bs1 ga4 padded", "ipo", 0.0, "given", 1, 4, False, 0),
    ("hinge peft bs3 ga2 pf nll", "hinge", 0.5, "peft", 3, 2, True, 0),
    ("robust precomputed bs2 ga2 padded", "robust", 0.0, "precomputed", 2, 2, False, 0),
    ("simpo bs1 ga4 pf nll", "simpo", 0.5, "none", 1, 4, True, 0),
    ("sigmoid copy token budget nll", "sigmoid", 0.5, "copy", 1, 8, True, 96),
]


def ddp_cases(tmp) -> dict:
    """The trainer on 2 DDP ranks with uneven pairs: every loss type, every kind of reference, both layouts, token
    budgets; and an evaluation whose metrics are over all 7 pairs once (accelerate's repeat dropped)."""
    pairs = imbalanced_pairs(7)
    out = {}
    for name, loss_type, nll_weight, kind, bs, ga, padding_free, budget in DDP_CASES:
        policy, given, examples, ref = setting(kind, pairs)
        want, want_loss = big_batch(policy, pairs, loss_type, ref, nll_weight)
        capture = CaptureGradients(policy)
        extra = {"max_tokens_per_batch": budget} if budget else {}
        args = train_args(
            tmp, bs, ga, args_class=TokenWeightedArguments, padding_free=padding_free, ddp_timeout=120, **extra
        )
        trainer = TokenWeightedTrainer(
            model=policy,
            args=args,
            train_dataset=Dataset.from_list(examples),
            data_collator=COLLATE,
            objective=objective_for(loss_type, nll_weight, given),
            callbacks=[capture],
        )
        trainer.train()
        log = trainer.state.log_history[0]
        out[name] = {
            "grad_error": relative_error(capture.grads[0], want),
            "steps": len(capture.grads),
            "loss_error": abs(log["loss"] - want_loss) / abs(want_loss),
            "num_pairs": log["num_pairs"],
            "padding_free": trainer.padding_free,
        }
    policy, given, examples, ref = setting("given", pairs)
    args = train_args(tmp, 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=2, ddp_timeout=120)
    trainer = TokenWeightedTrainer(
        model=policy,
        args=args,
        eval_dataset=Dataset.from_list(examples),
        data_collator=COLLATE,
        objective=objective_for("sigmoid", 0.5, given),
    )
    metrics = trainer.evaluate()
    with torch.no_grad():
        logps, _ = sequence_logps(policy, pairs)
    chosen, rejected = BETA * (logps[:7] - ref[:7]), BETA * (logps[7:] - ref[7:])
    out["evaluation"] = {
        "num_pairs": metrics["eval_num_pairs"],
        "accuracy_error": abs(metrics["eval_rewards/accuracies"] - (chosen > rejected).float().mean().item()),
        "margin_error": abs(metrics["eval_rewards/margins"] - (chosen - rejected).mean().item()),
        "logps_error": abs(metrics["eval_logps/chosen"] - logps[:7].mean().item()) / abs(logps[:7].mean().item()),
    }
    return out


def setting(kind, pairs):
    """``(policy, ref_model to give, examples, the reference's sequence log-probs for the hand-written batch)``."""
    if kind == "peft":
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
        policy = get_peft_model(tiny(2), lora)
        return policy, None, pairs, reference_logps(policy, pairs, disable_adapter=True)
    policy = tiny(0)
    if kind in ("copy", "none"):
        return policy, None, pairs, reference_logps(policy, pairs)
    other = tiny(1)
    ref = reference_logps(other, pairs)
    if kind == "given":
        return policy, other, pairs, ref
    n = len(pairs)
    rows = [
        {**p, "ref_chosen_logps": ref[i].item(), "ref_rejected_logps": ref[n + i].item()} for i, p in enumerate(pairs)
    ]
    given = torch.tensor([r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows])
    return policy, None, rows, given


# ---- sharded engines --------------------------------------------------------------------------------------------
def fsdp2_case(accelerator, vocab: int, given: bool = False) -> dict:
    """FSDP2 applied with ``fully_shard`` (each decoder layer, then the root), trained through hfacc's loop helper
    with the DPO objective and NLL term; the reference a frozen copy sharded like the policy (or a given model,
    sharded by hfacc)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hfacc import accumulation_window, iter_windows
    from hfacc.setup.model_setup import build_model_setup

    pairs = imbalanced_pairs(7, vocab=vocab)
    policy = tiny(0, vocab)
    other = tiny(1, vocab) if given else None
    ref = reference_logps(other if given else policy, pairs)
    want, _ = big_batch(policy, pairs, "sigmoid", ref, 0.5)
    policy.to(accelerator.device)
    for layer in policy.model.layers:
        fully_shard(layer)
    fully_shard(policy)
    objective = objective_for("sigmoid", 0.5, other)
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = pairs[rank::world]  # 4 pairs on rank 0, 3 on rank 1: micro-batches of 2 + 2 and 2 + 1 pairs (FSDP2 needs
    # as many micro-batches on every rank: each one's forward and backward are collectives)
    batches = [{k: v.to(accelerator.device) for k, v in COLLATE(mine[i : i + 2]).items()} for i in (0, 2)]
    setup = build_model_setup(policy, batches[0], accelerator, objective=objective, padding_free=False)
    module = objective.reference.module
    sharded = [isinstance(p, DTensor) for p in module.parameters()]
    head = module.get_output_embeddings().weight
    policy.train()
    for window in iter_windows(batches, len(batches)):
        for mb in accumulation_window(accelerator, policy, window, objective=objective):
            with mb.sync():
                _, sums = objective(policy, mb.batch)
                accelerator.backward(mb.scale(sums))
    grad = torch.cat([p.grad.full_tensor().float().cpu().flatten() for p in policy.parameters()])
    return {
        "grad_error": relative_error(grad, want),
        "fused": objective.fused and setup.loss_path == "fused",
        "reference_fused": bool(objective.reference.fused),
        "reference_sharded": all(sharded),
        "reference_head_local_numel": head.to_local().numel(),
        "reference_head_numel": head.numel(),
    }


def zero3_cases(run_trainer_case) -> dict:
    """Under ZeRO-3: the default frozen copy (partitioned like the policy) and a given ref_model; the trainer's
    applied update measured by ``run_trainer_case(policy, examples, objective)`` (tests/engine_check.py)."""
    out = {}
    for name, given in (("dpo copy", False), ("dpo given", True)):
        pairs = imbalanced_pairs(7, vocab=96)
        policy = tiny(0, 96)
        other = tiny(1, 96) if given else None
        ref = reference_logps(other if given else policy, pairs)
        want, want_loss = big_batch(policy, pairs, "ipo" if given else "sigmoid", ref, 0.5)
        objective = objective_for("ipo" if given else "sigmoid", 0.5, other)
        applied, trainer = run_trainer_case(policy, pairs, objective, COLLATE)
        reference = objective.reference.module
        out[name] = {
            "grad_error": relative_error(applied, want),
            "loss_error": abs(trainer.state.log_history[0]["loss"] - want_loss) / abs(want_loss),
            "fused": bool(objective.fused),
            "reference_partitioned": all(hasattr(p, "ds_shape") for p in reference.parameters()),
            "reference_partition_numel": sum(p.ds_tensor.numel() for p in reference.parameters()),
            "reference_fused": bool(objective.reference.fused),
            "reference_numel": sum(p.ds_numel for p in reference.parameters()),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
    return out
