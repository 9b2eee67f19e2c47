"""Drop-in fidelity: what a `transformers.Trainer` user does gives what stock gives, and stays exact.

Predictions (`predict`, `evaluate` with `compute_metrics`) are the model's logits, as stock returns them, for
transformers models and plain `nn.Module`s returning a tensor or a tuple; `compute_loss_func` is honored (or refused
with the exact alternative); PEFT prompt tuning's virtual tokens are accounted for; a plain module's labels are never
guessed silently; the training-time audit's tolerance follows the precision; the README's imports exist.
"""

import logging
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from torch import nn
from transformers import Trainer
from transformers.loss.loss_utils import ForCausalLMLoss

import hfacc
from hfacc import (
    DataCollatorForCausalLM,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_tiny_llama,
)
from tests.helpers import (
    VOCAB,
    PlainLM,
    flat_grad,
    full_batch_causal_lm,
    make_examples,
    pad,
    relative_error,
    run_trainer,
    train_args,
)

TOL = 1e-6
COLLATE = DataCollatorForCausalLM(pad_token_id=0)


def llama():
    return build_tiny_llama(vocab_size=VOCAB)


def padded_collate(features):
    """A collator that adds no labels (like DataCollatorWithPadding): the dataset has none, so neither has the batch."""
    batch = pad([{"input_ids": f["input_ids"], "labels": f["input_ids"]} for f in features])
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def shapes(predictions):
    return [p.shape for p in predictions] if isinstance(predictions, tuple) else predictions.shape


# ---- 1. predict() and evaluate() return what stock returns -------------------------------------------------------
@pytest.mark.parametrize("data", ["labels", "no labels, causal-LM collator", "no labels, padding collator"])
def test_predict_returns_the_logits_stock_returns(tmp_path, data):
    examples = make_examples(8)
    if data == "labels":
        dataset, collate = Dataset.from_list(examples), COLLATE
    else:  # the causal-LM collator trains on every token of an unlabeled example: labels = input_ids, as stock
        dataset = Dataset.from_list([{"input_ids": e["input_ids"]} for e in examples])
        collate = COLLATE if "causal" in data else padded_collate
    outputs = {}
    for cls in (Trainer, TokenWeightedTrainer):
        trainer = cls(
            model=llama(), args=train_args(tmp_path, 2, 1, per_device_eval_batch_size=4), data_collator=collate
        )
        outputs[cls] = trainer.predict(dataset)
    stock, ours = outputs[Trainer], outputs[TokenWeightedTrainer]
    length = max(len(e["input_ids"]) for e in examples)
    assert ours.predictions.shape == stock.predictions.shape == (8, length, VOCAB)
    np.testing.assert_allclose(ours.predictions, stock.predictions, rtol=1e-5, atol=1e-5)
    if data == "no labels, padding collator":
        assert ours.label_ids is None and stock.label_ids is None
        assert "test_loss" not in ours.metrics and "test_loss" not in stock.metrics
    else:
        np.testing.assert_array_equal(ours.label_ids, stock.label_ids)
        # Stock's loss is a mean of batch means, hfacc's the token mean: equal when computed on the same tokens.
        tokens = torch.tensor(stock.label_ids)[:, 1:] != -100
        assert ours.metrics["test_num_targets"] == tokens.sum().item()


def test_the_fused_path_runs_exactly_where_stock_discards_the_logits(tmp_path):
    """evaluate() without compute_metrics and prediction_loss_only never build the logits (fused loss); predict does."""
    examples = make_examples(8)
    dataset = Dataset.from_list(examples)
    _, token_loss, _ = full_batch_causal_lm(llama(), examples)
    trainer = TokenWeightedTrainer(model=llama(), args=train_args(tmp_path, 2, 1), data_collator=COLLATE)
    trainer.evaluate(dataset)  # resolves the objective (its fused-loss check asks for the projection too)
    assert trainer.objective.fused
    fused_forwards = []
    original = trainer.model.get_output_embeddings

    def spy():  # the fused path swaps the output projection for one forward: it asks for it every time
        fused_forwards.append(1)
        return original()

    trainer.model.get_output_embeddings = spy
    assert trainer.evaluate(dataset)["eval_loss"] == pytest.approx(token_loss, rel=1e-5)
    assert fused_forwards
    fused_forwards.clear()
    assert trainer.predict(dataset).predictions.shape[-1] == VOCAB and not fused_forwards  # logits: plain path
    trainer.args.prediction_loss_only = True
    output = trainer.predict(dataset)
    assert output.predictions is None and fused_forwards
    assert output.metrics["test_loss"] == pytest.approx(token_loss, rel=1e-5)


# ---- 2. plain nn.Modules returning a tensor or a tuple: compute_metrics sees their logits -------------------------
class TensorLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = llama()

    def forward(self, input_ids, attention_mask=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits


class TupleLM(TensorLM):
    def forward(self, input_ids, attention_mask=None):
        return (super().forward(input_ids, attention_mask),)


class PairLM(TensorLM):
    """Returns (logits, something else): stock hands compute_metrics both, as the model returned them."""

    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids, attention_mask), input_ids[:, 0].float()


@pytest.mark.parametrize("cls", [TensorLM, TupleLM, PairLM])
def test_compute_metrics_gets_a_plain_modules_logits(tmp_path, cls):
    examples = make_examples(8)
    model = cls()
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"rows": len(prediction.label_ids)}

    args = train_args(tmp_path, 2, 1, per_device_eval_batch_size=3, args_class=TokenWeightedArguments)
    args.objective = "causal_lm"
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        data_collator=COLLATE,
        compute_metrics=compute_metrics,
        eval_dataset=Dataset.from_list(examples),
    )
    metrics = trainer.evaluate()
    with torch.no_grad():
        batch = pad(examples)
        logits = model.inner(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    predictions = seen["predictions"]
    if cls is PairLM:
        assert isinstance(predictions, tuple) and len(predictions) == 2
        np.testing.assert_array_equal(predictions[1], batch["input_ids"][:, 0].float())
        predictions = predictions[0]
    assert predictions.shape == tuple(logits.shape)  # all 8 rows: none taken for a loss
    mask = batch["attention_mask"].bool().numpy()
    np.testing.assert_allclose(predictions[mask], logits.numpy()[mask], rtol=1e-4, atol=1e-5)
    assert metrics["eval_rows"] == 8
    _, token_loss, _ = full_batch_causal_lm(model, examples)
    assert metrics["eval_loss"] == pytest.approx(token_loss, rel=1e-5)


# ---- 3. compute_loss_func ---------------------------------------------------------------------------------------
def penalized_loss(outputs, labels, num_items_in_batch=None):
    """A custom loss that normalizes by num_items_in_batch, as transformers documents: CE + 0.5 * logsumexp**2."""
    logits, targets = outputs["logits"][:, :-1].float(), labels[:, 1:]
    mask = targets != -100
    ce = F.cross_entropy(logits[mask], targets[mask], reduction="sum")
    z = torch.logsumexp(logits[mask], dim=-1).pow(2).sum()
    total = ce + 0.5 * z
    return total / num_items_in_batch if num_items_in_batch is not None else total / mask.sum()


def test_compute_loss_func_is_honored_and_exact(tmp_path):
    examples = make_examples(8, seed=21)
    model = llama()
    batch = pad(examples)
    model.zero_grad()
    penalized_loss(
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]), batch["labels"]
    ).backward()
    reference = flat_grad(model)
    model.zero_grad()
    calls = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        calls.append(1)
        return penalized_loss(outputs, labels, num_items_in_batch)

    for bs, ga in [(2, 4), (1, 8)]:
        trainer, capture = run_trainer(
            TokenWeightedTrainer, model, examples, train_args(tmp_path, bs, ga), COLLATE, compute_loss_func=loss_func
        )
        assert relative_error(capture.grads[0], reference) <= TOL, (bs, ga)
    assert calls  # stock hfacc used to ignore it: called 0 times
    # Its own loss, not hfacc's cross-entropy, is what is logged; evaluation uses it too.
    with torch.no_grad():
        full = penalized_loss(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]), batch["labels"]
        )
    assert trainer.state.log_history[0]["loss"] == pytest.approx(full.item(), rel=1e-5)
    assert trainer.evaluate(Dataset.from_list(examples))["eval_loss"] == pytest.approx(full.item(), rel=1e-5)


def test_compute_loss_func_that_ignores_num_items_in_batch_is_refused_with_the_exact_alternative(tmp_path):
    def mean_loss(outputs, labels, num_items_in_batch=None):
        return ForCausalLMLoss(outputs["logits"], labels, VOCAB)  # no num_items_in_batch: a mean

    with pytest.raises(ValueError, match="does not divide by num_items_in_batch") as err:
        run_trainer(
            TokenWeightedTrainer,
            llama(),
            make_examples(8),
            train_args(tmp_path, 2, 4),
            COLLATE,
            compute_loss_func=mean_loss,
        )
    message = str(err.value)
    assert "hfacc.FunctionObjective(count_fn=" in message and "ForCausalLMLoss" in message
    assert callable(hfacc.FunctionObjective)  # the alternative it names exists


def test_a_function_objective_evaluates(tmp_path):
    """FunctionObjective has no per-sequence sums; evaluation used to ask it for them and fail."""
    examples = make_examples(8, seed=26)
    objective = hfacc.FunctionObjective(
        count_fn=lambda batch: (batch["labels"][:, 1:] != -100).sum(),
        loss_fn=lambda outputs, batch: hfacc.causal_lm_sums(outputs.logits, batch["labels"]).loss,
    )
    trainer = TokenWeightedTrainer(
        model=llama(), args=train_args(tmp_path, 2, 1), data_collator=COLLATE, objective=objective
    )
    _, token_loss, _ = full_batch_causal_lm(llama(), examples)
    metrics = trainer.evaluate(Dataset.from_list(examples))
    assert metrics["eval_loss"] == pytest.approx(token_loss, rel=1e-5)


def test_compute_loss_func_and_an_objective_are_not_both_taken(tmp_path):
    with pytest.raises(ValueError, match="either compute_loss_func or an hfacc Objective"):
        TokenWeightedTrainer(
            model=llama(),
            args=train_args(tmp_path, 2, 4),
            compute_loss_func=penalized_loss,
            objective=hfacc.CausalLMObjective(),
        )


# ---- 4. PEFT prompt tuning and prefix tuning ----------------------------------------------------------------------
def peft_model(kind):
    from peft import PrefixTuningConfig, PromptTuningConfig, get_peft_model

    config = {
        "prompt": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
        "prefix": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5),
    }[kind]
    torch.manual_seed(0)
    return get_peft_model(llama(), config)


def peft_reference(model, examples, kind):
    """Two references: PEFT's own loss on the whole batch, and one computed here from the logits by hand."""
    batch = pad(examples)
    model.zero_grad()
    model(**batch).loss.backward()
    own = flat_grad(model)
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    virtual = logits.shape[1] - batch["labels"].shape[1]
    assert virtual == (5 if kind == "prompt" else 0)
    # Position i of the row [virtual tokens, inputs] predicts token i + 1; virtual tokens carry label -100.
    labels = F.pad(batch["labels"], (virtual, 0), value=-100)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100).backward()
    by_hand = flat_grad(model)
    model.zero_grad()
    return own, by_hand


@pytest.mark.parametrize(
    "kind,fused,splits", [("prompt", True, [(2, 4), (1, 8)]), ("prompt", False, [(2, 4)]), ("prefix", True, [(1, 8)])]
)
def test_peft_prompt_learning_is_exact(tmp_path, kind, fused, splits):
    examples = make_examples(8, seed=22)
    for e in examples[:3]:  # text-style rows: the first token is a target too (of the last virtual token)
        e["labels"] = list(e["input_ids"])
    model = peft_model(kind)
    own, by_hand = peft_reference(model, examples, kind)
    assert relative_error(by_hand, own) <= TOL
    for bs, ga in splits:
        args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, fused_loss=fused)
        trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
        assert relative_error(capture.grads[0], own) <= TOL, (bs, ga)
        assert trainer.objective.fused is fused
    expected = sum(
        sum(1 for y in e["labels"][1:] if y != -100) + (kind == "prompt" and e["labels"][0] != -100) for e in examples
    )
    assert trainer.state.log_history[0]["num_targets"] == expected


# ---- 5. a plain module's [B, T] labels are never guessed silently --------------------------------------------------
class Tagger(nn.Module):
    """A token tagger built from scratch: label i belongs to position i (no shift)."""

    def __init__(self, num_tags=5):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, num_tags)

    def forward(self, input_ids, attention_mask=None):
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def tagged_examples(n=8, seed=23):
    examples = make_examples(n, seed=seed)
    for e in examples:
        e["labels"] = [(x * 7) % 5 if i % 3 else -100 for i, x in enumerate(e["input_ids"])]
    return examples


def test_a_taggers_aligned_labels_are_not_guessed(tmp_path):
    examples = tagged_examples()
    with pytest.raises(ValueError, match="objective='token'"):
        run_trainer(TokenWeightedTrainer, Tagger(), examples, train_args(tmp_path, 2, 4), COLLATE)
    model = Tagger()
    batch = pad(examples)
    F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).backward()
    reference = flat_grad(model)
    model.zero_grad()
    args = train_args(tmp_path, 2, 4, args_class=TokenWeightedArguments, objective="token")
    _, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert relative_error(capture.grads[0], reference) <= TOL


def test_a_plain_language_models_labels_are_taken_as_causal_and_said_at_warning(tmp_path, caplog):
    examples = make_examples(8, seed=24)
    model = PlainLM(llama())
    reference, _, _ = full_batch_causal_lm(model, examples)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        _, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    assert relative_error(capture.grads[0], reference) <= TOL
    said = [r for r in caplog.records if "taken as causal-LM labels" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "objective='causal_lm'" in said[0].getMessage()


# ---- 8. the audit's tolerance follows the precision ---------------------------------------------------------------
def audited_run(tmp_path, caplog, **overrides):
    from hfacc.training.audit import AccumulationAuditCallback

    examples = make_examples(16, seed=25)
    model = overrides.pop("model", None) or llama()
    args = train_args(
        tmp_path,
        2,
        4,
        args_class=TokenWeightedArguments,
        audit_every_n_steps=1,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        **overrides,
    )
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer, _ = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    audit = next(c for c in trainer.callback_handler.callbacks if isinstance(c, AccumulationAuditCallback))
    warnings = [r for r in caplog.records if "differs from a per-example recomputation" in r.getMessage()]
    return audit, warnings


def test_audit_tolerance_by_precision():
    from hfacc.training.audit import get_audit_tolerance

    assert get_audit_tolerance(torch.float32) == 1e-4
    assert get_audit_tolerance(torch.bfloat16) == pytest.approx(4 * 2**-7)  # 3.1e-2
    assert get_audit_tolerance(torch.float16) == pytest.approx(4 * 2**-10)  # 3.9e-3


def test_bf16_audit_of_an_exact_setup_stays_quiet(tmp_path, caplog):
    audit, warnings = audited_run(tmp_path, caplog, bf16=True)
    errors = [e for _, e in audit.errors]
    assert len(errors) == 2 and audit.tolerance == pytest.approx(4 * 2**-7)
    # bf16 rounding (measured 1.7e-3 to 2.3e-3 here) is well above fp32's 1e-4 and well below the tolerance.
    assert all(1e-4 < e < audit.tolerance / 4 for e in errors), errors
    assert not warnings


def test_bf16_audit_still_catches_what_breaks_equivalence(tmp_path, caplog):
    model = build_tiny_llama(vocab_size=VOCAB, attention_dropout=0.5)
    audit, warnings = audited_run(tmp_path, caplog, bf16=True, model=model)
    assert all(e > audit.tolerance for _, e in audit.errors) and len(warnings) == len(audit.errors) == 2


def test_fp32_audit_keeps_its_tolerance(tmp_path, caplog):
    audit, warnings = audited_run(tmp_path, caplog)
    assert audit.tolerance == 1e-4 and all(e < 1e-6 for _, e in audit.errors) and not warnings


# ---- 11. the names the README and the error messages use exist ---------------------------------------------------
def test_readme_imports_and_public_api():
    from hfacc import build_sft_dataset, get_tokenizer  # the README's first code block starts with these

    assert callable(build_sft_dataset) and callable(get_tokenizer)
    assert all(hasattr(hfacc, name) for name in hfacc.__all__)
    with pytest.raises(ValueError) as err:
        DataCollatorForCausalLM(pad_token_id=None)
    for name in re.findall(r"hfacc\.(\w+)", str(err.value)):
        assert hasattr(hfacc, name), f"the collator's error names hfacc.{name}, which does not exist"


# ---- 9, 10. two ranks: the last uneven window, and the checkpoint marker ----------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import json
    import subprocess

    from tests.helpers import ROOT, torchrun

    out = tmp_path_factory.mktemp("dropin") / "results.json"
    proc = subprocess.run(
        torchrun("tests/dropin_distributed_check.py", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["world_size"] == 2
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["hfacc bs1 ga4 n9", "hfacc bs2 ga2 n11", "hfacc token budget"])
def test_the_last_uneven_window_is_the_mean_over_its_real_examples(two_ranks, case):
    r = two_ranks[case]
    assert r["steps"] == len(r["windows"]) >= 2
    assert max(r["grad_errors"]) <= TOL, r["grad_errors"]
    assert r["num_targets"] == r["reference_targets"]  # the repeated examples are not counted
    assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)


@pytest.mark.distributed
def test_stock_trainer_trains_the_repeated_examples(two_ranks):
    """What accelerate's even_batches does to stock Trainer: its last window is off, the full ones are exact."""
    errors = two_ranks["stock bs1 ga4 n9"]["grad_errors"]
    assert errors[0] <= TOL and errors[-1] > 0.1


@pytest.mark.distributed
def test_checkpoint_marker_waits_for_every_ranks_files(two_ranks):
    r = two_ranks["marker"]
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= set(r["marker_files"])
    assert set(r["marker_files"]) == set(r["files"]) - {"checkpoint_complete.json"}


@pytest.mark.distributed
def test_evaluate_before_train_keeps_the_gradients_all_reduced(two_ranks):
    """Stock Trainer (transformers 5.24) trains each rank on its own gradient after an evaluate(): error 1.03."""
    r = two_ranks["evaluate first"]
    assert r["wrapper"] == "DistributedDataParallel" and r["grad_error"] <= TOL


@pytest.mark.distributed
@pytest.mark.parametrize("loss", ["hfacc", "compute_loss_func"])
def test_evaluation_on_two_ranks_counts_each_example_once(two_ranks, loss):
    r = two_ranks["evaluation"]
    assert r[loss]["num_targets"] == r["reference_targets"]
    assert r[loss]["loss"] == pytest.approx(r["reference"], rel=1e-5)
