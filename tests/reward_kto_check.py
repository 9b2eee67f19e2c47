"""Reward-model and KTO cases run inside the two-rank launch that exists already (tests/distributed_check.py calls
:func:`ddp_cases`; no launch of their own).

The ranks hold uneven examples: 7 pairs (7 unpaired rows), long answers at even places and short ones at odd places;
accelerate repeats an example to fill the last batch, which hfacc cuts. Every case compares the update with the
hand-written big batch of all 7 (tests/reward_kto_reference.py: plain torch). For KTO the reference point is the mean
over all 7 KL rows of both ranks, taken before the first backward: a per-rank or per-micro-batch z0 would miss it.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from hfacc import (
    DataCollatorForPreference,
    DataCollatorForUnpairedPreference,
    KTOObjective,
    RewardObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_tiny_llama,
)
from tests.helpers import CaptureGradients, relative_error, train_args
from tests.preference_reference import imbalanced_pairs
from tests.reward_kto_reference import (
    BETA,
    CENTER,
    DESIRABLE,
    UNDESIRABLE,
    imbalanced_rows,
    kto_big_batch,
    kto_reference_logps,
    reward_big_batch,
    tiny_reward_model,
)

# (name, bs, GA, padding-free); the reward cases with margins and centering
REWARD_CASES = [("reward bs2 ga2 pf", 2, 2, True), ("reward bs1 ga4 padded", 1, 4, False)]
# (name, reference, bs, GA, padding-free)
KTO_CASES = [
    ("kto copy bs2 ga2 pf", "copy", 2, 2, True),
    ("kto given bs1 ga4 pf", "given", 1, 4, True),
    ("kto peft bs3 ga2 padded", "peft", 3, 2, False),
    ("kto precomputed bs2 ga2 padded", "precomputed", 2, 2, False),
]


def run(model, examples, collate, objective, tmp, bs, ga, padding_free):
    capture = CaptureGradients(model)
    args = train_args(tmp, bs, ga, args_class=TokenWeightedArguments, padding_free=padding_free, ddp_timeout=120)
    trainer = TokenWeightedTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                                   data_collator=collate, objective=objective, callbacks=[capture])  # fmt: skip
    trainer.train()
    return trainer, capture


def ddp_cases(tmp) -> dict:
    out = {}
    pairs = imbalanced_pairs(7)
    for i, p in enumerate(pairs):
        p["margin"] = 0.25 * (i % 3) - 0.25
    for name, bs, ga, padding_free in REWARD_CASES:
        model = tiny_reward_model()
        want, want_loss, rewards = reward_big_batch(model, pairs, CENTER)
        trainer, capture = run(model, pairs, DataCollatorForPreference(0), RewardObjective(CENTER), tmp, bs, ga,
                               padding_free)  # fmt: skip
        log = trainer.state.log_history[0]
        out[name] = {
            "grad_error": relative_error(capture.grads[0], want),
            "steps": len(capture.grads),
            "loss_error": abs(log["loss"] - want_loss) / abs(want_loss),
            "num_pairs": log["num_pairs"],
            "extremes_error": max(
                abs(log["min_reward"] - rewards.min().item()), abs(log["max_reward"] - rewards.max().item())
            ),  # fmt: skip
            "padding_free": trainer.padding_free,
            "shared_prompts": trainer.model_setup.shared_prompts is not None,
        }
    rows = imbalanced_rows(7)
    for name, kind, bs, ga, padding_free in KTO_CASES:
        policy, given, examples, ref = kto_setting(kind, rows)
        want, want_loss, z0 = kto_big_batch(policy, rows, ref)
        objective = KTOObjective(
            beta=BETA, desirable_weight=DESIRABLE, undesirable_weight=UNDESIRABLE, ref_model=given
        )
        trainer, capture = run(policy, examples, DataCollatorForUnpairedPreference(0), objective, tmp, bs, ga,
                               padding_free)  # fmt: skip
        log = trainer.state.log_history[0]
        out[name] = {
            "grad_error": relative_error(capture.grads[0], want),
            "steps": len(capture.grads),
            "loss_error": abs(log["loss"] - want_loss) / abs(want_loss),
            "kl_error": abs(log["kl"] - z0),
            "z0": z0,
            "num_examples": log["num_examples"],
            "padding_free": trainer.padding_free,
        }
    return out


def kto_setting(kind, rows):
    """``(policy, ref_model to give, examples, the reference's log-probs)``; the precomputed ones from a reference
    sharper than the policy, so that z0 > 0."""
    if kind == "peft":
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
        policy = get_peft_model(build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=2), lora)
        return policy, None, rows, kto_reference_logps(policy, rows, disable_adapter=True)
    policy = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=0)
    if kind == "copy":
        return policy, None, rows, kto_reference_logps(policy, rows)
    other = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=1)
    if kind == "given":  # another model as it is (hfacc computes its log-probs in chunks; the reference from logits)
        return policy, other, rows, kto_reference_logps(other, rows)
    with torch.no_grad():  # precomputed from a sharper model: z0 about 0.3 on these rows, above the clamp
        other.lm_head.weight.mul_(5.0)
    ref = kto_reference_logps(other, rows)
    examples = [{**r, "ref_logps": ref[0][i].item(), "ref_kl_logps": ref[1][i].item()} for i, r in enumerate(rows)]
    return policy, None, examples, ref
