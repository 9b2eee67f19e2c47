"""`hfacc distill --dataset_name <your rows> --lmbda ...` distils on-policy from a local JSONL: the prompts are the
data's (a chat row's conversation up to its last assistant turn, or the 'prompt' column), the completions trained
are the student's samples (lmbda 1), or the dataset's in the micro-batches the student does not sample (lmbda 0.5).

The trainer is watched from outside (its ``sample`` and ``generate_micro_batches`` wrapped at the class): what it
sampled and the rows each optimizer step trained on.
"""

import json

import pytest

from hfacc import DistillationTrainer, build_default_model, build_default_tokenizer, generate_instruction_examples
from hfacc.cli import main as cli_main
from hfacc.generation.rollout import get_prompt_ids
from hfacc.ops.loss import IGNORE_INDEX

RUN = [
    "--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
    "--max_completion_length", "8", "--num_exact_match_examples", "0", "--logging_steps", "1", "--report_to", "none",
    "--save_strategy", "no", "--disable_tqdm", "true", "--torch_threads", "1", "--seed", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny student and a bigger teacher with one tokenizer, saved as a user's folders are."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = build_default_tokenizer()
    for name, hidden, seed in (("student", 32, 0), ("teacher", 48, 1)):
        build_default_model(tokenizer, hidden_size=hidden, num_layers=1, seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root, tokenizer


@pytest.fixture
def watch(monkeypatch):
    """``{"sampled": [(prompt ids, completion ids)], "steps": [rows trained by one step]}``, as the trainer runs."""
    seen = {"sampled": [], "steps": []}
    sample, make = DistillationTrainer.sample, DistillationTrainer.generate_micro_batches

    def recording_sample(self, prompt_ids, generation=0):
        completions, truncated = sample(self, prompt_ids, generation)
        seen["sampled"] += [(list(p), list(c)) for p, c in zip(prompt_ids, completions, strict=True)]
        return completions, truncated

    def recording_make(self, indices, generation=0):
        batches = make(self, indices, generation)
        seen["steps"].append([dict(r) for r in self.last_rows])
        return batches

    monkeypatch.setattr(DistillationTrainer, "sample", recording_sample)
    monkeypatch.setattr(DistillationTrainer, "generate_micro_batches", recording_make)
    return seen


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def distill(models, dataset, output_dir, *argv):
    """The exit code of ``hfacc distill`` on ``dataset`` (2: a user error, said in one line)."""
    root, _ = models
    try:
        return run_cli(root, dataset, output_dir, argv)
    except SystemExit as stop:
        return stop.code


def run_cli(root, dataset, output_dir, argv):
    return cli_main([
        "distill", "--model_name_or_path", str(root / "student"), "--teacher_model_name_or_path", str(root / "teacher"),
        "--dataset_name", dataset, "--output_dir", str(output_dir), *RUN, *argv,
    ])  # fmt: skip


def split(row):
    """A trained row's ``(prompt ids, completion ids)``: the completion is what carries labels."""
    first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
    return row["input_ids"][:first], row["input_ids"][first:]


def answer_ids(tokenizer, text, max_completion_length=8):
    """The dataset's answer as the trainer trains it: cut to ``max_completion_length`` with its EOS."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_completion_length - 1]
    return ids + [tokenizer.eos_token_id]


@pytest.mark.parametrize("kind", ["messages", "prompts"])
def test_rows_train_on_the_students_samples_of_their_prompts(models, watch, tmp_path, capsys, kind):
    """SFT chat rows (their conversations up to the last assistant turn), or rows of a prompt alone."""
    _, tokenizer = models
    conversations = [e["messages"] for e in generate_instruction_examples(24, seed=2)]
    rows = [{"messages": m} if kind == "messages" else {"prompt": m[:-1]} for m in conversations]
    assert distill(models, write_rows(tmp_path / "rows.jsonl", rows), tmp_path / "out", "--lmbda", "1") == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()

    prompts = {tuple(get_prompt_ids(tokenizer, m[:-1])): m[-1]["content"] for m in conversations}
    sampled = [tuple(c) for _, c in watch["sampled"]]
    assert len(watch["steps"]) == 2 and len(sampled) == 2 * 4  # every completion of both steps was sampled
    trained = [split(row) for step in watch["steps"] for row in step]
    assert [tuple(c) for _, c in trained] == sampled  # the student's samples, in the order sampled
    for prompt, completion in trained:
        assert tuple(prompt) in prompts  # a conversation of the data up to its last assistant turn
        assert completion != answer_ids(tokenizer, prompts[tuple(prompt)])  # not the dataset's answer
    err = capsys.readouterr().err
    said = err.count("on-policy distillation (lmbda 1) of chat rows: each row's prompt is its conversation up to")
    assert said == (1 if kind == "messages" else 0), err  # once, and only where prompts were taken from SFT rows


def test_prompt_completion_rows_mix_samples_and_the_datasets_completions(models, watch, tmp_path, capsys):
    _, tokenizer = models
    rows = [
        {"prompt": e["messages"][:-1], "completion": e["messages"][-1:]}
        for e in generate_instruction_examples(24, seed=3)
    ]
    data = write_rows(tmp_path / "pairs.jsonl", rows)
    assert distill(models, data, tmp_path / "out", "--lmbda", "0.5", "--seed", "1") == 0
    answers = {tuple(get_prompt_ids(tokenizer, r["prompt"])): r["completion"][0]["content"] for r in rows}
    sampled = {(tuple(p), tuple(c)) for p, c in watch["sampled"]}
    kinds = []
    for step in watch["steps"]:
        for start in (0, 2):  # the step's two micro-batches of two rows: each all sampled or all the dataset's
            micro = [split(row) for row in step[start : start + 2]]
            generated = [(tuple(p), tuple(c)) in sampled for p, c in micro]
            from_data = [c == answer_ids(tokenizer, answers[tuple(p)]) for p, c in micro]
            assert all(generated) != all(from_data) and len(set(generated)) == 1, (generated, from_data)
            kinds.append(all(generated))
    assert len(kinds) == 4 and any(kinds) and not all(kinds)  # lmbda 0.5 mixes both kinds of micro-batch
    assert "its 'completion' is trained in the share 1 - lmbda = 0.5" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("rows", "lmbda", "named"),
    [
        ([{"prompt": "What is 2 + 2?"}] * 8, "0.5", "its rows have a 'prompt' but no 'completion'"),
        ([{"text": "some plain text"}] * 8, "1", "hold none: give a 'prompt' column"),
    ],
)
def test_rows_without_what_on_policy_needs_are_one_line(models, tmp_path, capsys, rows, lmbda, named):
    data = write_rows(tmp_path / "rows.jsonl", rows)
    assert distill(models, data, tmp_path / "out", "--lmbda", lmbda) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
