"""Reward-model pairs, unpaired KTO rows, and the hand-written big-batch reference of both losses, in plain torch.

Nothing here imports hfacc: the losses are written out from TRL's code and the KTO paper, the reward is the model's
own pooled score (transformers' rule: the rightmost token that is not the pad token), so a bug in hfacc's loss math, its layout or its accumulation cannot hide here.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForSequenceClassification

from tests.preference_reference import make_pairs, padded

CENTER, BETA, DESIRABLE, UNDESIRABLE = 0.01, 0.5, 1.0, 1.5  # non-defaults, so that every term is exercised


def tiny_reward_model(vocab=64, seed=0, hidden=32) -> LlamaForSequenceClassification:
    """A one-layer Llama reward model (num_labels=1, pad id 0), from a config, seeded."""
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=0.5)  # scores of order 1: the loss is not flat at log 2
    return model


def reward_pairs(n=8, vocab=64, seed=3, margins=True):
    """``n`` pairs (tests/preference_reference.make_pairs: answers of 1-14 tokens), with a seeded ``margin`` each."""
    pairs = make_pairs(n, vocab, seed=seed)
    rng = random.Random(seed)
    if margins:
        for p in pairs:
            p["margin"] = round(rng.uniform(-1.0, 1.0), 3)
    return pairs


def sequence_rewards(model, pairs) -> torch.Tensor:
    """``[2B]`` (chosen first): the model's own score of each sequence, right-padded with 0 (its pad id), as TRL and
    pipelines score it (the rightmost token that is not the pad token: the one before a final EOS when EOS is 0)."""
    ids, mask, _ = padded(pairs)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


def ending_in_eos(pairs, eos=0):
    """``pairs`` with EOS = the pad id appended to every answer (twice to the first chosen one), as a tokenizer
    whose pad token is its EOS (TRL's default) gives them."""
    out = []
    for i, p in enumerate(pairs):
        q = dict(p)
        for side in ("chosen", "rejected"):
            end = [eos] * (2 if i == 0 and side == "chosen" else 1)
            q[f"{side}_input_ids"], q[f"{side}_labels"] = p[f"{side}_input_ids"] + end, p[f"{side}_labels"] + end
        out.append(q)
    return out


def reward_big_batch(model, pairs, center=CENTER):
    """One forward/backward of all pairs: ``(gradient, loss, rewards)``; loss = mean over pairs of
    ``-logsigmoid(r_c - r_r - m) + center * (r_c + r_r)^2`` (TRL's RewardTrainer)."""
    model.zero_grad()
    rewards = sequence_rewards(model, pairs)
    b = len(pairs)
    margin = torch.tensor([p.get("margin", 0.0) for p in pairs])
    chosen, rejected = rewards[:b], rewards[b:]
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center is not None:
        loss = loss + center * (chosen + rejected) ** 2
    loss = loss.mean()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad()
    return grad, loss.item(), rewards.detach()


def unpaired_rows(n=8, vocab=64, seed=5, prompt_lengths=(2, 9), completion_lengths=(1, 14)):
    """``n`` unpaired rows as hfacc builds them: a prompt (labels -100) and a completion, ``label`` True for 2 in 3,
    and the KL row: the prompt with the previous row's completion (cyclically)."""
    rng = random.Random(seed)
    raw = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_lengths))]
        completion = [rng.randrange(1, vocab) for _ in range(rng.randint(*completion_lengths))]
        raw.append((prompt, completion, i % 3 != 0))
    rows = []
    for i, (prompt, completion, label) in enumerate(raw):
        other = raw[i - 1][1]
        rows.append(
            {
                "completion_input_ids": prompt + completion,
                "completion_labels": [-100] * len(prompt) + completion,
                "label": label,
                "kl_input_ids": prompt + other,
                "kl_labels": [-100] * len(prompt) + other,
            }
        )
    return rows


def imbalanced_rows(n=7, vocab=64, seed=9):
    """Even rows with long completions (10-14 tokens), odd ones with 1-2: ranks that take alternate rows differ."""
    long = unpaired_rows(n, vocab, seed, completion_lengths=(10, 14))
    short = unpaired_rows(n, vocab, seed + 1, completion_lengths=(1, 2))
    return [long[i] if i % 2 == 0 else short[i] for i in range(n)]


def _pad(rows, ids_key, labels_key):
    length = max(len(r[ids_key]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for i, r in enumerate(rows):
        x, y = r[ids_key], r[labels_key]
        ids[i, : len(x)], mask[i, : len(x)], labels[i, : len(y)] = torch.tensor(x), 1, torch.tensor(y)
    return ids, mask, labels


def row_logps(model, rows, kl=False) -> torch.Tensor:
    """``[B]``: each row's completion (or KL row's) log-prob, summed over its scored tokens, from the full logits."""
    ids, mask, labels = _pad(
        rows, *(("kl_input_ids", "kl_labels") if kl else ("completion_input_ids", "completion_labels"))
    )
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    targets = labels[:, 1:]
    scored = targets != -100
    token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (token * scored).sum(-1)


@torch.no_grad()
def kto_reference_logps(model, rows, disable_adapter=False):
    """``(completions [B], KL rows [B])`` under the reference (a PEFT model with its adapter disabled: its base)."""
    was = model.training
    model.eval()
    try:
        if disable_adapter:
            with model.disable_adapter():
                return row_logps(model, rows), row_logps(model, rows, kl=True)
        return row_logps(model, rows), row_logps(model, rows, kl=True)
    finally:
        model.train(was)


def kto_big_batch(model, rows, ref, beta=BETA, desirable=DESIRABLE, undesirable=UNDESIRABLE):
    """One forward/backward of all rows: ``(gradient, loss, z0)``. ``ref`` = (completions, KL rows) reference log-probs.

    z0 = max(0, mean over all rows of the KL rows' log-ratios), no gradient; loss = mean over rows of
    ``w_D (1 - sigmoid(beta (r - z0)))`` (desirable) or ``w_U (1 - sigmoid(beta (z0 - r)))`` (undesirable).
    """
    model.zero_grad()
    with torch.no_grad():
        z0 = (row_logps(model, rows, kl=True) - ref[1]).mean().clamp(min=0)
    r = row_logps(model, rows) - ref[0]
    good = torch.tensor([row["label"] for row in rows])
    losses = torch.where(good, desirable * (1 - torch.sigmoid(beta * (r - z0))),
                         undesirable * (1 - torch.sigmoid(beta * (z0 - r))))  # fmt: skip
    loss = losses.mean()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad()
    return grad, loss.item(), z0.item()
