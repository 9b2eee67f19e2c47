"""Token-budget micro-batches and packing: less padding, same gradient as one big batch."""

import logging
import random

import pytest
import torch

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama
from hfacc.batching import TokenBudgetBatchSampler, check_packing, pack_examples
from tests.helpers import VOCAB, full_batch_causal_lm, make_examples, relative_error, run_trainer, train_args

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


def test_token_budget_sampler_covers_every_example_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(3, 120) for _ in range(500)] + [300]  # one example longer than the budget
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=512, seed=1)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)  # the same count every epoch, as the Trainer needs
        assert sorted(i for b in batches for i in b) == list(range(501))
        assert all(max(lengths[i] for i in b) * len(b) <= 512 or len(b) == 1 for b in batches)
        epochs.append(batches)
    assert epochs[0] != epochs[1]  # reshuffled per epoch...
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # ...deterministically, so a resumed run sees the same order
    padded = sampler.padding_fraction
    fixed = 1 - sum(lengths) / sum(max(lengths[i : i + 8]) * len(lengths[i : i + 8]) for i in range(0, 501, 8))
    assert padded < 0.1 < fixed  # length grouping removes most padding


def test_trainer_with_a_token_budget_is_exact(tmp_path):
    examples = make_examples(12, seed=31)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, token_loss, _ = full_batch_causal_lm(model, examples)
    sampler = TokenBudgetBatchSampler([len(e["input_ids"]) for e in examples], 120)
    k = len(sampler)  # one window holds every micro-batch, however many sequences each has
    args = train_args(
        tmp_path, 1, k, args_class=TokenWeightedArguments, max_tokens_per_batch=120, train_sampling_strategy="random"
    )
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    sizes = [b["input_ids"].shape for b in trainer.window_batches]
    assert len({s[0] for s in sizes}) > 1 and all(s[0] * s[1] <= 120 for s in sizes if s[0] > 1)
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], reference) <= 1e-6
    assert trainer.state.log_history[0]["loss"] == pytest.approx(token_loss, rel=1e-5)


def test_pack_examples_keeps_the_target_set():
    examples = make_examples(30, seed=32)
    rows = pack_examples(examples, 128)
    assert all(len(r["input_ids"]) <= 128 for r in rows) and len(rows) < 30
    segments = []
    for r in rows:
        starts = [j for j, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            assert r["labels"][a] == -100  # nothing in the row predicts a sequence's first token
            segments.append((tuple(r["input_ids"][a:b]), tuple(r["labels"][a + 1 : b])))
    # Every sequence is there once, with the targets it has unpacked (its first token is never a target).
    assert sorted(segments) == sorted((tuple(e["input_ids"]), tuple(e["labels"][1:])) for e in examples)
    # Best-fit decreasing fills rows: fewer rows than a first-come packing would need.
    assert len(rows) <= -(-sum(len(e["input_ids"]) for e in examples) // 128) + 1


def test_packed_collation_has_restarting_positions_and_no_attention_mask():
    rows = pack_examples([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}], 5)
    rows.append({"input_ids": [6, 7], "labels": [6, 7], "position_ids": [0, 1]})
    batch = COLLATE(rows)
    assert "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]  # padding is a sequence of its own
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5], [6, 7, -100, -100, -100]]


def test_packed_training_equals_the_unpacked_big_batch(tmp_path, caplog):
    examples = make_examples(12, seed=33)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, token_loss, _ = full_batch_causal_lm(model, examples)
    rows = pack_examples(examples, 128)
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer, capture = run_trainer(TokenWeightedTrainer, model, rows, train_args(tmp_path, 1, len(rows)), COLLATE)
    assert "packed rows checked" in caplog.text
    assert relative_error(capture.grads[0], reference) <= 1e-6
    assert trainer.state.log_history[0]["loss"] == pytest.approx(token_loss, rel=1e-5)


def test_the_cache_would_leak_so_it_is_switched_off():
    """transformers 5.x keeps packed sequences apart only without a cache; hfacc passes use_cache=False."""
    model = build_tiny_llama(vocab_size=VOCAB).eval()
    batch = COLLATE(pack_examples(make_examples(4, seed=34), 256))
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits
        kept = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert (leaky - kept).abs().max() > 1e-2
    assert check_packing(model, batch) is None


class LeakyLM(torch.nn.Module):
    """Takes position_ids but drops them: packed sequences then attend to each other."""

    def __init__(self):
        super().__init__()
        self.inner = build_tiny_llama(vocab_size=VOCAB)

    def forward(self, input_ids, position_ids=None, use_cache=None, attention_mask=None):
        return self.inner(input_ids=input_ids, use_cache=False)


def test_a_model_that_mixes_packed_sequences_is_refused(tmp_path):
    rows = pack_examples(make_examples(8, seed=35), 256)
    assert "not kept apart" in check_packing(LeakyLM(), COLLATE(rows))
    with pytest.raises(RuntimeError, match="Turn packing off"):
        run_trainer(TokenWeightedTrainer, LeakyLM(), rows, train_args(tmp_path, 1, 1), COLLATE)


def test_random_length_groups_vary_composition_but_keep_the_count():
    rng = random.Random(1)
    lengths = [rng.randint(20, 100) for _ in range(600)]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=320, group_size=64, seed=3)
    compositions = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert sorted(i for b in batches for i in b) == list(range(600))
        compositions.append({tuple(sorted(b)) for b in batches})
    assert compositions[0] != compositions[1]  # groups are redrawn every epoch
    fixed = TokenBudgetBatchSampler(lengths, max_tokens=320, seed=3)
    assert fixed.padding_fraction < sampler.padding_fraction < 0.1
