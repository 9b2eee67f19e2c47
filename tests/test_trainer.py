"""TokenWeightedTrainer against a hand-computed full-batch reference (fp32, relative L2 error <= 1e-6).

Every run uses learning rate 0 and no clipping, so the gradient captured before each optimizer step is the gradient
of that window at the initial weights, whatever the optimizer.
"""

import logging
from unittest import mock

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import Trainer

from hfacc import (
    DataCollatorForCausalLM,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    accumulation_window,
    build_tiny_llama,
    causal_lm_sums,
    get_gradient_scale,
    iter_windows,
)
from tests.helpers import (
    VOCAB,
    KwargsLM,
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
SPLITS = [(8, 1), (2, 4), (1, 8)]


def build_model(kind: str):
    llama = build_tiny_llama(vocab_size=VOCAB)
    return {"llama": llama, "plain": PlainLM(llama), "kwargs": KwargsLM(llama)}[kind]


@pytest.mark.parametrize("kind", ["llama", "plain", "kwargs"])
@pytest.mark.parametrize("bs,ga", SPLITS)
def test_accumulated_gradient_equals_the_full_batch(tmp_path, kind, bs, ga):
    examples = make_examples(8)
    model = build_model(kind)
    reference, token_loss, accuracy = full_batch_causal_lm(model, examples)
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, bs, ga), COLLATE)
    assert len(capture.grads) == 1
    assert relative_error(capture.grads[0], reference) <= TOL
    log = trainer.state.log_history[0]
    assert log["loss"] == pytest.approx(token_loss, rel=1e-5)
    assert log["token_accuracy"] == pytest.approx(accuracy, rel=1e-5)
    assert log["num_targets"] == sum((torch.tensor(e["labels"][1:]) != -100).sum().item() for e in examples)
    assert log["target_tokens_per_second"] > 0


@pytest.mark.parametrize("kind,at_least", [("plain", 0.1), ("kwargs", 2.0)])
def test_stock_trainer_is_wrong_on_the_same_data(tmp_path, kind, at_least):
    """The difference hfacc makes: stock Trainer's error on custom models (the README quotes these numbers)."""
    examples = make_examples(8)
    model = build_model(kind)
    reference, _, _ = full_batch_causal_lm(model, examples)
    _, stock = run_trainer(Trainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    _, ours = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    assert relative_error(stock.grads[0], reference) > at_least
    assert relative_error(ours.grads[0], reference) <= TOL


def test_short_last_window_is_normalized_by_its_own_count(tmp_path):
    examples = make_examples(10, seed=3)
    model = build_model("llama")
    first, _, _ = full_batch_causal_lm(model, examples[:8])
    last, _, _ = full_batch_causal_lm(model, examples[8:])
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    assert len(capture.grads) == 2
    assert relative_error(capture.grads[0], first) <= TOL
    assert relative_error(capture.grads[1], last) <= TOL


def test_logged_loss_is_token_weighted_across_windows(tmp_path):
    examples = make_examples(16, seed=4)
    model = build_model("llama")
    _, token_loss, accuracy = full_batch_causal_lm(model, examples)
    args = train_args(tmp_path, 2, 4, logging_steps=2)
    trainer, _ = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    step_log = [h for h in trainer.state.log_history if "loss" in h][0]
    assert step_log["step"] == 2
    assert step_log["loss"] == pytest.approx(token_loss, rel=1e-5)  # not the mean of the two windows' means
    assert step_log["token_accuracy"] == pytest.approx(accuracy, rel=1e-5)
    final = trainer.state.log_history[-1]
    assert final["train_loss"] == pytest.approx(token_loss, rel=1e-5)


def test_peft_lora_model(tmp_path):
    from peft import LoraConfig, get_peft_model

    examples = make_examples(8, seed=5)
    model = get_peft_model(build_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    # LoRA's B starts at zero, which would make every A-gradient zero: give it values.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    reference, _, _ = full_batch_causal_lm(model, examples)
    _, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    assert relative_error(capture.grads[0], reference) <= TOL


def test_label_smoothing(tmp_path):
    examples = make_examples(8, seed=6)
    model = build_model("llama")
    reference, _, _ = full_batch_causal_lm(model, examples, label_smoothing=0.1)
    args = train_args(tmp_path, 1, 8, label_smoothing_factor=0.1)
    _, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert relative_error(capture.grads[0], reference) <= TOL


@pytest.mark.parametrize("bs,ga", [(2, 4), (1, 8)])
def test_sequence_normalization(tmp_path, bs, ga):
    examples = make_examples(8, seed=7)
    examples[3]["labels"] = [-100] * len(examples[3]["labels"])  # a sequence without targets does not count
    model = build_model("llama")
    reference, _, _ = full_batch_causal_lm(model, examples, mode="sequence")
    args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, normalization="sequence")
    _, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert relative_error(capture.grads[0], reference) <= TOL


def test_micro_batch_normalization_is_the_mean_of_micro_batch_means(tmp_path):
    examples = make_examples(8, seed=8)
    model = build_model("llama")
    # Its own full-batch definition: the mean over the 4 micro-batches of each one's token mean.
    model.zero_grad()
    parts = [examples[i : i + 2] for i in range(0, 8, 2)]
    for part in parts:
        batch = pad(part)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sums = causal_lm_sums(logits, batch["labels"])
        (sums.loss / sums.count / len(parts)).backward()
    reference = flat_grad(model)
    model.zero_grad()
    args = train_args(tmp_path, 2, 4, args_class=TokenWeightedArguments, normalization="micro_batch")
    _, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert relative_error(capture.grads[0], reference) <= TOL
    token_reference, _, _ = full_batch_causal_lm(model, examples)
    assert relative_error(capture.grads[0], token_reference) > 1e-3  # it is a different objective


def test_all_masked_window_changes_nothing_and_warns(tmp_path, caplog):
    examples = make_examples(8, seed=9)
    masked = [{**e, "labels": [-100] * len(e["labels"])} for e in make_examples(8, seed=10)]
    model = build_model("llama")
    args = train_args(tmp_path, 2, 4, learning_rate=1e-2, weight_decay=0.1, logging_steps=1)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer, capture = run_trainer(
            TokenWeightedTrainer,
            model,
            examples + masked,
            args,
            COLLATE,
        )
    # After window 1 (real targets) the weights moved; window 2 (no targets) must leave them exactly as they were.
    assert len(capture.grads) == 2 and capture.grads[1].abs().max() == 0
    after_first = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.isfinite(p).all() for p in after_first.values())
    assert "no target in the whole window" in caplog.text
    logs = [h for h in trainer.state.log_history if "num_targets" in h]
    assert len(logs) == 2 and logs[1]["num_targets"] == 0 and "loss" not in logs[1]  # no NaN loss is logged
    # Re-run only the first window: the weights must be identical to the two-window run.
    fresh = build_model("llama")
    run_trainer(
        TokenWeightedTrainer,
        fresh,
        examples,
        train_args(tmp_path, 2, 4, learning_rate=1e-2, weight_decay=0.1),
        COLLATE,
    )
    for n, p in fresh.named_parameters():
        assert torch.equal(p, after_first[n]), n


def test_custom_loop_helper_matches_the_full_batch():
    examples = make_examples(8, seed=11)
    model = build_model("llama")
    reference, _, _ = full_batch_causal_lm(model, examples)
    # The Accelerator's own accumulation setting must not matter: the helper undoes accelerator.backward's division.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    prepared = accelerator.prepare(model)
    micro_batches = [COLLATE(examples[i : i + 2]) for i in range(0, 8, 2)]
    for batches in iter_windows(micro_batches, 4):
        for mb in accumulation_window(accelerator, prepared, batches):
            with mb.sync():
                logits = prepared(input_ids=mb.batch["input_ids"], attention_mask=mb.batch["attention_mask"]).logits
                accelerator.backward(mb.scale(causal_lm_sums(logits, mb.batch["labels"])))
    assert relative_error(flat_grad(model), reference) <= TOL
    assert [len(w) for w in iter_windows(range(10), 4)] == [4, 4, 2]


@pytest.mark.parametrize(
    "dtype,processes,expected",
    [
        (DistributedType.NO, 1, 1),
        (DistributedType.MULTI_CPU, 2, 2),
        (DistributedType.MULTI_GPU, 8, 8),
        (DistributedType.FSDP, 4, 4),
        (DistributedType.DEEPSPEED, 4, 4),
    ],
)
def test_gradient_scale_cancels_every_backends_average(dtype, processes, expected):
    assert get_gradient_scale(dtype, processes) == expected


def test_megatron_is_refused():
    with pytest.raises(NotImplementedError):
        get_gradient_scale(DistributedType.MEGATRON_LM, 2)


def test_deepspeed_backward_does_not_divide_by_accumulation_steps(tmp_path):
    """Under DeepSpeed the engine divides by GA unless told not to: the Trainer must pass scale_wrt_gas=False."""
    examples = make_examples(4, seed=12)
    model = build_model("llama")
    trainer = TokenWeightedTrainer(model=model, args=train_args(tmp_path, 2, 2), data_collator=COLLATE)
    batches = [COLLATE(examples[:2]), COLLATE(examples[2:])]
    trainer.window = trainer.open_window(batches, torch.device("cpu"))
    seen = {}

    def fake_backward(loss, **kwargs):
        seen.update(kwargs, loss=loss.detach())

    with (
        mock.patch.object(
            type(trainer.accelerator),
            "distributed_type",
            new_callable=mock.PropertyMock,
            return_value=DistributedType.DEEPSPEED,
        ),
        mock.patch.object(trainer.accelerator, "backward", side_effect=fake_backward),
    ):
        trainer.training_step(trainer.model, batches[0])
    assert seen["scale_wrt_gas"] is False
    sums = causal_lm_sums(model(**{k: v for k, v in batches[0].items() if k != "labels"}).logits, batches[0]["labels"])
    assert seen["loss"].item() == pytest.approx(sums.loss.item() / trainer.window.num_targets, rel=1e-6)


def test_invalid_settings_name_the_field():
    with pytest.raises(ValueError, match="normalization"):
        TokenWeightedArguments(output_dir="x", normalization="mean")
    with pytest.raises(ValueError, match="objective"):
        TokenWeightedArguments(output_dir="x", objective="ctc")


def test_plain_training_arguments_are_converted_once(tmp_path):
    """A plain TrainingArguments becomes TokenWeightedArguments with every field kept and hfacc's defaults added."""
    import dataclasses

    from transformers import Seq2SeqTrainingArguments

    plain = train_args(tmp_path, 2, 3, label_smoothing_factor=0.1, lr_scheduler_type="cosine", optim="sgd")
    trainer = TokenWeightedTrainer(model=build_tiny_llama(vocab_size=VOCAB), args=plain, data_collator=COLLATE)
    assert type(trainer.args) is TokenWeightedArguments
    assert all(getattr(trainer.args, f.name) == getattr(plain, f.name) for f in dataclasses.fields(plain))
    defaults = TokenWeightedArguments(output_dir=str(tmp_path))
    assert (trainer.args.normalization, trainer.args.max_skipped_steps) == (defaults.normalization, 10)
    seq2seq = Seq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True, use_cpu=True, report_to=[])
    converted = TokenWeightedTrainer(model=build_tiny_llama(vocab_size=VOCAB), args=seq2seq).args
    assert isinstance(converted, Seq2SeqTrainingArguments) and isinstance(converted, TokenWeightedArguments)
    assert converted.predict_with_generate and converted.fused_loss
