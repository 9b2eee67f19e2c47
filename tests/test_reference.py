"""The reference model (hfacc/models/reference.py): frozen copy, the user's model, a PEFT policy's base; no
gradient."""

import torch
from peft import LoraConfig, get_peft_model

from hfacc import build_tiny_llama
from hfacc.models.reference import build_reference_model
from hfacc.ops.logprobs import get_token_logprobs
from hfacc.ops.loss import shift_labels
from tests.helpers import VOCAB, make_examples, pad


def batch():
    padded = pad(make_examples(3, seed=5, lengths=(4, 16)))
    inputs = {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}
    return inputs, shift_labels(padded["labels"], attention_mask=padded["attention_mask"])


def policy_logps(model, inputs, targets):
    with torch.no_grad():
        return get_token_logprobs(model, inputs, targets, fused=False)[1].logps


def test_the_default_is_a_frozen_copy_taken_before_the_first_update():
    policy = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=1)
    inputs, targets = batch()
    before = policy_logps(policy, inputs, targets)
    reference = build_reference_model(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05)
    got = reference.logprobs(inputs, targets)
    assert torch.allclose(got.logps, before, atol=1e-6) and not got.logps.requires_grad
    assert not torch.allclose(policy_logps(policy, inputs, targets), before, atol=1e-3)
    assert all(not p.requires_grad for p in reference.module.parameters())
    assert reference.fused  # checked once on the first batch: the tiny Llama's head can be taken apart


def test_a_given_reference_is_used_as_it_is():
    policy = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=1)
    other = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=2)
    inputs, targets = batch()
    reference = build_reference_model(policy, ref_model=other)
    assert reference.module is other
    assert torch.allclose(reference.logprobs(inputs, targets).logps, policy_logps(other, inputs, targets), atol=1e-6)


def test_a_peft_policy_is_its_own_reference_with_the_adapter_disabled():
    base = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=1)
    inputs, targets = batch()
    want = policy_logps(base, inputs, targets)
    policy = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert not torch.allclose(policy_logps(policy, inputs, targets), want, atol=1e-4)  # the adapter changes them
    reference = build_reference_model(policy)
    assert reference.disable_adapter and reference.module is policy  # no second copy
    assert torch.allclose(reference.logprobs(inputs, targets).logps, want, atol=1e-6)
