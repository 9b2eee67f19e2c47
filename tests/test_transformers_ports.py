"""transformers' own Trainer tests on accumulation and losses, ported to run against TokenWeightedTrainer.

From tests/trainer/test_trainer.py and tests/trainer/trainer_test_utils.py of huggingface/transformers (5.x):
`TrainerGradientAccumulationTest` (regression GA, loss alignment with the model's loss and with a custom
`compute_loss_func`, batch counting with GA) and `TrainerStepCountingTest.test_training_loss`, with their thresholds.
Offline: where they download a model (nickypro/tinyllama-15M, roneneldan/TinyStories-33M) the same architecture is
built tiny from a config; where they load wikitext-2 the first 40 lines are replaced by 40 local lines of the same
kinds (empty lines, headings, sentences longer than the 16-token window), tokenized by the embedded tokenizer.
"""

import math
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn
from transformers import (
    DataCollatorForLanguageModeling,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    set_seed,
)
from transformers.loss.loss_utils import ForCausalLMLoss

from hfacc import TokenWeightedArguments, TokenWeightedTrainer


# ---- trainer_test_utils.py, as in transformers ----------------------------------------------------------------
class StoreLossCallback(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.losses.append(logs["loss"])


class RegressionDataset:
    def __init__(self, a=2, b=3, length=64, seed=42, label_names=None):
        np.random.seed(seed)
        self.label_names = ["labels"] if label_names is None else label_names
        self.length = length
        self.x = np.random.normal(size=(length,)).astype(np.float32)
        self.ys = [a * self.x + b + np.random.normal(scale=0.1, size=(length,)) for _ in self.label_names]
        self.ys = [y.astype(np.float32) for y in self.ys]

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        result = {name: y[i] for name, y in zip(self.label_names, self.ys, strict=True)}
        result["input_x"] = self.x[i]
        return result


class RegressionModelConfig(PretrainedConfig):
    def __init__(self, a=0, b=0, double_output=False, random_torch=True, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b, self.double_output, self.random_torch, self.hidden_size = a, b, double_output, random_torch, 1


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionModelConfig
    base_model_prefix = "regression"

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.as_tensor(config.a).float())
        self.b = nn.Parameter(torch.as_tensor(config.b).float())
        self.double_output = config.double_output
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y, y) if self.double_output else (y,)
        loss = nn.functional.mse_loss(y, labels)
        return (loss, y, y) if self.double_output else (loss, y)


def get_regression_trainer(a=0, b=0, train_len=64, eval_len=64, output_dir=None, objective="auto", **kwargs):
    """transformers' helper with TokenWeightedTrainer; ``objective`` is hfacc's (auto: the model's own loss)."""
    model = RegressionPreTrainedModel(RegressionModelConfig(a=a, b=b))
    args = TokenWeightedArguments(output_dir, report_to=[], use_cpu=True, objective=objective, **kwargs)
    return TokenWeightedTrainer(
        model, args, train_dataset=RegressionDataset(length=train_len), eval_dataset=RegressionDataset(length=eval_len)
    )


# ---- TrainerGradientAccumulationTest -----------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["auto", "regression"])
def test_gradient_accumulation(tmp_path, objective):
    # Training with half the batch size but accumulation steps as 2 should give the same training losses.
    # hfacc: with "auto" the regression model trains on its own loss (model_loss); "regression" is hfacc's exact MSE.
    trainer = get_regression_trainer(learning_rate=0.1, output_dir=tmp_path / "a", objective=objective)
    trainer.train()
    a, b = trainer.model.a, trainer.model.b
    trainer = get_regression_trainer(
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        learning_rate=0.1,
        output_dir=tmp_path / "b",
        objective=objective,
    )
    trainer.train()
    torch.testing.assert_close(trainer.model.a, a)
    torch.testing.assert_close(trainer.model.b, b)


def test_num_batches_in_training_with_gradient_accumulation(tmp_path):
    # transformers runs this on several accelerators; here on one CPU process (tests/test_dropin.py checks the
    # last, uneven window on two ranks, where hfacc cuts repeated examples but never drops a micro-batch).
    for num_train_epochs in [1, 2]:
        for train_len in [123, 120]:
            trainer = get_regression_trainer(
                train_len=train_len,
                per_device_train_batch_size=4,
                gradient_accumulation_steps=5,
                num_train_epochs=num_train_epochs,
                output_dir=tmp_path
                / f"e{num_train_epochs}-n{train_len}",  # other data: another run, another directory
            )
            total_batch_samples = []

            def wrap_get_batch_samples(fn, total_batch_samples=total_batch_samples):
                def wrapped_fn(epoch_iterator, num_batches, device):
                    assert num_batches > 0
                    batch_samples, num_items_in_batch = fn(epoch_iterator, num_batches, device)
                    assert len(batch_samples) == num_batches
                    total_batch_samples.append(num_batches)
                    return batch_samples, num_items_in_batch

                return wrapped_fn

            trainer.get_batch_samples = wrap_get_batch_samples(trainer.get_batch_samples)
            trainer.train()
            assert len(trainer.get_train_dataloader()) * num_train_epochs == sum(total_batch_samples)


# ---- TrainerStepCountingTest.test_training_loss -----------------------------------------------------------------
def test_training_loss(tmp_path):
    n_gpus = 1
    # With even logs
    trainer = get_regression_trainer(logging_steps=64 / (8 * n_gpus), output_dir=tmp_path / "even")
    trainer.train()
    log_history = trainer.state.log_history
    losses = [log["loss"] for log in log_history if "loss" in log]
    train_loss = log_history[-1]["train_loss"]
    assert sum(losses) / len(losses) == pytest.approx(train_loss, abs=0.5e-4)  # assertAlmostEqual(places=4)
    # With uneven logs
    trainer = get_regression_trainer(logging_steps=5, output_dir=tmp_path / "uneven")
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(train_loss, abs=0.5e-4)


# ---- loss alignment: a causal LM on short, padded text (offline stand-ins for the downloads) ---------------------
WORDS = "the game was released in japan and later in north america with new characters music and a story".split()


def text_lines(n=40):
    """wikitext-2's first lines are empty lines, " = Headings = " and long sentences; 40 lines of those kinds."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        if i % 3 == 0:
            lines.append("")
        elif i % 7 == 1:
            lines.append(f" = Section {i} = \n")
        else:
            lines.append(" ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))) + " .\n")
    return lines


def causal_lm_data():
    from datasets import Dataset

    from hfacc.data.embedded import build_default_tokenizer

    # Trained on these lines, not on the demo's data: the test's numbers must not move when the demo changes.
    tokenizer = build_default_tokenizer(corpus=text_lines())
    tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict({"text": text_lines()})

    def tokenize_function(examples):
        return tokenizer(examples["text"], max_length=16, padding="max_length", truncation=True)

    tokenized = dataset.map(tokenize_function, batched=True, remove_columns=dataset.column_names)
    return tokenizer, tokenized, DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)


def tiny_llama(vocab_size):  # nickypro/tinyllama-15M is a LlamaForCausalLM (dim 288, 6 layers), built tiny here
    set_seed(42)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            # transformers' test starts from a trained model whose per-token losses differ widely; a larger
            # initialisation gives a random one the same property, which is what makes micro-batch means differ.
            initializer_range=1.0,
        )
    ).float()


def tiny_gpt_neo(vocab_size):  # roneneldan/TinyStories-33M is a GPTNeoForCausalLM (768 wide, 4 layers), tiny here
    set_seed(42)
    return GPTNeoForCausalLM(
        GPTNeoConfig(
            vocab_size=vocab_size,
            hidden_size=48,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=64,
            initializer_range=1.0,
        )
    ).float()


ARGS = {
    "logging_steps": 1,
    "max_steps": 5,
    "learning_rate": 3e-4,
    "disable_tqdm": True,
    "report_to": [],
    "use_cpu": True,
}


def run(cls, model, tmp_path, dataset, collator, ga=1, bs=8, broken=False, **trainer_kwargs):
    # transformers' test reuses one output_dir; each run gets its own here, because hfacc refuses a new run over
    # another run's checkpoints (a later --resume_from_checkpoint last could continue theirs: docs/reliability.md).
    output_dir = tmp_path / f"run-{sum(1 for _ in tmp_path.iterdir())}"
    args = TokenWeightedArguments(
        str(output_dir), gradient_accumulation_steps=ga, per_device_train_batch_size=bs, **ARGS
    )
    callback = StoreLossCallback()
    trainer = cls(model, args, train_dataset=dataset, callbacks=[callback], data_collator=collator, **trainer_kwargs)
    if broken:
        # disable model_accepts_loss_kwargs so that "num_items_in_batch" is not passed to the model
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    return callback.losses


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_gradient_accumulation_loss_alignment_with_model_loss(tmp_path):
    tokenizer, dataset, collator = causal_lm_data()
    vocab = len(tokenizer)
    base = run(TokenWeightedTrainer, tiny_llama(vocab), tmp_path, dataset, collator)
    grad_accum = run(TokenWeightedTrainer, tiny_llama(vocab), tmp_path, dataset, collator, ga=2, bs=4)
    broken = run(TokenWeightedTrainer, tiny_llama(vocab), tmp_path, dataset, collator, ga=2, bs=4, broken=True)
    # all diff truth should be quite close (transformers: < 0.01)
    assert max_diff(base, grad_accum) < 0.01
    # transformers' "broken" run keeps the model from seeing num_items_in_batch; hfacc never relies on it, so the
    # same run is not broken under hfacc.
    assert max_diff(base, broken) < 0.01
    # The control, stock Trainer: its broken run is very off (transformers: > 0.7), its mean loss not by much (< 0.2).
    stock_base = run(Trainer, tiny_llama(vocab), tmp_path, dataset, collator)
    stock_broken = run(Trainer, tiny_llama(vocab), tmp_path, dataset, collator, ga=2, bs=4, broken=True)
    assert max_diff(stock_base, stock_broken) > 0.7
    assert abs(sum(stock_base) - sum(stock_broken)) / max(sum(stock_base), sum(stock_broken)) < 0.2
    assert base == pytest.approx(stock_base, rel=1e-4)  # hfacc logs the same token-weighted loss as stock


def compute_loss(logits, labels, vocab_size, num_items_in_batch, disable_num_items_in_batch=False):
    if disable_num_items_in_batch:
        num_items_in_batch = None
    return ForCausalLMLoss(logits["logits"], labels, vocab_size, num_items_in_batch)


@pytest.mark.slow
def test_gradient_accumulation_loss_alignment_with_loss_func(tmp_path):
    tokenizer, dataset, collator = causal_lm_data()
    vocab = len(tokenizer)
    loss_fn = partial(compute_loss, vocab_size=vocab)
    broken_fn = partial(compute_loss, vocab_size=vocab, disable_num_items_in_batch=True)
    base = run(TokenWeightedTrainer, tiny_gpt_neo(vocab), tmp_path, dataset, collator, compute_loss_func=loss_fn)
    grad_accum = run(
        TokenWeightedTrainer, tiny_gpt_neo(vocab), tmp_path, dataset, collator, ga=2, bs=4, compute_loss_func=loss_fn
    )
    # all diff truth should be quite close (transformers: < 0.01)
    assert max_diff(base, grad_accum) < 0.01
    # The broken function ignores num_items_in_batch: stock Trainer trains on it and is very off (> 3); hfacc
    # refuses it and names the exact alternative.
    stock_base = run(Trainer, tiny_gpt_neo(vocab), tmp_path, dataset, collator, compute_loss_func=loss_fn)
    stock_broken = run(
        Trainer, tiny_gpt_neo(vocab), tmp_path, dataset, collator, ga=2, bs=4, compute_loss_func=broken_fn
    )
    assert max_diff(stock_base, stock_broken) > 3
    with pytest.raises(ValueError, match="FunctionObjective"):
        run(
            TokenWeightedTrainer,
            tiny_gpt_neo(vocab),
            tmp_path,
            dataset,
            collator,
            ga=2,
            bs=4,
            compute_loss_func=broken_fn,
        )
    assert base == pytest.approx(stock_base, rel=1e-4) and not any(math.isnan(x) for x in base)
