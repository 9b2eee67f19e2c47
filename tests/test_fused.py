"""The fused chunked cross-entropy: same gradients as the full-logits path (fp32, <= 1e-6), no full logits."""

import logging

import pytest
import torch
import torch.nn.functional as F

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama
from hfacc.objectives import CausalLMObjective
from hfacc.objectives.causal_lm import check_fused_loss
from hfacc.ops.fused_loss import fused_linear_cross_entropy_sums, linear_cross_entropy_chunk
from tests.helpers import (
    VOCAB,
    flat_grad,
    full_batch_causal_lm,
    make_examples,
    relative_error,
    run_trainer,
    train_args,
)

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [7, 64, 0])
def test_pure_function_matches_torch(smoothing, bias, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(150, 32, requires_grad=True)
    weight = (torch.randn(97, 32) * 0.1).requires_grad_()
    b = (torch.randn(97) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, 97, (150,))
    sums, per_target, correct = fused_linear_cross_entropy_sums(
        hidden, weight, b, targets, chunk_size=chunk, label_smoothing=smoothing
    )
    (sums.loss * 0.3).backward()
    ours = [hidden.grad.clone(), weight.grad.clone()] + ([b.grad.clone()] if bias else [])
    for t in [hidden, weight] + ([b] if bias else []):
        t.grad = None
    logits = F.linear(hidden, weight, b)
    reference = F.cross_entropy(logits, targets, reduction="sum", label_smoothing=smoothing)
    (reference * 0.3).backward()
    theirs = [hidden.grad, weight.grad] + ([b.grad] if bias else [])
    assert sums.loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert sums.correct.item() == (logits.argmax(-1) == targets).sum().item() == correct.sum().item()
    torch.testing.assert_close(per_target.sum(), reference.detach(), rtol=1e-6, atol=0)
    for a, c in zip(ours, theirs, strict=True):
        assert relative_error(a, c) <= 1e-6


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_chunk_function_matches_autograd(smoothing, bias):
    """The kernel's pure per-chunk step: per-row losses, argmax hits and d(sum of losses)/d(logits) by autograd."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(40, 16), torch.randn(53, 16) * 0.2
    b = torch.randn(53) * 0.1 if bias else None
    targets = torch.randint(0, 53, (40,))
    losses, correct, grad_logits = linear_cross_entropy_chunk(hidden, weight, b, targets, smoothing)
    logits = F.linear(hidden, weight, b).requires_grad_()
    reference = F.cross_entropy(logits, targets, reduction="none", label_smoothing=smoothing)
    reference.sum().backward()
    torch.testing.assert_close(losses, reference.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(correct, logits.argmax(-1) == targets)
    assert relative_error(grad_logits, logits.grad) <= 1e-6
    no_grad = linear_cross_entropy_chunk(hidden, weight, b, targets, smoothing, with_grad=False)
    assert no_grad[2] is None and torch.equal(no_grad[0], losses)


def model_kind(kind):
    if kind == "tied":
        return build_tiny_llama(vocab_size=VOCAB, tie_word_embeddings=True)
    model = build_tiny_llama(vocab_size=VOCAB)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
    return model


@pytest.mark.parametrize("kind", ["plain", "tied", "lora"])
def test_trainer_takes_the_fused_path_and_stays_exact(tmp_path, kind):
    examples = make_examples(8, seed=21)
    model = model_kind(kind)
    reference, token_loss, accuracy = full_batch_causal_lm(model, examples)
    calls = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda m, i, out: calls.append((m.training, out.dim())))
    args = train_args(tmp_path, 2, 4, args_class=TokenWeightedArguments, loss_chunk_size=16)
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert trainer.objective.fused
    # The head module runs in every forward (its hooks must: that is where FSDP2/ZeRO-3 gather its weight), but it
    # returned [B, T, V] logits only in the start-up checks, which run in eval mode (padding-free: padded, packed and
    # a leak run; then fused against the plain path); in training it returned the loss sum (0-d) for each of the 4
    # micro-batches: no logits were materialized.
    assert calls[-4:] == [(True, 0)] * 4 and not any(training for training, _ in calls[:-4])
    assert (False, 3) in calls[:-4] and (False, 0) in calls[:-4]
    assert relative_error(capture.grads[0], reference) <= 1e-6
    log = trainer.state.log_history[0]
    assert log["loss"] == pytest.approx(token_loss, rel=1e-5)
    assert log["token_accuracy"] == pytest.approx(accuracy, rel=1e-5)


def test_fused_label_smoothing_and_eval_metrics(tmp_path):
    from datasets import Dataset

    examples = make_examples(8, seed=22)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, _, _ = full_batch_causal_lm(model, examples, label_smoothing=0.1)
    args = train_args(tmp_path, 1, 8, args_class=TokenWeightedArguments, label_smoothing_factor=0.1)
    trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    assert trainer.objective.fused and relative_error(capture.grads[0], reference) <= 1e-6
    # Evaluation through the fused path gives the same token-weighted metrics as the plain one.
    trainer.model_preparation_time = 100.0  # what an evaluation that prepared the model (DeepSpeed) leaves behind
    fused_metrics = trainer.evaluate(Dataset.from_list(examples))
    # stock subtracted it from every later evaluation's runtime too: -100 s here
    assert fused_metrics["eval_runtime"] >= 0 and "eval_model_preparation_time" not in fused_metrics
    trainer.objective.fused = False
    plain_metrics = trainer.evaluate(Dataset.from_list(examples))
    assert fused_metrics["eval_loss"] == pytest.approx(plain_metrics["eval_loss"], rel=1e-6)
    assert fused_metrics["eval_token_accuracy"] == plain_metrics["eval_token_accuracy"]


def test_models_that_post_process_logits_fall_back(tmp_path, caplog):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=5.0,
        attn_logit_softcapping=None,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).float()
    batch = COLLATE(make_examples(2, seed=23))
    problem = check_fused_loss(CausalLMObjective(), model, batch)
    assert problem is not None and "post-processes its logits" in problem
    examples = make_examples(8, seed=23)
    reference, _, _ = full_batch_causal_lm(model, examples)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    assert not trainer.objective.fused
    assert caplog.text.count("plain loss path (full logits)") == 1
    assert relative_error(capture.grads[0], reference) <= 1e-6


def test_lora_on_the_output_projection_falls_back():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_llama(vocab_size=VOCAB), LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    problem = check_fused_loss(CausalLMObjective(), model, COLLATE(make_examples(2)))
    assert "not a plain nn.Linear" in problem


def test_fused_loss_can_be_switched_off(tmp_path):
    args = train_args(tmp_path, 2, 4, args_class=TokenWeightedArguments, fused_loss=False)
    trainer, _ = run_trainer(TokenWeightedTrainer, build_tiny_llama(vocab_size=VOCAB), make_examples(8), args, COLLATE)
    assert not trainer.objective.fused


def test_gradient_of_hidden_and_head_match_plain_objective():
    """The objective-level swap: same LossSums and gradients as the plain objective on one micro-batch."""
    model = build_tiny_llama(vocab_size=VOCAB)
    batch = COLLATE(make_examples(4, seed=24))
    model.train()
    grads = []
    for fused in (True, False):
        model.zero_grad()
        _, sums = CausalLMObjective(fused=fused, chunk_size=5)(model, batch)
        sums.loss.backward()
        grads.append((flat_grad(model), sums))
    assert relative_error(grads[0][0], grads[1][0]) <= 1e-6
    assert grads[0][1].count == grads[1][1].count and grads[0][1].correct == grads[1][1].correct
