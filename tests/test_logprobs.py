"""Chunked per-token log-probs (hfacc/ops/logprobs.py): the full logits' values and gradients (fp32, <= 1e-6).

The losses built on them (preference pairs, policy gradients) are non-linear in the log-probs, so the checks here
backpropagate non-linear functions of them, not their sum.
"""

import pytest
import torch
import torch.nn.functional as F

from hfacc import build_tiny_llama
from hfacc.ops.logprobs import (
    check_fused_logprobs,
    get_token_logprobs,
    linear_logprobs,
    linear_logprobs_chunk,
    linear_logprobs_chunk_grad,
)
from hfacc.ops.loss import shift_labels
from tests.helpers import VOCAB, make_examples, pad, relative_error


def reference(hidden, weight, bias, targets, temperature):
    logits = F.linear(hidden, weight, bias).float() / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_chunk_functions_match_autograd(temperature):
    torch.manual_seed(0)
    logits = torch.randn(5, 11, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 7])
    weights = torch.randn(5)
    logp = (logits / temperature).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    (weights * logp).sum().backward()
    grad = linear_logprobs_chunk_grad(logits.detach().clone() / temperature, targets, weights, temperature)
    assert relative_error(grad, logits.grad) <= 1e-6

    h, w, b = torch.randn(5, 4), torch.randn(11, 4), torch.randn(11)
    logps, entropy = linear_logprobs_chunk(h, w, b, targets, temperature)
    want_logps, want_entropy = reference(h, w, b, targets, temperature)
    assert relative_error(logps, want_logps) <= 1e-6 and relative_error(entropy, want_entropy) <= 1e-6


@pytest.mark.parametrize("chunk_size", [3, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_give_the_full_logits_values_and_gradients(chunk_size, temperature):
    torch.manual_seed(1)
    h = torch.randn(10, 6, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(13, 6).requires_grad_()
    b = torch.randn(13).requires_grad_()
    targets = torch.randint(0, 13, (10,))
    coef = torch.randn(10)

    def loss(logps):  # non-linear in the log-probs, as DPO's sigmoid of a margin is
        return F.logsigmoid(coef * logps).sum() + (logps.exp() * coef).sum()

    logps, entropy = linear_logprobs(h, w, b, targets, chunk_size=chunk_size, temperature=temperature)
    loss(logps).backward()
    got = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    want_logps, want_entropy = reference(h, w, b, targets, temperature)
    loss(want_logps).backward()
    assert relative_error(logps.detach(), want_logps.detach()) <= 1e-6
    assert relative_error(entropy, want_entropy.detach()) <= 1e-6
    assert not entropy.requires_grad
    for a, t in zip(got, (h, w, b), strict=True):
        assert relative_error(a, t.grad) <= 1e-6


@pytest.fixture(scope="module")
def llama_batch():
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    batch = pad(make_examples(4, seed=3, lengths=(4, 20)))
    targets = shift_labels(batch["labels"], attention_mask=batch["attention_mask"])
    return model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, targets


def test_a_model_gives_the_same_logprobs_and_gradient_either_way(llama_batch):
    model, inputs, targets = llama_batch
    grads, values = [], []
    for fused in (True, False):
        model.zero_grad()
        _, result = get_token_logprobs(model, inputs, targets, fused=fused, temperature=0.9)
        assert result.logps.shape == (int((targets != -100).sum()),)
        F.logsigmoid(result.logps.sum() - 3.0).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        values.append(result.logps.detach())
    assert relative_error(values[0], values[1]) <= 1e-6
    assert relative_error(grads[0], grads[1]) <= 1e-6
    assert check_fused_logprobs(model, inputs, targets) is None


def test_a_model_that_post_processes_its_logits_is_refused(llama_batch):
    model, inputs, targets = llama_batch
    base_forward = type(model).forward

    class SoftCapped(type(model)):
        def forward(self, *args, **kwargs):
            outputs = base_forward(self, *args, **kwargs)
            outputs.logits = 30 * torch.tanh(outputs.logits / 30)
            return outputs

    model.__class__ = SoftCapped
    try:
        assert "post-processes its logits" in check_fused_logprobs(model, inputs, targets)
    finally:
        model.__class__ = SoftCapped.__mro__[1]
