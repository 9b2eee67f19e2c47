"""The hand-written big batch of distillation: plain torch (no hfacc code), so a bug in hfacc cannot hide in it.

One forward of the student and the teacher over all examples, padded; per target position (label != -100 after the
shift) the divergence written from its definition with ``F.kl_div`` (as TRL's GKDTrainer writes it), the student's
cross-entropy, their sum over all targets divided by their count, and its gradient.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F

from tests.helpers import flat_grad, pad

VOCAB = 64


def make_student(seed=0, vocab=VOCAB, init=0.1, layers=1):
    from hfacc import build_tiny_llama

    # initializer_range 0.1 (5x the default): peaked next-token distributions, so the divergence is far from 0
    return build_tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=layers, seed=seed, initializer_range=init)


def make_teacher(rows=VOCAB, seed=1, init=0.1, layers=2):
    from hfacc import build_tiny_llama

    return build_tiny_llama(vocab_size=rows, hidden_size=48, num_layers=layers, seed=seed, initializer_range=init)


def uneven_examples(n=8, seed=3, vocab=VOCAB):
    """Long completions (30-50 tokens) at even places, short ones (2-5) at odd places: micro-batches and ranks hold
    very different numbers of target tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(2, 6)
        answer = rng.randint(30, 50) if i % 2 == 0 else rng.randint(2, 5)
        ids = [rng.randrange(1, vocab) for _ in range(prompt + answer)]
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def divergence(student_logps, teacher_logps, beta):
    """The generalized JSD per row, from its definition (``F.kl_div(input, target)`` is KL(target || input))."""
    if beta == 0:
        return F.kl_div(student_logps, teacher_logps, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(teacher_logps, student_logps, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=student_logps.dtype)
    mixture = torch.logsumexp(torch.stack([student_logps + torch.log1p(-b), teacher_logps + torch.log(b)]), dim=0)
    teacher_term = F.kl_div(mixture, teacher_logps, reduction="none", log_target=True).sum(-1)
    student_term = F.kl_div(mixture, student_logps, reduction="none", log_target=True).sum(-1)
    return beta * teacher_term + (1 - beta) * student_term


def big_batch(student, teacher, examples, *, beta, temperature, ce_weight, top_k=None, vocab=VOCAB):
    """``(gradient, loss, teacher_agreement)`` of one big batch of ``examples``; ``top_k``: the teacher's top-K
    support (both distributions restricted to it and renormalized), None: the full vocabulary (the first
    ``vocab`` rows of each model's logits). In float64 (``student`` is converted in place, the teacher copied), so
    that what the comparison measures is the trained path's fp32 rounding alone."""
    batch = pad(examples)
    student.double().zero_grad()
    teacher = copy.deepcopy(teacher).double()
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1, :vocab]
    with torch.no_grad():
        t = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1, :vocab]
    y = batch["labels"][:, 1:]
    m = y != -100
    s, t, y = s[m], t[m], y[m]
    if top_k is None:
        student_logps, teacher_logps = (s / temperature).log_softmax(-1), (t / temperature).log_softmax(-1)
        teacher_top = t.argmax(-1)
    else:
        ids = t.log_softmax(-1).topk(top_k, dim=-1).indices
        student_logps = (s.gather(1, ids) / temperature).log_softmax(-1)
        teacher_logps = (t.gather(1, ids) / temperature).log_softmax(-1)
        teacher_top = ids[:, 0]
    d = divergence(student_logps, teacher_logps, beta)
    ce = F.cross_entropy(s, y, reduction="none")
    loss = (d + ce_weight * ce).sum() / m.sum()
    loss.backward()
    agreement = (s.argmax(-1) == teacher_top).float().mean().item()
    return flat_grad(student).float(), loss.item(), agreement
