"""Padding-free micro-batches: the same sequences in one row, the same targets, the same gradient as padded."""

import dataclasses
import logging

import pytest
import torch
import transformers as T

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama
from hfacc.data.padding_free import remove_padding
from hfacc.objectives import CausalLMObjective, SequenceClassificationObjective
from hfacc.ops.loss import shift_labels
from hfacc.ops.model_io import get_aux_loss
from hfacc.setup.layout_check import check_padding_free, check_row_offsets, padding_free_problem, uses_one_row
from tests.helpers import (
    VOCAB,
    build_family,
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
        assert set(row) == {"input_ids", "labels", "position_ids", "sequence_ids", "num_sequences", "padded_index"}
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
    # Best-fit decreasing into rows of 6: [6] [4 2] [3 1 + one filler]; the filler is a sequence of its own, made of
    # a real token (the batch's first, 1), not padding.
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 1, 2], [1, 2, 3, 1, 1, 1]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1]]
    assert rows["sequence_ids"].tolist() == [[0] * 6, [3] * 4 + [1] * 2, [2] * 3 + [4] + [-1] * 2]
    assert rows["labels"][2, 4:].tolist() == [-100, -100]
    assert rows["padded_index"][2].tolist() == [2 * 6, 2 * 6 + 1, 2 * 6 + 2, 4 * 6, 0, 0]
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
        # Scales its input embeddings in place (by sqrt(d_model)): the check's gradient probe must not be a leaf.
        "ctrl": lambda: T.CTRLConfig(
            vocab_size=VOCAB, n_embd=32, dff=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0, embd_pdrop=0
        ),
    }[family]()


def gradient(model, batch, fused=False, per_sequence=False):
    model.zero_grad()
    _, sums = CausalLMObjective(fused=fused)(model, batch, per_sequence=per_sequence)
    loss = (sums.loss / sums.count.clamp(min=1)).sum() if per_sequence else sums.loss / sums.count
    loss.backward()
    return flat_grad(model)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3", "gpt_neox", "ctrl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_the_padded_gradient(family):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family)).float()
    examples = make_examples(5, seed=3, lengths=(5, 30))
    assert check_padding_free(model, pad(examples)) is None
    # (side, fused loss, per-sequence sums, one row or rows of the longest sequence)
    cases = [("right", False, False, True), ("left", True, False, False), ("right", False, True, False)]
    if family == "ctrl":  # absolute positions from the row's first column, padding included: left padding moves them
        assert "its logits by" in check_padding_free(model, left_pad(examples))  # so left-padded data stays padded
        cases = [("right", *case[1:]) for case in cases]
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
        monkeypatch.setattr("hfacc.setup.layout_check.uses_one_row", lambda model: True)
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
    # Newer transformers renamed gradient_checkpointing (kept as a deprecated alias); 5.19 (vLLM's) has the old name.
    name = next(f.name for f in dataclasses.fields(TokenWeightedArguments) if f.name.endswith("_checkpointing"))
    checkpointing = {name: True, f"{name}_kwargs": {"use_reentrant": False}}
    args = train_args(tmp_path, 4, 2, args_class=TokenWeightedArguments, **checkpointing)
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
    expected = "takes no position_ids" if kind == "bloom" else "not what the padded run computes"
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


# ---- families whose exactness no signature shows: a router loss, convolutions and scans, the row index ------------
ROUTED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe"]


def padded_reference(model, examples, bs):
    """Plain torch, the padded path: sum over micro-batches j of S_j / N + router_aux_loss_coef * aux_j / k."""
    model.zero_grad()
    batches = [pad(examples[i : i + bs]) for i in range(0, len(examples), bs)]
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for b in batches:
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
        logits, targets = out.logits[:, :-1].float(), b["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / total
        if out.get("aux_loss") is not None:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss / len(batches)
        loss.backward()
    return flat_grad(model)


def micro_batch_gradient(model, batch):
    """The gradient of one micro-batch's mean loss plus its router loss, in whatever layout ``batch`` is."""
    model.zero_grad()
    outputs, sums = CausalLMObjective()(model, batch)
    aux = get_aux_loss(model, outputs)
    (sums.loss / sums.count + (0 if aux is None else aux)).backward()
    return flat_grad(model)


def train_family(tmp_path, caplog, model, examples):
    """One step of hfacc's defaults (bs 4 x GA 2); the padding-free decisions it logged at WARNING."""
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 4, 2), COLLATE)
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING and "padd" in r.message]
    return trainer, capture, warnings


@pytest.mark.parametrize("family", ROUTED)
def test_a_router_loss_gets_the_padded_gradient_in_one_row(tmp_path, caplog, family):
    """Packed rows' filler is counted by the router's load-balancing loss (the padded run masks padding): the check
    sees the aux loss and the filler's gradient, and training takes one row, which has no filler."""
    model = build_family(family)
    examples = make_examples(8, seed=12, lengths=(5, 30))
    reference = padded_reference(model, examples, 4)
    trainer, capture, warnings = train_family(tmp_path, caplog, model, examples)
    assert relative_error(capture.grads[0], reference) <= 1e-6
    assert trainer.padding_free and trainer.model_setup.one_row
    assert len(warnings) == 1 and "(one row), checked" in warnings[0] and "Not packed rows" in warnings[0]
    assert "auxiliary (router) loss by" in warnings[0] and "the gradient that reaches the filler" in warnings[0]
    # The router loss is each micro-batch's own: the split window's step is not one big batch's, and it is said.
    said = [r.message for r in caplog.records if r.levelno == logging.WARNING and "load-balancing" in r.message]
    assert len(said) == 1 and "output_router_logits=False" in said[0]
    # The check is needed: packed rows with a filler train another gradient.
    batch = pad(examples[:4])
    rows = remove_padding(batch, one_row=False)
    assert (rows["sequence_ids"] < 0).any()
    assert relative_error(micro_batch_gradient(model, rows), micro_batch_gradient(model, batch)) > 1e-4


@pytest.mark.parametrize("family", ["lfm2", "jamba"])
def test_layers_that_run_across_packed_sequences_train_padded(tmp_path, caplog, family):
    """LFM2's short convolution and Jamba's Mamba scan run across the sequences of a row: every layout leaks, by
    little enough on a fresh model to pass a logits check at 1e-4 (LFM2 did); this check sees the leak."""
    model = build_family(family)
    examples = make_examples(8, seed=14, lengths=(5, 30))  # LFM2 passes the old check on this data
    reference = padded_reference(model, examples, 4)
    trainer, capture, warnings = train_family(tmp_path, caplog, model, examples)
    assert relative_error(capture.grads[0], reference) <= 1e-6
    assert not trainer.padding_free
    assert len(warnings) == 1 and warnings[0].startswith("hfacc: padded micro-batches, as collated: packed rows")
    assert warnings[0].count("(a leak) by") == 4  # both layouts, by the logits and by the gradient
    assert warnings[0].count("reaches the one before it in its row (a leak) by") == 2
    batch = pad(examples)
    padded = micro_batch_gradient(model, batch)
    for one_row in (False, True):
        laid = remove_padding(batch, one_row)
        assert laid["input_ids"].shape[0] < 8  # rows hold several sequences
        assert relative_error(micro_batch_gradient(model, laid), padded) > 1e-6


def test_gemma3n_trains_packed_rows_with_a_filler_of_real_tokens(tmp_path, caplog, monkeypatch):
    """Gemma3n's pad token has a zero embedding; a filler made of it gave NaN gradients in 49 tensors (the step gate
    then skipped every step). The filler repeats a real token, and the check runs a backward, which sees a NaN."""
    import hfacc.setup.layout_check as layout_check

    model = build_family("gemma3n")
    examples = make_examples(8, seed=14, lengths=(5, 30))
    reference = padded_reference(model, examples, 4)
    trainer, capture, warnings = train_family(tmp_path, caplog, model, examples)
    assert trainer.padding_free and not trainer.model_setup.one_row and not warnings
    assert torch.isfinite(capture.grads[0]).all() and relative_error(capture.grads[0], reference) <= 1e-6
    # The filler as it was (the pad token 0): the check's backward sees the NaN, which the padded run does not have.
    lay_out = layout_check.remove_padding

    def zero_filler(batch, one_row=True, max_row_length=0):
        row = lay_out(batch, one_row, max_row_length)
        return {**row, "input_ids": row["input_ids"].masked_fill(row["sequence_ids"] < 0, 0)}

    monkeypatch.setattr(layout_check, "remove_padding", zero_filler)
    assert check_padding_free(model, pad(examples), one_row=False) == "its gradient is not finite"


def test_llama4_rows_are_checked_as_long_as_training_lays_them_out():
    """Llama 4's NoPE layers scale attention by the row index from floor_scale (8192) on: a sequence laid past it in
    a row computes differently, which no short check can see. One row of 3 x 2800 tokens (what one row gives a
    micro-batch of three 2800-token sequences) differs from the tile that crosses 8192 on; packed rows of 2800 are
    exact. (The suite's one row past 8192 tokens, on a hidden-16 model.)"""
    model = build_family("llama4", max_position_embeddings=16384)
    batch = pad(make_examples(3, seed=15, lengths=(2800, 2800)))
    assert check_padding_free(model, batch, one_row=True) is None  # 64 tokens see nothing
    length, why = check_row_offsets(model, batch, 8400)
    assert length == 6300 and "row offset 6300" in why  # tiles of 2100: the fourth straddles 8192
    assert check_row_offsets(model, batch, 2800) == (2800, None)


def test_llama4_falls_back_to_rows_it_verified(tmp_path, caplog, monkeypatch):
    """The trainer with one row preferred (flash/flex attention), on a Llama 4 whose floor_scale (and attention
    chunks) are 64 so that rows pass it cheaply: one row is refused past the verified offset and packed rows train
    the padded gradient; one row would not."""
    monkeypatch.setattr("hfacc.setup.layout_check.uses_one_row", lambda model: True)
    model = build_family("llama4", floor_scale=64, attention_chunk_size=64, initializer_range=0.5)
    examples = make_examples(8, seed=16, lengths=(20, 30))
    reference = padded_reference(model, examples, 4)
    trainer, capture, warnings = train_family(tmp_path, caplog, model, examples)
    assert relative_error(capture.grads[0], reference) <= 1e-6
    assert trainer.padding_free and not trainer.model_setup.one_row
    assert len(warnings) == 1 and "Not one row: a sequence laid from row offset 50 on" in warnings[0]
    batch = pad(examples[:4])
    assert (
        relative_error(micro_batch_gradient(model, remove_padding(batch)), micro_batch_gradient(model, batch)) > 1e-6
    )


def test_one_row_verified_to_an_offset_keeps_longer_micro_batches_padded(tmp_path, caplog, monkeypatch):
    """Flash attention (one row only: its packed rows would leak) on the Llama 4 above: one row is exact up to the
    offset the check verified, so a micro-batch with more real tokens trains padded, and the step is exact."""
    import hfacc.setup.layout_check as layout_check

    check = layout_check.check_padding_free
    monkeypatch.setattr(layout_check, "uses_one_row", lambda model: True)
    monkeypatch.setattr(
        layout_check,
        "check_padding_free",
        lambda model, batch, one_row=None: check(model, batch, one_row) if one_row else "rows leak under flash",
    )
    model = build_family("llama4", floor_scale=64, attention_chunk_size=64, initializer_range=0.5)
    examples = make_examples(4, seed=16, lengths=(20, 30)) + make_examples(4, seed=19, lengths=(5, 12))
    reference = padded_reference(model, examples, 4)
    seen, _ = record_inputs(model)
    trainer, capture, warnings = train_family(tmp_path, caplog, model, examples)
    assert relative_error(capture.grads[0], reference) <= 1e-6
    assert trainer.padding_free and trainer.model_setup.one_row and trainer.model_setup.max_row_length == 50
    assert len(warnings) == 1 and "(one row), at most 50 tokens per row" in warnings[0]
    assert "a micro-batch with more real tokens stays padded" in warnings[0]
    # The first micro-batch (99 real tokens) trains padded, the second (34) in one row.
    assert [(shape[0], masked) for shape, masked in seen[-2:]] == [(4, True), (1, False)]


def test_a_later_micro_batch_longer_than_the_first_is_checked_or_stays_padded(tmp_path, caplog, monkeypatch):
    """The first micro-batch lays out one row of 44 tokens; a later one of 99 real tokens crosses the Llama 4 above's
    floor_scale (64), which nothing ran at 44 (before: 1.6e-2 off the padded gradient, logged as checked). The
    Trainer checks rows as long as its data's longest lays out (one row fails past 64, packed rows take over);
    where the data's longest is not known (a stream), rows are bounded to what was verified."""
    from types import SimpleNamespace

    from hfacc.setup.layout_check import choose_padding_free

    monkeypatch.setattr("hfacc.setup.layout_check.uses_one_row", lambda model: True)
    model = build_family("llama4", floor_scale=64, attention_chunk_size=64, initializer_range=0.5)
    examples = make_examples(4, seed=19, lengths=(5, 12)) + make_examples(4, seed=16, lengths=(20, 30))
    reference = padded_reference(model, examples, 4)
    trainer, capture, warnings = train_family(tmp_path, caplog, model, examples)
    assert relative_error(capture.grads[0], reference) <= 1e-6
    longest = max(len(e["input_ids"]) for e in examples)
    setup = trainer.model_setup
    assert not setup.one_row and setup.max_row_length >= longest  # every row training lays out was run
    assert any("Not one row: a sequence laid from row offset" in w for w in warnings), warnings
    # The first micro-batch only: one row is verified to its 44 tokens, and the longer micro-batch stays padded.
    first, second = pad(examples[:4]), pad(examples[4:])
    choice = choose_padding_free(CausalLMObjective(), model, first, SimpleNamespace(num_processes=1))
    assert choice == (True, True, 44)
    assert remove_padding(second, True, choice.max_row_length) is None


def test_rows_never_lay_a_sequence_past_the_verified_length():
    examples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (9, 4, 3, 2)]
    batch = pad(examples)

    def ends(rows):  # where each sequence but a row's first ends
        ids = rows["sequence_ids"].tolist()
        return [max(i for i, s in enumerate(row) if s == seq) + 1 for row in ids for seq in set(row) - {-1, row[0]}]

    assert max(ends(remove_padding(batch, one_row=False))) == 9  # [9] [4 3 2]
    bounded = remove_padding(batch, one_row=False, max_row_length=6)  # [9] (from 0, as padded) [4 2] [3]
    assert max(ends(bounded)) <= 6 and bounded["input_ids"].shape == (3, 9)
    assert remove_padding(batch, one_row=True, max_row_length=17) is None  # 18 tokens in one row
    assert remove_padding(batch, one_row=True, max_row_length=18)["input_ids"].shape == (1, 18)


def test_neftune_noise_is_stock_trainers_for_the_padded_batch(tmp_path):
    """NEFTune scales its noise by the length of the embedded tensor: re-laid rows would get another magnitude (1.8x
    with padding to a multiple). hfacc draws it for the padded batch, as stock Trainer does: same gradient."""
    examples = make_examples(8, seed=17, lengths=(5, 30))
    collator = DataCollatorForCausalLM(pad_token_id=0, pad_to_multiple_of=32)
    grads = []
    for trainer_class in (T.Trainer, TokenWeightedTrainer):
        model = build_tiny_llama(vocab_size=VOCAB)
        args = train_args(tmp_path, 4, 2, neftune_noise_alpha=5.0)
        trainer, capture = run_trainer(trainer_class, model, examples, args, collator)
        grads.append(capture.grads[0])
    assert trainer.padding_free and relative_error(grads[1], grads[0]) <= 1e-6
    clean = run_trainer(
        TokenWeightedTrainer, build_tiny_llama(vocab_size=VOCAB), examples, train_args(tmp_path, 4, 2), collator
    )
    assert relative_error(clean[1].grads[0], grads[0]) > 1e-3  # the noise is there


def test_no_padding_warning_from_transformers_on_unpadded_data(tmp_path):
    """GPT-2 warns "your input_ids may be padded" when a pad id starts or ends a row without attention_mask: the
    check's filler once did (token 0). Equal-length rows, pad id 0: no such warning."""
    from transformers.utils import logging as hf_logging

    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, pad_token_id=0))
    examples = make_examples(4, seed=18, lengths=(20, 20))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logging.get_logger().addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers says it once per process
    try:
        trainer, _ = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 2, 1), COLLATE)
    finally:
        hf_logging.get_logger().removeHandler(handler)
    assert trainer.padding_free and not [m for m in seen if "may be padded" in m]
