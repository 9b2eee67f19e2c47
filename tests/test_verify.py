"""hfacc verify: PASS on a tiny Llama, FAIL with the right diagnosis where equivalence breaks, distributed path."""

import json
import subprocess

import pytest
import torch
from torch import nn
from transformers import Trainer

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama
from hfacc.cli import main as cli_main
from hfacc.verify.equivalence import verify_accumulation
from tests.helpers import ROOT, VOCAB, KwargsLM, make_examples, relative_error, run_trainer, torchrun, train_args

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


def finding(report, name):
    return next(f for f in report.findings if f.name == name)


class BatchNormLM(nn.Module):
    """Embedding -> BatchNorm over the micro-batch's positions -> head: its output depends on the batch."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return {"logits": self.head(h)}


def test_tiny_llama_passes_with_fp32_rounding():
    report = verify_accumulation(build_tiny_llama(vocab_size=VOCAB), make_examples(8), COLLATE)
    assert report.passed and report.error < 1e-6
    assert all(f.ok for f in report.findings)
    assert report.window["targets_per_micro_batch"] and len(report.worst) == 5
    assert report.precision_errors["bf16"] > 10 * report.error  # rounding is reported, and much larger
    assert "PASS" in report.format()


def test_batchnorm_fails_and_is_named():
    report = verify_accumulation(BatchNormLM(), make_examples(8), COLLATE, objective="causal_lm")
    assert not report.passed and report.error > 1e-3
    f = finding(report, "batch statistics")
    assert not f.ok and "norm" in f.message and "eval mode" in f.fix


def test_active_dropout_fails_and_is_named():
    model = build_tiny_llama(vocab_size=VOCAB, attention_dropout=0.3)
    report = verify_accumulation(model, make_examples(8), COLLATE)
    assert not report.passed
    f = finding(report, "randomness")
    assert not f.ok and "attention_dropout=0.3" in f.message


def test_stock_path_with_a_model_that_ignores_num_items_in_batch(tmp_path):
    model = KwargsLM(build_tiny_llama(vocab_size=VOCAB))
    examples = make_examples(8)
    report = verify_accumulation(model, examples, COLLATE, path="stock", objective="causal_lm")
    assert not report.passed
    f = finding(report, "stock Trainer")
    assert not f.ok and "ignores it" in f.message
    assert report.other_path_error < 1e-6  # hfacc's path on the same model is exact
    # The emulated stock path is what the real transformers.Trainer does on the same split.
    from tests.helpers import full_batch_causal_lm

    reference, _, _ = full_batch_causal_lm(model, examples)
    _, capture = run_trainer(Trainer, model, examples, train_args(tmp_path, 2, 4), COLLATE)
    assert relative_error(capture.grads[0], reference) == pytest.approx(report.error, rel=1e-4)


def test_cli_exit_codes(capsys):
    assert cli_main(["verify", "--gradient_accumulation_steps", "2", "--precisions", "bf16"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert cli_main(["verify", "--use_lora", "true", "--lora_dropout", "0.2", "--lora_r", "4"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "[!!] randomness" in out


def test_cli_reads_a_recipe_config(capsys):
    config = ROOT / "recipes" / "configs" / "tiny_default.yaml"
    assert cli_main(["verify", "--config", str(config), "--per_device_train_batch_size", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 per micro-batch x 2 micro-batches" in out  # GA from the YAML, micro-batch size from the flag


def test_show_mask_prints_highlighted_examples(capsys):
    assert cli_main(["show-mask", "--count", "2", "--color", "false"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- example") == 2 and "[[" in out and "<|im_end|>]]" in out


@pytest.mark.distributed
def test_distributed_verify_on_two_ranks(tmp_path):
    out = tmp_path / "report.json"
    cmd = torchrun("-m", "hfacc.cli", "verify", "--json_path", str(out))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["window"]["world_size"] == 2 and report["passed"] and report["error"] < 1e-6
    assert proc.stdout.count("hfacc verify:") == 1


def test_audit_callback_logs_the_error(tmp_path):
    examples = make_examples(16, seed=2)
    model = build_tiny_llama(vocab_size=VOCAB)
    args = train_args(
        tmp_path, 2, 4, args_class=TokenWeightedArguments, audit_every_n_steps=1, learning_rate=1e-3, max_grad_norm=0.5
    )
    trainer, _ = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
    audits = [h["accumulation_audit_error"] for h in trainer.state.log_history if "accumulation_audit_error" in h]
    assert len(audits) == 2 and max(audits) < 1e-6  # exact, even with clipping active

    # With dropout the recomputation draws other masks: the audit sees it. It restores the gradient and the RNG,
    # so the audited run ends with exactly the weights of an unaudited one.
    weights = {}
    for audited in (True, False):
        model = build_tiny_llama(vocab_size=VOCAB, attention_dropout=0.3)
        args = train_args(
            tmp_path,
            2,
            4,
            args_class=TokenWeightedArguments,
            learning_rate=1e-3,
            audit_every_n_steps=1 if audited else 0,
        )
        trainer, _ = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
        if audited:
            audits = [
                h["accumulation_audit_error"] for h in trainer.state.log_history if "accumulation_audit_error" in h
            ]
            assert len(audits) == 2 and min(audits) > 1e-3
        weights[audited] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in weights[True].items():
        assert torch.equal(value, weights[False][name]), name
