"""Padding-free micro-batches: the same sequences in one row, the same targets, the same gradient as padded."""

import logging

import pytest
import torch
import transformers as T

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama
from hfacc.loss import shift_labels
from hfacc.objectives import CausalLMObjective, SequenceClassificationObjective
from hfacc.padding_free import check_padding_free, padding_free_problem, remove_padding, uses_one_row
from tests.helpers import (
    VOCAB,
    flat_grad,
    full_batch_causal_lm,
    make_examples,
    pad,
    relative_error,
    run_trainer,
    train_args,
)

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


def left_pad(examples):
    batch = pad(examples)
    for value in batch.values():
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            value[i] = torch.roll(value[i], value.shape[1] - n)
    return batch


def test_right_and_left_padding_give_the_same_row_and_targets():
    examples = make_examples(4, seed=1)
    right, left = pad(examples), left_pad(examples)
    rows = [remove_padding(b) for b in (right, left)]
    concatenated = [t for e in examples for t in e["input_ids"]]
    for row in rows:
        assert set(row) == {"input_ids", "labels", "position_ids", "sequence_ids", "num_sequences"}
        assert row["input_ids"][0].tolist() == concatenated
        assert row["position_ids"][0].tolist() == [p for e in examples for p in range(len(e["input_ids"]))]
    # The targets of the row are those of the padded batch, position by position of the real tokens.
    for batch, row in zip((right, left), rows, strict=True):
        padded = shift_labels(batch["labels"], attention_mask=batch["attention_mask"])
        unpadded = shift_labels(row["labels"], position_ids=row["position_ids"])
        assert unpadded[0].tolist() == padded[batch["attention_mask"].bool()].tolist()


def test_rows_as_wide_as_the_longest_sequence_for_dense_attention():
    examples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (6, 2, 3, 4, 1)]
    batch = pad(examples)
    rows = remove_padding(batch, one_row=False)
    # Best-fit decreasing into rows of 6: [6] [4 2] [3 1 + one filler]; the filler is a sequence of its own.
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 1, 2], [1, 2, 3, 1, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1]]
    assert rows["sequence_ids"].tolist() == [[0] * 6, [3] * 4 + [1] * 2, [2] * 3 + [4] + [-1] * 2]
    assert rows["labels"][2, 4:].tolist() == [-100, -100]
    targets = CausalLMObjective()._targets(rows)
    assert (
        sorted(targets[targets != -100].tolist())
        == sorted(shift_labels(batch["labels"], attention_mask=batch["attention_mask"]).flatten().tolist())[
            5 * 6 - 11 :
        ]
    )  # the same 11 targets (5 sequences of 16 tokens)
    per_sequence = CausalLMObjective().count(rows)
    assert per_sequence.tolist() == CausalLMObjective().count(batch).tolist() == [11, 4]


def test_batches_that_cannot_be_laid_out_in_one_row_stay_padded():
    batch = pad(make_examples(3, seed=2))
    assert remove_padding({k: v for k, v in batch.items() if k != "attention_mask"}) is None
    holes = {**batch, "attention_mask": batch["attention_mask"].clone()}
    holes["attention_mask"][0, 1] = 0  # a masked token inside a sequence: the row would close the gap
    assert remove_padding(holes) is None
    empty = {**batch, "attention_mask": batch["attention_mask"].clone()}
    empty["attention_mask"][1] = 0
    assert remove_padding(empty) is None
    assert remove_padding({**batch, "per_example_weights": torch.zeros(3, 3, 8, 8)}) is None
    # Images are not per token either, but the model takes them in the order of their tokens: kept (test_vision.py).
    assert remove_padding({**batch, "pixel_values": torch.zeros(3, 3, 8, 8)})["pixel_values"].shape == (3, 3, 8, 8)
    # Positions of its own that do not count from each sequence's first token (left padding, absolute positions).
    left = left_pad(make_examples(3, seed=2))
    arange = torch.arange(left["input_ids"].shape[1]).expand_as(left["input_ids"])
    assert remove_padding({**left, "position_ids": arange}) is None
    assert remove_padding({**pad(make_examples(3, seed=2)), "position_ids": arange}) is not None  # right: same


def tiny_config(family):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return {
        "llama": lambda: T.LlamaConfig(**common),
        "qwen2": lambda: T.Qwen2Config(**common),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=8),
        "mistral": lambda: T.MistralConfig(**common, sliding_window=8),  # packed sequences longer than the window
        "gemma": lambda: T.GemmaConfig(**common, head_dim=8),
        "gemma2": lambda: T.Gemma2Config(**common, head_dim=8, sliding_window=8),
        "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=8, sliding_window=8),
        "phi3": lambda: T.Phi3Config(**common, pad_token_id=0),
        "gpt_neox": lambda: T.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"}),
    }[family]()


def gradient(model, batch, fused=False, per_sequence=False):
    model.zero_grad()
    _, sums = CausalLMObjective(fused=fused)(model, batch, per_sequence=per_sequence)
    loss = (sums.loss / sums.count.clamp(min=1)).sum() if per_sequence else sums.loss / sums.count
    loss.backward()
    return flat_grad(model)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "gpt_neox"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_the_padded_gradient(family):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family)).float()
    examples = make_examples(5, seed=3, lengths=(5, 30))
    assert check_padding_free(model, pad(examples)) is None
    # (side, fused loss, per-sequence sums, one row or rows of the longest sequence)
    cases = [("right", False, False, True), ("left", True, False, False), ("right", False, True, False)]
    for side, fused, per_sequence, one_row in cases:
        batch = pad(examples) if side == "right" else left_pad(examples)
        padded = gradient(model, batch, fused, per_sequence)
        unpadded = gradient(model, remove_padding(batch, one_row), fused, per_sequence)
        assert relative_error(unpadded, padded) <= 1e-6, (family, side, fused, per_sequence, one_row)


def record_inputs(model):
    """Shape of input_ids and whether an attention_mask came, for every forward of the decoder."""
    seen = []

    def hook(module, args, kwargs):
        seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask") is not None))

    return seen, model.model.register_forward_pre_hook(hook, with_kwargs=True)


def test_one_row_for_variable_length_kernels_rows_for_dense_masks():
    model = build_tiny_llama(vocab_size=VOCAB)
    assert not uses_one_row(model)  # sdpa
    for implementation, one_row in [("flash_attention_2", True), ("flex_attention", True), ("eager", False)]:
        model.config._attn_implementation = implementation
        assert uses_one_row(model) is one_row


@pytest.mark.parametrize("layout", ["rows", "one_row"])
def test_trainer_is_padding_free_by_default_and_exact(tmp_path, caplog, monkeypatch, layout):
    if layout == "one_row":  # what flash/flex attention get (neither runs backward on this CPU); sdpa is exact too
        monkeypatch.setattr("hfacc.padding_free.uses_one_row", lambda model: True)
    examples = make_examples(16, seed=4)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, token_loss, accuracy = full_batch_causal_lm(model, examples)
    seen, _ = record_inputs(model)
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 8, 2), COLLATE)
    assert trainer.padding_free and "padding-free micro-batches" in caplog.text
    training = seen[-2:]  # after the start-up checks: no attention_mask, no padding
    assert not any(masked for _, masked in training)
    micro_batches = (examples[:8], examples[8:])
    if layout == "one_row":  # variable-length kernels: one row of the real tokens
        assert [shape for shape, _ in training] == [(1, sum(len(e["input_ids"]) for e in b)) for b in micro_batches]
    else:  # dense masks: rows as wide as the longest sequence, fewer positions than padded
        padded = [len(b) * max(len(e["input_ids"]) for e in b) for b in micro_batches]
        assert all(r * w < p for ((r, w), _), p in zip(training, padded, strict=True))
    assert relative_error(capture.grads[0], reference) <= 1e-6
    log = trainer.state.log_history[0]
    assert log["loss"] == pytest.approx(token_loss, rel=1e-5)
    assert log["token_accuracy"] == pytest.approx(accuracy, rel=1e-5)


def word_tokenizer(padding_side):
    from tokenizers import Tokenizer, models

    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", unk_token="t1")
    tokenizer.padding_side = padding_side
    return tokenizer


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_transformers_collator_padding_either_side_with_lora_and_checkpointing(tmp_path, padding_side):
    """The user's own collator (transformers' DataCollatorForSeq2Seq pads labels with -100), a LoRA model, and
    gradient checkpointing: the update is the one big batch's."""
    from peft import LoraConfig, get_peft_model

    examples = make_examples(8, seed=5)
    model = get_peft_model(
        build_tiny_llama(vocab_size=VOCAB), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    reference, _, _ = full_batch_causal_lm(model, examples)
    collator = T.DataCollatorForSeq2Seq(word_tokenizer(padding_side), padding=True)
    args = train_args(
        tmp_path,
        4,
        2,
        args_class=TokenWeightedArguments,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
    )
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, collator)
    assert model.get_base_model().model.gradient_checkpointing
    assert trainer.padding_free and trainer.objective.fused  # the fused loss takes the unpadded row
    assert relative_error(capture.grads[0], reference) <= 1e-6


def test_sequence_normalization_stays_exact(tmp_path):
    examples = make_examples(8, seed=6)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, _, _ = full_batch_causal_lm(model, examples, mode="sequence")
    args = train_args(tmp_path, 4, 2, args_class=TokenWeightedArguments, normalization="sequence")
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert trainer.padding_free and relative_error(capture.grads[0], reference) <= 1e-6


def test_evaluation_takes_the_same_path_unless_logits_are_wanted(tmp_path):
    from datasets import Dataset

    examples = make_examples(10, seed=7)
    model = build_tiny_llama(vocab_size=VOCAB)
    _, token_loss, accuracy = full_batch_causal_lm(model, examples)
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=4)
    trainer, _ = run_trainer(TokenWeightedTrainer, model, examples[:2], args, COLLATE)
    seen, hook = record_inputs(model)
    metrics = trainer.evaluate(Dataset.from_list(examples))
    assert metrics["eval_loss"] == pytest.approx(token_loss, rel=1e-5)
    assert metrics["eval_token_accuracy"] == pytest.approx(accuracy, rel=1e-5)
    assert len(seen) == 3 and not any(masked for _, masked in seen)
    seen.clear()
    trainer.compute_metrics = lambda prediction: {}  # compute_metrics reads logits per padded position
    metrics = trainer.evaluate(Dataset.from_list(examples))
    hook.remove()
    assert metrics["eval_loss"] == pytest.approx(token_loss, rel=1e-5)
    assert [shape[0] for shape, masked in seen if masked] == [4, 4, 2]


class IgnoresPositions(torch.nn.Module):
    """Takes position_ids but drops them: packed sequences then attend to each other."""

    def __init__(self):
        super().__init__()
        self.inner = build_tiny_llama(vocab_size=VOCAB)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def tiny_bloom():
    torch.manual_seed(0)
    return T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4))


@pytest.mark.parametrize("kind", ["bloom", "ignores_positions"])
def test_models_that_cannot_go_padding_free_train_padded_and_say_so_once(tmp_path, caplog, kind):
    examples = make_examples(8, seed=8)
    model = tiny_bloom() if kind == "bloom" else IgnoresPositions()
    reference, _, _ = full_batch_causal_lm(model, examples)
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 4, 2), COLLATE)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "padded micro-batches" in r.message]
    assert not trainer.padding_free and len(warnings) == 1 and "padding_free=False" in warnings[0].message
    expected = "takes no position_ids" if kind == "bloom" else "differ from the padded ones"
    assert expected in warnings[0].message
    assert relative_error(capture.grads[0], reference) <= 1e-6


def test_heads_other_than_causal_lm_and_the_setting(tmp_path, caplog):
    model = build_tiny_llama(vocab_size=VOCAB)
    assert "does not support padding-free" in padding_free_problem(model, SequenceClassificationObjective())
    assert padding_free_problem(model, CausalLMObjective()) is None
    examples = make_examples(4, seed=9)
    args = train_args(tmp_path, 4, 1, args_class=TokenWeightedArguments, padding_free=False)
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer, _ = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert not trainer.padding_free and "padded micro-batches" not in caplog.text


def test_rows_packed_by_transformers_flattening_collator(tmp_path):
    """transformers' own padding-free collator (DataCollatorWithFlattening): one row, restarting position_ids."""
    examples = make_examples(8, seed=10)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, token_loss, _ = full_batch_causal_lm(model, examples)
    collator = T.DataCollatorWithFlattening()
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 4, 2), collator)
    assert relative_error(capture.grads[0], reference) <= 1e-6
    assert trainer.state.log_history[0]["loss"] == pytest.approx(token_loss, rel=1e-5)


def test_labels_left_on_padding_are_not_targets_and_it_is_said(tmp_path, caplog):
    """A collator that copies input_ids (padding included) into labels: padding is never a target, padded or
    padding-free, so both give the big batch's update; the user hears about it once."""

    def copies_padding_into_labels(rows):
        batch = COLLATE(rows)
        batch["labels"] = torch.where(batch["attention_mask"] == 1, batch["labels"], batch["input_ids"])
        return batch

    examples = make_examples(8, seed=11)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, _, _ = full_batch_causal_lm(model, examples)
    for padding_free in (True, False):
        args = train_args(tmp_path, 4, 2, args_class=TokenWeightedArguments, padding_free=padding_free)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hfacc"):
            _, capture = run_trainer(TokenWeightedTrainer, model, examples, args, copies_padding_into_labels)
        assert caplog.text.count("labels at padding positions") == 1
        assert relative_error(capture.grads[0], reference) <= 1e-6
