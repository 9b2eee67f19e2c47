"""Preference pairs and the hand-written big-batch reference of every preference loss, in plain torch.

Nothing here imports hfacc: the losses are written out from their papers (and TRL's code), so a bug in hfacc's loss
math or its accumulation cannot hide in the reference.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
BETA, SMOOTHING, GAMMA = 0.1, 0.2, 0.3  # non-defaults for the smoothing and margin, so they are exercised


def make_pairs(n: int = 8, vocab: int = 64, seed: int = 0, answer_lengths=(1, 14), prompt_lengths=(2, 9)):
    """``n`` pairs as hfacc builds them: a shared prompt (labels -100), then a chosen and a rejected answer of 1-14
    tokens (labels = the tokens), so pairs differ a lot in length: the case the issue measured."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_lengths))]
        example = {}
        for side in ("chosen", "rejected"):
            answer = [rng.randrange(1, vocab) for _ in range(rng.randint(*answer_lengths))]
            example[f"{side}_input_ids"] = prompt + answer
            example[f"{side}_labels"] = [-100] * len(prompt) + answer
        pairs.append(example)
    return pairs


def imbalanced_pairs(n: int = 7, vocab: int = 64, seed: int = 1):
    """Even pairs with long answers (10-14 tokens), odd ones with 1-2: ranks that take alternate pairs differ."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lengths = (10, 14) if i % 2 == 0 else (1, 2)
        out += make_pairs(1, vocab, seed=rng.randrange(10**6), answer_lengths=lengths)
    return out


def padded(pairs):
    """All 2B sequences, chosen rows first, right-padded: ``(input_ids, attention_mask, labels)``."""
    rows = [(p[f"{s}_input_ids"], p[f"{s}_labels"]) for s in ("chosen", "rejected") for p in pairs]
    length = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)], mask[i, : len(x)], labels[i, : len(y)] = torch.tensor(x), 1, torch.tensor(y)
    return ids, mask, labels


def sequence_logps(model, pairs):
    """``(logps [2B], lengths [2B])``: each sequence's summed log-prob of its scored tokens (label != -100 after the
    shift), from the model's full logits."""
    ids, mask, labels = padded(pairs)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    targets = labels[:, 1:]
    scored = targets != -100
    token_logps = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (token_logps * scored).sum(-1), scored.sum(-1)


def pair_loss(loss_type, logps, ref_logps, lengths, beta=BETA, eps=SMOOTHING, gamma=GAMMA):
    """Per pair: the loss of ``loss_type`` from [2B] sequence log-probs (chosen first), reference and lengths."""
    b = logps.shape[0] // 2
    pc, pr, nc, nr = logps[:b], logps[b:], lengths[:b].float(), lengths[b:].float()
    if loss_type == "simpo":
        z = beta * (pc / nc - pr / nr) - gamma
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    rc, rr = ref_logps[:b], ref_logps[b:]
    margin = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":  # conservative DPO (label smoothing eps)
        return -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    if loss_type == "ipo":  # log-ratios averaged over their tokens, as TRL does
        return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    raise ValueError(loss_type)


def big_batch(model, pairs, loss_type, ref_logps=None, nll_weight=0.0, **settings):
    """One forward/backward of all pairs: ``(gradient of the trained parameters, loss)``; ``settings``: beta, eps,
    gamma of :func:`pair_loss`.

    loss = mean over pairs of the pair loss + nll_weight * (sum of the chosen targets' -log p) / chosen targets.
    """
    model.zero_grad()
    logps, lengths = sequence_logps(model, pairs)
    b = len(pairs)
    loss = pair_loss(loss_type, logps, ref_logps, lengths, **settings).mean()
    if nll_weight:
        loss = loss + nll_weight * (-logps[:b].sum()) / lengths[:b].sum()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad()
    return grad, loss.item()


@torch.no_grad()
def reference_logps(model, pairs, disable_adapter=False):
    """The reference's sequence log-probs [2B] (a PEFT model with its adapter disabled: its base)."""
    was = model.training
    model.eval()
    try:
        if disable_adapter:
            with model.disable_adapter():
                return sequence_logps(model, pairs)[0]
        return sequence_logps(model, pairs)[0]
    finally:
        model.train(was)
