"""The objective seam: a loss of two terms, each over a unit of its own, is exact under any split, through the
stock Trainer hooks, with no branch for it in the trainer — the design the preference and policy-gradient objectives
build on.

The toy objective: the mean over sequences of the first target's cross-entropy (its unit: sequences, as a DPO pair
is) plus 0.5 x the mean over all target tokens of the cross-entropy (its unit: tokens, as DPO's NLL term).
"""

import math
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from hfacc import DataCollatorForCausalLM, Objective, TokenWeightedTrainer, build_tiny_llama
from hfacc.ops.loss import shift_labels
from hfacc.ops.model_io import get_logits, model_inputs
from tests.helpers import VOCAB, flat_grad, make_examples, pad, relative_error, run_trainer, train_args


class TwoTermSums(NamedTuple):
    first: torch.Tensor  # sum over sequences of their first target's cross-entropy
    tokens: torch.Tensor  # sum over target tokens of their cross-entropy
    num_sequences: torch.Tensor
    num_tokens: torch.Tensor


class FirstTargetPlusTokens(Objective):
    name = "first_target_plus_tokens"
    units = ("sequences", "sequences", "tokens")
    rate_name = "sequences_per_second"

    def count(self, batch):
        targets = shift_labels(batch["labels"], attention_mask=batch.get("attention_mask")) != -100
        sequences = targets.any(-1).sum()
        return torch.stack([sequences, sequences, targets.sum()])

    def __call__(self, model, batch, per_sequence=False):
        outputs = model(**model_inputs(batch))
        targets = shift_labels(batch["labels"], attention_mask=batch.get("attention_mask"))
        mask = targets != -100
        logits = get_logits(outputs).float()
        ce = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none").view(mask.shape)
        ce = ce * mask
        has = mask.any(-1)
        first = ce.gather(1, mask.long().argmax(-1, keepdim=True)).squeeze(1) * has
        return outputs, TwoTermSums(first.sum(), ce.sum(), has.sum(), mask.sum())

    def loss(self, sums, counts, *, normalization="token", world_size=1):
        sequences, tokens = counts.units[0], counts.units[2]  # each term over its own unit, window and all ranks
        return world_size * (sums.first / max(sequences, 1) + 0.5 * sums.tokens / max(tokens, 1))

    def mean_loss(self, sums):
        return sums.first / sums.num_sequences.clamp(min=1) + 0.5 * sums.tokens / sums.num_tokens.clamp(min=1)

    def metric_sums(self, sums):
        return torch.stack([sums.first.detach(), sums.num_sequences.float(), sums.tokens.detach(), sums.num_tokens])

    def metric_logs(self, totals, prefix=""):
        first, sequences, tokens, num_tokens = totals
        return {
            f"{prefix}loss": first / sequences + 0.5 * tokens / num_tokens if sequences else math.nan,
            f"{prefix}first_target_loss": first / sequences if sequences else math.nan,
            f"{prefix}num_sequences": int(sequences),
        }


def reference(model, examples):
    """One forward/backward of the whole batch, by hand: (gradient, loss)."""
    model.zero_grad()
    batch = pad(examples)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    terms_first, terms_tokens = [], []
    for row, labels in zip(logits, targets, strict=True):
        where = (labels != -100).nonzero().flatten()
        ce = F.cross_entropy(row[where], labels[where], reduction="none")
        terms_first.append(ce[0])
        terms_tokens.append(ce)
    loss = torch.stack(terms_first).mean() + 0.5 * torch.cat(terms_tokens).mean()
    loss.backward()
    grad = flat_grad(model)
    model.zero_grad()
    return grad, loss.item()


@pytest.fixture(scope="module")
def data():
    examples = make_examples(8, seed=7, lengths=(4, 40))
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    return examples, model, reference(model, examples)


@pytest.mark.parametrize("bs, ga", [(8, 1), (2, 4), (1, 8), (3, 3)])  # (3, 3): micro-batches of 3, 3 and 2
def test_each_term_over_its_own_unit_is_exact_under_every_split(tmp_path, data, bs, ga):
    examples, model, (want, want_loss) = data
    trainer, capture = run_trainer(
        TokenWeightedTrainer,
        model,
        examples,
        train_args(tmp_path, bs, ga),
        DataCollatorForCausalLM(pad_token_id=0),
        objective=FirstTargetPlusTokens(),
    )
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= 1e-6
    logged = next(entry for entry in trainer.state.log_history if "first_target_loss" in entry)
    assert abs(logged["loss"] - want_loss) <= 1e-5 * want_loss and logged["num_sequences"] == 8
    assert "sequences_per_second" in logged and "token_accuracy" not in logged
    assert not trainer.padding_free  # the objective does not declare padding-free support


def test_the_mean_of_micro_batch_means_is_not_it(data):
    """Negative control: the usual 'divide each micro-batch's mean by k' moves the gradient well past 1e-6."""
    examples, model, (want, _) = data
    model.zero_grad()
    objective = FirstTargetPlusTokens()
    for i in range(0, 8, 2):
        batch = pad(examples[i : i + 2])
        _, sums = objective(model, batch)
        (objective.mean_loss(sums) / 4).backward()
    assert relative_error(flat_grad(model), want) > 1e-3
    model.zero_grad()
