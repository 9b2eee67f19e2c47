"""Reliability: each bad input gets a clear error (or a counted, reported fix), NaN never reaches the weights,
resume is exact, checkpoints are complete or ignored, loading is safe. docs/reliability.md lists these cases."""

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch import nn

from hfacc import DataCollatorForCausalLM, NonFiniteLossError, TokenWeightedArguments, TokenWeightedTrainer
from hfacc.data.embedded import build_bpe_tokenizer, build_default_tokenizer, build_tiny_llama
from hfacc.data.formats import DataError
from hfacc.data.sft import build_sft_dataset
from hfacc.data.sources import load_sft_source
from hfacc.jobs.console import format_train_log
from hfacc.models.loading import get_tokenizer, load_causal_lm
from hfacc.runtime.config import ConfigError
from hfacc.training.checkpoint import MARKER, RUN_RECORD, resolve_checkpoint
from tests.helpers import ROOT, VOCAB, load_recipe, make_examples, recipe_types, run_trainer, train_args

COLLATE = DataCollatorForCausalLM(pad_token_id=0)
GOOD = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_default_tokenizer()


def sft(rows, tokenizer, **kw):
    """Rows as users ship them: a JSONL file (datasets keeps mixed JSON types there, so hfacc must check them)."""
    import tempfile

    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=tmp)
        return build_sft_dataset(data, tokenizer, **kw)


# ---- input validation: every case names the row, the field and the fix -------------------------------------


@pytest.mark.parametrize(
    "rows,match",
    [
        (
            [{"question": "a", "answer": "b"}],
            r"Cannot tell the dataset format from its columns \['answer', 'question'\]",
        ),
        ([{"mesages": [1]}], r"'mesages' -> 'messages'"),
        ([{"promt": "a", "completion": "b"}], r"'promt' -> 'prompt'"),
        ([{"conversations": [1]}], r"rename_column\('conversations', 'messages'\)"),
        ([{"messages": GOOD}, {"messages": "hello"}], r"row 1, field 'messages': expected a non-empty list"),
        ([{"messages": GOOD}, {"messages": [["user", "hi"]]}], r"row 1, field 'messages', message 0: expected a dict"),
        ([{"messages": [{"role": "user", "content": 5}, GOOD[1]]}], r"row 0.*'content' must be a string, got int"),
        ([{"messages": [{"role": "bot", "content": "x"}, GOOD[1]]}], r"message 0: unknown role 'bot'"),
        ([{"messages": GOOD}, {"messages": [GOOD[0]]}], r"row 1, field 'messages': the conversation has no assistant"),
        (
            [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "  "}],
            r"row 1, field 'completion': it is empty",
        ),
        ([{"prompt": "a", "completion": 3}], r"row 0, field 'completion': expected a string, got int"),
    ],
)
def test_bad_rows_are_named(tokenizer, rows, match):
    with pytest.raises(DataError, match=match):
        sft(rows, tokenizer)


def test_too_long_rows_follow_the_truncation_policy(tokenizer, caplog):
    rows = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "short", "completion": " long answer " * 20}]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        cut = sft(rows, tokenizer, max_length=20)
    assert [len(x) for x in cut["input_ids"]][1] == 20 and "1 of 2 examples exceed max_length=20" in caplog.text
    assert len(sft(rows, tokenizer, max_length=20, truncation="drop")) == 1
    with pytest.raises(DataError, match=r"row 1: \d+ tokens exceed max_length=20"):
        sft(rows, tokenizer, max_length=20, truncation="error")


def test_rows_without_targets_after_truncation_are_dropped_and_counted(tokenizer, caplog):
    rows = [{"prompt": "word " * 100, "completion": "x"}, {"prompt": "2+2=", "completion": "4"}]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        assert len(sft(rows, tokenizer, max_length=16)) == 1
    assert "1 of 2 examples have no target token" in caplog.text


def test_a_dataset_empty_after_filtering_is_an_error(tokenizer):
    with pytest.raises(DataError, match="No example is left"):
        sft([{"prompt": "word " * 100, "completion": "x"}], tokenizer, max_length=16)
    with pytest.raises(DataError, match="The dataset is empty"):
        build_sft_dataset(Dataset.from_list([{"text": "a"}]).select([]), tokenizer)


def test_chat_data_needs_a_chat_template():
    plain = build_bpe_tokenizer(["some text"] * 10, 300, ["</s>"], eos_token="</s>")
    with pytest.raises(DataError, match=r"needs a tokenizer with a chat template.*tokenizer.chat_template ="):
        sft([{"messages": GOOD}], plain)


def test_errors_in_a_local_file_name_the_row_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [{"messages": GOOD}] * 3 + [{"messages": [{"role": "user", "content": 7}, GOOD[1]]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(DataError, match=r"row 3 \(line 4 of data.jsonl\), field 'messages', message 0: 'content'"):
        load_sft_source(str(path))
    path.write_text(json.dumps({"messages": GOOD}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"line 2 is not valid JSON"):
        load_sft_source(str(path))
    path.write_text(json.dumps({"messages": GOOD}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match=r"row 1 \(line 2 of data.jsonl\): no field 'messages'"):
        load_sft_source(str(path))


def test_later_errors_name_the_source_row_not_the_shuffled_one(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(20)]
    rows[13]["prompt"] = "word " * 300  # too long for the policy below: only found after tokenization
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held_out = load_sft_source(str(path), eval_fraction=0.2, seed=0)
    part = train if 13 in train["_source_row"] else held_out
    with pytest.raises(DataError, match=r"row 13: \d+ tokens exceed max_length=64"):
        build_sft_dataset(part, tokenizer, max_length=64, truncation="error")


def test_a_missing_pad_token_is_set_and_said(tmp_path, caplog):
    plain = build_bpe_tokenizer(["some text"] * 10, 300, ["</s>"], eos_token="</s>")
    plain.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        loaded = get_tokenizer(str(tmp_path))
    assert loaded.pad_token == "</s>" and "had no pad token; using '</s>'" in caplog.text


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0"),
        ({"normalization": "mean"}, "normalization='mean'"),
        ({"objective": "ctc"}, "objective='ctc'"),
        ({"max_skipped_steps": -1}, "max_skipped_steps"),
    ],
)
def test_invalid_settings_name_the_field(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        TokenWeightedArguments(output_dir=str(tmp_path), **settings)


def test_a_config_with_unknown_keys_is_an_error(tmp_path):
    from hfacc.runtime.config import parse_args

    bad = tmp_path / "c.yaml"
    bad.write_text("learning_rate: 1.0e-4\nbatch_size: 8\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        parse_args(recipe_types(load_recipe()), ["--config", str(bad)])


# ---- numerical safety: non-finite losses and gradients never reach the weights ------------------------------

POISON = VOCAB - 1


class PoisonableLM(nn.Module):
    """Returns NaN logits for any micro-batch that contains the token POISON."""

    def __init__(self):
        super().__init__()
        self.inner = build_tiny_llama(vocab_size=VOCAB)

    def forward(self, input_ids, attention_mask=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        if (input_ids == POISON).any():
            logits = logits * float("nan")
        return {"logits": logits}


def clean_examples(n, seed):
    rows = make_examples(n, seed=seed)
    for r in rows:
        r["input_ids"] = [min(t, POISON - 1) for t in r["input_ids"]]
        r["labels"] = [min(t, POISON - 1) if t != -100 else t for t in r["labels"]]
    return rows


def test_a_nan_window_is_skipped_and_named(tmp_path, caplog):
    first, bad, last = clean_examples(4, 1), clean_examples(4, 2), clean_examples(4, 3)
    bad[3]["input_ids"][0] = POISON  # micro-batch 1 (of 2) of the second window
    args = dict(learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=1.0)
    torch.manual_seed(0)
    model = PoisonableLM()
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer, _ = run_trainer(
            TokenWeightedTrainer, model, first + bad + last, train_args(tmp_path, 2, 2, **args), COLLATE
        )
    assert "step 2 skipped: non-finite loss in micro-batch(es) [1] of 2 on rank 0" in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.state.log_history[-1]["train_skipped_steps"] == 1
    # The interval of the skipped step logs no loss (it logged `loss nan`), and the console says why.
    skipped = next(h for h in trainer.state.log_history if h.get("step") == 2 and "num_targets" in h)
    assert "loss" not in skipped and skipped["skipped_steps"] == 1
    assert format_train_log(skipped).startswith("no step applied") and "skipped steps 1" in format_train_log(skipped)
    # The skipped window left no trace: same weights as training on the two clean windows only.
    torch.manual_seed(0)
    clean = PoisonableLM()
    run_trainer(TokenWeightedTrainer, clean, first + last, train_args(tmp_path, 2, 2, **args), COLLATE)
    for (name, p), q in zip(model.named_parameters(), clean.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_non_finite_gradient_with_a_finite_loss_is_caught(tmp_path, caplog):
    model = build_tiny_llama(vocab_size=VOCAB)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.model.norm.weight.register_hook(lambda g: g * float("inf"))
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer, _ = run_trainer(
            TokenWeightedTrainer,
            model,
            make_examples(8),
            train_args(tmp_path, 2, 2, learning_rate=1e-2, max_grad_norm=0),
            COLLATE,
        )
    assert "non-finite gradient (the loss was finite on this rank)" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_training_stops_after_max_skipped_steps(tmp_path):
    rows = clean_examples(8, 4)
    for r in rows:
        r["input_ids"][0] = POISON
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments, max_skipped_steps=3)
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps had a non-finite loss"):
        run_trainer(TokenWeightedTrainer, PoisonableLM(), rows, args, COLLATE)


# ---- exact resume and complete checkpoints ------------------------------------------------------------------


class StopAt(Exception):
    pass


def resume_args(tmp_path, **kw):
    settings = dict(
        args_class=TokenWeightedArguments,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        train_sampling_strategy="random",
        num_train_epochs=2,
        save_strategy="steps",
        save_steps=2,
    )
    settings.update(kw)
    return train_args(tmp_path, 2, 2, **settings)


def train_resumable(output_dir, examples, stop_at=None, resume=None, crash_saving_at=None, **kw):
    """Dropout on, shuffled data, cosine schedule: everything resume has to restore."""
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                raise StopAt

    torch.manual_seed(0)
    model = build_tiny_llama(vocab_size=VOCAB, attention_dropout=0.2)
    trainer = TokenWeightedTrainer(
        model=model,
        args=resume_args(output_dir, **kw),
        train_dataset=Dataset.from_list(examples),
        data_collator=COLLATE,
        callbacks=[Stop()],
    )
    if crash_saving_at is not None:
        original = trainer._save_rng_state

        def crash(output_dir):
            if trainer.state.global_step == crash_saving_at:
                raise StopAt  # the machine went away half-way through writing the checkpoint
            original(output_dir)

        trainer._save_rng_state = crash
    try:
        trainer.train(resume_from_checkpoint=resume)
    except StopAt:
        return None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b):
    for name in a:
        diff = ((a[name] - b[name]).norm() / a[name].norm().clamp(min=1e-12)).item()
        assert diff <= 1e-6, (name, diff)


def test_resume_mid_epoch_ends_with_the_same_weights(tmp_path):
    examples = make_examples(12, seed=5)  # 3 optimizer steps per epoch, 6 in all
    full = train_resumable(tmp_path / "full", examples)
    assert train_resumable(tmp_path / "cut", examples, stop_at=4) is None  # interrupted in the second epoch
    resumed = train_resumable(tmp_path / "cut", examples, resume=True)
    assert_same(full, resumed)


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    examples = make_examples(12, seed=6)
    full = train_resumable(tmp_path / "full", examples, save_total_limit=1)
    out = tmp_path / "crashed"
    assert train_resumable(out, examples, crash_saving_at=4, save_total_limit=1) is None
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-4" / MARKER).exists()
    assert (out / "checkpoint-2" / MARKER).is_file()  # rotation waited for checkpoint-4 to complete
    with pytest.raises(ValueError, match="checkpoint-4: it has no checkpoint_complete.json.*newest complete one is"):
        resolve_checkpoint(str(out / "checkpoint-4"), out)
    resumed = train_resumable(out, examples, resume=True, save_total_limit=1)  # picks checkpoint-2
    assert_same(full, resumed)


def test_a_checkpoint_damaged_after_writing_is_refused(tmp_path):
    examples = make_examples(8, seed=7)
    train_resumable(tmp_path, examples, num_train_epochs=1)
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors has 100 bytes"):
        resolve_checkpoint(str(tmp_path / "checkpoint-2"), tmp_path)


# ---- safe loading -------------------------------------------------------------------------------------------


def test_pickled_weights_are_refused(tmp_path):
    model = build_tiny_llama(vocab_size=VOCAB)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pickled \(pytorch_model.bin\), and hfacc loads safetensors only"):
        load_causal_lm(str(tmp_path))


def test_remote_code_needs_consent(tmp_path):
    build_tiny_llama(vocab_size=VOCAB).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "evil.py").write_text("open(__file__ + '.ran', 'w').write('code ran')\n")
    ran = Path(str(tmp_path / "evil.py") + ".ran")
    # A known architecture with remote code on offer: the built-in class loads, the shipped code never runs.
    assert type(load_causal_lm(str(tmp_path))).__name__ == "LlamaForCausalLM" and not ran.exists()
    # An architecture only the shipped code knows: refused until asked for.
    config["model_type"] = "evil"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(str(tmp_path))
    assert not ran.exists()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/hfacc-pwned",))


def test_a_malicious_pickle_in_a_checkpoint_is_not_executed(tmp_path):
    examples = make_examples(8, seed=8)
    train_resumable(tmp_path, examples, num_train_epochs=1, save_steps=1, max_steps=1)
    checkpoint = tmp_path / "checkpoint-1"
    (checkpoint / "rng_state.pth").write_bytes(pickle.dumps(_Payload()))
    # A stock Trainer's checkpoint (no marker, in a folder no hfacc run wrote into): only the unpickler stands between
    # the attacker and the resume (with the marker, the changed file is refused before it is read).
    (checkpoint / MARKER).unlink()
    (tmp_path / RUN_RECORD).unlink()
    Path("/tmp/hfacc-pwned").unlink(missing_ok=True)
    with pytest.raises(Exception, match="[Ww]eights only|Unsupported global|UnpicklingError"):
        train_resumable(tmp_path, examples, num_train_epochs=1, save_steps=1, max_steps=2, resume=str(checkpoint))
    assert not Path("/tmp/hfacc-pwned").exists()


def test_the_library_never_calls_torch_load_without_weights_only():
    for path in (ROOT / "hfacc").rglob("*.py"):
        text = path.read_text()
        for i, line in enumerate(text.splitlines()):
            if "torch.load(" in line:
                assert "weights_only=True" in text.splitlines()[i] + text.splitlines()[i + 1], f"{path}:{i + 1}"


# ---- every mistake of the list, through the recipe: one `error:` line with the fix, exit code 2 ------------------


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    """Bad files, model folders and output dirs, made once: ``{name: path}``."""
    root = tmp_path_factory.mktemp("mistakes")
    line = json.dumps({"messages": GOOD})
    lines = [line] * 30

    def write(name, text):
        (root / name).write_text(text)
        return root / name

    files = {
        "good.jsonl": write("good.jsonl", "\n".join(lines) + "\n"),
        "broken.jsonl": write("broken.jsonl", "\n".join([*lines[:12], '{"messages": [oops', *lines]) + "\n"),
        "data.txt": write("data.txt", "hello\n"),
        "quote.csv": write("quote.csv", 'prompt,completion\n"a","b"\n"c","d\n"e","f"\n'),
        "small.jsonl": write("small.jsonl", "\n".join(lines[:15]) + "\n"),
        "empty_answer.jsonl": write(
            "empty_answer.jsonl",
            line + "\n" + json.dumps({"messages": [GOOD[0], {"role": "assistant", "content": ""}]}) + "\n",
        ),
        "lr_list.yaml": write("lr_list.yaml", "learning_rate: [1.0e-3, 2.0e-3]\n"),
        "ga.yaml": write("ga.yaml", "gradient_accumulation_steps: 2.5\n"),
        "a_file": write("a_file", "not a directory\n"),
    }
    utf8 = root / "utf8.jsonl"
    utf8.write_bytes(
        ("\n".join(lines[:20]) + "\n").encode() + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    )
    files["utf8.jsonl"] = utf8
    folder = root / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "b.jsonl").write_text("\n".join([*lines[:3], "{bad"]) + "\n")
    files["folder"] = folder
    tokenizer = build_default_tokenizer()
    for name in ("noconfig", "bin", "shapes", "notok", "badconfig", "trunc", "small_model"):
        path = root / name
        build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2).save_pretrained(path)
        tokenizer.save_pretrained(path)
        files[name] = path
    (root / "noconfig" / "config.json").unlink()
    (root / "bin" / "model.safetensors").unlink()
    (root / "bin" / "pytorch_model.bin").write_bytes(b"pickled")
    config = json.loads((root / "shapes" / "config.json").read_text())
    (root / "shapes" / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "intermediate_size": 128}))
    for p in (root / "notok").iterdir():
        if "token" in p.name or "chat" in p.name:
            p.unlink()
    (root / "badconfig" / "config.json").write_text("{not json")
    weights = (root / "trunc" / "model.safetensors").read_bytes()
    (root / "trunc" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    # Output dirs: a stock checkpoint with a broken trainer_state.json; a file where checkpoint-15 goes; another
    # run's checkpoint; a streaming run's checkpoint; a checkpoint of a bigger model.
    for name in ("stock", "file15", "other_run", "stream_ckpt", "bigger"):
        (root / name).mkdir()
    (root / "stock" / "checkpoint-2").mkdir()
    (root / "stock" / "checkpoint-2" / "trainer_state.json").write_text("{broken")
    (root / "file15" / "checkpoint-15").write_text("")
    settings = {"learning_rate": 0.5, "seed": 7, "streaming": False}
    for name, run in (("other_run", settings), ("stream_ckpt", {**settings, "streaming": True})):
        ckpt = root / name / "checkpoint-4"
        ckpt.mkdir()
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
        (ckpt / MARKER).write_text(json.dumps({"format": 2, "run": run, "files": {}}))
    ckpt = root / "bigger" / "checkpoint-4"
    build_tiny_llama(vocab_size=len(tokenizer), hidden_size=64, num_layers=1, num_heads=2).save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    files.update({name: root / name for name in ("stock", "file15", "other_run", "stream_ckpt", "bigger")})
    return files


STREAM = ["--streaming", "true", "--max_steps", "2", "--stream_eval_examples", "5", "--eval_strategy", "no"]
MISTAKES = {
    # name: (argv, with {name} for a path of the fixture; what the one line says)
    "map-style .jsonl not UTF-8": (["--dataset_name", "{utf8.jsonl}"], "line 21 is not valid UTF-8"),
    "streamed .jsonl with a broken line": (
        ["--dataset_name", "{broken.jsonl}", *STREAM],
        "broken.jsonl: line 13 is not valid JSON",
    ),
    "streamed .jsonl not UTF-8": (
        ["--dataset_name", "{utf8.jsonl}", *STREAM, "--max_steps", "4"],
        "utf8.jsonl: line 21 is not valid UTF-8",
    ),
    ".txt dataset": (["--dataset_name", "{data.txt}"], "hfacc reads .json, .jsonl, .csv and .parquet files"),
    "folder with one broken .jsonl": (["--dataset_name", "{folder}"], "b.jsonl: line 4 is not valid JSON"),
    "CSV with an unbalanced quote": (["--dataset_name", "{quote.csv}"], "the record that starts on line 3"),
    "stream all held out": (
        ["--dataset_name", "{small.jsonl}", "--streaming", "true", "--max_steps", "2"],
        "the stream has 15 rows, all held out for evaluation (stream_eval_examples=200)",
    ),
    "empty assistant content": (["--dataset_name", "{empty_answer.jsonl}"], "the assistant message is empty"),
    "read-only output dir": (["--output_dir", "/sys/hfacc-out"], "cannot write to --output_dir /sys/hfacc-out"),
    "output_dir naming a file": (["--output_dir", "{a_file}"], "is a file; name a directory"),
    # Before: transformers' OSError traceback ("not a valid JSON file").
    "model_name_or_path naming a file": (["--model_name_or_path", "{a_file}"], "it is a file; give the folder"),
    # Before: ignored, training on all but a held-out eval_fraction and evaluating on that.
    "an eval split of a single file": (
        ["--dataset_name", "{good.jsonl}", "--dataset_eval_split", "test"],
        "dataset_eval_split='test': dataset",
    ),
    "model folder without config.json": (["--model_name_or_path", "{noconfig}"], "the folder has no config.json"),
    "model folder with .bin weights only": (["--model_name_or_path", "{bin}"], "its weights are pickled"),
    "weights of other shapes": (["--model_name_or_path", "{shapes}"], "its weights do not fit its config.json"),
    "no tokenizer files": (["--model_name_or_path", "{notok}"], "the folder has no tokenizer files"),
    "invalid config.json": (["--model_name_or_path", "{badconfig}"], "config.json is not valid JSON"),
    "truncated weights": (["--model_name_or_path", "{trunc}"], "its weights are damaged or incomplete"),
    "YAML learning_rate a list": (["--config", "{lr_list.yaml}"], "learning_rate: expected a number, got [0.001"),
    "YAML gradient_accumulation_steps 2.5": (["--config", "{ga.yaml}"], "expected a whole number, got 2.5"),
    "--learning_rate=-2e-3": (["--learning_rate=-2e-3"], "learning_rate=-0.002: it must be >= 0."),
    "--learning_rate -1e-2": (["--learning_rate", "-1e-2"], "learning_rate=-0.01: it must be >= 0."),
    "a second --config": (["--config", "{ga.yaml}", "--config", "{lr_list.yaml}"], "--config is given 2 times"),
    "invalid trainer_state.json": (
        ["--output_dir", "{stock}", "--resume_from_checkpoint", "{stock}/checkpoint-2"],
        "its trainer_state.json is not valid JSON",
    ),
    "a plain file named checkpoint-15": (["--output_dir", "{file15}"], "checkpoint-15 is a file, where the Trainer"),
    "resume_from_checkpoint naming the output dir": (
        ["--output_dir", "{stock}", "--resume_from_checkpoint", "{stock}"],
        "it is an output directory, not a checkpoint",
    ),
    "a new run over another run's checkpoints": (
        ["--output_dir", "{other_run}"],
        "holds checkpoints of another run (checkpoint-4: learning_rate 0.5 there",
    ),
    "a streaming checkpoint resumed map-style": (
        ["--output_dir", "{stream_ckpt}", "--resume_from_checkpoint", "last"],
        "no checkpoint of this run",
    ),
    "resuming with another model size": (
        ["--model_name_or_path", "{small_model}", "--dataset_name", "{good.jsonl}", "--output_dir", "{bigger}"]
        + ["--resume_from_checkpoint", "{bigger}/checkpoint-4", "--eval_strategy", "no"],
        "its weights are another model's: 'lm_head.weight' has shape [320, 64] there and [320, 32] here",
    ),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_every_listed_mistake_is_one_error_line_with_exit_code_2(mistakes, case, tmp_path, capsys, monkeypatch):
    """The recipe's __main__ in-process. Before: raw tracebacks, or messages that named no line or no fix."""
    from hfacc.jobs.console import EXIT_USER_ERROR, run_recipe

    monkeypatch.delenv("HFACC_DEBUG", raising=False)
    argv, expected = MISTAKES[case]
    for name, path in mistakes.items():
        argv = [a.replace(f"{{{name}}}", str(path)) for a in argv]
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(tmp_path / "out")]
    # Small, should a check not fire: the run would train, and fail the test, in seconds.
    argv += ["--num_exact_match_examples", "0", "--per_device_train_batch_size", "4", "--num_embedded_examples", "32"]
    if "--max_steps" not in argv:
        argv += ["--max_steps", "2"]
    module = load_recipe()
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(module.main, recipe_types(module), module.default_config(argv), argv=argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == EXIT_USER_ERROR, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]
    assert "Traceback" not in out + err


def test_a_stream_whose_every_row_is_dropped_stops_after_one_pass(tokenizer):
    """Before: it read the stream again and again (a 20-row stream 2000 times; the recipe: epoch 1400)."""
    from datasets import IterableDataset

    from hfacc.data.streaming import StreamBatches

    read = []

    def rows():
        for _ in range(20):
            read.append(1)
            yield {"prompt": "word " * 100, "completion": "x"}

    stream = build_sft_dataset(IterableDataset.from_generator(rows), tokenizer, max_length=16)
    with pytest.raises(DataError, match="holds no usable example: all 20 of its rows were dropped"):
        next(iter(StreamBatches(stream, COLLATE, batch_size=2)))
    assert len(read) <= 21  # one pass (and the first row, read to know the format)
