"""Fixed rollouts and the hand-written big-batch policy-gradient reference (plain torch, no hfacc code).

A fixed rollout is what an online step consumes, frozen: prompts with completions of 1-14 tokens, one advantage per
completion, and the old policy's log-probs: the current model's plus noise, so that many ratios leave
[1 - eps, 1 + eps_high] on both sides (clipped tokens, zero gradient) and the clipping is exercised.
"""

from __future__ import annotations

import random

import torch

from tests.helpers import VOCAB, flat_grad


def make_rollout(model, n=8, seed=0, completion_lengths=(1, 14), prompt_lengths=(2, 12), noise=0.4) -> list[dict]:
    """``n`` rollout rows: input_ids, labels (-100 on the prompt), advantages and old_logps (aligned with labels)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p, c = rng.randint(*prompt_lengths), rng.randint(*completion_lengths)
        ids = [rng.randrange(1, VOCAB) for _ in range(p + c)]
        rows.append({"input_ids": ids, "labels": [-100] * p + ids[p:], "advantages": rng.gauss(0, 1)})
    with torch.no_grad():
        for row in rows:
            logp = token_logps(model, row["input_ids"])
            old = (logp + noise * torch.randn(logp.shape, generator=generator)).tolist()
            p = sum(1 for y in row["labels"] if y == -100)
            # old_logps[t] is the log-prob of input_ids[t] (t >= 1: predicted by position t - 1); 0 on the prompt.
            row["old_logps"] = [0.0] * p + old[p - 1 :]
    return rows


def token_logps(model, ids, temperature=1.0) -> torch.Tensor:
    """``log p(ids[t] | ids[:t])`` for t = 1..n-1 of one unpadded sequence: ``[n - 1]``."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].float() / temperature
    return logits.log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]


def per_token_losses(
    model,
    row,
    eps=0.2,
    eps_high=0.28,
    beta=0.0,
    ref_model=None,
    temperature=1.0,
    level="token",
    surrogate="clip",
    tau_pos=1.0,
    tau_neg=1.05,
) -> torch.Tensor:
    """The surrogate (x the row's importance weight, + beta x k3 KL) of each completion token of one row, written
    out by hand: PPO's clip, CISPO's capped detached ratio x log-prob or SAPO's sigmoid gate; at ``level="sequence"``
    (GSPO) one ratio for the whole row, exp of the mean log-ratio of its tokens."""
    labels = torch.tensor(row["labels"][1:])
    completion = labels != -100
    logp = token_logps(model, row["input_ids"], temperature)[completion]
    old = torch.tensor(row["old_logps"][1:])[completion] if "old_logps" in row else logp.detach()
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = log_ratio.mean().expand(log_ratio.shape)
    ratio = torch.exp(log_ratio)
    a = row["advantages"]
    if surrogate == "cispo":
        loss = -torch.clamp(ratio.detach(), max=eps_high) * a * logp
    elif surrogate == "sapo":
        tau = tau_pos if a > 0 else tau_neg
        loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * a
    else:
        loss = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps_high) * a)
    if "importance_weights" in row:  # the sampler's mismatch corrected: a fixed weight per token (not on the KL)
        loss = loss * torch.tensor(row["importance_weights"][1:])[completion]
    if beta:
        if "ref_logps" in row:
            ref = torch.tensor(row["ref_logps"][1:])[completion]
        else:
            with torch.no_grad():
                ref = token_logps(ref_model, row["input_ids"], temperature)[completion]
        delta = ref - logp
        loss = loss + beta * (torch.exp(delta) - delta - 1)
    return loss


def reference_loss(model, rows, loss_type, max_completion_length=16, **kwargs) -> torch.Tensor:
    """The big batch's loss: every row of the step in one batch, the loss type's mean taken once."""
    if loss_type in ("cispo", "sapo"):  # their surrogate, divided as TRL divides them: token / sequence
        kwargs["surrogate"], loss_type = loss_type, {"cispo": "token", "sapo": "sequence"}[loss_type]
    losses = [per_token_losses(model, row, **kwargs) for row in rows]
    if loss_type == "token":
        return torch.cat(losses).sum() / sum(len(x) for x in losses)
    if loss_type == "sequence":
        return torch.stack([x.mean() for x in losses]).mean()
    if loss_type == "dr_grpo":
        return torch.cat(losses).sum() / (len(losses) * max_completion_length)
    raise ValueError(loss_type)


def reference_gradient(model, rows, loss_type, **kwargs) -> tuple[torch.Tensor, float]:
    """``(gradient, loss)`` of :func:`reference_loss`, from one backward."""
    model.zero_grad()
    loss = reference_loss(model, rows, loss_type, **kwargs)
    loss.backward()
    grad = flat_grad(model)
    model.zero_grad()
    return grad, loss.item()


def reference_sgd_steps(model, steps, loss_type, lr, **kwargs) -> list[torch.Tensor]:
    """The gradients of consecutive SGD steps, each on its own rows (a list per step), taken on ``model`` in place."""
    grads = []
    for rows in steps:
        grad, _ = reference_gradient(model, rows, loss_type, **kwargs)
        grads.append(grad)
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                if p.requires_grad:
                    p -= lr * grad[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
    return grads
