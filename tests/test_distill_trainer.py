"""On-policy distillation (hfacc/training/distill_trainer.py): each optimizer step's update is the big batch of the
completions that step trains, generated or not, for lmbda 0, 0.5 and 1.

Each step's rows are recorded as the trainer makes them; the reference (tests/distillation_reference.py: plain torch)
is one big batch of them. The learning rate is 0, so every step starts from the same student. Two ranks:
tests/distillation_check.py (in tests/test_distributed.py's launch).
"""

import tempfile

import pytest
import torch
from datasets import Dataset

from hfacc import DistillationArguments, DistillationTrainer, build_default_tokenizer, generate_instruction_examples
from tests.distillation_reference import big_batch, make_student, make_teacher
from tests.helpers import CaptureGradients, relative_error, train_args

TOL = 1e-6
OUT = tempfile.mkdtemp()  # the trainers' output_dir (they save nothing: save_strategy 'no')


@pytest.fixture(scope="module")
def setting():
    tokenizer = build_default_tokenizer()
    rows = [
        {"prompt": e["messages"][:-1], "completion": e["messages"][-1:]}
        for e in generate_instruction_examples(16, seed=5)
    ]
    return tokenizer, Dataset.from_list(rows), make_teacher(rows=len(tokenizer), init=0.1)


def eos_prone_student(tokenizer):
    """The tiny student with a biased output projection that favours EOS: sampled completions end at different
    lengths (ragged steps), and the chunked loss runs with a bias."""
    student = make_student(vocab=len(tokenizer), init=0.1)
    head = torch.nn.Linear(student.lm_head.in_features, student.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(student.lm_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 3.5
    student.lm_head = head
    return student


def run(setting, lmbda, beta=0.5, temperature=1.0, ce_weight=0.0, steps=2):
    tokenizer, prompts, teacher = setting
    student = eos_prone_student(tokenizer)
    capture = CaptureGradients(student)
    args = train_args(
        OUT, 2, 2, args_class=DistillationArguments, lmbda=lmbda, beta=beta, temperature=temperature,
        ce_weight=ce_weight, max_completion_length=12, max_steps=steps, loss_chunk_size=16, seed=3,
    )  # fmt: skip
    trainer = DistillationTrainer(
        student, teacher, args, train_dataset=prompts, processing_class=tokenizer, callbacks=[capture]
    )
    recorded, generated = [], []
    make, sample = trainer.generate_micro_batches, trainer.sample

    def record(indices, generation=0):
        batches = make(indices, generation)
        recorded.append(list(trainer.last_rows))
        return batches

    trainer.generate_micro_batches = record
    trainer.sample = lambda ids, generation=0: generated.append(len(ids)) or sample(ids, generation)
    torch.manual_seed(0)
    trainer.train()
    return trainer, capture, recorded, generated


@pytest.mark.parametrize(("lmbda", "beta", "temperature", "ce_weight"), [(0.0, 0.0, 1.0, 0.5), (0.5, 0.5, 2.0, 0.0),
                                                                         (1.0, 1.0, 1.0, 0.5)])  # fmt: skip
def test_each_step_is_the_big_batch_of_what_it_trains(setting, lmbda, beta, temperature, ce_weight):
    tokenizer, _, teacher = setting
    trainer, capture, recorded, generated = run(setting, lmbda, beta, temperature, ce_weight)
    assert len(capture.grads) == len(recorded) == 2
    draws = [d for step in range(2) for d in _draws(trainer, step)]
    if lmbda == 0:
        assert not generated and not any(draws)
    elif lmbda == 1:
        assert all(draws) and sum(generated) == 8
    else:
        assert any(draws) and not all(draws)  # this seed mixes both kinds of micro-batches
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for step, rows in enumerate(recorded):
        want, loss, _ = big_batch(
            eos_prone_student(tokenizer), teacher, rows, beta=beta, temperature=temperature, ce_weight=ce_weight,
            vocab=len(tokenizer),
        )  # fmt: skip
        assert relative_error(capture.grads[step], want) <= TOL
        # The denominator: the completion tokens this step trains (generated where the student generated).
        assert logs[step]["num_targets"] == sum(sum(1 for y in r["labels"] if y != -100) for r in rows)
        assert logs[step]["loss"] == pytest.approx(loss, rel=1e-5)
        assert logs[step]["on_policy_fraction"] == sum(_draws(trainer, step)) / 2
    lengths = {sum(1 for y in r["labels"] if y != -100) for rows in recorded for r in rows}
    assert len(lengths) > 2  # ragged: micro-batches hold different numbers of completion tokens


def _draws(trainer, step):
    trainer._generations, saved = step, trainer._generations
    try:
        return trainer.on_policy_draws(2)
    finally:
        trainer._generations = saved


def test_the_generated_tokens_are_counted_not_the_datasets(setting):
    """TRL's GKDTrainer counts the dataset's labels before it replaces them by the student's (trl#4719)."""
    trainer, _, recorded, _ = run(setting, lmbda=1.0, steps=1)
    dataset_tokens = sum(
        len(trainer.completion_ids(trainer.train_dataset[i], i)) for i in range(4)
    )  # the first step's 4 prompts, sequential
    trained = trainer.state.log_history[0]["num_targets"]
    assert trained == sum(sum(1 for y in r["labels"] if y != -100) for r in recorded[0]) != dataset_tokens


def test_bad_settings_are_one_error(setting):
    tokenizer, prompts, teacher = setting
    with pytest.raises(ValueError, match="lmbda=1.5"):
        train_args(OUT, 1, 1, args_class=DistillationArguments, lmbda=1.5)
    args = train_args(OUT, 1, 1, args_class=DistillationArguments, lmbda=0.5)
    with pytest.raises(ValueError, match="has no 'completion' column"):
        DistillationTrainer(make_student(vocab=len(tokenizer), init=0.1), teacher, args,
                            train_dataset=prompts.remove_columns("completion"), processing_class=tokenizer)  # fmt: skip
